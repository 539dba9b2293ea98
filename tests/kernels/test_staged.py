"""The staged engine: chunking, contiguous ranges, and the two-slot pipeline's order.

On CPU the DMA is simulated by a byte copy (nothing asynchronous); the ``gpu`` test pushes
hundreds of chunks through the ring with the real streams and events.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_buffers import gpu_and_cpu
from hypothesis import given
from hypothesis import strategies as st
from pools import (
    POISON,
    Geometry,
    layer_jobs,
    layers_buffer_size,
    oracle,
    pool_over,
    pools_over,
    random_bytes,
)

import xkv.kernels as K
from xkv.kernels import staged
from xkv.kernels.jobs import Job, build_job, offsets_arg


def _dma(flat, f, slot, o, z, to_slot):
    if to_slot:
        slot[o : o + z] = flat[f : f + z]
    else:
        flat[f : f + z] = slot[o : o + z]


@pytest.mark.parametrize("save", [False, True])
@given(job=layer_jobs(save=True), seed=st.integers(0, 2**16), chunk=st.integers(1, 3000))
def test_staged_pipeline(save, job, seed, chunk):
    geoms, offsets, ids, offs, flat_size = job
    size = layers_buffer_size(geoms, offsets)
    raw = random_bytes(size, seed) if save else torch.full((size,), POISON, dtype=torch.uint8)
    flat = (
        torch.full((flat_size,), POISON, dtype=torch.uint8)
        if save
        else random_bytes(flat_size, seed)
    )
    pools = pools_over(raw, geoms, offsets)
    expect_raw, expect_flat = raw.clone(), flat.clone()
    epools = pools_over(expect_raw, geoms, offsets)
    oracle(expect_raw, epools, expect_flat, offs, ids, save=save)
    j = build_job(pools, ids, flat, offsets_arg(offs, len(pools), "offsets"), save=save)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(staged, "STAGED_MIN_CHUNK", chunk)
        mp.setattr(staged, "STAGED_MAX_CHUNK", chunk)
        if ids.size:
            staged.run(j, 2, dma=_dma)
    assert torch.equal(raw, expect_raw) and torch.equal(flat, expect_flat)


def test_staged_chunks_and_ranges():
    offs = np.array([0, 10, 20, 50, 60, 5], dtype=np.int64)
    assert staged.contiguous_ranges(offs, 10) == [(0, 0, 30), (50, 30, 20), (5, 50, 10)]
    assert staged.contiguous_ranges(np.zeros(0, np.int64), 10) == []
    g = Geometry(8, 100, ((0, 100),))
    raw = torch.zeros(800, dtype=torch.uint8)
    pools = [pool_over(raw, 0, g)] * 3
    job = Job(
        pools, np.arange(8), torch.zeros(2400, dtype=torch.uint8), None, 0, False, 0, 2400, False
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(staged, "STAGED_MIN_CHUNK", 300)
        mp.setattr(staged, "STAGED_MAX_CHUNK", 300)
        assert staged.chunks(job) == [
            ([0], 0, 3),
            ([0], 3, 6),
            ([0], 6, 8),
            ([1], 0, 3),
            ([1], 3, 6),
            ([1], 6, 8),
            ([2], 0, 3),
            ([2], 3, 6),
            ([2], 6, 8),
        ]
        mp.setattr(staged, "STAGED_MIN_CHUNK", 1700)
        mp.setattr(staged, "STAGED_MAX_CHUNK", 1700)
        assert staged.chunks(job) == [([0, 1], 0, 8), ([2], 0, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("save", [False, True])
def test_staged_pipeline_many_chunks(save, monkeypatch):
    """Hundreds of chunks through the two-slot ring: slot reuse must wait for the other stream."""
    monkeypatch.setattr(staged, "STAGED_MIN_CHUNK", 3 * 4096)
    monkeypatch.setattr(staged, "STAGED_MAX_CHUNK", 3 * 4096)
    g = Geometry(4000, 4096, ((0, 4096),))
    rng = np.random.default_rng(1)
    ids = rng.permutation(g.num_blocks)[:3000]
    offs = np.arange(3000, dtype=np.int64) * 4096
    offs[1000:] += 64  # a break in the contiguous run
    data = random_bytes(int(offs.max()) + 4096, 10)
    raw_cpu, pool_cpu, raw_gpu, pool_gpu = gpu_and_cpu(g, 11, fill=POISON if not save else None)
    if not save:
        oracle(raw_cpu, [pool_cpu], data, offs[None], ids, save=False)
        K.restore(data.pin_memory(), offs, pool_gpu, ids, engine="staged")
        torch.cuda.synchronize()
        assert torch.equal(raw_gpu.cpu(), raw_cpu)
    else:
        out = torch.full_like(data, POISON).pin_memory()
        expect = torch.full_like(data, POISON)
        oracle(raw_cpu, [pool_cpu], expect, offs[None], ids, save=True)
        K.save(pool_gpu, ids, out, offs, engine="staged")
        torch.cuda.synchronize()
        assert torch.equal(out, expect)
