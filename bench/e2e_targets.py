"""Issue 24's targets for one prompt length, as ``bench/e2e_ttft.py`` prints them under its table.

Restore TTFT <= :data:`RATIO` x Offloading's; exposed restore (xkv - vLLM's GPU prefix hit) <=
:data:`EXPOSED_X` x restored bytes / the run's copy-engine H2D bandwidth + :data:`EXPOSED_MS`; a
cold prefill with xkv's stores <= +:data:`COLD_SHORT` over no connector below 4096 tokens,
+:data:`COLD_LONG` from 4096.
"""

from __future__ import annotations

RATIO, EXPOSED_X, EXPOSED_MS, COLD_SHORT, COLD_LONG = 0.80, 1.10, 2.0, 0.05, 0.02


def target_marks(n: int, xkv: float | None, offload: float | None, hit: float | None,
                 cold_none: float | None, cold_xkv: float | None, cached: int | None,
                 bytes_per_token: int, bw_gbps: float | None) -> tuple[str, str, str, str]:
    """One row of issue 24's targets for ``n`` prompt tokens (medians, ms): the ratio to
    Offloading, the exposed restore, its bound, the cold overhead, each "value (met|missed)" or
    "—" where a figure is missing."""
    bound = (EXPOSED_X * cached * bytes_per_token / (bw_gbps * 1e6) + EXPOSED_MS
             if (cached and bw_gbps) else None)
    ex = xkv - hit if xkv is not None and hit is not None else None
    ratio = ("—" if xkv is None or not offload
             else f"{xkv / offload:.3f} ({'met' if xkv / offload <= RATIO else 'missed'})")
    exs = "—" if ex is None or bound is None else f"{ex:.1f} ({'met' if ex <= bound else 'missed'})"
    lim = COLD_SHORT if n < 4096 else COLD_LONG
    ov = ("—" if cold_xkv is None or not cold_none else
          f"{(cold_xkv / cold_none - 1) * 100:+.1f}% "
          f"({'met' if cold_xkv / cold_none <= 1 + lim else 'missed'})")
    return ratio, exs, "—" if bound is None else f"{bound:.1f}", ov
