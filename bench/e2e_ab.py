"""``bench/e2e_ttft.py --ab-unverified``: checked and unchecked restores in the same xkv engine.

The engine runs with ``allow_unverified_requests``; each restore repetition restores the prompt
twice, once checked (phase ``restore``) and once with ``kv_transfer_params {"xkv_verify": false}``
(phase ``restore_unverified``), which of the two goes first alternating from one repetition to the
next, so drift falls on both. Why: issue 25 asks for checked restores within 1 % of unchecked ones,
and a 4k restore's TTFT moved by 16 % between two engines of the same settings (bench/RESULTS.md
"stop 42"): only one engine can resolve 1 %.
"""

from __future__ import annotations

import re
import statistics

from timing_rest import field

UNCHECKED = {"xkv_verify": False}  # the request's kv_transfer_params (xkv.connector.compat)


def order(rep: int) -> tuple[bool, bool]:
    """Whether the first and the second restore of repetition ``rep`` are checked."""
    return (True, False) if rep % 2 == 0 else (False, True)


def phase(checked: bool) -> str:
    return "restore" if checked else "restore_unverified"


_TIMING = re.compile(r"bytes=(\d+) copy_ms=([\d.]+) .*checked=(\d+)/(\d+)")
#: the optional fields the report compares checked / unchecked, beside ``copy_ms``
_SIDE_FIELDS = ("pre_ms", "sync_ms")


def copy_times(lines: list[str], lens: list[int], bytes_per_token: int) -> dict:
    """{(tokens, checked): [(copy_ms, pre_ms, sync_ms)]} of ``XKV_TIMING restore`` lines whose
    bytes are within 5 % of ``tokens * bytes_per_token`` (a verified restore also counts its
    hash-only pages); ``checked``: every group of the step verified; ``pre_ms`` / ``sync_ms``
    None where the line has none (engines before those fields)."""
    out: dict = {}
    for n, checked, ms, ln in _steps(lines, lens, bytes_per_token):
        out.setdefault((n, checked), []).append((ms, *(field(ln, k) for k in _SIDE_FIELDS)))
    return out


def _steps(lines: list[str], lens: list[int], bytes_per_token: int):
    """``(tokens, checked, copy_ms, line)`` of every ``XKV_TIMING restore`` line matched as
    :func:`copy_times` matches them."""
    if not bytes_per_token:
        return
    for ln in lines:
        m = _TIMING.search(ln)
        if not m:
            continue
        nbytes, ms, ck, groups = int(m[1]), float(m[2]), int(m[3]), int(m[4])
        for n in lens:
            if abs(nbytes - n * bytes_per_token) <= 0.05 * n * bytes_per_token and groups:
                yield n, ck == groups, ms, ln


#: the step's implicit synchronisations ``XKV_TIMING`` counts (only on a line when any)
_SYNC_FIELDS = ("alloc_retries", "device_allocs", "pinned_allocs")


def sync_steps(lines: list[str], n: int, bytes_per_token: int) -> dict:
    """{checked: (steps, {field: steps with any})} of the ``n``-token restores' lines: how many
    steps of each side allocated (a host wait for the device) inside the restore's window, so
    an A/B whose sides differ in ``pre_ms`` (stop 43, stop 54) says whether such a wait is why."""
    out: dict = {}
    for _, checked, _, ln in _steps(lines, [n], bytes_per_token):
        steps, hit = out.setdefault(checked, (0, dict.fromkeys(_SYNC_FIELDS, 0)))
        for k in _SYNC_FIELDS:
            hit[k] += int(bool(field(ln, k)))
        out[checked] = (steps + 1, hit)
    return out


def report(rows: list[dict], lens: list[int], timing: dict | None = None,
           bytes_per_token: int = 0) -> list[str]:
    """Per xkv kind with both phases and length: the medians and the median of each repetition's
    checked / unchecked ratio (rows of one repetition are consecutive), and, from the kind's
    ``XKV_TIMING`` lines (``timing[kind]``), the restores' GPU copy time checked / unchecked.
    Empty without A/B rows."""
    out: list[str] = []
    kinds = sorted({r["kind"] for r in rows if r["phase"] == "restore_unverified"})
    for kind in kinds:
        for n in lens:
            mine = [r for r in rows if r["kind"] == kind and r["tokens"] == n
                    and r["phase"] in ("restore", "restore_unverified")]
            # (checked, unchecked) of each repetition, whichever went first
            pairs = [(a, b) if a["phase"] == "restore" else (b, a)
                     for a, b in zip(mine[::2], mine[1::2], strict=False) if a["phase"] != b["phase"]]
            if not pairs:
                continue
            ck, un = [c for c, _ in pairs], [u for _, u in pairs]
            ratios = [c["ttft_ms"] / u["ttft_ms"] for c, u in pairs]
            ratio = statistics.median(ratios)
            # the pairs' spread: whether a 1 % target (issue 25) is inside the run's noise
            spread = ""
            if len(ratios) >= 4:
                q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
                spread = f" (quartiles {q1:.3f}-{q3:.3f})"
            eng = [c["engine_ms"] / u["engine_ms"] for c, u in pairs
                   if c.get("engine_ms") and u.get("engine_ms")]
            out.append(
                f"same-engine checked / unchecked restore ({kind}, {n} tokens, {len(pairs)} pairs): "
                f"TTFT median {statistics.median(c['ttft_ms'] for c in ck):.1f} / "
                f"{statistics.median(u['ttft_ms'] for u in un):.1f} ms, median of the pairs' ratios "
                f"{ratio:.3f}{spread}" + (f" (engine-side {statistics.median(eng):.3f})" if eng else "")
                + f"; cached {sorted({c['cached'] for c in ck})} / {sorted({u['cached'] for u in un})}")
            ct = copy_times((timing or {}).get(kind, []), [n], bytes_per_token)
            ck_t, un_t = ct.get((n, True)), ct.get((n, False))
            if ck_t and un_t:
                c, u = (statistics.median(row[0] for row in t) for t in (ck_t, un_t))
                out[-1] += (f"; XKV_TIMING copy_ms median {c:.2f} / {u:.2f} ({c / u:.3f}, "
                            f"{len(ck_t)} / {len(un_t)} steps)")
                # pre_ms: host time before the first copy, not the same on both sides (stop 43:
                # unverified requests 2.5-8 ms more), so the TTFT ratio is not the copies' alone;
                # sync_ms: the end of the step waiting for the loads (stop 50: a checked 32k MLA
                # restore's load stream ended after the forward)
                for k, name in enumerate(_SIDE_FIELDS, start=1):
                    vals = [[row[k] for row in t if row[k] is not None] for t in (ck_t, un_t)]
                    if all(vals):
                        out[-1] += (f", {name} median {statistics.median(vals[0]):.2f} / "
                                    f"{statistics.median(vals[1]):.2f}")
                ss = sync_steps((timing or {}).get(kind, []), n, bytes_per_token)
                (c_n, c_hit), (u_n, u_hit) = ss[True], ss[False]
                waits = [f"{k} {c_hit[k]} / {u_hit[k]}" for k in _SYNC_FIELDS
                         if c_hit[k] or u_hit[k]]
                if waits:
                    out[-1] += (f"; steps that allocated, of {c_n} / {u_n}: "
                                + ", ".join(waits))
    if out:
        out.insert(0, "")
    return out
