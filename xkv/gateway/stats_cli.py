"""``xkv-gateway stats``: the gateway's numbers as a table, from its STATS message.

Every row names the Prometheus series it equals (``xkv.gateway.metrics``), so the table, a
``curl .../metrics`` and the Grafana dashboard (docs/grafana-dashboard.json) read the same.
"""

from __future__ import annotations

import argparse
import json
import sys

from xkv.gateway import metrics, transport
from xkv.gateway.client import GatewayClient, GatewayUnavailable
from xkv.gateway.disk_metrics import DISK_ROWS

# (section, what, snapshot key, unit); the Prometheus series of a key is metrics.series(key)
ROWS = (
    ("card", "capacity", "capacity_bytes", "bytes"),
    ("card", "used", "used_bytes", "bytes"),
    ("card", "fill", "fill_ratio", "ratio"),
    ("card", "objects ready", "ready_objects", "count"),
    ("card", "bytes ready", "ready_bytes", "bytes"),
    ("card", "objects being written", "staged_objects", "count"),
    ("card", "layouts", "layouts", "count"),
    ("lookups", "lookups", "lookups", "count"),
    ("lookups", "chunks asked", "lookup_chunks", "count"),
    ("lookups", "chunks hit", "hit_chunks", "count"),
    ("lookups", "chunks missed", "miss_chunks", "count"),
    ("lookups", "bytes found", "hit_bytes", "bytes"),
    ("stores", "reserved", "reserved", "count"),
    ("stores", "already stored", "exists", "count"),
    ("stores", "no space", "no_space", "count"),
    ("stores", "committed", "committed", "count"),
    ("stores", "bytes stored", "stored_bytes", "bytes"),
    ("freed", "evicted (LRU)", "evicted_lru", "count"),
    ("freed", "evicted (quota)", "evicted_quota", "count"),
    ("freed", "aborted", "aborted", "count"),
    ("freed", "write TTL passed", "write_expired", "count"),
    ("freed", "reported corrupt", "corrupt_removed", "count"),
    ("freed", "corrupt reports (keys)", "corrupt_reports", "count"),
    ("leases", "live", "leases", "count"),
    ("leases", "granted", "leases_granted", "count"),
    ("leases", "released", "released", "count"),
    ("leases", "expired (TTL)", "lease_expired", "count"),
    ("events", "blocks stored", "kv_events_stored", "count"),
    ("events", "blocks removed", "kv_events_removed", "count"),
    ("events", "batches sent", "kv_event_batches", "count"),
)

# Shown only by a gateway that runs the scale-out tier (--mooncake-master): xkv/gateway/tier.py
TIER_ROWS = (
    ("tier", "connected", "tier_up", "count"),
    ("tier", "lookups that asked", "tier_lookups", "count"),
    ("tier", "lookups that could not ask", "tier_skipped", "count"),
    ("tier", "objects pulled", "tier_hits", "count"),
    ("tier", "chunks missed", "tier_misses", "count"),
    ("tier", "chunks served in time", "tier_served_chunks", "count"),
    ("tier", "objects prefetched", "tier_late_objects", "count"),
    ("tier", "bad: lost", "tier_lost", "count"),
    ("tier", "bad: corrupt", "tier_corrupt", "count"),
    ("tier", "bad: truncated", "tier_truncated", "count"),
    ("tier", "bytes pulled", "tier_pull_bytes", "bytes"),
    ("tier", "time pulling", "tier_pull_seconds", "seconds"),
    ("tier", "write-through backlog", "tier_inflight", "count"),
    ("tier", "written", "tier_written", "count"),
    ("tier", "write errors", "tier_write_errors", "count"),
    ("tier", "writes dropped", "tier_write_dropped", "count"),
)


def _human(value: float, unit: str) -> str:
    if unit == "ratio":
        return f"{100.0 * value:.1f} %"
    if unit == "seconds":
        return f"{value:.3f} s"
    if unit == "bytes":
        for div, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if value >= div:
                return f"{value / div:.2f} {name}"
        return f"{int(value)} B"
    return f"{int(value)}"


def rows(stats: dict) -> list[tuple[str, str, str, float, str]]:
    """(section, what, shown value, raw value, series) for a STATS reply's ``stats``."""
    s = metrics.derived(stats)
    out = [(sec, what, _human(s.get(key, 0), unit), s.get(key, 0), metrics.series(key))
           for sec, what, key, unit in ROWS + (TIER_ROWS if "tier_up" in s else ())
           + (DISK_ROWS if "disk_up" in s else ())]  # disk tier (issue 26)
    for prefix, sec, total in (("requests_", "requests", "xkv_gateway_requests_total"),
                               ("errors_", "errors", "xkv_gateway_errors_total")):
        for k in sorted(k for k in s if k.startswith(prefix)):
            label = "type" if sec == "requests" else "code"
            name = k[len(prefix):]
            out.append((sec, name, _human(s[k], "count"), s[k], f'{total}{{{label}="{name}"}}'))
    return out


def render_table(stats: dict, epoch: int, endpoint: str) -> str:
    table = rows(stats)
    w = [max(len(r[i]) for r in table) for i in range(3)]
    head = (f"xkv-gateway {endpoint}  epoch {epoch:016x}  up {stats.get('uptime_s', 0):.0f} s"
            + (f"  KV events on port {stats['kv_events_port']}" if "kv_events_port" in stats
               else ""))
    lines = [head, f"{'':{w[0]}}  {'what':{w[1]}}  {'value':>{w[2]}}  series",]
    prev = None
    for sec, what, shown, _raw, series in table:
        lines.append(f"{sec if sec != prev else '':{w[0]}}  {what:{w[1]}}  {shown:>{w[2]}}  {series}")
        prev = sec
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="xkv-gateway stats",
                                description="Print a running gateway's counters as a table "
                                            "(the same numbers as its /metrics).")
    p.add_argument("--host", default=None,
                   help="gateway address (default $XKV_GATEWAY_HOSTNAME, else localhost)")
    p.add_argument("--port", type=int, default=transport.DEFAULT_PORT,
                   help=f"gateway control port (default {transport.DEFAULT_PORT})")
    p.add_argument("--curve-server-key", metavar="FILE",
                   help="the gateway's public certificate, when it runs with CURVE (TCP)")
    p.add_argument("--curve-client-key", metavar="FILE",
                   help="this client's secret certificate (its public half in the gateway's "
                        "--curve-allowed-clients), with --curve-server-key")
    p.add_argument("--timeout", type=float, default=2.0, metavar="SECONDS")
    p.add_argument("--json", action="store_true",
                   help="print {series: value} as JSON instead of the table")
    args = p.parse_args(argv)
    try:
        args.host = args.host or transport.gateway_host()
    except ValueError as e:
        p.error(str(e))
    server_key = None
    if args.curve_server_key:
        import zmq.auth

        server_key = zmq.auth.load_certificate(args.curve_server_key)[0]
    try:
        with GatewayClient(args.host, args.port, timeout_s=args.timeout,
                           curve_server_key=server_key,
                           curve_client_keys=args.curve_client_key) as c:
            stats = c.stats(timeout_s=args.timeout)
            epoch, endpoint = c.epoch or 0, c.endpoint
    except GatewayUnavailable as e:
        print(f"xkv-gateway stats: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({series: raw for _s, _w, _v, raw, series in rows(stats)}, indent=1))
    else:
        print(render_table(stats, epoch, endpoint))
    return 0
