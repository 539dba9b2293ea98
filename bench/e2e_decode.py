"""Decode speed after a restore, per kind of ``bench/e2e_ttft.py`` (``--decode-tokens N``): what
an engine's CUDA-graph mode costs every later token, not only the first.

xkv's engines run piecewise graphs unless ``full_cuda_graphs`` is on (the per-layer hooks), so
every decode step of every request runs its attention outside a graph; the no-connector and
Offloading engines keep vLLM's ``FULL_AND_PIECEWISE``. A TTFT table does not show that cost.
Each kind restores (xkv, Offloading) or GPU-hits (no connector) a prompt of the shortest length
and generates ``N`` tokens; ``tpot_ms`` is (last token's time - first token's time) / (N - 1)
from vLLM's request metrics (engine core timestamps, monotonic). ``--decode-batch B``: B such
prompts at once (each restored, then decoding together: a batch of B per step), one row each.
"""

from __future__ import annotations

import statistics

PHASE = "decode"


def add_args(ap) -> None:
    ap.add_argument("--decode-tokens", type=int, default=0,
                    help="after the restores: each kind restores (GPU-hits, no connector) the "
                         "shortest prompt and generates this many tokens, --reps times; the "
                         "summary gives ms per output token after the first (0: skip; >= 2)")
    ap.add_argument("--decode-batch", type=int, default=1,
                    help="with --decode-tokens: this many prompts restored and decoded at once "
                         "(a decode batch of this size; >= 1)")


def check(n: int, batch: int = 1) -> None:
    if n and n < 2:
        raise SystemExit(f"--decode-tokens {n}: expected 0 (skip) or at least 2 output tokens "
                         "(the time per token is measured between the first and the last)")
    if batch < 1:
        raise SystemExit(f"--decode-batch {batch}: expected at least 1 prompt at once")


def tpot_ms(metrics, out_tokens: int) -> float | None:
    """Milliseconds per output token after the first, from a request's ``metrics``
    (``first_token_ts`` / ``last_token_ts``, seconds); None with fewer than two tokens or
    without the timestamps."""
    first = getattr(metrics, "first_token_ts", 0) or 0
    last = getattr(metrics, "last_token_ts", 0) or 0
    if out_tokens < 2 or not first or last < first:
        return None
    return round((last - first) * 1e3 / (out_tokens - 1), 3)


def report(rows: list[dict]) -> list[str]:
    """One line per length and decode batch (``batch``, 1 when absent): each kind's median
    ``tpot_ms`` of its ``decode`` rows (empty without them), the kinds in the order they first
    appear."""
    dec = [r for r in rows if r["phase"] == PHASE and r.get("tpot_ms") is not None]
    out = []
    for n, b in sorted({(r["tokens"], r.get("batch", 1)) for r in dec}):
        mine = [r for r in dec if r["tokens"] == n and r.get("batch", 1) == b]
        parts = []
        for k in dict.fromkeys(r["kind"] for r in mine):
            v = [r["tpot_ms"] for r in mine if r["kind"] == k]
            outs = {len(r["out_tokens"]) for r in mine if r["kind"] == k}
            parts.append(f"{k} {statistics.median(v):.2f} ({len(v)} x {max(outs)} tokens)")
        at_once = f", {b} requests at once" if b > 1 else ""
        out.append(f"decode after a restore (GPU hit for none), {n}-token prompt{at_once}, ms "
                   f"per output token after the first, median: " + "; ".join(parts))
    return out
