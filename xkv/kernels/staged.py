"""The staged engine: copy engine <-> a GPU staging ring <-> pages.

Large contiguous copy-engine transfers move bytes between the flat buffer (host memory) and one
of two staging slots in HBM, pipelined in chunks, while the Triton kernel packs/unpacks the other
slot from/into the pages, so PCIe runs at copy-engine speed and the kernel never waits on PCIe.
Chunks follow the concatenation's layer-major order; a chunk is at most ``STAGED_MAX_CHUNK`` bytes.
A verified job (``job.checks``) runs each chunk's kernel with its checks (the general launch path,
its tables uploaded per chunk): the terms come from the staging slot, i.e. restores hash what the
copy engine brought from the flat buffer, saves the pages they pack.
"""

from __future__ import annotations

import numpy as np
import torch

from xkv.kernels import _launch, copy_engine, host
from xkv.kernels.jobs import Job

__all__ = ["STAGED_MIN_BYTES", "chunks", "contiguous_ranges", "layer_chunks", "run"]

STAGED_MIN_BYTES = 8 << 20  # below this a staged copy cannot fill its pipeline
STAGED_MIN_CHUNK = 1 << 20
STAGED_MAX_CHUNK = 32 << 20
_BATCH_MIN_RANGES = 8  # fewer contiguous ranges than this: plain copies beat one batch call


