"""The torch engine (``engine="reference"``): what CPU caches get, and a fallback on any device.

Each run of each layer is one strided ``[num_blocks, run_bytes]`` view of the pool; blocks are
gathered (``index_select``) or scattered (``index_copy_``) with one call per run when the flat
fragments are evenly spaced, fragment by fragment otherwise. Slices copy byte ranges one
fragment at a time. The tests check it against an independent byte-loop oracle
(``tests/kernels/pools.py``), as they check every other engine.

Verified copies (``job.checks``, :mod:`xkv.kernels.verify`) hash the bytes read with
:func:`xkv.kernels.checksum.words_torch` (the same words as the Triton kernel) and add them into
the job's word buffer; a restore's hash-only fragments are read, not written.
"""

from __future__ import annotations

import numpy as np
import torch

from xkv.kernels.checksum import words_torch
from xkv.kernels.jobs import Job

__all__ = ["run"]


def _flat_rows(flat: torch.Tensor, offs: np.ndarray, length: int) -> torch.Tensor | None:
    """``[n, length]`` view of flat rows starting at ``offs`` if they are evenly spaced, else None."""
    n = offs.size
    step = int(offs[1] - offs[0]) if n > 1 else length
    if n > 1 and (
        step < 0 or not np.array_equal(offs, offs[0] + step * np.arange(n, dtype=np.int64))
    ):
        return None
    return flat.as_strided((n, length), (step, 1), flat.storage_offset() + int(offs[0]))


def _copy_slice(job: Job, layer: int, view: torch.Tensor, offs: np.ndarray, cum: int, ln: int):
    n, bb = job.n, job.block_bytes
    for i in range(n):
        pos = (layer * n + i) * bb + cum
        a, b = max(job.lo - pos, 0), min(job.hi - pos, ln)
        if a >= b:
            continue
        f = int(offs[i]) + cum
        pool_bytes = view[int(job.ids[i]), a:b]
        flat_bytes = job.flat[f + a : f + b]
        if job.save:
            flat_bytes.copy_(pool_bytes)
        else:
            pool_bytes.copy_(flat_bytes)


def _checked(job: Job, layer: int, pool, offs: np.ndarray, ids: torch.Tensor) -> None:
    """One layer of a verified copy: per run, the rows read (pages for saves, flat rows for
    restores) are written; the whole pages they form are hashed (runs of any length) and the
    terms added to the word buffer."""
    jc = job.checks
    words = jc.bind(pool.device, job.save).words
    dev = pool.device
    cols = torch.from_numpy(jc.objects).to(dev) + jc.rows[layer] * jc.num_objects
    pos = torch.from_numpy(jc.pages).to(dev) * (job.block_bytes // 4)
    keep = torch.from_numpy(jc.store).to(dev)
    counted = torch.from_numpy(jc.hashed).to(dev)
    read = []
    cum = 0
    for r, (_, ln) in enumerate(pool.runs):
        view = pool.run_view(r)
        # hash_pages (job.store False): pages read and hashed; the flat buffer is never viewed
        flat_rows = _flat_rows(job.flat, offs + cum, ln) if job.store else None
        if job.save:
            rows = view.index_select(0, ids)  # [n, ln]
            if job.store and flat_rows is not None and (job.n == 1
                                                        or int(flat_rows.stride(0)) >= ln):
                flat_rows.copy_(rows)
            elif job.store:
                for i in range(job.n):
                    f = int(offs[i]) + cum
                    job.flat[f : f + ln].copy_(rows[i])
        else:
            rows = flat_rows if flat_rows is not None else torch.stack(
                [job.flat[int(o) + cum : int(o) + cum + ln] for o in offs])
            rows = rows.to(dev)
            view.index_copy_(0, ids[keep], rows[keep])
        read.append(rows)
        cum += ln
    acc = words_torch(torch.cat(read, 1) if len(read) > 1 else read[0], pos)
    flat_words = words.view(-1)
    upd = torch.zeros(flat_words.numel(), dtype=torch.int64, device=dev)
    upd.index_add_(0, cols[counted], acc[counted])
    flat_words.copy_(_wrap32(flat_words.to(torch.int64) + upd))


def _wrap32(x: torch.Tensor) -> torch.Tensor:
    """int64 -> int32 with the same low 32 bits (two's complement)."""
    x = x & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def run(job: Job) -> None:
    """Execute ``job`` with torch ops on the pools' device (stream-ordered on CUDA)."""
    n = job.n
    offs_all = job.flat_offsets()
    for layer, pool in enumerate(job.pools):
        ids = torch.from_numpy(job.ids).to(pool.device)
        offs = offs_all[layer]
        if job.checks is not None:
            _checked(job, layer, pool, offs, ids)
            continue
        cum = 0
        for r, (_, ln) in enumerate(pool.runs):
            view = pool.run_view(r)  # [num_blocks, ln]
            if job.sliced:
                _copy_slice(job, layer, view, offs, cum, ln)
            elif job.save:
                rows = _flat_rows(job.flat, offs + cum, ln)
                gathered = view.index_select(0, ids)
                if rows is not None and (n == 1 or int(rows.stride(0)) >= ln):
                    rows.copy_(gathered)
                else:
                    for i in range(n):
                        f = int(offs[i]) + cum
                        job.flat[f : f + ln].copy_(gathered[i])
            else:
                rows = _flat_rows(job.flat, offs + cum, ln)
                if rows is None:
                    rows = torch.stack([job.flat[int(o) + cum : int(o) + cum + ln] for o in offs])
                view.index_copy_(0, ids, rows.to(view.device))
            cum += ln
