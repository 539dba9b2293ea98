"""bench/round_stats.py, bench/shared_prefix.py's per-round accounting (no GPU): which
``XKV_TIMING restore`` lines belong to which timed round, the floor a fully hidden copy would
leave, vLLM's counters per round, and where the report prints each."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace as NS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import round_stats  # noqa: E402
import shared_prefix  # noqa: E402


def _timing(nbytes: int, ms: float) -> str:
    return (f"(EngineCore pid=7) INFO [cuda_transfer.py:180] XKV_TIMING restore bytes={nbytes} "
            f"copy_ms={ms} issue_ms=1.00 launches=2 checked=1/1 GBps=40.0")


def _round(r: int) -> str:
    return "SP_ROUND " + json.dumps({"round": r, "ms": 1.0, "cached": [0]})


def test_lines_before_each_round_mark_are_that_rounds_and_round_0_is_dropped():
    rc = round_stats.RoundCopies()
    feed = [("a", _timing(5, 1.5)), ("a", _round(0)),           # the untimed prefill round
            ("a", _timing(100, 2.25)), ("b", _timing(7, 9.0)),  # kinds interleave
            ("a", "XKV_TIMING gc generation=1 ms=2.19 collected=3"), ("a", _timing(50, 1.0)),
            ("a", _round(1)), ("b", _round(0)), ("a", _round(2)),  # a round without restores
            ("b", _timing(3, 0.5)), ("b", _round(1))]
    for kind, line in feed:
        rc.line(kind, line)
    assert rc.rounds == {"a": [[150, 3.25], [0, 0.0]], "b": [[3, 0.5]]}


def test_no_timing_lines_no_rows_and_no_floor():
    rc = round_stats.RoundCopies()
    for r in range(3):
        rc.line("xkv", _round(r))
    assert rc.rounds == {"xkv": [[0, 0.0], [0, 0.0]]}
    assert round_stats.hidden_floor([10.0, 12.0], rc.rounds["xkv"], 20.0) is None
    assert round_stats.hidden_floor([10.0, 12.0], [], 20.0) is None
    # a round count that does not match the timed rounds (a cut child): no floor either
    assert round_stats.hidden_floor([10.0, 12.0], [[1e9, 2.0]], 20.0) is None


def test_the_floor_is_the_mean_round_minus_copy_over_offloadings_mean():
    line = round_stats.hidden_floor([1500.0, 1300.0], [[12e9, 300.0], [10e9, 100.0]], 1600.0)
    # round minus copy: 1200 and 1200 -> mean 1200 / 1600
    assert line == ("restored 10.0-12.0 GB per round, copy 100-300 ms (XKV_TIMING); round minus "
                    "copy 1200-1200 ms, mean 1200: with every copy hidden >= 0.750 x "
                    "Offloading's mean round")


def test_the_report_prints_the_floor_under_each_xkv_kind():
    res = {"rc": {}, "copies": {"xkv": [[2e9, 50.0], [2e9, 150.0]]}, "kinds": {
        "xkv": {"round_ms": [400.0, 500.0], "outputs": [], "cached": []},
        "xkv@load_mode=auto": {"round_ms": [450.0, 450.0], "outputs": [], "cached": []},
        "offload": {"round_ms": [500.0, 500.0], "outputs": [], "cached": []}}}
    text = shared_prefix.report(res)
    assert "xkv / Offloading mean round time: 0.900" in text
    assert "xkv: restored 2.0-2.0 GB per round, copy 50-150 ms" in text
    assert ">= 0.700 x Offloading's mean round" in text
    # the variant logged no timing: its ratio line only
    assert "xkv@load_mode=auto / Offloading mean round time: 0.900" in text
    assert "xkv@load_mode=auto: restored" not in text


def test_engine_counts_sum_counters_over_labels_and_count_histogram_observations():
    snap = [NS(name="vllm:num_preemptions", value=2), NS(name="vllm:num_preemptions", value=1),
            NS(name="vllm:iteration_tokens_total", count=17, sum=4000.0),
            NS(name="vllm:prefix_cache_hits", value=512),
            NS(name="vllm:request_queue_time_seconds", count=3, sum=0.25),
            NS(name="vllm:request_prefill_time_seconds", count=3, sum=0.0625),
            NS(name="vllm:request_decode_time_seconds", count=2, sum=1.5),
            NS(name="vllm:generation_tokens", value=99)]  # not read
    assert round_stats.engine_counts(snap) == {
        "steps": 17, "preemptions": 3, "gpu_hit_tokens": 512, "connector_hit_tokens": 0,
        "queue_ms": 250.0, "prefill_ms": 62.5, "decode_ms": 1500.0, "requests": 3}
    assert round_stats.engine_counts([]) == dict.fromkeys(
        [*round_stats.ENGINE_METRICS, *round_stats.ENGINE_TIMES, "requests"], 0)


def test_engine_line_means_and_its_place_in_the_report():
    rows = [{"steps": 10, "preemptions": 0, "gpu_hit_tokens": 100, "connector_hit_tokens": 8192},
            {"steps": 13, "preemptions": 3, "gpu_hit_tokens": 0, "connector_hit_tokens": 0}]
    assert round_stats.engine_line(rows) == (
        "per round (mean of 2): 11.5 engine steps, 1.5 preemptions, GPU prefix-cache hits 50 "
        "tokens, connector hits 4096 tokens")
    assert round_stats.engine_line([]) is None
    # with the request phases: per finished request over every round
    timed = [dict(rows[0], queue_ms=300.0, prefill_ms=40.0, decode_ms=900.0, requests=3),
             dict(rows[1], queue_ms=100.0, prefill_ms=20.0, decode_ms=300.0, requests=1)]
    assert round_stats.engine_line(timed).endswith(
        "connector hits 4096 tokens; per request (4): queued 100.0 ms, prefill 15.0 ms, "
        "decode 300.0 ms")
    res = {"rc": {}, "kinds": {
        "none": {"round_ms": [1.0, 1.0], "outputs": [], "cached": [], "engine": rows},
        "xkv": {"round_ms": [1.0, 1.0], "outputs": [], "cached": []}}}
    text = shared_prefix.report(res)
    assert "none: per round (mean of 2): 11.5 engine steps" in text
    assert "xkv: per round" not in text
