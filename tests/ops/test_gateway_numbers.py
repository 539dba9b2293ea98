"""The numbers an operator reads from a gateway: /metrics, ``xkv-gateway stats`` and the Grafana
dashboard agree, and every gateway series the dashboard queries is in a scrape."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import urllib.request

import pytest
from promtext import dashboard_selectors, missing, value

from xkv.gateway import GatewayClient, GatewayError, Reservation
from xkv.gateway.testing import spawn_gateway, stop_gateway

PAGE = 4096


def _keys(n: int, tag: bytes) -> list[bytes]:
    return [hashlib.sha256(tag + i.to_bytes(4, "little")).digest() for i in range(n)]


@pytest.fixture(scope="module")
def busy_gateway():
    """A gateway with metrics and KV events after traffic of every kind: hits, misses, stores,
    LRU and quota evictions, an abort, released and expired leases, an error reply."""
    proc, port = spawn_gateway("64K", extra_args=[
        "--metrics-port", "0", "--kv-events-port", "0", "--quota", "small=8K",
        "--lease-ttl", "0.2", "--log-level", "INFO"], stderr=subprocess.PIPE)
    with GatewayClient("127.0.0.1", port, timeout_s=2.0) as c:
        lay = c.register_layout("ns", "fp", 1, PAGE).layout_id
        small = c.register_layout("small", "fp", 1, PAGE).layout_id
        keys = _keys(6, b"a")
        blocks = [([k], None) for k in keys]
        res = c.reserve(lay, keys, blocks=blocks, block_size=16, group_idx=0)
        c.commit(lay, 0, res[:5])
        c.abort(lay, 0, res[5:])
        hit = c.lookup([(lay, keys[:3] + _keys(2, b"miss"))])  # 3 hits, 2 misses
        c.release(hit.lease_id)
        c.lookup([(lay, keys[:1])])  # this lease expires
        c.reserve(lay, keys[:2])  # exists
        for k in _keys(3, b"q"):  # the quota (2 objects) evicts one
            c.commit(small, 0, c.reserve(small, [k]))
        c.reserve(lay, _keys(16, b"fill"))  # LRU evictions (the card holds 16 objects)
        with pytest.raises(GatewayError):
            c.commit(lay, 5, [Reservation(k, (0,) * 6, (0,) * 6) for k in keys])  # shard out
            # of range: an error reply
        import time

        time.sleep(0.5)
        c.ping()  # the loop wakes up and expires the lease
    url = None
    for line in iter(proc.stderr.readline, b""):
        if b"metrics http://" in line:
            url = line.decode().split("metrics ", 1)[1].split(",")[0].strip()
            break
    proc.stderr.close()
    yield proc, port, url
    stop_gateway(proc)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _stats_cli(port: int, *extra: str) -> str:
    return subprocess.run([sys.executable, "-m", "xkv.gateway", "stats", "--port", str(port),
                           *extra], capture_output=True, text=True, check=True, timeout=60).stdout


def test_cli_table_equals_the_scrape(busy_gateway):
    _, port, url = busy_gateway
    text = _scrape(url)
    table = json.loads(_stats_cli(port, "--json"))
    assert len(table) > 30
    for series, raw in table.items():
        if series.startswith("xkv_gateway_requests_total"):  # the STATS call itself counts
            continue
        assert value(text, series) == pytest.approx(raw, abs=1e-6), series
    # the traffic above, as an operator reads it
    assert value(text, "xkv_gateway_lookup_chunks_total") == 6
    assert value(text, "xkv_gateway_hit_chunks_total") == 4
    assert value(text, "xkv_gateway_miss_chunks_total") == 2
    assert value(text, "xkv_gateway_hit_bytes_total") == 4 * PAGE
    assert value(text, 'xkv_gateway_freed_objects_total{reason="quota"}') == 1
    assert value(text, 'xkv_gateway_freed_objects_total{reason="abort"}') == 1
    assert value(text, 'xkv_gateway_freed_objects_total{reason="lru"}') >= 5
    assert value(text, "xkv_gateway_stored_bytes_total") == 8 * PAGE
    assert value(text, "xkv_gateway_leases_granted_total") == 2
    assert value(text, "xkv_gateway_leases_released_total") == 1
    assert value(text, "xkv_gateway_lease_expired_total") == 1
    assert value(text, 'xkv_gateway_kv_events_total{type="stored"}') == 8
    assert value(text, 'xkv_gateway_kv_events_total{type="removed"}') >= 6
    # full, but for the aborted object's page: quarantined (late writers), neither used nor free
    assert value(text, "xkv_gateway_quarantined_bytes") == PAGE
    assert value(text, "xkv_gateway_card_fill_ratio") == 15 / 16
    assert value(text, 'xkv_gateway_errors_total{code="bad_request"}') == 1


def test_cli_table_reads_like_a_table(busy_gateway):
    _, port, _ = busy_gateway
    out = _stats_cli(port)
    assert out.startswith("xkv-gateway ipc://") and "KV events on port" in out
    assert "93.8 %" in out and "64.00 KiB" in out  # one page quarantined (see above)
    row = next(ln for ln in out.splitlines() if "chunks missed" in ln)
    assert row.split()[-2:] == ["2", "xkv_gateway_miss_chunks_total"]
    r = subprocess.run([sys.executable, "-m", "xkv.gateway", "stats", "--port", "1",
                        "--timeout", "0.2"], capture_output=True, text=True, timeout=60)
    # no gateway on port 1: exit 1 and a message naming the port and where it looked
    assert r.returncode == 1 and "no xkv gateway" in r.stderr and "port 1" in r.stderr, r.stderr


def test_dashboard_gateway_series_are_in_a_scrape(busy_gateway):
    _, _, url = busy_gateway
    sel = dashboard_selectors()
    assert sum(name.startswith("xkv_gateway_") for name, _ in sel) >= 15
    assert missing(_scrape(url), sel, "xkv_gateway_") == []
