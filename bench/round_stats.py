"""Per-round accounting of ``bench/shared_prefix.py`` (no vLLM, no GPU): the restores' bytes and
copy time of each timed round from the engine's ``XKV_TIMING restore`` lines, the ratio to
Offloading a fully hidden copy would leave, and vLLM's own step, preemption and prefix-cache
counters per round (``--engine-stats``)."""

from __future__ import annotations

import json
import statistics

from timing_rest import TIMING

#: what ``--engine-stats`` reads per round from vLLM's Prometheus metrics (``LLM.get_metrics``):
#: counters summed over their labels, a histogram's observation count (one per engine step)
ENGINE_METRICS = {"steps": "vllm:iteration_tokens_total", "preemptions": "vllm:num_preemptions",
                  "gpu_hit_tokens": "vllm:prefix_cache_hits",
                  "connector_hit_tokens": "vllm:external_prefix_cache_hits"}


class RoundCopies:
    """Per kind and timed round, the restores' bytes and GPU copy time (``XKV_TIMING restore``
    lines of the engine, on a GPU with ``XKV_TIMING=1``), from the child's output in order: the
    lines before ``SP_ROUND r`` belong to round ``r``; round 0 (the untimed prefill) is dropped.
    ``rounds[kind]``: ``[[bytes, copy_ms], ...]``, one per timed round (empty: no timing lines)."""

    def __init__(self) -> None:
        self.rounds: dict[str, list[list[float]]] = {}
        self._cur: dict[str, list[float]] = {}

    def line(self, kind: str, line: str) -> None:
        m = TIMING.search(line)  # the XKV_TIMING restore line: bytes, copy_ms, issue_ms
        if m:
            cur = self._cur.setdefault(kind, [0, 0.0])
            cur[0] += int(m[1])
            cur[1] += float(m[2])
        elif line.startswith("SP_ROUND "):
            cur = self._cur.pop(kind, [0, 0.0])
            if json.loads(line.partition(" ")[2])["round"]:
                self.rounds.setdefault(kind, []).append([cur[0], round(cur[1], 2)])


#: where a finished request's time went, vLLM's per-request histograms read as their sums (ms;
#: their observation count is ``requests``): queued (arrival to first scheduled, which includes
#: an asynchronous restore's wait), prefill (scheduled to first token: a synchronous restore's
#: step included), decode (first to last token). Why a round is longer than another's.
ENGINE_TIMES = {"queue_ms": "vllm:request_queue_time_seconds",
                "prefill_ms": "vllm:request_prefill_time_seconds",
                "decode_ms": "vllm:request_decode_time_seconds"}


def engine_counts(metrics) -> dict[str, float]:
    """:data:`ENGINE_METRICS`, :data:`ENGINE_TIMES` and ``requests`` (the queue histogram's
    observations) in one ``LLM.get_metrics()`` snapshot (0 where absent)."""
    by_name = {v: k for k, v in ENGINE_METRICS.items()}
    times = {v: k for k, v in ENGINE_TIMES.items()}
    out: dict[str, float] = dict.fromkeys([*ENGINE_METRICS, *ENGINE_TIMES, "requests"], 0)
    for m in metrics:
        key = by_name.get(m.name)
        if key is not None:
            out[key] += int(m.value if hasattr(m, "value") else m.count)
        key = times.get(m.name)
        if key is not None:
            out[key] += float(m.sum) * 1e3
            if key == "queue_ms":
                out["requests"] += int(m.count)
    return out


def engine_line(rows: list[dict[str, float]]) -> str | None:
    """The report line of one kind's ``--engine-stats`` rows (one per timed round): means, and
    per finished request the mean of each :data:`ENGINE_TIMES` phase (rows without them, or
    without finished requests: none)."""
    if not rows:
        return None
    mean = {k: statistics.mean(r.get(k, 0) for r in rows) for k in ENGINE_METRICS}
    line = (f"per round (mean of {len(rows)}): {mean['steps']:.1f} engine steps, "
            f"{mean['preemptions']:.1f} preemptions, GPU prefix-cache hits "
            f"{mean['gpu_hit_tokens']:.0f} tokens, connector hits "
            f"{mean['connector_hit_tokens']:.0f} tokens")
    requests = sum(r.get("requests", 0) for r in rows)
    if requests:
        per = {k: sum(r.get(k, 0) for r in rows) / requests for k in ENGINE_TIMES}
        line += (f"; per request ({requests:.0f}): queued {per['queue_ms']:.1f} ms, prefill "
                 f"{per['prefill_ms']:.1f} ms, decode {per['decode_ms']:.1f} ms")
    return line


def hidden_floor(round_ms: list[float], copies: list[list[float]], off_mean: float) -> str | None:
    """The report line of one xkv kind: its restored GB and copy ms per round, and the ratio to
    Offloading's mean round that even a restore whose copy were entirely hidden could not beat:
    a round takes at least its time minus its copy time. None without one copy row per round."""
    if not copies or len(copies) != len(round_ms) or not any(b for b, _ in copies):
        return None
    gb = [b / 1e9 for b, _ in copies]
    ms = [c for _, c in copies]
    rest = [r - c for r, c in zip(round_ms, ms, strict=True)]
    return (f"restored {min(gb):.1f}-{max(gb):.1f} GB per round, copy {min(ms):.0f}-{max(ms):.0f} "
            f"ms (XKV_TIMING); round minus copy {min(rest):.0f}-{max(rest):.0f} ms, mean "
            f"{statistics.mean(rest):.0f}: with every copy hidden >= "
            f"{statistics.mean(rest) / off_mean:.3f} x Offloading's mean round")
