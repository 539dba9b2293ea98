"""pack / unpack: blocks <-> a contiguous staging buffer, bit-exact against the oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_buffers import GEOMS, GPU_ENGINES, gpu_and_cpu
from hypothesis import given
from hypothesis import strategies as st
from pools import POISON, block_ids, geometries, oracle, pool_over, setup_single

import xkv.kernels as K

ENGINES = ["reference", "triton"]


@pytest.mark.parametrize("engine", ENGINES)
@given(g=geometries(), seed=st.integers(0, 2**16), data=st.data())
def test_pack_unpack(engine, g, seed, data):
    ids = block_ids(data.draw, g.num_blocks)
    raw, _, pool = setup_single(g, 0, 1, seed)
    staging = torch.full((ids.size * g.block_bytes + 5,), POISON, dtype=torch.uint8)
    expect = staging.clone()
    contiguous = (np.arange(ids.size, dtype=np.int64) * g.block_bytes)[None]
    oracle(raw, [pool], expect, contiguous, ids, save=True)
    K.pack(pool, ids, staging, engine=engine)
    assert torch.equal(staging, expect)
    # unpack into a poisoned copy of the cache: exactly the packed blocks come back
    raw2 = torch.full_like(raw, POISON)
    pool2 = pool_over(raw2, 0, g)
    expect2 = raw2.clone()
    oracle(expect2, [pool_over(expect2, 0, g)], staging, contiguous, ids, save=False)
    K.unpack(staging, pool2, ids, engine=engine, max_programs=1)
    assert torch.equal(raw2, expect2)


@pytest.mark.gpu
@pytest.mark.parametrize("engine", GPU_ENGINES)
@pytest.mark.parametrize("budget", [1, 4, 132])
def test_pack_unpack_gpu(engine, budget):
    g = GEOMS["kv-first"]
    ids = np.array([31, 0, 7, 8, 30], dtype=np.int64)
    raw_cpu, pool_cpu, raw_gpu, pool_gpu = gpu_and_cpu(g, 5)
    staging = torch.full((ids.size * g.block_bytes,), POISON, dtype=torch.uint8, device="cuda")
    expect = torch.full_like(staging, POISON, device="cpu")
    contiguous = (np.arange(ids.size, dtype=np.int64) * g.block_bytes)[None]
    oracle(raw_cpu, [pool_cpu], expect, contiguous, ids, save=True)
    K.pack(pool_gpu, ids, staging, engine=engine, max_programs=budget)
    torch.cuda.synchronize()
    assert torch.equal(staging.cpu(), expect)
    raw2 = torch.full_like(raw_gpu, POISON)
    K.unpack(staging, pool_over(raw2, 0, g), ids, engine=engine, max_programs=budget)
    for b in ids.tolist():
        assert torch.equal(pool_over(raw2, 0, g).block(b).cpu(), pool_cpu.block(b))
