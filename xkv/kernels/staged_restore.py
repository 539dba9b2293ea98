"""Prepared staged restores: the copy engine brings host bytes into the ring, Triton unpacks them.

SMs reading host memory top out at 0.87-0.93 of the copy engine's rate (bench/RESULTS.md: 48.5 of
55.5 GB/s on the H100 inside the engine, 50.5-51.3 of 55 on the H200 in the page mover); the copy
engine reaches the link's rate on large contiguous copies, and a slot unpacked from GPU memory
takes a few percent of the copy's time. Here everything is decided at prepare time:

* a step's restore of ``L`` layers x ``n`` fragments (a validated :class:`~xkv.kernels.jobs.Job`,
  host flat buffer) is cut per layer group (``groups``; None: one group per layer) into chunks
  in the layers' order (:func:`chunks`: fragments ``[i0, i1)`` of one layer, or several whole
  layers), each assigned a slot of the device's :class:`~xkv.kernels.ring.Ring` in turn;
* each chunk's copy-engine ranges (contiguous runs of the card merged, cut at registration
  boundaries) become address arrays, and each chunk's unpack a sub-job reading the ring
  (``flat_off`` = its place in the slot) whose tables, with every other chunk's, go to the GPU
  in ONE upload on the current (prepare) stream; a verified job's chunks hash the slot as they
  unpack it (the bytes the copy engine brought), into the job's one word buffer;

and ``calls[g]()`` only issues group ``g``'s chunks: per chunk, on the copy stream, a wait for
the slot's last reader, the copy, an event; on the current stream a wait for that event, the
unpack launch(es), the slot's new ``free`` event. No allocation, planning or upload per launch.

CPU (tests): ``dma(flat, flat_off, ring_buf, ring_off, size)`` replaces the copy engine and
everything runs in order; the unpack runs the same Triton launches (interpreter).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from xkv.kernels import _launch, copy_engine, host
from xkv.kernels.jobs import Job
from xkv.kernels.ring import SLOT_BYTES, Ring, ring
from xkv.kernels.staged import contiguous_ranges

__all__ = ["CHUNK_MIN_BYTES", "MAX_PAGE_BYTES", "chunks", "prepare"]

CHUNK_MIN_BYTES = 1 << 20  # a smaller copy-engine transfer loses to its per-copy cost
#: pages up to a ring slot; larger ones (a big Mamba state) keep the per-launch staged engine
#: rather than growing the process's ring to three of them
MAX_PAGE_BYTES = SLOT_BYTES
_FEW_RANGES = 8  # at most this many ranges: plain async copies beat one batch call


def chunks(layers: Sequence[int], n: int, bb: int, chunk_bytes: int) -> list[tuple[list[int], int, int]]:
    """Chunks of ``layers`` x ``n`` fragments of ``bb`` bytes in layer-major order, each at most
    ``max(chunk_bytes, bb)`` bytes: ``(ls, i0, i1)`` = fragments ``[i0, i1)`` of each layer of
    ``ls`` (one layer, or several whole layers)."""
    if n == 0 or not layers:
        return []
    per = max(1, chunk_bytes // bb)
    ls = list(layers)
    if per >= n:
        lpc = max(1, per // n)
        return [(ls[a : a + lpc], 0, n) for a in range(0, len(ls), lpc)]
    return [([layer], i, min(i + per, n)) for layer in ls for i in range(0, n, per)]


class _Chunk:
    """One chunk: its slot, copy-engine work and unpack launches."""

    __slots__ = ("launches", "ranges", "slot", "views")

    def __init__(self, slot: int, ranges: tuple, views: list | None) -> None:
        self.slot = slot
        self.ranges = ranges  # (dst, src, sizes) uint64 addresses, for one batch call
        self.views = views  # or [(slot view, card view)] for a few plain copies
        self.launches: list = []


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
    groups = [[k] for k in range(L)] if groups is None else [list(g) for g in groups]
    if n == 0 or bb == 0 or not L:
        return [lambda: None for _ in groups]
    dev = job.pools[0].device
    cuda = dev.type == "cuda" and dma is None
    r = the_ring if the_ring is not None else ring(dev, bb)
    if bb > r.slot_bytes:
        raise ValueError(f"a {bb}-byte page does not fit the ring's {r.slot_bytes}-byte slots")
    if chunk_bytes is None:
        chunk_bytes = min(r.slot_bytes, max(L * n * bb // 8, CHUNK_MIN_BYTES))
    chunk_bytes = max(bb, min(int(chunk_bytes), r.slot_bytes))
    offs = job.flat_offsets()
    fptr, rptr = job.flat.data_ptr(), r.buf.data_ptr()
    bounds = host.piece_boundaries() if cuda else np.zeros(0, np.uint64)
    if job.checks is not None:
        job.checks.bind(dev, False)  # every chunk's hash adds into the job's one word buffer
    tables, plans, staged = _launch.Tables(), {}, []
    per_group: list[list[_Chunk]] = []
    k = 0
    for g in groups:
        mine = []
        for ls, i0, i1 in chunks(g, n, bb, chunk_bytes):
            s, m = k % r.slots, i1 - i0
            k += 1
            at = s * r.slot_bytes + (np.arange(len(ls) * m, dtype=np.int64) * bb).reshape(
                len(ls), m)
            rng = np.array(contiguous_ranges(offs[ls, i0:i1].ravel(), bb),
                           dtype=np.int64).reshape(-1, 3)
            src, dst, size = host.split_at(
                (rng[:, 0] + fptr).astype(np.uint64),
                (rng[:, 1] + s * r.slot_bytes + rptr).astype(np.uint64),
                rng[:, 2].astype(np.uint64), bounds)
            views = None
            if not cuda or size.size <= _FEW_RANGES or not copy_engine.available():
                views = [(int(d) - rptr, int(a) - fptr, int(z))
                         for d, a, z in zip(dst.tolist(), src.tolist(), size.tolist(),
                                            strict=True)]
            c = _Chunk(s, (dst, src, size), views)
            sub = Job([job.pools[i] for i in ls], job.ids[i0:i1], r.buf, at, 0, False, 0,
                      len(ls) * m * bb, False,
                      None if job.checks is None else job.checks.select(ls, i0, i1))
            staged.append((c, _launch.stage(sub, max_programs, tables, plans=plans)))
            mine.append(c)
        per_group.append(mine)
    t = tables.upload(dev)  # one upload, on the prepare stream
    for c, bind in staged:
        c.launches = bind(t)
    return [_issuer(mine, job, r, dev, cuda, dma) for mine in per_group]


def _issuer(mine: list[_Chunk], job: Job, r: Ring, dev: torch.device, cuda: bool,
            dma: Callable | None) -> Callable[[], None]:
    flat = job.flat
    if not cuda:
        def run_cpu() -> None:
            for c in mine:
                for o, f, z in c.views:
                    dma(flat, f, r.buf, o, z)
                for launch in c.launches:
                    launch()
        return run_cpu
    side = copy_engine.side_stream(dev, "h2d")

    def run_cuda() -> None:
        cur = torch.cuda.current_stream(dev)
        with r.lock:
            r.used_on(cur)
            r.used_on(side)
            for c in mine:
                with torch.cuda.stream(side):
                    if r.free[c.slot] is not None:
                        side.wait_event(r.free[c.slot])
                    if c.views is not None:
                        for o, f, z in c.views:
                            r.buf[o : o + z].copy_(flat[f : f + z], non_blocking=True)
                    else:
                        copy_engine.batch_copy(*c.ranges, device=dev, src_is_host=True)
                    landed = torch.cuda.Event()
                    landed.record(side)
                cur.wait_event(landed)
                for launch in c.launches:
                    launch()
                free = torch.cuda.Event()
                free.record(cur)
                r.free[c.slot] = free
    return run_cuda
