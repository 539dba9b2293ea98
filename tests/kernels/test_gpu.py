"""The compiled kernels on a GPU: bit-exact against the torch reference run on CPU copies.

Sources and destinations: GPU memory, pinned host memory, and plain host memory registered with
``register_host`` (what the gateway's shared-memory card is). Engines: Triton and the batched copy
engine. Marked ``gpu``: skipped without CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pools import POISON, Geometry, block_ids, fragment_offsets, geometries, pool_over, random_bytes

import xkv.kernels as K
from xkv.layout import describe_cache

pytestmark = pytest.mark.gpu

GEOMS = {
    "4k": Geometry(64, 4096, ((0, 4096),)),
    "16k-padded": Geometry(40, 16384 + 512, ((0, 16384),)),
    "kv-first": Geometry(32, 2048, ((0, 2048), (32 * 2048, 2048))),
    "odd": Geometry(33, 1003, ((3, 997),)),
    "mla-656": Geometry(20, 64 * 656, ((0, 64 * 656),)),
    "256k": Geometry(6, 262144, ((0, 262144),)),
}
SOURCES = ["gpu", "pinned", "registered"]
ENGINES = ["triton", "copy_engine", "staged"]


_KEEP: list[
    torch.Tensor
] = []  # registered buffers stay alive: freed memory must not stay registered


def _flat(kind: str, data: torch.Tensor) -> torch.Tensor:
    if kind == "gpu":
        return data.cuda()
    if kind == "pinned":
        return data.pin_memory()
    t = torch.empty(
        data.numel() + 4096, dtype=torch.uint8
    )  # plain malloc'd memory, then registered
    t = t[: data.numel()]
    t.copy_(data)
    _KEEP.append(t)
    return K.register_host(t)


def _gpu_and_cpu(g: Geometry, seed: int, fill: int | None = None, base_off: int = 0):
    raw_cpu = (
        random_bytes(base_off + g.extent + 7, seed)
        if fill is None
        else torch.full((base_off + g.extent + 7,), fill, dtype=torch.uint8)
    )
    raw_gpu = raw_cpu.cuda()
    return raw_cpu, pool_over(raw_cpu, base_off, g), raw_gpu, pool_over(raw_gpu, base_off, g)


@pytest.fixture(scope="module", autouse=True)
def _calibration_off():
    K.set_calibration(None)  # 'auto' = Triton unless a test calibrates
    yield
    K.set_calibration(None)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("geom", sorted(GEOMS))
def test_restore_save(geom, source, engine):
    g = GEOMS[geom]
    rng = np.random.default_rng(0)
    n = g.num_blocks - 1
    ids = rng.permutation(g.num_blocks)[:n]
    offs = np.arange(n, dtype=np.int64)[rng.permutation(n)] * (g.block_bytes + 16) + 5
    data = random_bytes(int(offs.max()) + g.block_bytes + 9, 1)
    flat = _flat(source, data)
    raw_cpu, pool_cpu, raw_gpu, pool_gpu = _gpu_and_cpu(g, 2, fill=POISON, base_off=3)
    K.restore_ref(data, offs, pool_cpu, ids)
    K.restore(flat, offs, pool_gpu, torch.from_numpy(ids).cuda(), engine=engine, max_programs=4)
    torch.cuda.synchronize()
    assert torch.equal(raw_gpu.cpu(), raw_cpu)
    # save it back into a poisoned buffer of the same kind
    out = _flat(source, torch.full_like(data, POISON))
    expect = torch.full_like(data, POISON)
    K.save_ref(pool_cpu, ids, expect, offs)
    K.save(pool_gpu, ids, out, offs, engine=engine, max_programs=2)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), expect)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("budget", [1, 4, 132])
def test_slice_pack_unpack(engine, budget):
    g = GEOMS["kv-first"]
    ids = np.array([31, 0, 7, 8, 30], dtype=np.int64)
    data = random_bytes(ids.size * g.block_bytes, 3)
    flat = data.pin_memory()
    offs = np.arange(ids.size, dtype=np.int64) * g.block_bytes
    for lo, hi in [(0, data.numel()), (1000, 9000), (4095, 4097), (2048, 2048 * 4 + 1), (17, 18)]:
        raw_cpu, pool_cpu, raw_gpu, pool_gpu = _gpu_and_cpu(g, 4, fill=POISON)
        K.restore_slice_ref(data, offs, pool_cpu, ids, lo, hi)
        K.restore_slice(flat, offs, pool_gpu, ids, lo, hi, engine=engine, max_programs=budget)
        torch.cuda.synchronize()
        assert torch.equal(raw_gpu.cpu(), raw_cpu), (lo, hi)
    raw_cpu, pool_cpu, raw_gpu, pool_gpu = _gpu_and_cpu(g, 5)
    staging = torch.full((ids.size * g.block_bytes,), POISON, dtype=torch.uint8, device="cuda")
    expect = torch.full_like(staging, POISON, device="cpu")
    K.pack_ref(pool_cpu, ids, expect)
    K.pack(pool_gpu, ids, staging, engine=engine, max_programs=budget)
    torch.cuda.synchronize()
    assert torch.equal(staging.cpu(), expect)
    raw2 = torch.full_like(raw_gpu, POISON)
    K.unpack(staging, pool_over(raw2, 0, g), ids, engine=engine, max_programs=budget)
    for b in ids.tolist():
        assert torch.equal(pool_over(raw2, 0, g).block(b).cpu(), pool_cpu.block(b))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("arrangement", ["separate", "interleaved"])
def test_layers(engine, arrangement):
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
    pools_cpu = [pool_over(raw_cpu, o, g) for o, g in zip(offsets, geoms, strict=True)]
    pools_gpu = [pool_over(raw_gpu, o, g) for o, g in zip(offsets, geoms, strict=True)]
    ids = np.array([23, 0, 5, 11], dtype=np.int64)
    offs = (np.arange(L * ids.size, dtype=np.int64) * page).reshape(
        L, ids.size
    )  # layer-major object
    data = random_bytes(L * ids.size * page, 6)
    K.restore_layers_ref(data, offs, pools_cpu, ids)
    K.restore_layers(data.pin_memory(), offs, pools_gpu, ids, engine=engine)
    torch.cuda.synchronize()
    assert torch.equal(raw_gpu.cpu(), raw_cpu)
    out = torch.full_like(data, POISON).pin_memory()
    K.save_layers(pools_gpu, ids, out, offs, engine=engine)
    torch.cuda.synchronize()
    assert torch.equal(out, data)


def test_describe_cache_on_gpu_round_trip():
    cache = torch.randn(16, 32, 2, 128, dtype=torch.bfloat16, device="cuda").permute(
        0, 2, 1, 3
    )  # NHD
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


def test_rejects_unpinned_host_and_wrong_device():
    g = GEOMS["4k"]
    _, _, raw_gpu, pool_gpu = _gpu_and_cpu(g, 7)
    before = raw_gpu.clone()
    with pytest.raises(ValueError, match="pinned"):
        K.restore(torch.zeros(4096, dtype=torch.uint8), [0], pool_gpu, [1])
    with pytest.raises(ValueError):
        K.save(pool_gpu, [1], torch.zeros(4096, dtype=torch.uint8), [0])
    cpu_pool = pool_over(torch.zeros(g.extent, dtype=torch.uint8), 0, g)
    with pytest.raises(ValueError):
        K.restore(torch.zeros(4096, dtype=torch.uint8, device="cuda"), [0], cpu_pool, [1])
    torch.cuda.synchronize()
    assert torch.equal(raw_gpu, before)


def test_register_host_round_trip():
    t = torch.zeros(1 << 20, dtype=torch.uint8)
    assert not K.is_host_accessible(t)
    K.register_host(t)
    assert K.is_host_accessible(t) and K.is_host_accessible(t[4096:8192])
    K.register_host(t)  # idempotent
    K.unregister_host(t)
    assert not K.is_host_accessible(t)


def test_calibrate_and_auto():
    cal = K.calibrate(sizes=(4096, 262144), total_bytes=16 << 20)
    assert cal.sizes == (4096, 262144) and K.calibration() is cal
    for d in ("restore", "save"):
        for size in cal.sizes:
            assert set(cal.gbps[d][size]) == {"triton", "copy_engine", "staged"}
            assert all(v > 0 for v in cal.gbps[d][size].values())
    g = GEOMS["256k"]
    raw_cpu, pool_cpu, raw_gpu, pool_gpu = _gpu_and_cpu(g, 8, fill=POISON)
    data = random_bytes(2 * g.block_bytes, 9)
    K.restore_ref(data, [0, g.block_bytes], pool_cpu, [5, 0])
    K.restore(data.pin_memory(), [0, g.block_bytes], pool_gpu, [5, 0])  # auto
    torch.cuda.synchronize()
    assert torch.equal(raw_gpu.cpu(), raw_cpu)
    K.set_calibration(None)


@pytest.mark.parametrize("save", [False, True])
def test_staged_pipeline_many_chunks(save, monkeypatch):
    """Hundreds of chunks through the two-slot ring: slot reuse must wait for the other stream."""
    import xkv.kernels.page_copy as pc

    monkeypatch.setattr(pc, "STAGED_MIN_CHUNK", 3 * 4096)
    monkeypatch.setattr(pc, "STAGED_MAX_CHUNK", 3 * 4096)
    g = Geometry(4000, 4096, ((0, 4096),))
    rng = np.random.default_rng(1)
    ids = rng.permutation(g.num_blocks)[:3000]
    offs = np.arange(3000, dtype=np.int64) * 4096
    offs[1000:] += 64  # a break in the contiguous run
    data = random_bytes(int(offs.max()) + 4096, 10)
    raw_cpu, pool_cpu, raw_gpu, pool_gpu = _gpu_and_cpu(g, 11, fill=POISON if not save else None)
    if not save:
        K.restore_ref(data, offs, pool_cpu, ids)
        K.restore(data.pin_memory(), offs, pool_gpu, ids, engine="staged")
        torch.cuda.synchronize()
        assert torch.equal(raw_gpu.cpu(), raw_cpu)
    else:
        out = torch.full_like(data, POISON).pin_memory()
        expect = torch.full_like(data, POISON)
        K.save_ref(pool_cpu, ids, expect, offs)
        K.save(pool_gpu, ids, out, offs, engine="staged")
        torch.cuda.synchronize()
        assert torch.equal(out, expect)


@settings(max_examples=20, deadline=None)
@given(g=geometries(), seed=st.integers(0, 2**16), data=st.data(), engine=st.sampled_from(ENGINES))
def test_property_restore_gpu(g, seed, data, engine):
    ids = block_ids(data.draw, g.num_blocks)
    offs, size = data.draw(
        fragment_offsets(ids.size, g.block_bytes, disjoint=True, aligned=data.draw(st.booleans()))
    )
    budget = data.draw(st.sampled_from([1, 2, 4, 16]))
    src = random_bytes(size, seed)
    raw_cpu, pool_cpu, raw_gpu, pool_gpu = _gpu_and_cpu(g, seed + 1, fill=POISON)
    K.restore_ref(src, offs, pool_cpu, ids)
    K.restore(src.pin_memory(), offs, pool_gpu, ids, engine=engine, max_programs=budget)
    out = torch.full((size,), POISON, dtype=torch.uint8).pin_memory()
    expect = torch.full((size,), POISON, dtype=torch.uint8)
    K.save_ref(pool_cpu, ids, expect, offs)
    K.save(pool_gpu, ids, out, offs, engine=engine, max_programs=budget)
    torch.cuda.synchronize()
    assert torch.equal(raw_gpu.cpu(), raw_cpu)
    assert torch.equal(out, expect)
