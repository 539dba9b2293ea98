"""The torch engine (``engine="reference"``): what CPU caches get, and a fallback on any device.

Each run of each layer is one strided ``[num_blocks, run_bytes]`` view of the pool; blocks are
gathered (``index_select``) or scattered (``index_copy_``) with one call per run when the flat
fragments are evenly spaced, fragment by fragment otherwise. Slices copy byte ranges one
fragment at a time. The tests check it against an independent byte-loop oracle
(``tests/kernels/pools.py``), as they check every other engine.
"""

from __future__ import annotations

import numpy as np
import torch

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


def run(job: Job) -> None:
    """Execute ``job`` with torch ops on the pools' device (stream-ordered on CUDA)."""
    n = job.n
    offs_all = job.flat_offsets()
    for layer, pool in enumerate(job.pools):
        ids = torch.from_numpy(job.ids).to(pool.device)
        offs = offs_all[layer]
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
