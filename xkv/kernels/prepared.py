"""Prepared steps: a group's copies validated once, then launched layer by layer with no host work.

At ``start_load_kv`` (and at a step's first save) the worker knows everything a cache group's
copies need for the whole step: the block ids (int64 ``[n]``, host, the same for every layer of
the group) and the byte offset of every layer's fragment in the flat buffer (the card): int64
``[L, n]`` (host), row ``l`` for ``pools[l]``. :func:`prepare_restore` / :func:`prepare_save`

* validate all of it once (``ValueError`` naming the value, before any byte moves);
* resolve the engine once per layer (``"auto"`` as in :mod:`xkv.kernels.page_copy`);
* Triton layers: plan every launch on the host and send all their device tables (block ids, the
  ``[L, n]`` offsets, one run table per geometry) in ONE pinned, non-blocking host-to-device copy
  on the current stream (``defer_rest``, restores: the first launch's tables so, the others'
  in one more such copy at the first ``launch`` of any of them, while the first copy runs);
  copy-engine layers: build their address lists (host memory, read by the driver at launch);

and return a :class:`PreparedCopy` whose ``launch(l)`` only issues layer ``l``'s copy, always on
the stream that was current at prepare time (:attr:`PreparedCopy.stream`; the tables are uploaded
there, or on the stream passed to that first later launch): no validation, no host
synchronisation, no allocation with the ``"triton"`` and
``"copy_engine"`` engines and on CPU; a restore from host memory whose every layer takes
``"staged"`` is prepared whole by :mod:`xkv.kernels.staged_restore` (the process's staging ring,
every chunk's tables in the one upload); other ``"staged"`` copies (saves, pages larger than a
ring slot) still allocate their staging per launch, and ``"reference"`` on CUDA its index tensor).

``prepare_restore(src, offs, pools, ids).launch(l)`` moves exactly the bytes of
``restore(src, offs[l], pools[l], ids)``; ``prepare_save(pools, ids, dst, offs).launch(l)`` those of
``save(pools[l], ids, dst, offs[l])``, with the same kernel variant. Layers are checked as those
one-layer calls check them (layers need the same ``block_bytes`` and device; no cross-layer
aliasing check, since the launches are ordered on one stream). A layer may be launched again.

``checks=`` (:class:`~xkv.kernels.verify.Checks`, shapes there): every launch also computes the
checksum terms of its layer into one ``[L, C]`` word buffer, :attr:`PreparedCopy.checks`
(uploaded with the tables, on the same stream); read it once after the last launch
(restores: ``checks.readback()`` / ``mismatched()``; saves: ``host_words()``).

Lifetime: the object holds the device tables and references to ``src``/``dst`` and the pools;
they must stay allocated and the step's block ids and card slots unchanged until the last launch
has run on the GPU. Dropping the object once the last ``launch`` is issued is safe without a
synchronisation (the tables are freed stream-ordered on the stream they are used on).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from xkv.kernels import _launch, _torch, copy_engine, staged, staged_restore
from xkv.kernels._lazy import deferred
from xkv.kernels.jobs import IndexLike, Job, build_job, offsets_arg, pools_arg
from xkv.kernels.page_copy import check_engine
from xkv.kernels.verify import Checks
from xkv.layout import PagePool

__all__ = ["PreparedCopy", "prepare_restore", "prepare_save"]


class PreparedCopy:
    """``L`` per-layer copies ready to launch (see the module docstring)."""

    def __init__(self, job: Job, engines: list[str], calls: list[Callable[[], None]],
                 stream: torch.cuda.Stream | None) -> None:
        self.save = job.save
        self.n = job.n  # fragments per layer
        self.block_bytes = job.block_bytes
        self.engines = tuple(engines)  # per layer, resolved
        self.stream = stream  # CUDA: where the tables were uploaded and every launch runs
        self._calls = calls
        self._job = job  # keeps the buffers and pools referenced while the copies may run
        #: the checksum words (xkv.kernels.verify.CheckWords) of a verified copy, else None
        self.checks = job.checks.buf if job.checks is not None else None

    def __len__(self) -> int:
        return len(self._calls)

    @property
    def nbytes(self) -> int:
        """Bytes one layer moves."""
        return self.n * self.block_bytes

    def launch(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Issue layer ``layer``'s copy (``0 <= layer < len(self)``) on :attr:`stream`, or on
        ``stream`` (CUDA), which the caller has ordered after the prepare stream's uploads (e.g.
        it waits for an event recorded there after them)."""
        if not 0 <= layer < len(self._calls):
            raise IndexError(f"layer {layer} out of range [0, {len(self._calls)})")
        st = self.stream if stream is None else stream
        if st is None:
            self._calls[layer]()
        else:
            with torch.cuda.stream(st):
                self._calls[layer]()


