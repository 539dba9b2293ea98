"""Move KV pages between a paged cache (:class:`~xkv.layout.PagePool`) and a flat byte buffer.

Public launchers (all offsets and lengths in bytes; index arguments are int64 tensors on any device,
numpy arrays or lists):

* :func:`restore` / :func:`restore_layers` -- flat fragments -> blocks (one launch for all layers);
* :func:`save` / :func:`save_layers` -- blocks -> flat fragments;
* :func:`restore_slice` -- only bytes ``[lo, hi)`` of the concatenated fragments;
* ``pack`` / ``unpack`` live in :mod:`xkv.kernels.staging`.

Each validates everything first and raises ``ValueError`` with nothing written. Then, by ``engine``:

* ``"auto"``: the torch reference on CPU tensors; on CUDA the Triton kernel, or, once
  :func:`calibrate` has run on this GPU, whichever engine it measured fastest for this direction and
  fragment size;
* ``"triton"``: the kernel reads/writes the flat buffer directly (host memory over PCIe), SMs only;
* ``"copy_engine"``: one ``cuMemcpyBatchAsync`` with every run of every fragment (no SMs; slow for
  small fragments);
* ``"staged"``: large contiguous copy-engine transfers between the flat buffer and a GPU staging
  ring, pipelined in chunks with Triton pack/unpack between the ring and the pages (HBM only), so
  PCIe runs at copy-engine speed and the kernel never waits on PCIe;
* ``"reference"``: the torch reference (any device).

``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` (the tests use it); ``"copy_engine"`` and
``"staged"`` need CUDA; ``"staged"`` falls back to ``"triton"`` for slices. The ``*_ref`` functions
are the torch references with the same signatures. GPU work is ordered on the current torch stream
(the copy-engine paths hop to side streams and back with events); nothing synchronizes the host.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from xkv.kernels import copy_engine
from xkv.kernels._launch import default_programs, launch_config, word_bytes
from xkv.kernels.host import is_host_accessible
from xkv.layout import PagePool

__all__ = [
    "ENGINES",
    "Calibration",
    "calibrate",
    "calibration",
    "restore",
    "restore_layers",
    "restore_layers_ref",
    "restore_ref",
    "restore_slice",
    "restore_slice_ref",
    "save",
    "save_layers",
    "save_layers_ref",
    "save_ref",
    "set_calibration",
]

ENGINES = ("auto", "triton", "copy_engine", "staged", "reference")
STAGED_MIN_BYTES = 8 << 20  # below this a staged copy cannot fill its pipeline
STAGED_MIN_CHUNK = 1 << 20
STAGED_MAX_CHUNK = 32 << 20
IndexLike = torch.Tensor | np.ndarray | Sequence[int]


# --------------------------------------------------------------------------------------------------
# public API


def restore(
    src: torch.Tensor,
    src_offsets: IndexLike,
    dst: PagePool,
    block_ids: IndexLike,
    *,
    max_programs: int | None = None,
    engine: str = "auto",
) -> None:
    """For every i: block ``block_ids[i]`` of ``dst`` <- ``src[src_offsets[i] : src_offsets[i] + dst.block_bytes]``."""
    job = _job([dst], block_ids, src, _offsets(src_offsets, 1, "src_offsets"), save=False)
    _run(job, engine, max_programs)


def restore_layers(
    src: torch.Tensor,
    src_offsets: IndexLike,
    dsts: Sequence[PagePool],
    block_ids: IndexLike,
    *,
    max_programs: int | None = None,
    engine: str = "auto",
) -> None:
    """:func:`restore` for L layers at once; ``src_offsets`` is ``[L, n]`` (layer l, fragment i).

    Layers that share a geometry (block stride and runs) go in one launch, addressed through a
    table of per-layer base offsets.
    """
    dsts = _pools(dsts, "dsts")
    job = _job(dsts, block_ids, src, _offsets(src_offsets, len(dsts), "src_offsets"), save=False)
    _run(job, engine, max_programs)


def save(
    src: PagePool,
    block_ids: IndexLike,
    dst: torch.Tensor,
    dst_offsets: IndexLike,
    *,
    max_programs: int | None = None,
    engine: str = "auto",
) -> None:
    """For every i: ``dst[dst_offsets[i] : dst_offsets[i] + src.block_bytes]`` <- block ``block_ids[i]`` of ``src``."""
    job = _job([src], block_ids, dst, _offsets(dst_offsets, 1, "dst_offsets"), save=True)
    _run(job, engine, max_programs)


def save_layers(
    srcs: Sequence[PagePool],
    block_ids: IndexLike,
    dst: torch.Tensor,
    dst_offsets: IndexLike,
    *,
    max_programs: int | None = None,
    engine: str = "auto",
) -> None:
    """:func:`save` for L layers at once; ``dst_offsets`` is ``[L, n]``."""
    srcs = _pools(srcs, "srcs")
    job = _job(srcs, block_ids, dst, _offsets(dst_offsets, len(srcs), "dst_offsets"), save=True)
    _run(job, engine, max_programs)


def restore_slice(
    src: torch.Tensor,
    src_offsets: IndexLike,
    dst: PagePool,
    block_ids: IndexLike,
    lo: int,
    hi: int,
    *,
    max_programs: int | None = None,
    engine: str = "auto",
) -> None:
    """:func:`restore`, but only bytes ``[lo, hi)`` of the concatenation of the n fragments (in
    order, ``n * dst.block_bytes`` bytes) are written; the range may start and end inside pages."""
    job = _job(
        [dst], block_ids, src, _offsets(src_offsets, 1, "src_offsets"), save=False, lo=lo, hi=hi
    )
    _run(job, engine, max_programs)


def restore_ref(src, src_offsets, dst, block_ids, *, max_programs=None) -> None:
    """Torch reference of :func:`restore` (same validation)."""
    restore(src, src_offsets, dst, block_ids, max_programs=max_programs, engine="reference")


def restore_layers_ref(src, src_offsets, dsts, block_ids, *, max_programs=None) -> None:
    """Torch reference of :func:`restore_layers`."""
    restore_layers(src, src_offsets, dsts, block_ids, max_programs=max_programs, engine="reference")


def save_ref(src, block_ids, dst, dst_offsets, *, max_programs=None) -> None:
    """Torch reference of :func:`save`."""
    save(src, block_ids, dst, dst_offsets, max_programs=max_programs, engine="reference")


def save_layers_ref(srcs, block_ids, dst, dst_offsets, *, max_programs=None) -> None:
    """Torch reference of :func:`save_layers`."""
    save_layers(srcs, block_ids, dst, dst_offsets, max_programs=max_programs, engine="reference")


def restore_slice_ref(src, src_offsets, dst, block_ids, lo, hi, *, max_programs=None) -> None:
    """Torch reference of :func:`restore_slice`."""
    restore_slice(
        src, src_offsets, dst, block_ids, lo, hi, max_programs=max_programs, engine="reference"
    )


# --------------------------------------------------------------------------------------------------
# calibration: which engine is fastest, per direction and fragment size


@dataclass(frozen=True)
class Calibration:
    """Which engine moved each fragment size fastest on one GPU, per direction (from :func:`calibrate`)."""

    sizes: tuple[int, ...]  # measured fragment sizes, ascending
    restore: tuple[tuple[str, ...], ...]  # per size: engines, fastest first
    save: tuple[tuple[str, ...], ...]
    gbps: dict  # {"restore"|"save": {size: {engine: GB/s}}}

    def engine_for(self, save: bool, run_bytes: int, total_bytes: int, flat_on_host: bool) -> str:
        """The engine for fragments whose smallest run is ``run_bytes``: the ranking of the largest
        measured size not above it (or of the smallest size), minus engines that do not apply here
        (staged needs host memory and enough bytes to fill its pipeline)."""
        k = 0
        for j, size in enumerate(self.sizes):
            if size <= run_bytes:
                k = j
        for eng in (self.save if save else self.restore)[k]:
            if eng == "staged" and (not flat_on_host or total_bytes < STAGED_MIN_BYTES):
                continue
            if eng == "copy_engine" and not copy_engine.available():
                continue
            return eng
        return "triton"


_CALIBRATION: dict[int, Calibration | None] = {}  # device index -> calibration


def calibration(device: torch.device | int | None = None) -> Calibration | None:
    """The calibration ``engine="auto"`` follows on ``device`` (None: Triton always)."""
    return _CALIBRATION.get(_device_index(device))


def set_calibration(cal: Calibration | None, device: torch.device | int | None = None) -> None:
    """Install (or clear, with None) the calibration of ``device``."""
    _CALIBRATION[_device_index(device)] = cal


def calibrate(
    device: torch.device | int | None = None,
    *,
    sizes: Sequence[int] = (4096, 16384, 65536, 262144),
    total_bytes: int = 128 << 20,
    max_programs: int | None = None,
    engines: Sequence[str] = ("triton", "copy_engine", "staged"),
) -> Calibration | None:
    """Time every engine at each fragment size, host <-> GPU, both directions, once; install and
    return the ranking that ``engine="auto"`` follows from then on. ``None`` without CUDA."""
    if not torch.cuda.is_available():
        return None
    idx = _device_index(device)
    dev = torch.device("cuda", idx)
    engines = [e for e in engines if e != "copy_engine" or copy_engine.available()]
    from xkv.layout import describe_cache

    gb: dict[str, dict[int, dict[str, float]]] = {"restore": {}, "save": {}}
    for size in sorted(sizes):
        n = max(4, total_bytes // size)
        cache = torch.empty((n * 2, size), dtype=torch.uint8, device=dev)
        pool = describe_cache(cache)
        host = torch.empty(n * size, dtype=torch.uint8, pin_memory=True)
        ids = torch.randperm(n * 2)[:n]
        offs = torch.arange(n, dtype=torch.int64) * size
        for direction in ("restore", "save"):
            job = _job([pool], ids, host, _offsets(offs, 1, "offsets"), save=direction == "save")
            gb[direction][size] = {}
            for eng in engines:
                with torch.cuda.device(dev):
                    _run(job, eng, max_programs)  # warm-up (and compile)
                    torch.cuda.synchronize(dev)
                    t0 = torch.cuda.Event(enable_timing=True)
                    t1 = torch.cuda.Event(enable_timing=True)
                    t0.record()
                    for _ in range(3):
                        _run(job, eng, max_programs)
                    t1.record()
                    torch.cuda.synchronize(dev)
                gb[direction][size][eng] = 3 * n * size / (t0.elapsed_time(t1) * 1e-3) / 1e9
        del cache, host
    ss = tuple(sorted(sizes))

    def rank(d: str) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(sorted(gb[d][z], key=lambda e: -gb[d][z][e])) for z in ss)

    cal = Calibration(sizes=ss, restore=rank("restore"), save=rank("save"), gbps=gb)
    _CALIBRATION[idx] = cal
    return cal


# --------------------------------------------------------------------------------------------------
# validation: builds a job or raises ValueError before anything is written


@dataclass
class _Job:
    pools: list[PagePool]
    ids: np.ndarray  # int64 [n]
    flat: torch.Tensor  # uint8 1-D
    flat_off: np.ndarray | None  # int64 [L, n] bytes, or None: contiguous from flat_base
    flat_base: int
    save: bool
    lo: int
    hi: int
    sliced: bool

    @property
    def n(self) -> int:
        return int(self.ids.size)

    @property
    def block_bytes(self) -> int:
        return self.pools[0].block_bytes if self.pools else 0

    def flat_offsets(self) -> np.ndarray:
        if self.flat_off is not None:
            return self.flat_off
        L, n, bb = len(self.pools), self.n, self.block_bytes
        return (self.flat_base + np.arange(L * n, dtype=np.int64) * bb).reshape(L, n)


def _pools(pools: Sequence[PagePool], name: str) -> list[PagePool]:
    if isinstance(pools, PagePool) or not isinstance(pools, Sequence):
        raise ValueError(f"{name} must be a sequence of PagePool")
    pools = list(pools)
    for p in pools:
        if not isinstance(p, PagePool):
            raise ValueError(f"{name} must hold PagePool objects, got {type(p).__name__}")
    return pools


def _as_index(x: IndexLike, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")
        return x.detach().to("cpu", torch.int64).numpy()
    a = np.asarray(x)
    if a.size == 0:
        return a.astype(np.int64).reshape(a.shape)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got {a.dtype}")
    return a.astype(np.int64, copy=False)


def _offsets(x: IndexLike, layers: int, name: str) -> tuple[np.ndarray, int, str]:
    return (_as_index(x, name), layers, name)


def _flat_tensor(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"{name} must be a uint8 (or int8) tensor, got {t.dtype}")
    if t.dim() != 1 or (t.numel() > 1 and t.stride(0) != 1):
        raise ValueError(
            f"{name} must be 1-D and contiguous, got shape {tuple(t.shape)} stride {tuple(t.stride())}"
        )
    return t.view(torch.uint8) if t.dtype == torch.int8 else t


def _job(
    pools: list[PagePool],
    block_ids: IndexLike,
    flat: torch.Tensor,
    offsets: tuple[np.ndarray, int, str] | None,
    *,
    save: bool,
    lo: int | None = None,
    hi: int | None = None,
    flat_name: str | None = None,
) -> _Job:
    flat_name = flat_name or ("dst" if save else "src")
    flat = _flat_tensor(flat, flat_name)
    ids = _as_index(block_ids, "block_ids")
    if ids.ndim != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {ids.shape}")
    n, L = int(ids.size), len(pools)
    if L:
        p0 = pools[0]
        for p in pools[1:]:
            if p.block_bytes != p0.block_bytes:
                raise ValueError(f"layers differ in block_bytes: {p0.describe()} vs {p.describe()}")
            if p.device != p0.device:
                raise ValueError(f"layers are on different devices: {p0.device} vs {p.device}")
        _check_devices(p0.device, flat, flat_name)
        if n:
            if ids.min() < 0 or any(ids.max() >= p.num_blocks for p in pools):
                bad = ids[(ids < 0) | (ids >= min(p.num_blocks for p in pools))][:4]
                raise ValueError(
                    f"block_ids out of range [0, {min(p.num_blocks for p in pools)}): {bad.tolist()}"
                )
            if not save and np.unique(ids).size != n:
                raise ValueError(
                    "block_ids has duplicates: two fragments would write the same block"
                )
    bb = pools[0].block_bytes if L else 0
    flat_off = None
    if offsets is not None:
        off, layers, oname = offsets
        want = (n,) if layers == 1 and off.ndim == 1 else (layers, n)
        if off.shape != want:
            raise ValueError(f"{oname} must have shape {want}, got {off.shape}")
        flat_off = off.reshape(layers, n)
        if flat_off.size:
            if flat_off.min() < 0 or flat_off.max() + bb > flat.numel():
                raise ValueError(
                    f"{oname} out of bounds: fragments of {bb} bytes at [{flat_off.min()}, {flat_off.max()}] "
                    f"in a {flat.numel()}-byte {flat_name}"
                )
            if save and bb and L * n > 1:
                s = np.sort(flat_off.ravel())
                if (np.diff(s) < bb).any():
                    raise ValueError(f"{oname}: two fragments of {bb} bytes overlap in {flat_name}")
    elif L * n * bb > flat.numel():
        raise ValueError(
            f"{flat_name} holds {flat.numel()} bytes, {L} x {n} blocks of {bb} need {L * n * bb}"
        )
    sliced = lo is not None or hi is not None
    total = L * n * bb
    if sliced:
        if L != 1:
            raise ValueError("a slice restores one layer")
        if not (isinstance(lo, (int, np.integer)) and isinstance(hi, (int, np.integer))):
            raise ValueError(f"lo and hi must be ints, got {lo!r}, {hi!r}")
        if not 0 <= lo <= hi <= total:
            raise ValueError(
                f"slice [{lo}, {hi}) not inside [0, {total}) of the concatenated fragments"
            )
        lo, hi = int(lo), int(hi)
    else:
        lo, hi = 0, total
    if not save and L > 1 and n:
        _check_no_alias(pools)
    if L and n and bb:
        _check_flat_vs_pools(flat, flat_off, 0, L * n * bb, pools, flat_name)
    return _Job(pools, ids, flat, flat_off, 0, save, lo, hi, sliced)


def _check_devices(dev: torch.device, flat: torch.Tensor, name: str) -> None:
    if dev.type == "cuda":
        if flat.device.type == "cuda":
            if flat.device != dev:
                raise ValueError(f"{name} is on {flat.device}, the cache on {dev}")
        elif flat.device.type == "cpu":
            if flat.numel() and not is_host_accessible(flat):  # an empty buffer is never read
                raise ValueError(
                    f"{name} is host memory that is neither pinned nor registered: the GPU cannot read it "
                    "directly (pin it, or call xkv.kernels.register_host once)"
                )
        else:
            raise ValueError(f"{name} is on {flat.device}, the cache on {dev}")
    elif flat.device != dev:
        raise ValueError(
            f"{name} is on {flat.device}, the cache on {dev}: CPU caches take CPU buffers"
        )


def _check_no_alias(pools: list[PagePool]) -> None:
    """No byte of one layer's blocks may be a byte of another's (two writers, one byte)."""
    order = sorted(pools, key=lambda p: p.data_ptr)
    comp = [order[0]]
    end = order[0].data_ptr + order[0].extent
    comps = []
    for p in order[1:]:
        if p.data_ptr < end:
            comp.append(p)
        else:
            comps.append(comp)
            comp = [p]
        end = max(end, p.data_ptr + p.extent)
    comps.append(comp)
    for c in comps:
        if len(c) < 2:
            continue
        s = c[0].block_stride
        if all(p.block_stride == s and p.span <= s for p in c):
            ivs = []
            for p in c:
                d = (p.data_ptr - c[0].data_ptr) % s
                for o, ln in p.runs:
                    a = (o + d) % s
                    ivs += [(a, a + ln)] if a + ln <= s else [(a, s), (0, a + ln - s)]
            ivs.sort()
            if any(b0 > a1 for (_, b0), (a1, _) in itertools.pairwise(ivs)):
                raise ValueError("two destination layers share bytes (the same pool twice?)")
        else:
            for i, p in enumerate(c):
                for q in c[i + 1 :]:
                    if p.overlaps(q):
                        raise ValueError(
                            f"destination layers overlap: {p.describe()} and {q.describe()}"
                        )


def _check_flat_vs_pools(flat, flat_off, lo, hi, pools, name) -> None:
    if flat.device != pools[0].device:
        return
    if flat_off is not None and flat_off.size:
        a = flat.data_ptr() + int(flat_off.min())
        b = flat.data_ptr() + int(flat_off.max()) + pools[0].block_bytes
    else:
        a, b = flat.data_ptr() + lo, flat.data_ptr() + hi
    for p in pools:
        if a < p.data_ptr + p.extent and p.data_ptr < b:
            raise ValueError(f"{name} overlaps the paged cache it is copied to or from")


def _device_index(device) -> int:
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else -1
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "cuda":
        return -1
    return (
        d.index
        if d.index is not None
        else (torch.cuda.current_device() if torch.cuda.is_available() else 0)
    )


# --------------------------------------------------------------------------------------------------
# dispatch


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _run(job: _Job, engine: str, max_programs: int | None) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if max_programs is not None and (
        not isinstance(max_programs, (int, np.integer)) or max_programs < 1
    ):
        raise ValueError(f"max_programs must be a positive int, got {max_programs!r}")
    if not job.pools:
        return
    dev = job.pools[0].device
    if engine == "auto":
        if dev.type != "cuda":
            engine = "reference"
        else:
            cal = _CALIBRATION.get(_device_index(dev))
            engine = "triton"
            if cal is not None and job.block_bytes and not job.sliced:
                run = min(n for p in job.pools for _, n in p.runs)
                total = len(job.pools) * job.n * job.block_bytes
                engine = cal.engine_for(job.save, run, total, job.flat.device.type == "cpu")
    if engine == "triton" and dev.type != "cuda" and not _interpreting():
        raise ValueError(
            "engine='triton' on CPU tensors needs TRITON_INTERPRET=1 (use 'reference' or 'auto')"
        )
    if engine in ("copy_engine", "staged") and dev.type != "cuda":
        raise ValueError(f"engine={engine!r} needs CUDA tensors")
    if job.n == 0 or job.block_bytes == 0 or job.lo == job.hi:
        return
    budget = default_programs() if max_programs is None else int(max_programs)
    if engine == "reference":
        _run_reference(job)
    elif engine == "triton" or (engine == "staged" and job.sliced):
        _run_triton(job, budget)
    elif engine == "staged":
        _run_staged(job, budget)
    else:
        _run_copy_engine(job)


# ---- torch reference --------------------------------------------------------------------------


def _flat_rows(flat: torch.Tensor, offs: np.ndarray, length: int) -> torch.Tensor | None:
    """``[n, length]`` view of flat rows starting at ``offs`` if they are evenly spaced, else None."""
    n = offs.size
    step = int(offs[1] - offs[0]) if n > 1 else length
    if n > 1 and (
        step < 0 or not np.array_equal(offs, offs[0] + step * np.arange(n, dtype=np.int64))
    ):
        return None
    return flat.as_strided((n, length), (step, 1), flat.storage_offset() + int(offs[0]))


def _run_reference(job: _Job) -> None:
    n, bb = job.n, job.block_bytes
    offs_all = job.flat_offsets()
    ids_np = job.ids
    for layer, pool in enumerate(job.pools):
        ids = torch.from_numpy(ids_np).to(pool.device)
        offs = offs_all[layer]
        cum = 0
        for r, (_, ln) in enumerate(pool.runs):
            view = pool.run_view(r)  # [num_blocks, ln]
            if job.sliced:
                for i in range(n):
                    pos = (layer * n + i) * bb + cum
                    a, b = max(job.lo - pos, 0), min(job.hi - pos, ln)
                    if a >= b:
                        continue
                    f = int(offs[i]) + cum
                    pool_bytes = view[int(ids_np[i]), a:b]
                    flat_bytes = job.flat[f + a : f + b]
                    if job.save:
                        flat_bytes.copy_(pool_bytes)
                    else:
                        pool_bytes.copy_(flat_bytes)
            else:
                rows = _flat_rows(job.flat, offs + cum, ln)
                if job.save:
                    gathered = view.index_select(0, ids)
                    if rows is not None and (n == 1 or int(rows.stride(0)) >= ln):
                        rows.copy_(gathered)
                    else:
                        for i in range(n):
                            f = int(offs[i]) + cum
                            job.flat[f : f + ln].copy_(gathered[i])
                else:
                    if rows is None:
                        rows = torch.stack(
                            [job.flat[int(o) + cum : int(o) + cum + ln] for o in offs]
                        )
                    view.index_copy_(0, ids, rows.to(view.device))
            cum += ln


# ---- Triton -------------------------------------------------------------------------------------


def _geometry_groups(pools: list[PagePool]) -> list[list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(pools):
        groups.setdefault((p.block_stride, p.runs), []).append(i)
    return list(groups.values())


def _run_triton(job: _Job, max_programs: int, *, tile_bytes: int | None = None) -> None:
    for launch in _triton_launches(job, max_programs, tile_bytes=tile_bytes):
        launch()


def _triton_launches(job: _Job, max_programs: int, *, tile_bytes: int | None = None) -> list:
    """Upload the descriptors and return one closure per launch (one per layer geometry).

    Calling the closures again repeats the same copy without rebuilding anything (benchmarks).
    """
    n, bb = job.n, job.block_bytes
    groups = _geometry_groups(job.pools)
    offs_all = None if (job.flat_off is None and len(groups) == 1) else job.flat_offsets()
    ids, lo, hi = job.ids, job.lo, job.hi
    if job.sliced:  # only the fragments that meet [lo, hi)
        f0, f1 = lo // bb, -(-hi // bb)
        ids = ids[f0:f1]
        offs_all = job.flat_offsets()[:, f0:f1]
        lo, hi = lo - f0 * bb, hi - f0 * bb
        n = f1 - f0
    dev = job.pools[0].device
    launches = []
    for layers in groups:
        flat_off = None if offs_all is None else offs_all[layers]
        desc = ids if flat_off is None else np.concatenate([ids, flat_off.ravel()])
        desc_t = torch.from_numpy(np.ascontiguousarray(desc, dtype=np.int64))
        if dev.type == "cuda":  # pinned, so the upload is asynchronous and stream-ordered
            desc_t = desc_t.pin_memory().to(dev, non_blocking=True)
        gcd = int(np.gcd.reduce(flat_off.ravel())) if flat_off is not None and flat_off.size else 0
        launches.append(
            _launch_group(
                [job.pools[i] for i in layers],
                job.flat,
                ids_t=desc_t[:n],
                n=n,
                flat_off_t=None if flat_off is None else desc_t[n:],
                flat_off_gcd=gcd,
                flat_base=job.flat_base + layers[0] * job.n * bb if flat_off is None else 0,
                save=job.save,
                sliced=job.sliced,
                lo=lo,
                hi=hi,
                max_programs=max_programs,
                tile_bytes=tile_bytes,
            )
        )
    return launches


def _launch_group(
    pools: list[PagePool],
    flat: torch.Tensor,
    *,
    ids_t: torch.Tensor,
    n: int,
    flat_off_t: torch.Tensor | None,
    flat_off_gcd: int,
    flat_base: int,
    save: bool,
    sliced: bool,
    lo: int,
    hi: int,
    max_programs: int,
    tile_bytes: int | None = None,
    tables: dict | None = None,
) -> _Launch:
    """One launch over layers of one geometry: the word size from the alignment of everything
    touched, the tile from :func:`launch_config`, the small layer/run table uploaded (or reused
    from ``tables``). ``ids_t`` and ``flat_off_t`` (bytes) are int64 tensors on the pools' device."""
    from xkv.kernels import _page_copy as K

    dev = pools[0].device
    low = min(pools, key=lambda p: p.data_ptr)
    layer_off = [p.data_ptr - low.data_ptr for p in pools]
    runs = pools[0].runs
    run_off = [o for o, _ in runs]
    run_len = [ln for _, ln in runs]
    run_cum = list(itertools.accumulate([0, *run_len[:-1]]))
    bb = sum(run_len)
    vals = [pools[0].block_stride, low.data_ptr, flat.data_ptr(), bb, flat_base]
    vals += run_off + run_len + layer_off
    if flat_off_t is not None:
        vals.append(flat_off_gcd)
    if sliced:
        vals += [lo, hi]
    align = math.gcd(*vals)
    word = word_bytes(align)
    vec = 2 if word == 8 and align % 16 == 0 else 1
    R, Lg = len(runs), len(pools)
    n_rows = Lg * n * R
    max_run = max(run_len)
    kw = {"tile_bytes": tile_bytes} if tile_bytes else {}
    cfg = launch_config(max_run, n_rows, max_programs, word=word, save=save, **kw)
    max_run_w = max_run // word
    even = (not sliced) and min(run_len) == max_run and max_run_w % cfg.cols == 0
    key = (word, tuple(layer_off), runs)
    tab = None if tables is None else tables.get(key)
    if tab is None:
        tab = torch.tensor(
            [x // word for x in layer_off + run_off + run_len + run_cum], dtype=torch.int64
        )
        if dev.type == "cuda":
            tab = tab.pin_memory().to(dev, non_blocking=True)
        if tables is not None:
            tables[key] = tab
    args = (
        low.base,
        flat,
        ids_t,
        ids_t if flat_off_t is None else flat_off_t,
        tab[:Lg],
        tab[Lg:],
        n,
        R,
        n_rows,
        -(-n_rows // cfg.rows),
        pools[0].block_stride // word,
        bb // word,
        flat_base // word,
        lo // word,
        hi // word,
        max_run_w,
    )
    meta = dict(
        WORD_T=K.WORD_TYPES[word],
        WORD=word,
        SAVE=save,
        HAS_FLAT_OFF=flat_off_t is not None,
        HAS_LAYERS=Lg > 1,
        SLICED=sliced,
        EVEN=even,
        VEC=vec,
        ROWS=cfg.rows,
        COLS=cfg.cols,
        num_warps=cfg.num_warps,
    )
    return _Launch(K.page_copy_kernel, cfg.programs, args, meta, dev)


class _Launch:
    """One prepared kernel launch (descriptors already on the device)."""

    __slots__ = ("args", "dev", "grid", "kernel", "meta")

    def __init__(self, kernel, programs: int, args: tuple, meta: dict, dev: torch.device):
        self.kernel, self.grid, self.args, self.meta, self.dev = (
            kernel,
            (programs,),
            args,
            meta,
            dev,
        )

    def __call__(self) -> None:
        if self.dev.type == "cuda":
            with torch.cuda.device(self.dev):
                self.kernel[self.grid](*self.args, **self.meta)
        else:
            self.kernel[self.grid](*self.args, **self.meta)


# ---- copy engine --------------------------------------------------------------------------------


def _run_copy_engine(job: _Job) -> None:
    dsts, srcs, sizes = _copy_engine_plan(job)
    copy_engine.batch_copy(
        dsts,
        srcs,
        sizes,
        device=job.pools[0].device,
        src_is_host=(not job.save) and job.flat.device.type == "cpu",
    )


def _copy_engine_plan(job: _Job) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(destination addresses, source addresses, sizes) of every run of every fragment."""
    n, bb = job.n, job.block_bytes
    offs = job.flat_offsets()  # [L, n]
    fptr = np.uint64(job.flat.data_ptr())
    srcs, dsts, sizes = [], [], []
    for layer, pool in enumerate(job.pools):
        runs = np.array(pool.runs, dtype=np.int64).reshape(-1, 2)
        cum = np.concatenate([[0], np.cumsum(runs[:, 1])[:-1]])
        pool_addr = (
            pool.data_ptr + job.ids[:, None] * pool.block_stride + runs[None, :, 0]
        )  # [n, R]
        flat_addr = offs[layer][:, None] + cum[None, :]
        size = np.broadcast_to(runs[None, :, 1], pool_addr.shape).copy()
        if job.sliced:
            pos = (layer * n + np.arange(n))[:, None] * bb + cum[None, :]
            a = np.clip(job.lo - pos, 0, size)
            b = np.clip(job.hi - pos, 0, size)
            pool_addr, flat_addr, size = pool_addr + a, flat_addr + a, b - a
        keep = size.ravel() > 0
        p = pool_addr.ravel()[keep].astype(np.uint64)
        f = flat_addr.ravel()[keep].astype(np.uint64) + fptr
        z = size.ravel()[keep].astype(np.uint64)
        (srcs, dsts) = (srcs + [p], dsts + [f]) if job.save else (srcs + [f], dsts + [p])
        sizes.append(z)
    return np.concatenate(dsts), np.concatenate(srcs), np.concatenate(sizes)


# ---- staged: copy engine <-> GPU staging ring <-> pages --------------------------------------------


def _staged_chunks(job: _Job) -> list[tuple[list[int], int, int]]:
    """Chunks in the concatenation's (layer-major) order: ``(layers, i0, i1)`` is fragments
    ``[i0, i1)`` of each of ``layers`` (one layer, or several whole layers)."""
    L, n, bb = len(job.pools), job.n, job.block_bytes
    chunk = min(max((L * n * bb) // 8, STAGED_MIN_CHUNK), STAGED_MAX_CHUNK)
    per = max(1, chunk // bb)
    if per >= n:
        lpc = max(1, per // n)
        return [(list(range(a, min(a + lpc, L))), 0, n) for a in range(0, L, lpc)]
    return [([layer], i, min(i + per, n)) for layer in range(L) for i in range(0, n, per)]


def _contiguous_ranges(flat_off: np.ndarray, bb: int) -> list[tuple[int, int, int]]:
    """``(flat offset, slot offset, bytes)`` for fragments j at ``flat_off[j]`` <-> slot ``j * bb``,
    merging neighbours that are contiguous on both sides."""
    if flat_off.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(flat_off) != bb) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [flat_off.size]])
    return [
        (int(flat_off[a]), int(a) * bb, int(b - a) * bb) for a, b in zip(starts, ends, strict=True)
    ]


def _run_staged(job: _Job, max_programs: int, *, dma=None) -> None:
    """Pipeline: DMA chunk k+1 between the flat buffer and a staging slot while Triton
    packs/unpacks chunk k between the other slot and the pages. Two slots, events between a side
    stream (copies) and the current stream (kernels). ``dma(flat, flat_off, slot, slot_off, size,
    to_slot)`` replaces the copy engine in CPU tests (then nothing is asynchronous)."""
    dev = job.pools[0].device
    bb = job.block_bytes
    chunks = _staged_chunks(job)
    ids_t = torch.from_numpy(np.ascontiguousarray(job.ids, dtype=np.int64))
    if dev.type == "cuda":  # every chunk's kernel reads a slice of this one upload
        ids_t = ids_t.pin_memory().to(dev, non_blocking=True)
    tables: dict = {}

    def kernel(ls: list[int], i0: int, i1: int, slot: torch.Tensor) -> None:
        pools = [job.pools[i] for i in ls]
        if len({(p.block_stride, p.runs) for p in pools}) > 1:  # mixed geometries: general path
            sub = _Job(pools, job.ids[i0:i1], slot, None, 0, job.save, 0, slot.numel(), False)
            _run_triton(sub, max_programs)
            return
        _launch_group(
            pools,
            slot,
            ids_t=ids_t[i0:i1],
            n=i1 - i0,
            flat_off_t=None,
            flat_off_gcd=0,
            flat_base=0,
            save=job.save,
            sliced=False,
            lo=0,
            hi=slot.numel(),
            max_programs=max_programs,
            tables=tables,
        )()

    slot_bytes = max(len(ls) * (i1 - i0) for ls, i0, i1 in chunks) * bb
    staging = torch.empty(2 * slot_bytes, dtype=torch.uint8, device=dev)
    offs = job.flat_offsets()
    cuda = dma is None
    if cuda:
        cur = torch.cuda.current_stream(dev)
        side = copy_engine.side_stream(dev, "d2h" if job.save else "h2d")
        side.wait_stream(cur)
        staging.record_stream(side)
    free: list = [None, None]  # per slot: event after which the slot may be overwritten

    def copy(ranges, slot, to_slot: bool) -> None:
        if dma is not None:
            for f, o, z in ranges:
                dma(job.flat, f, slot, o, z, to_slot)
        elif len(ranges) <= 8 or not copy_engine.available():
            for f, o, z in ranges:
                a, b = job.flat[f : f + z], slot[o : o + z]
                if to_slot:
                    b.copy_(a, non_blocking=True)
                else:
                    a.copy_(b, non_blocking=True)
        else:
            fp, sp = job.flat.data_ptr(), slot.data_ptr()
            r = np.array(ranges, dtype=np.int64).reshape(-1, 3)
            src, dst = (r[:, 0] + fp, r[:, 1] + sp) if to_slot else (r[:, 1] + sp, r[:, 0] + fp)
            copy_engine.batch_copy(
                dst.astype(np.uint64),
                src.astype(np.uint64),
                r[:, 2].astype(np.uint64),
                device=dev,
                src_is_host=to_slot and job.flat.device.type == "cpu",
            )

    for k, (ls, i0, i1) in enumerate(chunks):
        s = k % 2
        m = len(ls) * (i1 - i0)
        slot = staging[s * slot_bytes : s * slot_bytes + m * bb]
        ranges = _contiguous_ranges(offs[ls, i0:i1].ravel(), bb)
        if not cuda:
            if job.save:
                kernel(ls, i0, i1, slot)
                copy(ranges, slot, False)
            else:
                copy(ranges, slot, True)
                kernel(ls, i0, i1, slot)
            continue
        if not job.save:
            with torch.cuda.stream(side):
                if free[s] is not None:
                    side.wait_event(free[s])
                copy(ranges, slot, True)
                landed = torch.cuda.Event()
                landed.record(side)
            cur.wait_event(landed)
            kernel(ls, i0, i1, slot)
            free[s] = torch.cuda.Event()
            free[s].record(cur)
        else:
            if free[s] is not None:
                cur.wait_event(free[s])
            kernel(ls, i0, i1, slot)
            packed = torch.cuda.Event()
            packed.record(cur)
            with torch.cuda.stream(side):
                side.wait_event(packed)
                copy(ranges, slot, False)
                free[s] = torch.cuda.Event()
                free[s].record(side)
    if cuda and job.save:
        cur.wait_stream(side)
