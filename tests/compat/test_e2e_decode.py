"""bench/e2e_decode.py: time per output token from vLLM's request metrics, and its summary line
(no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import e2e_decode  # noqa: E402


def test_time_per_token_after_the_first():
    m = SimpleNamespace(first_token_ts=10.0, last_token_ts=10.09)
    assert e2e_decode.tpot_ms(m, 10) == pytest.approx(10.0)
    assert e2e_decode.tpot_ms(m, 1) is None  # one token: no interval
    assert e2e_decode.tpot_ms(SimpleNamespace(first_token_ts=0.0, last_token_ts=0.0), 5) is None
    assert e2e_decode.tpot_ms(SimpleNamespace(first_token_ts=2.0, last_token_ts=1.0), 5) is None
    assert e2e_decode.tpot_ms(None, 5) is None


def test_report_gives_each_kinds_median_per_length_in_order_of_appearance():
    def row(kind, n, t, outs=8):
        return dict(kind=kind, phase="decode", tokens=n, tpot_ms=t, out_tokens=[1] * outs)

    rows = [row("xkv", 2048, 9.0), row("none", 2048, 7.0), row("xkv", 2048, 11.0),
            row("xkv", 2048, 10.0), row("none", 2048, 7.5),
            dict(kind="xkv", phase="restore", tokens=2048, ttft_ms=20.0, out_tokens=[1]),
            dict(kind="offload", phase="decode", tokens=2048, out_tokens=[1])]  # no tpot: left out
    (line,) = e2e_decode.report(rows)
    assert line.startswith("decode after a restore (GPU hit for none), 2048-token prompt")
    assert line.endswith(": xkv 10.00 (3 x 8 tokens); none 7.25 (2 x 8 tokens)")
    assert e2e_decode.report([]) == []


@pytest.mark.parametrize("n,ok", [(0, True), (1, False), (2, True), (64, True)])
def test_decode_tokens_needs_two_or_none(n, ok):
    if ok:
        e2e_decode.check(n)
    else:
        with pytest.raises(SystemExit, match="--decode-tokens 1"):
            e2e_decode.check(n)


@pytest.mark.parametrize("b,ok", [(0, False), (-3, False), (1, True), (8, True)])
def test_decode_batch_needs_one_or_more(b, ok):
    if ok:
        e2e_decode.check(4, b)
    else:
        with pytest.raises(SystemExit, match=f"--decode-batch {b}: expected at least 1"):
            e2e_decode.check(4, b)


def test_report_gives_one_line_per_decode_batch():
    """Rows of a batched run (``batch``) get a line of their own that says how many requests
    decoded at once; rows without ``batch`` are batch 1 (files written before the option)."""
    def row(kind, t, batch=None):
        r = dict(kind=kind, phase="decode", tokens=512, tpot_ms=t, out_tokens=[1] * 4)
        return r if batch is None else {**r, "batch": batch}

    rows = [row("xkv", 9.0), row("xkv", 12.0, 8), row("xkv", 14.0, 8), row("none", 7.0, 8),
            row("none", 6.0, 1)]
    one, eight = e2e_decode.report(rows)
    assert one.endswith("512-token prompt, ms per output token after the first, median: "
                        "xkv 9.00 (1 x 4 tokens); none 6.00 (1 x 4 tokens)")
    assert eight.endswith("512-token prompt, 8 requests at once, ms per output token after the "
                          "first, median: xkv 13.00 (2 x 4 tokens); none 7.00 (1 x 4 tokens)")
