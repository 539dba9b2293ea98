"""Connector counters, summed over ranks and steps (vLLM ships ``.data`` between processes).

The façade subclasses vLLM's ``KVConnectorStats`` with these methods; this module stays free of
vLLM so the scheduler and worker classes can count without it. Units: bytes, seconds, counts.
"""

from __future__ import annotations

from typing import Any

FIELDS = (
    "lookups",  # LOOKUP messages sent
    "lookup_chunks_hit",  # chunks the gateway reported present (all groups)
    "tokens_promised",  # tokens returned to vLLM as loadable
    "bytes_restored",
    "seconds_restored",
    "blocks_restored",
    "bytes_saved",
    "seconds_saved",
    "chunks_saved",  # chunk shards committed
    "chunks_reserved",
    "load_errors",  # blocks reported through get_block_ids_with_load_errors
    "save_errors",  # chunk shards not committed (aborted or failed)
    "gateway_errors",  # calls that failed (deadline, refusal, dead gateway)
)


class StatsMixin:
    """Counters in ``self.data`` (a plain dict, msgpack/pickle friendly)."""

    data: dict[str, Any]

    def __init__(self, data: dict[str, Any] | None = None):
        self.data = {k: 0 for k in FIELDS}
        if data:
            for k, v in data.items():
                self.data[k] = self.data.get(k, 0) + v

    def add(self, name: str, value: float = 1) -> None:
        if name not in self.data:
            raise KeyError(f"unknown connector stat {name!r}; known: {', '.join(FIELDS)}")
        self.data[name] += value

    def reset(self) -> None:
        self.data = {k: 0 for k in FIELDS}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: StatsMixin) -> StatsMixin:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """The 'KV Transfer metrics' line: totals plus derived GB/s (0 when nothing moved)."""
        d = self.data
        out: dict[str, int | float] = {k: d[k] for k in FIELDS if d.get(k)}
        for what in ("restored", "saved"):
            b, s = d.get(f"bytes_{what}", 0), d.get(f"seconds_{what}", 0)
            if b and s:
                out[f"{what}_GBps"] = round(b / s / 1e9, 3)
        for k in ("seconds_restored", "seconds_saved"):
            if k in out:
                out[k] = round(float(out[k]), 6)
        return out

    def take(self) -> dict[str, Any] | None:
        """Return the data and start counting afresh; None when nothing was counted."""
        if self.is_empty():
            return None
        data, self.data = self.data, {k: 0 for k in FIELDS}
        return data


class ConnectorStats(StatsMixin):
    """Plain counters for roles and tests that run without vLLM."""
