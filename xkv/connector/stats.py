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
    "checksum_mismatches",  # objects (shards) whose restored bytes did not match their words
    "blocks_unverified",  # blocks restored without a checksum check (see docs/verification.md)
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


#: Prometheus counters of the connector, one per field (vLLM adds ``_total`` and the labels
#: ``model_name``, ``engine``). Worker fields are summed over ranks (bytes moved by all ranks;
#: seconds are rank-seconds); scheduler fields are counted once.
PROM_COUNTERS = {
    "lookups": ("vllm:xkv_lookups", "LOOKUP messages the connector sent to the gateway."),
    "lookup_chunks_hit": ("vllm:xkv_lookup_hit_chunks",
                          "Chunks the gateway reported present (all groups)."),
    "tokens_promised": ("vllm:xkv_hit_tokens",
                        "Prompt tokens the connector offered vLLM to load instead of computing."),
    "bytes_restored": ("vllm:xkv_restored_bytes", "Bytes copied from the card into the KV cache."),
    "seconds_restored": ("vllm:xkv_restore_seconds",
                         "Seconds spent restoring (summed over ranks)."),
    "blocks_restored": ("vllm:xkv_restored_blocks", "KV blocks restored (summed over ranks)."),
    "bytes_saved": ("vllm:xkv_stored_bytes", "Bytes copied from the KV cache to the card."),
    "seconds_saved": ("vllm:xkv_store_seconds", "Seconds spent storing (summed over ranks)."),
    "chunks_saved": ("vllm:xkv_stored_chunks", "Chunk shards committed to the card."),
    "chunks_reserved": ("vllm:xkv_reserved_chunks", "Chunks reserved on the card for storing."),
    "load_errors": ("vllm:xkv_load_errors", "Blocks reported to vLLM as load errors."),
    "save_errors": ("vllm:xkv_save_errors", "Chunk shards not committed (aborted or failed)."),
    "gateway_errors": ("vllm:xkv_gateway_errors",
                       "Gateway calls that failed (deadline, refusal, dead gateway)."),
    "checksum_mismatches": ("vllm:xkv_checksum_mismatches",
                            "Stored objects whose restored bytes did not match their checksums "
                            "(their blocks became load errors; reported to the gateway)."),
    "blocks_unverified": ("vllm:xkv_unverified_blocks",
                          "KV blocks restored without a checksum check (summed over ranks)."),
}
assert set(PROM_COUNTERS) == set(FIELDS)


class PromMetricsMixin:
    """``observe`` for vLLM's ``KVConnectorPromMetrics`` (the façade mixes it in; vLLM gives the
    counter class, the label names and each engine's label values)."""

    _counter_cls: Any
    _labelnames: list[str]
    per_engine_labelvalues: dict[int, list[object]]

    def _register_counters(self) -> None:
        """Every counter of every engine exists from the start (a scrape shows zeros, so
        dashboards and alerts see the series before the first restore)."""
        self._children: dict[tuple[int, str], Any] = {}
        for f, (name, doc) in PROM_COUNTERS.items():
            counter = self._counter_cls(name=name, documentation=doc, labelnames=self._labelnames)
            for idx, labels in self.per_engine_labelvalues.items():
                self._children[(idx, f)] = counter.labels(*labels)

    def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0) -> None:
        """Add one interval's ``data`` (as :class:`StatsMixin` keeps it) to the counters."""
        for f, v in (transfer_stats_data or {}).items():
            child = self._children.get((engine_idx, f))
            if v and child is not None:
                child.inc(v)
