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


def engine_counts(metrics) -> dict[str, int]:
    """:data:`ENGINE_METRICS` in one ``LLM.get_metrics()`` snapshot (0 where absent)."""
    by_name = {v: k for k, v in ENGINE_METRICS.items()}
    out = dict.fromkeys(ENGINE_METRICS, 0)
    for m in metrics:
        key = by_name.get(m.name)
        if key is not None:
            out[key] += int(m.value if hasattr(m, "value") else m.count)
    return out


def engine_line(rows: list[dict[str, int]]) -> str | None:
    """The report line of one kind's ``--engine-stats`` rows (one per timed round): means."""
    if not rows:
        return None
    mean = {k: statistics.mean(r.get(k, 0) for r in rows) for k in ENGINE_METRICS}
    return (f"per round (mean of {len(rows)}): {mean['steps']:.1f} engine steps, "
            f"{mean['preemptions']:.1f} preemptions, GPU prefix-cache hits "
            f"{mean['gpu_hit_tokens']:.0f} tokens, connector hits "
            f"{mean['connector_hit_tokens']:.0f} tokens")


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