def prepare_restore(src: torch.Tensor, src_offsets: IndexLike, dsts: Sequence[PagePool],
                    block_ids: IndexLike, *, max_programs: int | None = None,
                    engine: str = "auto",
                    layer_groups: Sequence[Sequence[int]] | None = None,
                    checks: Checks | None = None, defer_rest: bool = False) -> PreparedCopy:
    """Prepare ``L`` restores: ``launch(l)`` writes block ``block_ids[i]`` of ``dsts[l]`` from
    ``src[src_offsets[l, i] : + block_bytes]`` for every i. ``src_offsets``: int64 ``[L, n]`` bytes.

    ``layer_groups`` (a partition of ``range(L)`` into runs of consecutive layers): ``launch(g)``
    then copies every layer of group ``g`` (one Triton launch when the group's layers share a
    geometry and all use Triton; else the layers' copies one after the other), ``len()`` is the
    number of groups: fewer launches, coarser completion points.

    ``defer_rest`` (for a caller that launches everything at once, e.g. a restore step's issue):
    only the first Triton launch is planned here, the others at the first ``launch`` of any of
    them, so the first copy runs while the host plans the rest (:func:`_first_then_rest`)."""
    dsts = pools_arg(dsts, "dsts")
    offs = offsets_arg(src_offsets, len(dsts), "src_offsets")
    job = build_job(dsts, block_ids, src, offs, save=False, per_layer=True, checks=checks)
    return _prepare(job, engine, max_programs, layer_groups, defer_rest)


def prepare_save(srcs: Sequence[PagePool], block_ids: IndexLike, dst: torch.Tensor,
                 dst_offsets: IndexLike, *, max_programs: int | None = None,
                 engine: str = "auto", checks: Checks | None = None,
                 layer_groups: Sequence[Sequence[int]] | None = None) -> PreparedCopy:
    """Prepare ``L`` saves: ``launch(l)`` writes ``dst[dst_offsets[l, i] : + block_bytes]`` from
    block ``block_ids[i]`` of ``srcs[l]`` for every i. ``dst_offsets``: int64 ``[L, n]`` bytes.
    ``layer_groups`` as for :func:`prepare_restore` (``[list(range(L))]``: every layer in one
    launch, checksum words of every layer included: ``save_mode`` step's verified saves)."""
    srcs = pools_arg(srcs, "srcs")
    offs = offsets_arg(dst_offsets, len(srcs), "dst_offsets")
    job = build_job(srcs, block_ids, dst, offs, save=True, per_layer=True, checks=checks)
    return _prepare(job, engine, max_programs, layer_groups)


def _noop() -> None:
    return None


def _check_groups(groups: Sequence[Sequence[int]], L: int) -> list[list[int]]:
    out = [[int(k) for k in g] for g in groups]
    flat = [k for g in out for k in g]
    if flat != list(range(L)) or any(not g for g in out):
        raise ValueError(f"layer_groups must split range({L}) into non-empty runs of consecutive "
                         f"layers, in order; got {out}")
    return out


def _prepare(job: Job, engine: str, max_programs: int | None,
             layer_groups: Sequence[Sequence[int]] | None = None,
             defer: bool = False) -> PreparedCopy:
    L = len(job.pools)
    groups = None if layer_groups is None else _check_groups(layer_groups, L)
    chosen = _engines(job, engine, max_programs)  # may raise
    if not L:
        check_engine(job, engine, max_programs)
    if job.checks is not None:  # one word buffer for every layer, on the prepare stream
        job.checks.bind(job.pools[0].device if L else job.flat.device, job.save)
    # after bind: a layer's checks take the bound word buffer (built before it, they would not)
    # one-layer jobs only for the layers that run alone (Triton layers plan from ``job``)
    layers = _Layers(job)
    stream = None
    if L and job.pools[0].device.type == "cuda":
        stream = torch.cuda.current_stream(job.pools[0].device)
    engines = [e for e, _ in chosen]
    calls: list[Callable[[], None]] = [_noop] * (L if groups is None else len(groups))
    if job.n == 0 or job.block_bytes == 0:
        return PreparedCopy(job, engines, calls, stream)
    if _ring_restore(job, engines):  # every layer staged: one plan, one upload, the ring
        return PreparedCopy(job, engines, staged_restore.prepare(job, chosen[0][1], groups),
                            stream)
    if groups is not None:
        return PreparedCopy(job, engines, _group_calls(job, layers, chosen, groups, defer),
                            stream)
    tri = [k for k in range(L) if engines[k] == "triton"]
    if tri:  # one upload for every Triton layer's tables (defer: the first's, then the rest's)
        budget = chosen[tri[0]][1]
        for k, launch in zip(tri, _first_then_rest(job, budget, [[k] for k in tri], defer),
                             strict=True):
            calls[k] = launch
    for k, (eng, budget) in enumerate(chosen):
        if eng == "reference":
            calls[k] = _bind(_torch.run, layers[k])
        elif eng == "copy_engine":
            calls[k] = copy_engine.runner(layers[k])
        elif eng == "staged":
            calls[k] = _bind(staged.run, layers[k], budget)
    return PreparedCopy(job, engines, calls, stream)


