"""restore / restore_layers / save / save_layers / restore_slice / pack / unpack on CPU.

Every test runs both the torch reference (what CPU tensors get) and the Triton kernel under
``TRITON_INTERPRET=1`` (``engine="triton"``), against a byte-by-byte oracle, bit-exact, with the
destination poisoned beforehand so unwritten and stray bytes both fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pools import (
    POISON,
    Geometry,
    block_ids,
    fragment_offsets,
    geometries,
    oracle,
    pool_over,
    random_bytes,
)

import xkv.kernels as K
from xkv.kernels import _launch

ENGINES = ["reference", "triton"]


@st.composite
def single_jobs(draw, *, save: bool):
    g = draw(geometries())
    ids = block_ids(draw, g.num_blocks)
    aligned = draw(st.booleans())
    offs, flat_size = draw(
        fragment_offsets(ids.size, g.block_bytes, disjoint=save, aligned=aligned)
    )
    base_off = draw(st.sampled_from([0, 16, 3, 8]))
    return g, ids, offs, flat_size, base_off


def _setup(g: Geometry, base_off: int, flat_size: int, seed: int):
    raw = random_bytes(base_off + g.extent + 13, seed)
    flat = random_bytes(flat_size, seed + 1)
    return raw, flat, pool_over(raw, base_off, g)


@pytest.mark.parametrize("engine", ENGINES)
@given(job=single_jobs(save=False), seed=st.integers(0, 2**16))
def test_restore(engine, job, seed):
    g, ids, offs, flat_size, base_off = job
    raw, flat, pool = _setup(g, base_off, flat_size, seed)
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
    raw, flat, pool = _setup(g, base_off, flat_size, seed)
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
    g, ids, offs, flat_size, base_off = job
    total = ids.size * g.block_bytes
    lo = data.draw(st.integers(0, total))
    hi = data.draw(st.integers(lo, total))
    raw, flat, pool = _setup(g, base_off, flat_size, seed)
    raw.fill_(POISON)
    expect = raw.clone()
    oracle(
        expect, [pool_over(expect, base_off, g)], flat, offs[None], ids, save=False, lo=lo, hi=hi
    )
    K.restore_slice(flat, offs, pool, ids, lo, hi, engine=engine, max_programs=4)
    assert torch.equal(raw, expect)


@pytest.mark.parametrize("engine", ENGINES)
@given(g=geometries(), seed=st.integers(0, 2**16), data=st.data())
def test_pack_unpack(engine, g, seed, data):
    ids = block_ids(data.draw, g.num_blocks)
    raw, _, pool = _setup(g, 0, 1, seed)
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


@st.composite
def layer_jobs(draw, *, save: bool):
    """L pools over one buffer: separate regions, interleaved (block-outermost), or two geometries."""
    L = draw(st.integers(1, 4))
    arrangement = draw(st.sampled_from(["separate", "interleaved", "mixed"]))
    g0 = draw(geometries(big=False, max_blocks=5))
    lens = tuple(n for _, n in g0.runs)
    if arrangement == "interleaved":  # layer l's page at l * span inside a block of L * span
        span = max(o + n for o, n in g0.runs)
        stride = L * span + draw(st.integers(0, 9))
        geoms = [Geometry(g0.num_blocks, stride, g0.runs)] * L
        offsets = [k * span for k in range(L)]
    else:
        geoms = [g0] + [
            draw(geometries(run_lens=lens)) if arrangement == "mixed" else g0 for _ in range(L - 1)
        ]
        geoms = [Geometry(g0.num_blocks, g.block_stride, g.runs) for g in geoms]
        offsets, pos = [0] * L, draw(st.integers(0, 7))
        for k in draw(st.permutations(range(L))):  # layer order need not follow addresses
            offsets[k] = pos
            pos += geoms[k].extent + draw(st.integers(0, 9))
    ids = block_ids(draw, g0.num_blocks)
    offs, flat_size = draw(
        fragment_offsets(L * ids.size, g0.block_bytes, disjoint=save, aligned=draw(st.booleans()))
    )
    return geoms, offsets, ids, offs.reshape(L, ids.size), flat_size


@pytest.mark.parametrize("engine", ENGINES)
@given(job=layer_jobs(save=False), seed=st.integers(0, 2**16))
def test_restore_layers(engine, job, seed):
    geoms, offsets, ids, offs, flat_size = job
    raw = torch.full(
        (max(o + g.extent for o, g in zip(offsets, geoms, strict=True)) + 11,),
        POISON,
        dtype=torch.uint8,
    )
    flat = random_bytes(flat_size, seed)
    pools = [pool_over(raw, o, g) for o, g in zip(offsets, geoms, strict=True)]
    expect = raw.clone()
    oracle(
        expect,
        [pool_over(expect, o, g) for o, g in zip(offsets, geoms, strict=True)],
        flat,
        offs,
        ids,
        save=False,
    )
    K.restore_layers(flat, torch.from_numpy(offs), pools, torch.from_numpy(ids), engine=engine)
    assert torch.equal(raw, expect)


@pytest.mark.parametrize("engine", ENGINES)
@given(job=layer_jobs(save=True), seed=st.integers(0, 2**16))
def test_save_layers(engine, job, seed):
    geoms, offsets, ids, offs, flat_size = job
    raw = random_bytes(max(o + g.extent for o, g in zip(offsets, geoms, strict=True)) + 11, seed)
    flat = torch.full((flat_size,), POISON, dtype=torch.uint8)
    pools = [pool_over(raw, o, g) for o, g in zip(offsets, geoms, strict=True)]
    expect = flat.clone()
    oracle(raw, pools, expect, offs, ids, save=True)
    K.save_layers(pools, ids, flat, offs, engine=engine, max_programs=2)
    assert torch.equal(flat, expect)


# ---- edge cases ---------------------------------------------------------------------------------


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


def test_cpu_auto_is_the_reference(monkeypatch):
    g = Geometry(2, 8, ((0, 8),))
    raw = torch.zeros(16, dtype=torch.uint8)
    called = []
    import xkv.kernels.page_copy as pc

    monkeypatch.setattr(pc, "_run_reference", lambda job: called.append(job))
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


# ---- every kind of bad input: ValueError, nothing written --------------------------------------


def _bad_cases():
    g = Geometry(4, 24, ((0, 10), (12, 6)))  # 16 bytes a block
    inter = Geometry(4, 48, ((0, 16),))  # two layers interleaved: offsets 0 and 16

    def setup():
        raw = torch.full((300,), POISON, dtype=torch.uint8)
        flat = random_bytes(100, 1)
        return raw, flat, pool_over(raw, 0, g)

    def two(raw, second=16):
        return [pool_over(raw, 0, inter), pool_over(raw, second, inter)]

    R, S, RL, SL = K.restore, K.save, K.restore_layers, K.save_layers
    u8 = torch.uint8
    return {
        "id too large": lambda raw, flat, p, e: R(flat, [0], p, [4], engine=e),
        "id negative": lambda raw, flat, p, e: R(flat, [0], p, [-1], engine=e),
        "duplicate destination": lambda raw, flat, p, e: R(flat, [0, 16], p, [1, 1], engine=e),
        "offset past the end": lambda raw, flat, p, e: R(flat, [85], p, [1], engine=e),
        "negative offset": lambda raw, flat, p, e: R(flat, [-1], p, [1], engine=e),
        "offsets/ids length": lambda raw, flat, p, e: R(flat, [0, 16], p, [1], engine=e),
        "float ids": lambda raw, flat, p, e: R(flat, [0], p, torch.tensor([1.0]), engine=e),
        "bool ids": lambda raw, flat, p, e: R(flat, [0], p, torch.tensor([True]), engine=e),
        "2-D ids": lambda raw, flat, p, e: R(flat, [0], p, [[1]], engine=e),
        "float offsets": lambda raw, flat, p, e: R(flat, [0.5], p, [1], engine=e),
        "wrong flat dtype": lambda raw, flat, p, e: R(flat.float(), [0], p, [1], engine=e),
        "2-D flat": lambda raw, flat, p, e: R(flat.view(10, 10), [0], p, [1], engine=e),
        "strided flat": lambda raw, flat, p, e: R(flat[::2], [0], p, [1], engine=e),
        "flat is the cache": lambda raw, flat, p, e: R(raw, [10], p, [0], engine=e),
        "flat on another device": lambda raw, flat, p, e: R(flat.to("meta"), [0], p, [1], engine=e),
        "save overlap": lambda raw, flat, p, e: S(p, [0, 1], flat, [0, 8], engine=e),
        "save past the end": lambda raw, flat, p, e: S(p, [0], flat, [90], engine=e),
        "save into the cache": lambda raw, flat, p, e: S(p, [0], raw, [0], engine=e),
        "slice lo > hi": lambda raw, flat, p, e: K.restore_slice(flat, [0], p, [1], 9, 3, engine=e),
        "slice past the end": lambda raw, flat, p, e: K.restore_slice(
            flat, [0], p, [1], 0, 17, engine=e
        ),
        "slice negative": lambda raw, flat, p, e: K.restore_slice(
            flat, [0], p, [1], -1, 3, engine=e
        ),
        "slice float bounds": lambda raw, flat, p, e: K.restore_slice(
            flat, [0], p, [1], 0.0, 3, engine=e
        ),
        "staging too small": lambda raw, flat, p, e: K.pack(
            p, [0, 1], torch.zeros(31, dtype=u8), engine=e
        ),
        "unpack too small": lambda raw, flat, p, e: K.unpack(
            torch.zeros(31, dtype=u8), p, [0, 1], engine=e
        ),
        "unpack duplicates": lambda raw, flat, p, e: K.unpack(
            torch.zeros(32, dtype=u8), p, [0, 0], engine=e
        ),
        "layers offsets shape": lambda raw, flat, p, e: RL(flat, [0, 16], two(raw), [1], engine=e),
        "same layer twice": lambda raw, flat, p, e: RL(flat, [[0], [16]], [p, p], [1], engine=e),
        "layers overlap": lambda raw, flat, p, e: RL(flat, [[0], [16]], two(raw, 8), [1], engine=e),
        "layers block bytes": lambda raw, flat, p, e: RL(
            flat, [[0], [20]], [p, pool_over(raw, 200, Geometry(2, 20, ((0, 20),)))], [1], engine=e
        ),
        "not a pool": lambda raw, flat, p, e: RL(flat, [[0]], [raw], [1], engine=e),
        "pool not a sequence": lambda raw, flat, p, e: SL(p, [1], flat, [[0]], engine=e),
        "save layers overlap": lambda raw, flat, p, e: SL(
            two(raw), [1], flat, [[0], [8]], engine=e
        ),
        "bad engine": lambda raw, flat, p, e: R(flat, [0], p, [1], engine="dma"),
        "bad max_programs": lambda raw, flat, p, e: R(flat, [0], p, [1], engine=e, max_programs=0),
    }, setup


BAD, _SETUP = _bad_cases()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_rejected_nothing_written(case, engine):
    raw, flat, pool = _SETUP()
    raw0, flat0 = raw.clone(), flat.clone()
    with pytest.raises(ValueError):
        BAD[case](raw, flat, pool, engine)
    assert torch.equal(raw, raw0) and torch.equal(flat, flat0)


# ---- launch sizes (a pure function) -------------------------------------------------------------


def test_launch_config_examples():
    c = _launch.launch_config(4096, 10_000, 4)
    assert (c.programs, c.rows, c.cols, c.num_warps) == (4, 16, 512, 16)
    c = _launch.launch_config(16384, 10_000, 2, tile_bytes=32768)
    assert (c.programs, c.rows, c.cols, c.num_warps) == (2, 8, 512, 8)
    c = _launch.launch_config(256, 10_000, 4)
    assert (c.rows, c.cols) == (64, 32)
    c = _launch.launch_config(4096, 4, 8)  # a tiny job spreads over the budget
    assert (c.programs, c.rows) == (4, 1)
    c = _launch.launch_config(4097, 100, 4, word=1)
    assert c.cols == 4096 and c.rows * c.cols <= _launch.MAX_TILE_ELEMS
    with pytest.raises(ValueError):
        _launch.launch_config(4096, 10, 0)


@given(
    run=st.integers(1, 1 << 20),
    rows=st.integers(0, 1 << 16),
    budget=st.integers(1, 264),
    word=st.sampled_from([1, 2, 4, 8]),
    tile=st.sampled_from([8192, 32768, 65536, 131072]),
)
def test_launch_config_properties(run, rows, budget, word, tile):
    c = _launch.launch_config(run, rows, budget, word=word, tile_bytes=tile)
    assert 1 <= c.programs <= budget
    assert c.programs <= max(1, -(-rows // c.rows))
    for v in (c.rows, c.cols, c.num_warps):
        assert v >= 1 and v & (v - 1) == 0
    assert c.cols * word <= _launch.MAX_COL_BYTES and c.rows * c.cols <= _launch.MAX_TILE_ELEMS
    assert c.num_warps <= 16


def test_word_and_default_programs(monkeypatch):
    assert [_launch.word_bytes(a) for a in (0, 16, 12, 6, 3)] == [8, 8, 4, 2, 1]
    monkeypatch.delenv("XKV_MAX_PROGRAMS", raising=False)
    assert K.default_programs() == _launch.DEFAULT_PROGRAMS
    monkeypatch.setenv("XKV_MAX_PROGRAMS", "7")
    assert K.default_programs() == 7
    monkeypatch.setenv("XKV_MAX_PROGRAMS", "0")
    with pytest.raises(ValueError):
        K.default_programs()


def test_register_host_without_cuda_is_a_noop():
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    t = torch.zeros(10, dtype=torch.uint8)
    assert K.register_host(t) is t
    K.unregister_host(t)
    with pytest.raises(ValueError):
        K.register_host(t[::2])


# ---- the copy-engine plan (address math only; executed here with memmove) -----------------------


def _execute_plan(job) -> None:
    import ctypes

    import xkv.kernels.page_copy as pc

    dsts, srcs, sizes = pc._copy_engine_plan(job)
    for d, s, z in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, z)


@given(job=single_jobs(save=False), seed=st.integers(0, 2**16), data=st.data())
def test_copy_engine_plan_restore_slice(job, seed, data):
    import xkv.kernels.page_copy as pc

    g, ids, offs, flat_size, base_off = job
    total = ids.size * g.block_bytes
    lo = data.draw(st.integers(0, total))
    hi = data.draw(st.integers(lo, total))
    raw, flat, pool = _setup(g, base_off, flat_size, seed)
    raw.fill_(POISON)
    expect = raw.clone()
    oracle(
        expect, [pool_over(expect, base_off, g)], flat, offs[None], ids, save=False, lo=lo, hi=hi
    )
    _execute_plan(
        pc._job([pool], ids, flat, pc._offsets(offs, 1, "src_offsets"), save=False, lo=lo, hi=hi)
    )
    assert torch.equal(raw, expect)


@given(job=layer_jobs(save=True), seed=st.integers(0, 2**16))
def test_copy_engine_plan_save_layers(job, seed):
    import xkv.kernels.page_copy as pc

    geoms, offsets, ids, offs, flat_size = job
    raw = random_bytes(max(o + g.extent for o, g in zip(offsets, geoms, strict=True)) + 11, seed)
    flat = torch.full((flat_size,), POISON, dtype=torch.uint8)
    pools = [pool_over(raw, o, g) for o, g in zip(offsets, geoms, strict=True)]
    expect = flat.clone()
    oracle(raw, pools, expect, offs, ids, save=True)
    _execute_plan(
        pc._job(pools, ids, flat, pc._offsets(offs, len(pools), "dst_offsets"), save=True)
    )
    assert torch.equal(flat, expect)


def test_launch_choices():
    """Word size, 16-byte hint and the unmasked path follow the alignment of everything copied."""
    import xkv.kernels.page_copy as pc

    def meta(g, base_off, offs):
        raw = torch.zeros(base_off + g.extent + 16, dtype=torch.uint8)
        flat = torch.zeros(int(max(offs)) + g.block_bytes + 16, dtype=torch.uint8)
        job = pc._job(
            [pool_over(raw, base_off, g)],
            list(range(len(offs))),
            flat,
            pc._offsets(np.array(offs), 1, "o"),
            save=False,
        )
        ((launch,),) = [pc._triton_launches(job, 4)]
        return launch.meta, launch.grid

    m, grid = meta(Geometry(8, 4096, ((0, 4096),)), 0, [0, 4096, 8192, 12288])
    assert (m["WORD_T"].primitive_bitwidth, m["VEC"], m["EVEN"], m["ROWS"], m["COLS"]) == (
        64,
        2,
        True,
        1,
        512,
    )
    assert grid == (4,)
    m, _ = meta(Geometry(8, 4096, ((0, 4096),)), 8, [0, 4096])
    assert (m["WORD_T"].primitive_bitwidth, m["VEC"], m["EVEN"]) == (64, 1, True)
    m, _ = meta(Geometry(8, 1003, ((3, 997),)), 0, [0, 1000])
    assert (m["WORD_T"].primitive_bitwidth, m["EVEN"]) == (8, False)
    m, _ = meta(Geometry(8, 1004, ((0, 1002),)), 0, [0, 1002])
    assert m["WORD_T"].primitive_bitwidth == 16


# ---- the staged engine's chunking and pipeline order (DMA simulated by a byte copy) --------------


def _dma(flat, f, slot, o, z, to_slot):
    if to_slot:
        slot[o : o + z] = flat[f : f + z]
    else:
        flat[f : f + z] = slot[o : o + z]


@pytest.mark.parametrize("save", [False, True])
@given(job=layer_jobs(save=True), seed=st.integers(0, 2**16), chunk=st.integers(1, 3000))
def test_staged_pipeline(save, job, seed, chunk):
    import xkv.kernels.page_copy as pc

    geoms, offsets, ids, offs, flat_size = job
    size = max(o + g.extent for o, g in zip(offsets, geoms, strict=True)) + 11
    raw = random_bytes(size, seed) if save else torch.full((size,), POISON, dtype=torch.uint8)
    flat = (
        torch.full((flat_size,), POISON, dtype=torch.uint8)
        if save
        else random_bytes(flat_size, seed)
    )
    pools = [pool_over(raw, o, g) for o, g in zip(offsets, geoms, strict=True)]
    expect_raw, expect_flat = raw.clone(), flat.clone()
    epools = [pool_over(expect_raw, o, g) for o, g in zip(offsets, geoms, strict=True)]
    oracle(expect_raw, epools, expect_flat, offs, ids, save=save)
    j = pc._job(pools, ids, flat, pc._offsets(offs, len(pools), "offsets"), save=save)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pc, "STAGED_MIN_CHUNK", chunk)
        mp.setattr(pc, "STAGED_MAX_CHUNK", chunk)
        if ids.size:
            pc._run_staged(j, 2, dma=_dma)
    assert torch.equal(raw, expect_raw) and torch.equal(flat, expect_flat)


def test_staged_chunks_and_ranges():
    import xkv.kernels.page_copy as pc

    offs = np.array([0, 10, 20, 50, 60, 5], dtype=np.int64)
    assert pc._contiguous_ranges(offs, 10) == [(0, 0, 30), (50, 30, 20), (5, 50, 10)]
    assert pc._contiguous_ranges(np.zeros(0, np.int64), 10) == []
    g = Geometry(8, 100, ((0, 100),))
    raw = torch.zeros(800, dtype=torch.uint8)
    pools = [pool_over(raw, 0, g)] * 3
    job = pc._Job(
        pools, np.arange(8), torch.zeros(2400, dtype=torch.uint8), None, 0, False, 0, 2400, False
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pc, "STAGED_MIN_CHUNK", 300)
        mp.setattr(pc, "STAGED_MAX_CHUNK", 300)
        assert pc._staged_chunks(job) == [
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
        mp.setattr(pc, "STAGED_MIN_CHUNK", 1700)
        mp.setattr(pc, "STAGED_MAX_CHUNK", 1700)
        assert pc._staged_chunks(job) == [([0, 1], 0, 8), ([2], 0, 8)]


def test_auto_follows_calibration():
    import xkv.kernels.page_copy as pc

    cal = pc.Calibration(
        sizes=(4096, 65536),
        restore=(("triton", "staged", "copy_engine"), ("staged", "copy_engine", "triton")),
        save=(("staged", "triton", "copy_engine"), ("copy_engine", "triton", "staged")),
        gbps={},
    )
    big = pc.STAGED_MIN_BYTES
    assert cal.engine_for(False, 100, big, True) == "triton"
    assert cal.engine_for(False, 70000, big, True) == "staged"
    assert cal.engine_for(False, 70000, big - 1, True) in (
        "copy_engine",
        "triton",
    )  # too small to stage
    assert cal.engine_for(False, 70000, big, False) in (
        "copy_engine",
        "triton",
    )  # GPU flat: no staging
    assert cal.engine_for(True, 5000, big, True) == "staged"
