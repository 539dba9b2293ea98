"""The connector's Prometheus counters through vLLM's own path: ``build_prom_metrics`` with the
metric classes, labels and engines vLLM's ``KVConnectorProm`` passes, then ``observe`` with the
``data`` dict the scheduler forwards (``SchedulerStats.kv_connector_stats``)."""

from __future__ import annotations

import functools
import types

import pytest

pytestmark = pytest.mark.vllm


def _build(registry):
    from prometheus_client import Counter, Gauge, Histogram

    from xkv_vllm_connector.fusionx_connector import FusIOnXConnector

    types_ = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    cfg = types.SimpleNamespace(kv_transfer_config=None)
    return FusIOnXConnector.build_prom_metrics(cfg, types_, ["model_name", "engine"],
                                               {0: ["m", "0"], 1: ["m", "1"]})


def test_counters_follow_the_stats_data():
    from prometheus_client import CollectorRegistry, generate_latest
    from promtext import value

    from xkv.connector.stats import FIELDS, PROM_COUNTERS, ConnectorStats

    reg = CollectorRegistry()
    prom = _build(reg)
    text = generate_latest(reg).decode()
    for f in FIELDS:  # every series exists, at zero, for every engine before any traffic
        for e in ("0", "1"):
            assert value(text, f'{PROM_COUNTERS[f][0]}_total{{engine="{e}"}}') == 0
    a, b = ConnectorStats(), ConnectorStats()
    a.add("tokens_promised", 256)
    a.add("bytes_restored", 1 << 20)
    a.add("seconds_restored", 0.25)
    b.add("tokens_promised", 128)
    b.add("load_errors", 3)
    prom.observe(a.data, 0)
    prom.observe(b.data, 0)
    prom.observe(dict(a.data, unknown_future_field=7), 1)  # unknown keys are ignored
    prom.observe(None, 1)
    text = generate_latest(reg).decode()
    assert value(text, 'vllm:xkv_hit_tokens_total{engine="0",model_name="m"}') == 384
    assert value(text, 'vllm:xkv_hit_tokens_total{engine="1"}') == 256
    assert value(text, 'vllm:xkv_restored_bytes_total{engine="0"}') == 1 << 20
    assert value(text, 'vllm:xkv_restore_seconds_total{engine="0"}') == 0.25
    assert value(text, 'vllm:xkv_load_errors_total{engine="0"}') == 3
    assert value(text, 'vllm:xkv_load_errors_total{engine="1"}') == 0
