"""Launch sizes (pure functions) and the Triton launch's word size, hints and tables."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pools import Geometry, layer_jobs, layers_buffer_size, pool_over, pools_over

import xkv.kernels as K
from xkv.kernels import _budgets, _launch
from xkv.kernels.jobs import build_job, offsets_arg
from xkv.layout import PagePool


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
    # an MLA page (576 bf16 x 16 tokens = 18 KiB): rows of 2 KiB divide it, 128 KiB tiles stay
    c = _launch.launch_config(18432, 10_000, 64, save=False)
    assert (c.rows, c.cols, c.num_warps) == (64, 256, 16)
    # no power of two of >= 2 KiB divides a 10496-byte page (fp8 MLA) or a 5 KiB one: 4 KiB rows
    assert _launch.launch_config(10496, 10_000, 64, save=False).cols == 512
    assert _launch.launch_config(5120, 10_000, 64, save=False).cols == 512
    assert _launch.launch_config(6144, 10_000, 64, save=False).cols == 256  # 3 x 2 KiB
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
    run_words = -(-run // word)
    if run_words > c.cols and run_words % c.cols:  # a run over several rows is masked only
        assert (run_words & -run_words) * word < _launch.MIN_EVEN_COL_BYTES  # when it must be


def test_word_and_default_programs(monkeypatch):
    assert [_launch.word_bytes(a) for a in (0, 16, 12, 6, 3)] == [8, 8, 4, 2, 1]
    monkeypatch.delenv("XKV_MAX_PROGRAMS", raising=False)
    assert K.default_programs() == _budgets.DEFAULT_PROGRAMS
    monkeypatch.setenv("XKV_MAX_PROGRAMS", "7")
    assert K.default_programs() == 7
    monkeypatch.setenv("XKV_MAX_PROGRAMS", "0")
    with pytest.raises(ValueError):
        K.default_programs()


def test_launch_choices():
    """Word size, 16-byte hint and the unmasked path follow the alignment of everything copied."""
    def meta(g, base_off, offs):
        raw = torch.zeros(base_off + g.extent + 16, dtype=torch.uint8)
        flat = torch.zeros(int(max(offs)) + g.block_bytes + 16, dtype=torch.uint8)
        job = build_job(
            [pool_over(raw, base_off, g)],
            list(range(len(offs))),
            flat,
            offsets_arg(np.array(offs), 1, "o"),
            save=False,
        )
        ((launch,),) = [_launch.launches(job, 4)]
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
    m, _ = meta(Geometry(2, 18432, ((0, 18432),)), 0, [0, 18432])  # the MLA page: unmasked
    assert (m["VEC"], m["EVEN"], m["COLS"]) == (2, True, 256)
    m, _ = meta(Geometry(8, 4096, ((0, 4096),)), 8, [0, 4096])
    assert (m["WORD_T"].primitive_bitwidth, m["VEC"], m["EVEN"]) == (64, 1, True)
    m, _ = meta(Geometry(8, 1003, ((3, 997),)), 0, [0, 1000])
    assert (m["WORD_T"].primitive_bitwidth, m["EVEN"]) == (8, False)
    m, _ = meta(Geometry(8, 1004, ((0, 1002),)), 0, [0, 1002])
    assert m["WORD_T"].primitive_bitwidth == 16


@given(sizes=st.lists(st.integers(0, 9), max_size=6))
def test_tables_sections_are_16_byte_aligned(sizes):
    """Every table section starts 16 bytes apart from the buffer's start, whatever the counts
    (the kernel's pointer specialisation must not depend on how many blocks a step has)."""
    t = _launch.Tables()
    parts = [np.arange(n, dtype=np.int64) + 100 * k for k, n in enumerate(sizes)]
    at = [t.add(p) for p in parts]
    buf = t.upload(torch.device("cpu"))
    for a, p in zip(at, parts, strict=True):
        assert a % 2 == 0
        assert torch.equal(buf[a : a + p.size], torch.from_numpy(p))


def test_one_upload_per_copy(monkeypatch):
    """A copy over several layer geometries still sends its tables in one upload."""
    calls = []
    real = _launch.Tables.upload
    monkeypatch.setattr(_launch.Tables, "upload", lambda self, dev: calls.append(1) or real(self, dev))
    raw = torch.zeros(4096, dtype=torch.uint8)
    pools = [pool_over(raw, 0, Geometry(4, 100, ((0, 40),))),
             pool_over(raw, 1000, Geometry(4, 60, ((8, 40),)))]
    job = build_job(pools, [0, 3], torch.zeros(400, dtype=torch.uint8),
                    offsets_arg(np.array([[0, 40], [80, 120]]), 2, "o"), save=False)
    assert len(_launch.launches(job, 4)) == 2 and calls == [1]


@given(job=layer_jobs(save=False), budget=st.sampled_from([1, 4, 7]))
def test_per_layer_launches_equal_one_layer_copies(job, budget):
    """Layer k's launch in a per-layer set (prepared steps) is the launch of the one-layer copy:
    same variant, scalars and base, the tables' contents too."""
    geoms, offsets, ids, offs, flat_size = job
    if not ids.size:
        return
    raw = torch.zeros(layers_buffer_size(geoms, offsets), dtype=torch.uint8)
    pools = pools_over(raw, geoms, offsets)
    flat = torch.zeros(flat_size, dtype=torch.uint8)
    whole = build_job(pools, ids, flat, offsets_arg(offs, len(pools), "o"), save=False,
                      per_layer=True)
    each = _launch.launches(whole, budget, groups=[[k] for k in range(len(pools))])
    for k, launch in enumerate(each):
        (alone,) = _launch.launches(whole.layer(k), budget)
        assert launch.key == alone.key and launch.grid == alone.grid
        assert launch.args[0].data_ptr() == alone.args[0].data_ptr()
        # scalars but lo, hi (read only by slices: the whole copy's bounds vs the layer's);
        # args 6..8 are the checksum tables (unread stand-ins here: an unverified copy)
        assert launch.args[9:16] + launch.args[18:] == alone.args[9:16] + alone.args[18:]
        for a, b in zip(launch.args[2:9], alone.args[2:9], strict=True):
            assert torch.equal(a, b)


def test_checked_restores_default_to_their_own_budget(monkeypatch):
    """A restore that checks checksums runs with ``VERIFIED_RESTORE_PROGRAMS`` when the caller
    names no budget (hashing lengthens each program: 4 programs halve the H200's restore rate),
    and so does a checked save of pages whose shortest run is below ``SMALL_CHECKED_RUN_BYTES``
    (stop 56: 4 KiB checked saves at 4 programs 0.78 x the unchecked ones); other saves,
    unchecked restores and an explicit or ``XKV_MAX_PROGRAMS`` budget are unchanged."""
    from pools import random_bytes

    from xkv.kernels.page_copy import check_engine

    monkeypatch.delenv("XKV_MAX_PROGRAMS", raising=False)
    small = _budgets.SMALL_CHECKED_RUN_BYTES

    def budget(save, checked, max_programs=None, runs=((0, 8192),)):
        bb = sum(n for _, n in runs)
        g = Geometry(8, max(o + n for o, n in runs), runs)
        pool = pool_over(random_bytes(g.extent, 1), 0, g)
        card = torch.zeros(bb * 8, dtype=torch.uint8)
        offs = offsets_arg(np.arange(3, dtype=np.int64) * bb, 1, "o")
        exp = None if save else np.zeros((1, 1), np.uint32)
        checks = K.Checks(np.zeros(3, np.int64), np.arange(3), 1, expected=exp) if checked else None
        job = build_job([pool], np.arange(3), card, offs, save=save, checks=checks)
        return check_engine(job, "reference", max_programs)[1]

    V, D = _budgets.VERIFIED_RESTORE_PROGRAMS, _budgets.DEFAULT_PROGRAMS
    assert V > D and small == 8192
    assert budget(False, True) == V == K.default_programs(True)
    assert budget(False, False) == budget(True, True) == budget(True, False) == D
    # a page of 8 KiB in two 4 KiB runs (K and V of one head): its rows are 4 KiB
    two_runs = ((0, 4096), (8192, 4096))
    assert budget(True, True, runs=two_runs) == budget(True, True, runs=((0, 4096),)) == V
    assert budget(True, True, runs=((0, small - 4),)) == V
    assert budget(True, True, runs=((0, small),)) == D
    assert budget(True, False, runs=two_runs) == budget(False, False, runs=two_runs) == D
    assert budget(True, True, 3, runs=two_runs) == budget(False, True, 3) == 3
    monkeypatch.setenv("XKV_MAX_PROGRAMS", "6")
    assert budget(False, True) == budget(True, False) == budget(True, True, runs=two_runs) == 6


def test_min_even_row_env(monkeypatch):
    """XKV_MIN_EVEN_ROW_BYTES (a positive byte count) and XKV_CHECK_SPLIT (a power of two):
    anything else is refused, naming the variable."""
    assert _launch._env_count("ROW_BYTES_UNDER_TEST", 1024) == 1024
    monkeypatch.setenv("ROW_BYTES_UNDER_TEST", "8192")
    assert _launch._env_count("ROW_BYTES_UNDER_TEST", 1024) == 8192
    for bad in ("0", "-1", "2k", ""):
        monkeypatch.setenv("ROW_BYTES_UNDER_TEST", bad)
        with pytest.raises(ValueError, match="ROW_BYTES_UNDER_TEST"):
            _launch._env_count("ROW_BYTES_UNDER_TEST", 1024)
    monkeypatch.setenv("ROW_BYTES_UNDER_TEST", "8")  # XKV_CHECK_SPLIT's check: powers of two
    assert _launch._env_count("ROW_BYTES_UNDER_TEST", 1, pow2=True) == 8
    for bad in ("3", "12", "0"):
        monkeypatch.setenv("ROW_BYTES_UNDER_TEST", bad)
        with pytest.raises(ValueError, match="ROW_BYTES_UNDER_TEST"):
            _launch._env_count("ROW_BYTES_UNDER_TEST", 1, pow2=True)
    monkeypatch.setattr(_launch, "MIN_EVEN_COL_BYTES", 8192)  # the switch off: masked 4 KiB rows
    assert _launch.launch_config(18432, 10_000, 64, save=False).cols == 512


def test_resized_keeps_the_variant_and_gives_the_counts_of_a_plan_of_that_size():
    """``resized`` (a staged restore's chunks): the plan's constexprs and tile unchanged, the
    counts, bounds and grid those ``plan`` gives for ``n`` fragments whenever its tile is the
    same (a short chunk runs the full slot's compiled variant)."""
    raw = torch.zeros(3 * 64 * 4096 + 64, dtype=torch.uint8)
    pools = [PagePool(raw[k * 64 * 4096:], 64, 4096, 4096, ((0, 2048), (2048, 2048)))
             for k in range(3)]
    flat = torch.zeros(4096 * 64, dtype=torch.uint8)

    def mk(n, budget):
        return _launch.plan(pools, flat, n=n, has_flat_off=True, flat_off_gcd=4096, flat_base=0,
                            save=False, sliced=False, lo=0, hi=3 * n * 4096,
                            max_programs=budget)

    for budget in (4, 64):
        full = mk(64, budget)
        for n in (1, 7, 33, 64):
            r = _launch.resized(full, n, budget)
            assert r.meta == full.meta and r.table.tolist() == full.table.tolist()
            own = mk(n, budget)
            assert r.scalars[:4] == (n, 2, 3 * n * 2, -(-3 * n * 2 // full.meta["ROWS"]))
            assert r.scalars[8] == 3 * n * 4096 // full.meta["WORD"]
            assert 1 <= r.programs <= budget
            if own.meta["ROWS"] == full.meta["ROWS"]:
                assert r.scalars == own.scalars and r.programs == own.programs


def test_checked_restore_tile_keeps_one_mib_in_flight():
    """A verified restore's programs share ``CHECKED_RESTORE_IN_FLIGHT`` of host reads: the tile
    is the largest power of two that fits the share, between 4 KiB and the restore tile."""
    assert _budgets.CHECKED_RESTORE_IN_FLIGHT == 1 << 20
    assert [_launch.checked_restore_tile(p) for p in (1, 4, 8, 16, 32, 48, 64, 256, 1000)] == [
        131072, 131072, 131072, 65536, 32768, 16384, 16384, 4096, 4096]
    for p in range(1, 300):
        t = _launch.checked_restore_tile(p)
        assert t & (t - 1) == 0 and 4096 <= t <= _launch.READ_TILE_BYTES
        assert t == _launch.READ_TILE_BYTES or t == 4096 or t * p <= 1 << 20 < 2 * t * p
    with pytest.raises(ValueError, match="max_programs must be >= 1, got 0"):
        _launch.checked_restore_tile(0)


@pytest.mark.parametrize("budget", [16, 32, 64])
def test_verified_restores_launch_the_checked_tile_and_others_keep_theirs(budget):
    """The tile of a plan: verified restores ``checked_restore_tile(budget)``, unchecked
    restores ``READ_TILE_BYTES``, saves (checked or not) ``WRITE_TILE_BYTES``; an explicit
    ``tile_bytes`` wins. Enough 4 KiB pages that no tile is cut to the rows per program."""
    from pools import random_bytes

    n = 64 * budget
    g = Geometry(n, 4096, ((0, 4096),))
    pool = pool_over(random_bytes(g.extent, 1), 0, g)
    card = torch.zeros(4096 * n, dtype=torch.uint8)
    offs = offsets_arg(np.arange(n, dtype=np.int64) * 4096, 1, "o")

    def tile(save, checked, **kw):
        exp = None if save else np.zeros((1, 1), np.uint32)
        checks = K.Checks(np.zeros(n, np.int64), np.arange(n), 1, expected=exp) if checked else None
        job = build_job([pool], np.arange(n), card, offs, save=save, checks=checks)
        (launch,) = _launch.launches(job, budget, **kw)
        return launch.meta["ROWS"] * launch.meta["COLS"] * launch.meta["WORD"]

    assert tile(False, True) == _launch.checked_restore_tile(budget)
    assert tile(False, False) == _launch.READ_TILE_BYTES
    assert tile(True, True) == tile(True, False) == _launch.WRITE_TILE_BYTES
    assert tile(False, True, tile_bytes=128 * 1024) == 128 * 1024


def test_launch_config_gives_verified_restores_their_tile():
    """The tile rule lives in ``launch_config``: ``check`` on a restore takes the checked tile,
    a save keeps the write tile, an explicit ``tile_bytes`` wins."""
    for budget in (4, 16, 32, 64):
        c = _launch.launch_config(4096, 100_000, budget, save=False, check=True)
        assert c.rows * c.cols * 8 == _launch.checked_restore_tile(budget)
        c = _launch.launch_config(4096, 100_000, budget, save=True, check=True)
        assert c.rows * c.cols * 8 == _launch.WRITE_TILE_BYTES
        c = _launch.launch_config(4096, 100_000, budget, save=False, check=True, tile_bytes=8192)
        assert c.rows * c.cols * 8 == 8192