def _ring_restore(job: Job, engines: list[str]) -> bool:
    """A restore whose every layer takes the staged engine, from host memory into CUDA pages,
    of pages that fit a ring slot, with the driver's batch copy: :mod:`xkv.kernels.staged_restore`
    prepares it whole (else each layer runs the per-launch staged engine)."""
    return (not job.save and not job.sliced and bool(engines)
            and all(e == "staged" for e in engines)
            and job.pools[0].device.type == "cuda" and job.flat.device.type == "cpu"
            and job.block_bytes <= staged_restore.MAX_PAGE_BYTES and copy_engine.available())


def _engines(job: Job, engine: str, max_programs: int | None) -> list[tuple[str, int]]:
    """``check_engine`` of every one-layer job of ``job``, each distinct pool geometry checked
    once: what it decides depends on the layer only through its pool (device, block bytes and
    runs; the ids, direction and checks are the job's), and building 32 one-layer jobs (their
    offsets and checks rows) to ask 32 times the same question was host time before the copy.
    ``"auto"`` takes the staged engine for every layer of a restore
    :func:`~xkv.kernels.staged_restore.preferred` accepts (decided on the whole job's bytes)."""
    if engine == "auto" and staged_restore.preferred(job):
        engine = "staged"  # the whole restore through the copy engine and the ring
    seen: dict[tuple, tuple[str, int]] = {}
    out = []
    for k, p in enumerate(job.pools):
        key = (p.device, p.block_bytes, p.runs)
        if key not in seen:
            seen[key] = check_engine(job.layer(k), engine, max_programs)
        out.append(seen[key])
    return out


class _Layers:
    """``job.layer(k)`` on first use, kept (a 16k-token restore of 32 layers built all of them
    for nothing when every layer is Triton's: host time before the copy starts)."""

    def __init__(self, job: Job) -> None:
        self._job = job
        self._got: dict[int, Job] = {}

    def __getitem__(self, k: int) -> Job:
        if k not in self._got:
            self._got[k] = self._job.layer(k)
        return self._got[k]


def _bind(fn, *args) -> Callable[[], None]:
    return lambda: fn(*args)


def _group_calls(job: Job, layers: _Layers, chosen: list, groups: list[list[int]],
                 defer: bool = False):
    """One call per layer group: a single Triton launch for a group of one geometry whose layers
    all use Triton (every such group's tables in one upload), else the layers' own calls."""
    one = [g for g in groups
           if all(chosen[k][0] == "triton" for k in g) and len(_launch.geometry_groups(
               [job.pools[k] for k in g])) == 1]
    fused = {}
    if one:
        budget = chosen[one[0][0]][1]
        fused = dict(zip(map(tuple, one), _first_then_rest(job, budget, one, defer),
                         strict=True))
    calls = []
    for g in groups:
        if tuple(g) in fused:
            calls.append(fused[tuple(g)])
            continue
        per = [_layer_call(layers[k], *chosen[k]) for k in g]
        calls.append(lambda per=per: [c() for c in per])
    return calls


def _first_then_rest(job: Job, budget: int, groups: list[list[int]],
                     defer: bool) -> list[Callable[[], None]]:
    """``_launch.launches(job, budget, groups=groups)``; with ``defer`` the first launch planned
    (and its tables uploaded) now and the others at the first call of any of them, which the
    caller makes after the first launch: its copy is under way while the host plans the rest (a
    light step's six plans and their upload were 0.9-1.5 ms before the first byte moved on the
    H100 of stop 46, ``XKV_TIMING`` ``plan_ms``). Same plans and kernel variants as planning
    them together: each group's plan depends on the job and that group's layers only. A job
    without an offset table plans them together (one group alone would address it otherwise)."""
    if not defer or len(groups) < 2 or job.flat_off is None:
        return list(_launch.launches(job, budget, groups=groups))
    rest = deferred(lambda: _launch.launches(job, budget, groups=groups[1:]).__getitem__)
    return [*_launch.launches(job, budget, groups=groups[:1]),
            *(lambda i=i: rest(i)() for i in range(len(groups) - 1))]


def _layer_call(layer: Job, eng: str, budget: int) -> Callable[[], None]:
    """One layer's copy with its resolved engine (what ``_prepare`` binds per layer)."""
    if eng == "triton":
        (launch,) = _launch.launches(layer, budget)
        return launch
    if eng == "reference":
        return _bind(_torch.run, layer)
    if eng == "copy_engine":
        return copy_engine.runner(layer)
    return _bind(staged.run, layer, budget)
