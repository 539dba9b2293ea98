"""bench/e2e_targets.py: issue 24's targets as bench/e2e_ttft.py marks them, and e2e_ttft's helpers
(no GPU)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import e2e_ab  # noqa: E402
import e2e_targets  # noqa: E402
import e2e_ttft  # noqa: E402
from e2e_targets import target_marks  # noqa: E402


def test_the_issues_thresholds():
    assert (e2e_targets.RATIO, e2e_targets.EXPOSED_X, e2e_targets.EXPOSED_MS) == (0.80, 1.10, 2.0)
    assert (e2e_targets.COLD_SHORT, e2e_targets.COLD_LONG) == (0.05, 0.02)


def test_a_row_marks_each_target_met_or_missed_at_its_edge():
    # 2048 tokens of 131072 B at 55 GB/s: bound 1.10 x 268435456 / 55e6 ms + 2 = 7.37 ms
    row = target_marks(2048, 19.2, 24.0, 12.0, 50.0, 52.5, 2048, 131072, 55.0)
    assert row == ("0.800 (met)", "7.2 (met)", "7.4", "+5.0% (met)")
    row = target_marks(2048, 19.3, 24.0, 11.9, 50.0, 52.6, 2048, 131072, 55.0)
    assert row == ("0.804 (missed)", "7.4 (missed)", "7.4", "+5.2% (missed)")
    # from 4096 tokens the cold limit is +2 %
    assert target_marks(4096, None, None, None, 100.0, 102.0, None, 131072, None)[3] == "+2.0% (met)"
    assert target_marks(4096, None, None, None, 100.0, 102.1, None, 131072, None)[3] == "+2.1% (missed)"


def test_missing_figures_give_dashes():
    assert target_marks(2048, None, None, None, None, None, None, 131072, None) == ("—",) * 4
    assert target_marks(2048, 20.0, 0.0, 10.0, 0.0, 50.0, 2048, 131072, None) == ("—",) * 4


def test_none_graphs_piecewise_changes_only_the_no_connector_engine_in_graphs_mode():
    """``--none-graphs piecewise``: the baseline engine runs the graph mode xkv's engines get."""
    a = e2e_ttft._args(["--none-graphs", "piecewise", "--kv-gib", "4"])
    kw = e2e_ttft.engine_kwargs(a, "none", 4096)
    assert kw["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert kw["kv_cache_memory_bytes"] == 4 << 30 and not kw["enforce_eager"]
    for kind in ("xkv", "offload", "xkv@verify_checksums=off"):
        assert "compilation_config" not in e2e_ttft.engine_kwargs(a, kind, 4096)
    assert "kv_transfer_config" not in kw
    eager = e2e_ttft._args(["--none-graphs", "piecewise", "--mode", "eager"])
    assert "compilation_config" not in e2e_ttft.engine_kwargs(eager, "none", 4096)
    assert "compilation_config" not in e2e_ttft.engine_kwargs(e2e_ttft._args([]), "none", 4096)


def test_ab_unverified_engine_allows_the_field_and_alternates_the_order():
    a = e2e_ttft._args(["--ab-unverified"])
    assert e2e_ttft.engine_kwargs(a, "xkv", 4096)["kv_transfer_config"][
        "kv_connector_extra_config"]["allow_unverified_requests"] is True
    plain = e2e_ttft.engine_kwargs(e2e_ttft._args([]), "xkv", 4096)
    assert "allow_unverified_requests" not in plain["kv_transfer_config"]["kv_connector_extra_config"]
    assert [e2e_ab.order(i) for i in range(3)] == [(True, False), (False, True), (True, False)]
    assert e2e_ab.UNCHECKED == {"xkv_verify": False}


def test_ab_report_pairs_each_repetitions_two_restores():
    def r(phase, ms, eng, kind="xkv", n=4096):
        return dict(kind=kind, phase=phase, tokens=n, ttft_ms=ms, engine_ms=eng, cached=4095)

    rows = [r("cold", 100.0, 99.0), r("restore", 31.0, 27.0), r("restore_unverified", 30.0, 27.0),
            r("restore_unverified", 40.0, 36.0), r("restore", 41.0, 36.0),
            r("restore", 30.0, 26.0), r("restore_unverified", 33.0, 30.0),
            r("restore", 50.0, 45.0, kind="offload")]
    (blank, line) = e2e_ab.report(rows, [4096])
    assert blank == ""
    assert line.startswith("same-engine checked / unchecked restore (xkv, 4096 tokens, 3 pairs): "
                           "TTFT median 31.0 / 33.0 ms, median of the pairs' ratios 1.025")
    assert "(engine-side 1.000)" in line and "quartiles" not in line  # 3 pairs: no spread
    assert e2e_ab.report([x for x in rows if x["phase"] != "restore_unverified"], [4096]) == []
    # from 4 pairs the pairs' ratios' quartiles follow their median (1.0, 1.1, 1.2, 1.3)
    four = [r(p, ms, 20.0) for c in (20.0, 22.0, 24.0, 26.0)
            for p, ms in (("restore", c), ("restore_unverified", 20.0))]
    (_, line) = e2e_ab.report(four, [4096])
    assert "median of the pairs' ratios 1.150 (quartiles 1.075-1.225) (engine-side 1.000)" in line


def test_ab_report_adds_the_restores_copy_times_by_length_and_check():
    bpt = 131072
    tl = lambda n, ms, ck, extra=0, pre=3.0, sync=0.9: (  # noqa: E731
        f"XKV_TIMING restore bytes={n * bpt + extra} copy_ms={ms} issue_ms=5.0 issue_cpu_ms=5.0 "
        f"pre_ms={pre} plan_ms=1.0 launches=6 checked={ck}/1 GBps=30.0 gc_ms=1.20 sync_ms={sync}")
    lines = [tl(4096, 15.0, 1, 2 << 20), tl(4096, 16.0, 0, pre=7.0, sync=0.1),
             tl(4096, 17.0, 1, 2 << 20, sync=0.7), tl(4096, 15.5, 0, pre=9.0, sync=0.05),
             tl(512, 3.0, 1), "XKV_TIMING gc generation=0 ms=3.1"]
    ct = e2e_ab.copy_times(lines, [512, 4096], bpt)
    assert ct == {(4096, True): [(15.0, 3.0, 0.9), (17.0, 3.0, 0.7)],
                  (4096, False): [(16.0, 7.0, 0.1), (15.5, 9.0, 0.05)],
                  (512, True): [(3.0, 3.0, 0.9)]}
    rows = [dict(kind="xkv", phase=p, tokens=4096, ttft_ms=30.0, engine_ms=26.0, cached=4095)
            for p in ("restore", "restore_unverified")]
    (_, line) = e2e_ab.report(rows, [4096], {"xkv": lines}, bpt)
    assert line.endswith("XKV_TIMING copy_ms median 16.00 / 15.75 (1.016, 2 / 2 steps), "
                         "pre_ms median 3.00 / 8.00, sync_ms median 0.80 / 0.08")
    no_sync = [re.sub(r" sync_ms=[\d.]+", "", ln) for ln in lines]  # before sync_ms (stop 50)
    (_, line) = e2e_ab.report(rows, [4096], {"xkv": no_sync}, bpt)
    assert line.endswith("XKV_TIMING copy_ms median 16.00 / 15.75 (1.016, 2 / 2 steps), "
                         "pre_ms median 3.00 / 8.00")
    old = [re.sub(r" pre_ms=[\d.]+", "", ln) for ln in no_sync]  # before pre_ms too
    (_, line) = e2e_ab.report(rows, [4096], {"xkv": old}, bpt)
    assert line.endswith("XKV_TIMING copy_ms median 16.00 / 15.75 (1.016, 2 / 2 steps)")


def test_ab_report_counts_the_steps_that_allocated_on_each_side():
    """``device_allocs`` / ``pinned_allocs`` / ``alloc_retries`` (only on a line when any): the
    report says how many steps of each side had one, so a ``pre_ms`` gap between the sides
    (stop 54) shows whether an implicit synchronisation is in it; none on any line: nothing."""
    bpt = 18432
    tl = lambda ck, more="": (  # noqa: E731
        f"XKV_TIMING restore bytes={4096 * bpt} copy_ms=5.0 issue_ms=5.0 issue_cpu_ms=5.0 "
        f"pre_ms=2.0 plan_ms=1.0 launches=5 checked={ck}/1 GBps=15.0{more} sync_ms=0.01")
    lines = [tl(1), tl(0, " device_allocs=2"), tl(1, " pinned_allocs=1"),
             tl(0, " device_allocs=1 pinned_allocs=3"), tl(0)]
    assert e2e_ab.sync_steps(lines, 4096, bpt) == {
        True: (2, {"alloc_retries": 0, "device_allocs": 0, "pinned_allocs": 1}),
        False: (3, {"alloc_retries": 0, "device_allocs": 2, "pinned_allocs": 1})}
    rows = [dict(kind="xkv", phase=p, tokens=4096, ttft_ms=20.0, engine_ms=16.0, cached=4095)
            for p in ("restore", "restore_unverified")]
    (_, line) = e2e_ab.report(rows, [4096], {"xkv": lines}, bpt)
    assert line.endswith("sync_ms median 0.01 / 0.01; steps that allocated, of 2 / 3: "
                         "device_allocs 0 / 2, pinned_allocs 1 / 1"), line
    plain = [tl(1), tl(0)]
    (_, line) = e2e_ab.report(rows, [4096], {"xkv": plain}, bpt)
    assert line.endswith("sync_ms median 0.01 / 0.01"), line


def test_a_decode_shaped_hit_is_one_token_past_a_block_boundary():
    assert e2e_ttft.decode_hit_len(2048, 16) == 2049
    assert e2e_ttft.decode_hit_len(300, 16) == 289
    assert e2e_ttft.decode_hit_len(300, 128) == 257
    assert e2e_ttft.decode_hit_len(10, 16) == 17  # at least one whole block to hit
    for bad in (0, -16):
        with pytest.raises(ValueError, match=f"block_size {bad}"):
            e2e_ttft.decode_hit_len(2048, bad)


def test_the_report_lists_the_multi_case_of_every_kind_variants_included(tmp_path, capsys):
    """Stop 56's 8 x 16k call (committed JSON): ``xkv@load_mode=auto`` ran the multi case too,
    and the report names it beside the plain kinds, in the order the kinds ran."""
    import json
    import tarfile

    tar = ROOT / "bench/results/h100_2026-12-08_stop56/c2/e2e_llama_graphs.tar.xz"
    with tarfile.open(tar) as t:
        res = json.load(t.extractfile("e2e_llama_graphs/e2e_ttft.json"))
    res["args"]["model"] = str(ROOT / "bench/models/llama8b")
    e2e_ttft._report(res, tmp_path)
    multi = [ln for ln in (tmp_path / "table.md").read_text().splitlines()
             if ln.startswith("multi (")]
    assert [ln.split(")")[0][len("multi ("):] for ln in multi] == [
        "xkv", "none", "xkv@load_mode=auto", "offload"]
    auto = next(ln for ln in multi if ln.startswith("multi (xkv@load_mode=auto)"))
    assert "median 451.5 ms" in auto and "cached tokens [16383," in auto
    capsys.readouterr()
