"""restore / restore_layers / save / save_layers / restore_slice and the engine dispatch.

CPU tests run both the torch engine (what CPU tensors get) and the Triton kernel under
``TRITON_INTERPRET=1`` (``engine="triton"``) against the byte-loop oracle, bit-exact, with the
destination poisoned beforehand so unwritten and stray bytes both fail. The ``gpu`` tests run the
compiled kernels and the DMA engines against the oracle run on CPU copies.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_buffers import GEOMS, GPU_ENGINES, SOURCES, flat_of, gpu_and_cpu
from hypothesis import given, settings
from hypothesis import strategies as st
from pools import (
    POISON,
    Geometry,
    block_ids,
    fragment_offsets,
    geometries,
    layer_jobs,
    layers_buffer_size,
    oracle,
    pool_over,
    pools_over,
    random_bytes,
    setup_single,
    single_jobs,
    slice_case,
)

import xkv.kernels as K
from xkv.kernels import _launch
from xkv.kernels.jobs import build_job, offsets_arg
from xkv.layout import describe_cache

ENGINES = ["reference", "triton"]


@pytest.mark.parametrize("engine", ENGINES)
@given(job=single_jobs(save=False), seed=st.integers(0, 2**16))
def test_restore(engine, job, seed):
    g, ids, offs, flat_size, base_off = job
    raw, flat, pool = setup_single(g, base_off, flat_size, seed)
    raw.fill_(POISON)
    expect = raw.clone()
    oracle(expect, [pool_over(expect, base_off, g)], flat, offs[None], ids, save=False)
    K.restore(
        flat, torch.from_numpy(offs), pool, torch.from_numpy(ids), engine=engine, max_programs=3
    )
    assert torch.equal(raw, expect)


@pytest.mark.parametrize("engine", ENGINES)
@given(job=single_jobs(save=True), seed=st.integers(0, 2**16))
def test_save(engine, job, seed):
    g, ids, offs, flat_size, base_off = job
    raw, flat, pool = setup_single(g, base_off, flat_size, seed)
    flat.fill_(POISON)
    expect = flat.clone()
    oracle(raw, [pool], expect, offs[None], ids, save=True)
    before = raw.clone()
    K.save(pool, ids.tolist(), flat, offs.tolist(), engine=engine, max_programs=2)
    assert torch.equal(flat, expect)
    assert torch.equal(raw, before)


@pytest.mark.parametrize("engine", ENGINES)
@given(job=single_jobs(save=False), seed=st.integers(0, 2**16), data=st.data())
def test_restore_slice(engine, job, seed, data):
    raw, flat, pool, expect, ids, offs, lo, hi = slice_case(job, seed, data)
    K.restore_slice(flat, offs, pool, ids, lo, hi, engine=engine, max_programs=4)
    assert torch.equal(raw, expect)


@pytest.mark.parametrize("engine", ENGINES)
@given(job=layer_jobs(save=False), seed=st.integers(0, 2**16))
def test_restore_layers(engine, job, seed):
    geoms, offsets, ids, offs, flat_size = job
    raw = torch.full((layers_buffer_size(geoms, offsets),), POISON, dtype=torch.uint8)
    flat = random_bytes(flat_size, seed)
    pools = pools_over(raw, geoms, offsets)
    expect = raw.clone()
    oracle(expect, pools_over(expect, geoms, offsets), flat, offs, ids, save=False)
    K.restore_layers(flat, torch.from_numpy(offs), pools, torch.from_numpy(ids), engine=engine)
    assert torch.equal(raw, expect)


@pytest.mark.parametrize("engine", ENGINES)
@given(job=layer_jobs(save=True), seed=st.integers(0, 2**16))
def test_save_layers(engine, job, seed):
    geoms, offsets, ids, offs, flat_size = job
    raw = random_bytes(layers_buffer_size(geoms, offsets), seed)
    flat = torch.full((flat_size,), POISON, dtype=torch.uint8)
    pools = pools_over(raw, geoms, offsets)
    expect = flat.clone()
    oracle(raw, pools, expect, offs, ids, save=True)
    K.save_layers(pools, ids, flat, offs, engine=engine, max_programs=2)
    assert torch.equal(flat, expect)


@pytest.mark.parametrize("budget", [1, 3, 64])
@pytest.mark.parametrize("save", [False, True])
def test_mla_pages_take_the_unmasked_rows_and_stay_exact(save, budget):
    """18 KiB pages (MLA's 576 bf16 x 16 tokens): 2 KiB tile rows that divide the page
    (``launch_config``), the unmasked variant; every byte as the oracle puts it, the
    destination poisoned, fragments in shuffled card slots and ids in random order."""
    g = Geometry(9, 18432 + 512, ((256, 18432),))
    rng = np.random.default_rng(budget * 2 + save)
    ids = rng.permutation(9)[:7].astype(np.int64)
    offs = (rng.permutation(8)[:7] * 18432 + 4096).astype(np.int64)
    raw, flat, pool = setup_single(g, 16, 4096 + 8 * 18432 + 64, int(rng.integers(1 << 16)))
    job = build_job([pool], ids, flat, offsets_arg(offs[None], 1, "o"), save=save)
    ((launch,),) = [_launch.launches(job, budget)]
    assert (launch.meta["EVEN"], launch.meta["VEC"], launch.meta["COLS"]) == (True, 2, 256)
    if save:
        flat.fill_(POISON)
        expect = flat.clone()
        oracle(raw, [pool], expect, offs[None], ids, save=True)
        K.save(pool, ids, flat, offs, engine="triton", max_programs=budget)
        assert torch.equal(flat, expect)
    else:
        raw.fill_(POISON)
        expect = raw.clone()
        oracle(expect, [pool_over(expect, 16, g)], flat, offs[None], ids, save=False)
        K.restore(flat, torch.from_numpy(offs), pool, torch.from_numpy(ids), engine="triton",
                  max_programs=budget)
        assert torch.equal(raw, expect)


def test_the_mla_latent_cache_takes_the_unmasked_rows():
    """vLLM's MLA cache ([blocks, 16 tokens, 512 + 64] bf16), described as the connector does:
    its 18 KiB pages get 2 KiB rows and the unmasked variant, restores and saves, checked or not
    (stop 39: 8-byte accesses and 29-31 GB/s before)."""
    pool = describe_cache(torch.zeros(10, 16, 576, dtype=torch.bfloat16), kind="mla")
    assert pool.runs == ((0, 18432),)
    flat = torch.zeros(64 * 18432, dtype=torch.uint8)
    offs = offsets_arg(np.arange(10)[None] * 18432, 1, "o")
    for save in (False, True):
        for check in (False, True):
            p = _launch.plan([pool], flat, n=10, has_flat_off=True, flat_off_gcd=18432,
                             flat_base=0, save=save, sliced=False, lo=0, hi=0, max_programs=64,
                             check=check)
            assert (p.meta["EVEN"], p.meta["VEC"], p.meta["COLS"]) == (True, 2, 256)
    job = build_job([pool], list(range(10)), flat, offs, save=False)
    assert _launch.launches(job, 4)[0].meta["EVEN"]


@pytest.mark.parametrize("engine", ENGINES)
def test_empty_and_single(engine):
    g = Geometry(3, 40, ((0, 17), (20, 3)))
    raw = torch.full((200,), POISON, dtype=torch.uint8)
    pool = pool_over(raw, 1, g)
    flat = random_bytes(64, 0)
    K.restore(flat, [], pool, [], engine=engine)
    K.restore_layers(flat, np.zeros((0, 0), np.int64), [], [], engine=engine)
    K.restore_slice(flat, [0], pool, [2], 5, 5, engine=engine)
    K.pack(pool, [], torch.empty(0, dtype=torch.uint8), engine=engine)
    assert (raw == POISON).all()
    K.restore(flat, [7], pool, [2], engine=engine)
    assert torch.equal(pool.block(2), flat[7:27])
    assert (raw[: 1 + 80] == POISON).all()


def test_cpu_auto_is_the_torch_engine(monkeypatch):
    g = Geometry(2, 8, ((0, 8),))
    raw = torch.zeros(16, dtype=torch.uint8)
    called = []
    from xkv.kernels import _torch

    monkeypatch.setattr(_torch, "run", lambda job: called.append(job))
    K.restore(torch.ones(8, dtype=torch.uint8), [0], pool_over(raw, 0, g), [1])
    assert len(called) == 1


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    g = Geometry(2, 8, ((0, 8),))
    raw = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        K.restore(torch.ones(8, dtype=torch.uint8), [0], pool_over(raw, 0, g), [1], engine="triton")
    with pytest.raises(ValueError, match="CUDA"):
        K.restore(
            torch.ones(8, dtype=torch.uint8), [0], pool_over(raw, 0, g), [1], engine="copy_engine"
        )


# ---- on a GPU: every engine, every kind of flat buffer ------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("engine", GPU_ENGINES)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("geom", sorted(GEOMS))
def test_restore_save_gpu(geom, source, engine):
    g = GEOMS[geom]
    rng = np.random.default_rng(0)
    n = g.num_blocks - 1
    ids = rng.permutation(g.num_blocks)[:n]
    offs = np.arange(n, dtype=np.int64)[rng.permutation(n)] * (g.block_bytes + 16) + 5
    data = random_bytes(int(offs.max()) + g.block_bytes + 9, 1)
    flat = flat_of(source, data)
    raw_cpu, pool_cpu, raw_gpu, pool_gpu = gpu_and_cpu(g, 2, fill=POISON, base_off=3)
    oracle(raw_cpu, [pool_cpu], data, offs[None], ids, save=False)
    K.restore(flat, offs, pool_gpu, torch.from_numpy(ids).cuda(), engine=engine, max_programs=4)
    torch.cuda.synchronize()
    assert torch.equal(raw_gpu.cpu(), raw_cpu)
    # save it back into a poisoned buffer of the same kind
    out = flat_of(source, torch.full_like(data, POISON))
    expect = torch.full_like(data, POISON)
    oracle(raw_cpu, [pool_cpu], expect, offs[None], ids, save=True)
    K.save(pool_gpu, ids, out, offs, engine=engine, max_programs=2)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), expect)


@pytest.mark.gpu
@pytest.mark.parametrize("engine", GPU_ENGINES)
@pytest.mark.parametrize("budget", [1, 4, 132])
def test_restore_slice_gpu(engine, budget):
    g = GEOMS["kv-first"]
    ids = np.array([31, 0, 7, 8, 30], dtype=np.int64)
    data = random_bytes(ids.size * g.block_bytes, 3)
    flat = data.pin_memory()
    offs = np.arange(ids.size, dtype=np.int64) * g.block_bytes
    for lo, hi in [(0, data.numel()), (1000, 9000), (4095, 4097), (2048, 2048 * 4 + 1), (17, 18)]:
        raw_cpu, pool_cpu, raw_gpu, pool_gpu = gpu_and_cpu(g, 4, fill=POISON)
        oracle(raw_cpu, [pool_cpu], data, offs[None], ids, save=False, lo=lo, hi=hi)
        K.restore_slice(flat, offs, pool_gpu, ids, lo, hi, engine=engine, max_programs=budget)
        torch.cuda.synchronize()
        assert torch.equal(raw_gpu.cpu(), raw_cpu), (lo, hi)


@pytest.mark.gpu
@pytest.mark.parametrize("engine", GPU_ENGINES)
@pytest.mark.parametrize("arrangement", ["separate", "interleaved"])
def test_layers_gpu(engine, arrangement):
    L, page, nb = 5, 4096, 24
    if arrangement == "interleaved":  # BLNHC: layer l's page at l * page inside a block of L pages
        geoms = [Geometry(nb, L * page, ((0, page),))] * L
        offsets = [k * page for k in range(L)]
    else:
        geoms = [Geometry(nb, page, ((0, page),))] * L
        offsets = [k * (nb * page + 64) for k in [3, 0, 4, 1, 2]]
    size = max(o + g.extent for o, g in zip(offsets, geoms, strict=True)) + 64
    raw_cpu = torch.full((size,), POISON, dtype=torch.uint8)
    raw_gpu = raw_cpu.cuda()
    pools_cpu = pools_over(raw_cpu, geoms, offsets)
    pools_gpu = pools_over(raw_gpu, geoms, offsets)
    ids = np.array([23, 0, 5, 11], dtype=np.int64)
    offs = (np.arange(L * ids.size, dtype=np.int64) * page).reshape(L, ids.size)  # layer-major
    data = random_bytes(L * ids.size * page, 6)
    oracle(raw_cpu, pools_cpu, data, offs, ids, save=False)
    K.restore_layers(data.pin_memory(), offs, pools_gpu, ids, engine=engine)
    torch.cuda.synchronize()
    assert torch.equal(raw_gpu.cpu(), raw_cpu)
    out = torch.full_like(data, POISON).pin_memory()
    K.save_layers(pools_gpu, ids, out, offs, engine=engine)
    torch.cuda.synchronize()
    assert torch.equal(out, data)


@pytest.mark.gpu
def test_describe_cache_on_gpu_round_trip():
    cache = torch.randn(16, 32, 2, 128, dtype=torch.bfloat16, device="cuda").permute(0, 2, 1, 3)
    pool = describe_cache(cache, layout="NHD")
    host = torch.empty(4 * pool.block_bytes, dtype=torch.uint8).pin_memory()
    K.save(pool, [15, 0, 3, 9], host, np.arange(4) * pool.block_bytes)
    other = torch.zeros_like(cache)
    pool2 = describe_cache(other, layout="NHD")
    K.restore(host, np.arange(4) * pool.block_bytes, pool2, [15, 0, 3, 9])
    torch.cuda.synchronize()
    for b in (15, 0, 3, 9):
        assert torch.equal(other[b], cache[b])
    assert (other[1] == 0).all()


@pytest.mark.gpu
@settings(max_examples=20, deadline=None)
@given(g=geometries(), seed=st.integers(0, 2**16), data=st.data(),
       engine=st.sampled_from(GPU_ENGINES))
def test_property_restore_save_gpu(g, seed, data, engine):
    ids = block_ids(data.draw, g.num_blocks)
    offs, size = data.draw(
        fragment_offsets(ids.size, g.block_bytes, disjoint=True, aligned=data.draw(st.booleans()))
    )
    budget = data.draw(st.sampled_from([1, 2, 4, 16]))
    src = random_bytes(size, seed)
    raw_cpu, pool_cpu, raw_gpu, pool_gpu = gpu_and_cpu(g, seed + 1, fill=POISON)
    oracle(raw_cpu, [pool_cpu], src, offs[None], ids, save=False)
    K.restore(src.pin_memory(), offs, pool_gpu, ids, engine=engine, max_programs=budget)
    out = torch.full((size,), POISON, dtype=torch.uint8).pin_memory()
    expect = torch.full((size,), POISON, dtype=torch.uint8)
    oracle(raw_cpu, [pool_cpu], expect, offs[None], ids, save=True)
    K.save(pool_gpu, ids, out, offs, engine=engine, max_programs=budget)
    torch.cuda.synchronize()
    assert torch.equal(raw_gpu.cpu(), raw_cpu)
    assert torch.equal(out, expect)