def chunks(job: Job) -> list[tuple[list[int], int, int]]:
    """Chunks in the concatenation's (layer-major) order: ``(layers, i0, i1)`` is fragments
    ``[i0, i1)`` of each of ``layers`` (one layer, or several whole layers)."""
    L, n, bb = len(job.pools), job.n, job.block_bytes
    chunk = min(max((L * n * bb) // 8, STAGED_MIN_CHUNK), STAGED_MAX_CHUNK)
    return layer_chunks(range(L), n, bb, chunk)


def layer_chunks(layers, n: int, bb: int, chunk_bytes: int) -> list[tuple[list[int], int, int]]:
    """Chunks of ``layers`` x ``n`` fragments of ``bb`` bytes in layer-major order, each at most
    ``max(chunk_bytes, bb)`` bytes: ``(ls, i0, i1)`` = fragments ``[i0, i1)`` of each layer of
    ``ls`` (one layer, or several whole layers)."""
    ls = list(layers)
    if n == 0 or not ls:
        return []
    per = max(1, chunk_bytes // bb)
    if per >= n:
        lpc = max(1, per // n)
        return [(ls[a : a + lpc], 0, n) for a in range(0, len(ls), lpc)]
    return [([layer], i, min(i + per, n)) for layer in ls for i in range(0, n, per)]


def contiguous_ranges(flat_off: np.ndarray, bb: int) -> list[tuple[int, int, int]]:
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


class _Pipeline:
    """The kernel side and the DMA side of one staged copy."""

    def __init__(self, job: Job, max_programs: int, dma) -> None:
        self.job, self.max_programs, self.dma = job, max_programs, dma
        self.dev = job.pools[0].device
        t = _launch.Tables()
        t.add(job.ids)
        self.ids_t = t.upload(self.dev)  # every chunk's kernel reads a slice of this one upload
        self.tables: dict = {}  # run tables by variant, uploaded once each

    def kernel(self, ls: list[int], i0: int, i1: int, slot: torch.Tensor) -> None:
        job = self.job
        pools = [job.pools[i] for i in ls]
        if job.checks is not None or len({(p.block_stride, p.runs) for p in pools}) > 1:
            # mixed geometries or checksums: the general path (chunk's checks in its upload)
            sub = Job(pools, job.ids[i0:i1], slot, None, 0, job.save, 0, slot.numel(), False,
                      None if job.checks is None else job.checks.select(ls, i0, i1))
            _launch.run(sub, self.max_programs)
            return
        p = _launch.plan(pools, slot, n=i1 - i0, has_flat_off=False, flat_off_gcd=0, flat_base=0,
                         save=job.save, sliced=False, lo=0, hi=slot.numel(),
                         max_programs=self.max_programs)
        key = (p.meta["WORD"], tuple(p.table.tolist()))
        tab = self.tables.get(key)
        if tab is None:
            t = _launch.Tables()
            t.add(p.table)
            tab = self.tables[key] = t.upload(self.dev)
        _launch.Launch(p, slot, self.ids_t[i0:i1], None, tab)()

    def copy(self, ranges, slot: torch.Tensor, to_slot: bool) -> None:
        flat = self.job.flat
        if self.dma is not None:
            for f, o, z in ranges:
                self.dma(flat, f, slot, o, z, to_slot)
            return
        fp, sp = flat.data_ptr(), slot.data_ptr()
        r = np.array(ranges, dtype=np.int64).reshape(-1, 3)
        # a range over two registered pieces of a card pinned in segments is cut there: one
        # cudaMemcpy / batch copy must not span two registrations
        fa, sa, zs = host.split_at(r[:, 0] + fp, r[:, 1] + sp, r[:, 2], host.piece_boundaries())
        if len(zs) <= _BATCH_MIN_RANGES or not copy_engine.available():
            for f, o, z in zip((fa - fp).tolist(), (sa - sp).tolist(), zs.tolist(), strict=True):
                a, b = flat[f : f + z], slot[o : o + z]
                if to_slot:
                    b.copy_(a, non_blocking=True)
                else:
                    a.copy_(b, non_blocking=True)
        else:
            src, dst = (fa, sa) if to_slot else (sa, fa)
            copy_engine.batch_copy(dst.astype(np.uint64), src.astype(np.uint64),
                                   zs.astype(np.uint64), device=self.dev,
                                   src_is_host=to_slot and flat.device.type == "cpu")


def run(job: Job, max_programs: int, *, dma=None) -> None:
    """Pipeline: DMA chunk k+1 between the flat buffer and a staging slot while Triton
    packs/unpacks chunk k between the other slot and the pages. Two slots, events between a side
    stream (copies) and the current stream (kernels). ``dma(flat, flat_off, slot, slot_off, size,
    to_slot)`` replaces the copy engine in CPU tests (then nothing is asynchronous)."""
    pipe = _Pipeline(job, max_programs, dma)
    dev, bb = pipe.dev, job.block_bytes
    if job.checks is not None:
        job.checks.bind(dev, job.save)  # one word buffer for every chunk
    todo = chunks(job)
    slot_bytes = max(len(ls) * (i1 - i0) for ls, i0, i1 in todo) * bb
    staging = torch.empty(2 * slot_bytes, dtype=torch.uint8, device=dev)
    offs = job.flat_offsets()
    cuda = dma is None
    if cuda:
        cur = torch.cuda.current_stream(dev)
        side = copy_engine.side_stream(dev, "d2h" if job.save else "h2d")
        side.wait_stream(cur)
        staging.record_stream(side)
    free: list = [None, None]  # per slot: event after which the slot may be overwritten
    for k, (ls, i0, i1) in enumerate(todo):
        s = k % 2
        m = len(ls) * (i1 - i0)
        slot = staging[s * slot_bytes : s * slot_bytes + m * bb]
        ranges = contiguous_ranges(offs[ls, i0:i1].ravel(), bb)
        if not cuda:
            if job.save:
                pipe.kernel(ls, i0, i1, slot)
                pipe.copy(ranges, slot, False)
            else:
                pipe.copy(ranges, slot, True)
                pipe.kernel(ls, i0, i1, slot)
            continue
        if not job.save:
            with torch.cuda.stream(side):
                if free[s] is not None:
                    side.wait_event(free[s])
                pipe.copy(ranges, slot, True)
                landed = torch.cuda.Event()
                landed.record(side)
            cur.wait_event(landed)
            pipe.kernel(ls, i0, i1, slot)
            free[s] = torch.cuda.Event()
            free[s].record(cur)
        else:
            if free[s] is not None:
                cur.wait_event(free[s])
            pipe.kernel(ls, i0, i1, slot)
            packed = torch.cuda.Event()
            packed.record(cur)
            with torch.cuda.stream(side):
                side.wait_event(packed)
                pipe.copy(ranges, slot, False)
                free[s] = torch.cuda.Event()
                free[s].record(side)
    if cuda and job.save:
        cur.wait_stream(side)
