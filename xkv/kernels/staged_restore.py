"""Prepared staged restores: the copy engine brings host bytes into the ring, Triton unpacks them.

SMs reading host memory reach 0.6-0.93 of the copy engine's rate, by host (bench/RESULTS.md: 48.5
of 55.5 GB/s on stop 39's H100 inside the engine, 29-33 of 55 on stop 40's, 50.5-51.3 of 55 on the
H200 in the page mover); the copy engine reaches the link's rate on large contiguous copies, and
a slot unpacked from GPU memory takes a few percent of the copy's time. Here everything is
decided at prepare time:

* a step's restore of ``L`` layers x ``n`` fragments (a validated :class:`~xkv.kernels.jobs.Job`,
  host flat buffer) is cut per layer group (``groups``; None: one group per layer) into chunks
  in the layers' order (:func:`group_chunks`: fragments ``[i0, i1)`` of one layer, of every
  layer of the group, or several whole layers), each assigned a slot of the device's
  :class:`~xkv.kernels.ring.Ring` in turn;
* inside its slot a chunk's fragments lie in the order of their card offsets (the unpack reads
  each fragment's ring offset from a table, so any order unpacks alike): a stored object holds
  its layers one after another, so the pages of several layers of one object are ONE copy-engine
  range, where a ring laid out layer by layer needed one per layer. The driver's batch call
  costs host time per range (stop 44, H100: the MLA model's 32k restore, 18 KiB pages, ~57
  ranges per 16 MiB chunk, issued its copies no faster than the copy engine ran them);
* the copy-engine ranges of every chunk (contiguous runs of the card merged, cut at
  registration boundaries) come from one vectorised pass; the unpacks' tables (block ids, every
  fragment's ring offset ``[L, n]``, the checks' fragment table per distinct range) go to the GPU
  in ONE upload on the issuing stream, built when the first chunk's copy has been queued (the
  copy engine moves that chunk meanwhile: the first copy starts that much sooner), and every
  chunk of a geometry runs the one kernel variant planned for a full slot
  (``_launch.resized``: a short chunk compiles nothing new); a verified job's chunks hash the
  slot as they unpack it (the bytes the copy engine brought), into the job's one word buffer;

and ``calls[g]()`` only issues group ``g``'s chunks: per chunk, on the copy stream, a wait for
the slot's last unpack (an event per slot, reused), one batched copy, the slot's ``landed``
event; on the current stream a wait for it, the unpack launch(es), the slot's ``free`` event.
No allocation, planning or upload per launch (the tables' one upload comes with the restore's
first chunk).

CPU (tests): ``dma(flat, flat_off, ring_buf, ring_off, size)`` replaces the copy engine and
everything runs in order; the unpack runs the same Triton launches (interpreter).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch

from xkv.kernels import _launch, copy_engine, host, staged
from xkv.kernels._lazy import deferred
from xkv.kernels.calibrate import calibration
from xkv.kernels.jobs import Job
from xkv.kernels.ring import SLOT_BYTES, Ring, ring
from xkv.kernels.ring_choice import takes_ring

__all__ = ["CHUNK_MIN_BYTES", "MAX_PAGE_BYTES", "absolute_ranges", "card_order", "chunks",
           "group_chunks", "object_run", "preferred", "prepare", "ring_offset_gcd",
           "unpack_plan"]

CHUNK_MIN_BYTES = 1 << 20  # a smaller copy-engine transfer loses to its per-copy cost
#: pages up to a ring slot; larger ones (a big Mamba state) keep the per-launch staged engine
#: rather than growing the process's ring to three of them
MAX_PAGE_BYTES = SLOT_BYTES


#: the chunking rule of both staged engines (``staged.layer_chunks``)
chunks = staged.layer_chunks


def group_chunks(layers, n: int, bb: int, chunk_bytes: int,
                 align: int = 1) -> list[tuple[list[int], int, int]]:
    """Chunks of a layer group's restore (``layers`` x ``n`` fragments of ``bb`` bytes), each at
    most ``max(chunk_bytes, bb)`` bytes: ``(ls, i0, i1)``. ``align``: the pages one stored
    object holds per layer (:func:`object_run`). Several layers whose fragments do not all fit
    one chunk, at least one fragment of each does, and a chunk of one layer would span several
    objects (``align`` below a chunk's pages; with objects of >= 2 pages per layer also where a
    chunk could take whole layers, which would cut every object at each chunk's layer boundary):
    fragments ``[i0, i1)`` of every layer, ``m`` per chunk, rounded down to a multiple of ``align``
    when ``m`` reaches it (whole objects: a layer-major object's pages of those layers are one range
    in the card); when a whole object of every layer does not fit a chunk (a group of more than
    ``per // align`` layers: ``whole`` groups, deep models), the layers are split into runs of
    ``per // align`` first, each run's objects whole. Otherwise :func:`chunks` (one layer's
    fragments, or several whole layers): where a layer's pages lie contiguous in the card, a
    one-layer chunk is one range already."""
    ls = list(layers)
    per = max(1, chunk_bytes // bb) if bb else 1
    if (n == 0 or len(ls) < 2 or per < len(ls) or align >= per
            or (per >= n and (align < 2 or per >= n * len(ls)))):
        return chunks(ls, n, bb, chunk_bytes)
    k = per // align if align > 1 else len(ls)
    if k < len(ls):  # an object's pages of every layer exceed a chunk: runs of k layers
        return [c for a in range(0, len(ls), k)
                for c in group_chunks(ls[a : a + k], n, bb, chunk_bytes, align)]
    m = per // len(ls)
    if align > 1 and m >= align:
        m -= m % align
    return [(ls, i, min(i + m, n)) for i in range(0, n, m)]


def object_run(flat_off: np.ndarray, bb: int) -> int:
    """The longest run of consecutive fragments contiguous in the card among one layer's
    ``flat_off`` (int64 bytes, ``[n]``): the pages a stored object holds per layer when objects
    are layer-major (1 when none are contiguous)."""
    if flat_off.size < 2:
        return 1
    brk = np.flatnonzero(np.diff(flat_off) != bb)
    edges = np.concatenate([[-1], brk, [flat_off.size - 1]])
    return int(np.diff(edges).max())


def card_order(flat_off: np.ndarray, chunk: np.ndarray) -> np.ndarray:
    """Indices ordering fragments (``flat_off`` int64 bytes, ``chunk`` their chunk, both
    ``[N]``) by chunk, then card offset (stable): a chunk's slot holds its fragments so."""
    if flat_off.size == 0:
        return np.zeros(0, np.int64)
    span = int(flat_off.max()) + 1
    if int(flat_off.min()) >= 0 and int(chunk.max()) < (1 << 62) // span:
        return np.argsort(chunk * span + flat_off, kind="stable")  # mostly sorted: fast
    return np.lexsort((flat_off, chunk))


class _Chunk:
    """One chunk: its slot, copy-engine work and unpack launches."""

    __slots__ = ("index", "ranges", "slot", "unpack")

    def __init__(self, index: int, slot: int, ranges: tuple,
                 unpack: Callable[[int], list]) -> None:
        self.index, self.slot = index, slot
        self.ranges = ranges  # (ring offsets, flat offsets, sizes) int64 bytes, merged runs
        self.unpack = unpack  # chunk index -> its launches

    def launch(self) -> None:
        for launch in self.unpack(self.index):
            launch()


def _ranges(flat_off: np.ndarray, ring_off: np.ndarray, chunk: np.ndarray, bb: int,
            n_chunks: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per chunk the copy-engine ranges of fragments in ring order (``flat_off`` / ``ring_off``
    int64 bytes, ``chunk`` the chunk of each): neighbours contiguous on both sides and in one
    chunk merge into one range. One vectorised pass over every fragment."""
    if flat_off.size == 0:
        return [(np.zeros(0, np.int64),) * 3 for _ in range(n_chunks)]
    brk = np.flatnonzero((np.diff(flat_off) != bb) | (np.diff(ring_off) != bb)
                         | (np.diff(chunk) != 0)) + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [flat_off.size]])
    owner = chunk[starts]
    cut = np.searchsorted(owner, np.arange(n_chunks + 1))
    d, f, z = ring_off[starts], flat_off[starts], (ends - starts) * bb
    return [(d[a:b], f[a:b], z[a:b]) for a, b in zip(cut[:-1], cut[1:], strict=True)]


def prepare(job: Job, max_programs: int, groups: Sequence[Sequence[int]] | None = None, *,
            dma: Callable | None = None, chunk_bytes: int | None = None,
            the_ring: Ring | None = None) -> list[Callable[[], None]]:
    """One call per layer group (``groups``: runs of consecutive layers covering
    ``range(len(job.pools))``; None: one per layer) issuing that group's staged restore (module
    docstring). ``job``: a restore (``save=False``), unsliced, its flat buffer host memory the
    GPU can read (CUDA) or anything (CPU with ``dma``). ``chunk_bytes``: default a slot, or an
    eighth of the copy when that is smaller (>= :data:`CHUNK_MIN_BYTES`), so a short restore
    still pipelines."""
    if job.save or job.sliced:
        raise ValueError("a staged restore prepares whole restores (save=False, not sliced)")
    L, n, bb = len(job.pools), job.n, job.block_bytes
    groups = [[k] for k in range(L)] if groups is None else [[int(k) for k in g] for g in groups]
    if [k for g in groups for k in g] != list(range(L)) or any(not g for g in groups):
        raise ValueError(f"groups must split range({L}) into non-empty runs of consecutive "
                         f"layers, in order; got {groups}")
    if n == 0 or bb == 0 or not L:
        return [lambda: None for _ in groups]
    dev = job.pools[0].device
    cuda = dev.type == "cuda" and dma is None
    if cuda and not copy_engine.available():
        raise ValueError("a staged restore needs the driver's cuMemcpyBatchAsync (CUDA 12.8+)")
    r = the_ring if the_ring is not None else ring(dev)
    if bb > r.slot_bytes:
        raise ValueError(f"a {bb}-byte page does not fit the ring's {r.slot_bytes}-byte slots")
    if chunk_bytes is None:
        chunk_bytes = min(r.slot_bytes, max(L * n * bb // 8, CHUNK_MIN_BYTES))
    chunk_bytes = max(bb, min(int(chunk_bytes), r.slot_bytes))
    flat_off = job.flat_offsets()  # [L, n] int64 bytes
    todo = [(gi, ls, i0, i1) for gi, g in enumerate(groups)
            for ls, i0, i1 in group_chunks(g, n, bb, chunk_bytes, object_run(flat_off[g[0]], bb))]
    # every fragment's chunk (chunks cover consecutive layers x a fragment range), then its
    # place in the ring: chunk k fills slot k % slots from its start, in card order
    cid = np.empty((L, n), np.int64)
    for k, (_, ls, i0, i1) in enumerate(todo):
        cid[ls[0] : ls[-1] + 1, i0:i1] = k
    order = card_order(flat_off.ravel(), cid.ravel())
    c_sorted = cid.ravel()[order]
    start = np.searchsorted(c_sorted, np.arange(len(todo)))
    base = (np.arange(len(todo), dtype=np.int64) % r.slots) * r.slot_bytes
    ring_sorted = base[c_sorted] + (np.arange(L * n, dtype=np.int64) - start[c_sorted]) * bb
    ring_off = np.empty(L * n, np.int64)
    ring_off[order] = ring_sorted
    ring_off = ring_off.reshape(L, n)
    per_chunk = _ranges(flat_off.ravel()[order], ring_sorted, c_sorted, bb, len(todo))
    # the unpack tables are built (and uploaded) at the first unpack: the issuer makes it after
    # queueing the restore's first copy, so the copy engine does not wait for them
    unpack = deferred(lambda: _unpacks(job, r, ring_off, todo, max_programs))
    out: list[list[_Chunk]] = [[] for _ in groups]
    for k, (gi, _, _, _) in enumerate(todo):
        out[gi].append(_Chunk(k, k % r.slots, per_chunk[k], unpack))
    if cuda:
        every = [c for mine in out for c in mine]
        for c, rg in zip(every, absolute_ranges([c.ranges for c in every], r.buf.data_ptr(),
                                                job.flat.data_ptr(), host.piece_boundaries()),
                         strict=True):
            c.ranges = rg
    return [_issuer(mine, job, r, dev, cuda, dma) for mine in out]


def absolute_ranges(ranges: list[tuple], ring_ptr: int, flat_ptr: int,
                    bounds: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per chunk, its ranges ``(ring offsets, flat offsets, sizes)`` (int64 bytes) as the copy
    engine takes them: uint64 addresses ``ring_ptr + d``, ``flat_ptr + f`` and sizes, cut where a
    range crosses a registration boundary (``bounds``, :func:`~xkv.kernels.host.piece_boundaries`)
    exactly as :func:`~xkv.kernels.host.split_at` cuts it. One vectorised pass over every range
    of the restore; only a chunk with a range over a boundary (rare) goes through ``split_at``.
    A 32k restore has ~256 chunks: done per chunk (and again per copy call) it took 4.0 ms on
    the CPU box, 0.36 ms so (``bench/staged_prepare_time.py``); the GPU host planned that restore
    in 8.7-15.4 ms before its first copy (bench/RESULTS.md "stop 41")."""
    if not ranges:
        return []
    counts = np.array([rg[2].size for rg in ranges], np.int64)
    d = np.concatenate([rg[0] for rg in ranges]).astype(np.uint64) + np.uint64(ring_ptr)
    f = np.concatenate([rg[1] for rg in ranges]).astype(np.uint64) + np.uint64(flat_ptr)
    z = np.concatenate([rg[2] for rg in ranges]).astype(np.uint64)
    at = np.concatenate([[0], np.cumsum(counts)])
    b = bounds.astype(np.uint64)
    cs = np.concatenate([[0], np.cumsum(host.crossing(d, f, z, b))])
    crossing = cs[at[1:]] > cs[at[:-1]]  # per chunk: any of its ranges cut
    out = []
    for k in range(len(ranges)):
        sl = slice(at[k], at[k + 1])
        if crossing[k]:
            out.append(host.split_at(d[sl], f[sl], z[sl], b))
        else:
            out.append((d[sl], f[sl], z[sl]))
    return out


def unpack_plan(pools: list, r: Ring, gcd: int, max_programs: int,
                check: bool) -> _launch.LaunchPlan:
    """The unpack variant of chunks of ``pools`` (one layer, or several whole layers of one
    geometry) from ``r``: planned for a full slot (``max(1, slot pages // layers)`` fragments
    per layer), so its tile does not depend on the restore's length (:func:`_launch.resized`
    gives each chunk's counts): a one-layer or layer-group restore's tile at that budget, which
    the connector's warmup compiles (tests/kernels/test_warmup.py)."""
    bb = pools[0].block_bytes
    n = max(1, r.slot_bytes // bb // len(pools))
    return _launch.plan(list(pools), r.buf, n=n, has_flat_off=True, flat_off_gcd=gcd,
                        flat_base=0, save=False, sliced=False, lo=0, hi=len(pools) * n * bb,
                        max_programs=max_programs, check=check)


def ring_offset_gcd(bb: int, r: Ring) -> int:
    """The gcd of the ring offsets of a restore of several pages of ``bb`` bytes (their word
    size and 16-byte hint: only its low 4 bits matter)."""
    return math.gcd(bb, r.slot_bytes)


def preferred(job: Job) -> bool:
    """Whether ``engine="auto"`` takes this path for ``job`` (every layer): a whole restore of
    at least ``staged.STAGED_MIN_BYTES`` from host memory into CUDA pages that fit a slot, the
    copy engine's batch call available, no calibration installed for the GPU (one decides
    per fragment size instead), and the GPU's start-up probe (:mod:`~xkv.kernels.ring_choice`)
    found the ring at least ``MIN_GAIN`` x faster than the Triton kernel and the restore large
    enough for that to pay for the ring's host work (``ring_choice.takes_ring``), or none ran.
    SMs read host memory at 0.6-0.93 of the copy engine's rate by host (bench/RESULTS.md "stop
    40", "stop 41"); where they read nearly as fast, or the restore is short (stop 50: the MLA
    model's 4k restore), the ring's host work loses more than its copy gains."""
    if job.save or job.sliced or not job.pools or job.n == 0:
        return False
    dev = job.pools[0].device
    nbytes = len(job.pools) * job.n * job.block_bytes
    return (dev.type == "cuda" and job.flat.device.type == "cpu"
            and job.block_bytes <= MAX_PAGE_BYTES and nbytes >= staged.STAGED_MIN_BYTES
            and copy_engine.available() and calibration(dev) is None and takes_ring(dev, nbytes))


def _unpacks(job: Job, r: Ring, ring_off: np.ndarray, todo: list, max_programs: int):
    """The unpack launches of every chunk with ONE table upload: the block ids and the ring
    offsets ``[L, n]`` once (a chunk of one layer reads a slice of each), the checks' fragment
    table once per distinct fragment range, per-layer word rows once. Every slice a launch gets
    starts 16-byte aligned (the kernel's variants assume aligned tables: an unaligned one is
    another variant, compiled mid-serving): a slice that would not gets its own section. Plans:
    one per layer geometry for a full slot (:func:`_launch.resized` for shorter chunks: every
    chunk runs that variant), a chunk of several whole layers its own (few). Uploads, and
    returns ``unpack(k)``, the launches of chunk ``k``, built on first use: the issue loop
    builds them while the copy engine is busy, not before the first copy."""
    n, bb = job.n, job.block_bytes
    jc = job.checks
    tables = _launch.Tables()
    at_ids = tables.add(job.ids)
    at_off = tables.add(ring_off)
    gcd = ring_offset_gcd(bb, r)  # divides every ring offset: the variant warmup compiles
    if jc is not None:
        C = jc.num_objects
        res_all = np.array(jc.rows, np.int64) * C
        at_res = tables.add(res_all)
        full_chk = jc.table()
    cache: dict = {}

    def section(key, start: int, values: np.ndarray) -> int:
        """The int64 index of ``values`` in the upload: ``start`` (they are already there) if
        16-byte aligned, else a section of their own; once per ``key``."""
        at = cache.get(key)
        if at is None:
            at = cache[key] = start if start % 2 == 0 else tables.add(values)
        return at

    plans: dict[tuple, tuple] = {}  # (geometry, m) -> (plan, its run table's index)
    subs_of: dict[tuple, list] = {}  # a chunk's layers -> per geometry group what chunks share
    specs = []  # per chunk: [(plan, base pool, layers, i0, i1, off_at, res_at, chk_at, tab_at)]
    for _, ls, i0, i1 in todo:
        m = i1 - i0
        mine = []
        subs = subs_of.get(tuple(ls))
        if subs is None:
            subs = subs_of[tuple(ls)] = []
            for sub in [[0]] if len(ls) == 1 else _launch.geometry_groups(
                    [job.pools[i] for i in ls]):
                lsg = [ls[j] for j in sub]
                l0, lg = lsg[0], len(lsg)
                run = lsg == list(range(l0, l0 + lg))
                res_at = None
                if jc is not None and run:
                    res_at = section(("res", l0, lg), at_res + l0, res_all[l0 : l0 + lg])
                elif jc is not None:  # a mixed-geometry chunk's layers: their own rows, once
                    res_at = tables.add(res_all[lsg])
                p0 = job.pools[l0]
                key = (tuple(lsg) if lg > 1 else None, p0.block_stride, p0.runs,
                       p0.data_ptr & 15)
                subs.append((lsg, l0, lg, run, res_at, p0, key))
        for lsg, l0, lg, run, res_at, p0, key in subs:
            ids_at = section(("ids", i0, i1), at_ids + i0, job.ids[i0:i1])
            if lg == 1 or (run and m == n):
                off_at = section(("off", l0, lg, i0, i1), at_off + l0 * n + i0,
                                 ring_off[l0 : l0 + lg, i0:i1])
            else:  # several layers, part of their fragments: their own rows
                off_at = tables.add(ring_off[lsg, i0:i1])
            chk_at = None
            if jc is not None:
                chk_at = cache.get(("chk", i0, i1))
                if chk_at is None:
                    chk_at = cache[("chk", i0, i1)] = tables.add(full_chk[:, i0:i1])
            got = plans.get((key, m))
            if got is None:
                whole = plans.get(key)
                if whole is None:
                    pools = [job.pools[i] for i in lsg]
                    whole = plans[key] = unpack_plan(pools, r, gcd, max_programs, jc is not None)
                p = _launch.resized(whole, m, max_programs)
                tab_at = cache.get(("tab", p.table.tobytes()))
                if tab_at is None:
                    tab_at = cache[("tab", p.table.tobytes())] = tables.add(p.table)
                got = plans[(key, m)] = (p, tab_at)
            p, tab_at = got
            mine.append((p, p0 if lg == 1 else None, lg, i0, i1, ids_at, off_at, res_at, chk_at,
                         tab_at))
        specs.append(mine)

    words = None if jc is None else jc.bind(job.pools[0].device, False).words
    t = tables.upload(job.pools[0].device)  # one upload, on the issuing stream
    built: dict[int, list] = {}

    def unpack(k: int) -> list:
        launches = built.get(k)
        if launches is not None:
            return launches
        launches = built[k] = []
        for p, p0, lg, i0, i1, ids_at, off_at, res_at, chk_at, tab_at in specs[k]:
            m = i1 - i0
            if p0 is not None:
                p = replace(p, pools=(p0,), base=p0.base)
            check = None if jc is None else (words, t[res_at : res_at + lg],
                                             t[chk_at : chk_at + 3 * m])
            launches.append(_launch.Launch(p, r.buf, t[ids_at : ids_at + m],
                                           t[off_at : off_at + lg * m],
                                           t[tab_at : tab_at + p.table.size], check))
        return launches

    return unpack


def _issuer(mine: list[_Chunk], job: Job, r: Ring, dev: torch.device, cuda: bool,
            dma: Callable | None) -> Callable[[], None]:
    flat = job.flat
    if not cuda:
        def run_cpu() -> None:
            for c in mine:
                for o, f, z in zip(*(a.tolist() for a in c.ranges), strict=True):
                    dma(flat, f, r.buf, o, z)
                c.launch()
        return run_cpu
    side = copy_engine.side_stream(dev, "h2d")

    def run_cuda() -> None:
        cur = torch.cuda.current_stream(dev)
        landed, free = r.events()
        with r.lock:
            r.used_on(cur)
            r.used_on(side)
            for c in mine:
                s = c.slot
                side.wait_event(free[s])  # the slot's last unpack (none yet: no wait)
                d, f, z = c.ranges
                copy_engine.batch_copy(d, f, z, device=dev, src_is_host=True, stream=side,
                                       presplit=True)
                landed[s].record(side)
                # built the first time here (the restore's first chunk: every chunk's tables,
                # one upload), while the copy engine moves this chunk
                launches = c.unpack(c.index)
                cur.wait_event(landed[s])
                for launch in launches:
                    launch()
                free[s].record(cur)
    return run_cuda
