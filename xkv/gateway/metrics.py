"""Prometheus text exposition of the gateway's counters, served on 127.0.0.1 by http.server.

No client library: the gateway's numbers already live in plain dicts, so rendering the text format
(https://prometheus.io/docs/instrumenting/exposition_formats/) is a few lines. Names carry the
``xkv_gateway_`` prefix and base units (bytes, seconds); counters end in ``_total``.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from xkv.gateway.disk_metrics import DISK  # disk tier (issue 26)
from xkv.gateway.protocol import ErrorCode, RequestType

#: Upper bounds (seconds) of the request-duration histogram buckets; +Inf is implicit.
BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 1e-1)


class Histogram:
    """Request durations per request type (single writer: the gateway loop)."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def observe(self, kind: str, seconds: float) -> None:
        row = self.counts.get(kind)
        if row is None:
            row = self.counts[kind] = [0] * (len(BUCKETS) + 1)
            self.sums[kind] = 0.0
        row[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sums[kind] += seconds


# (metric, snapshot key, type, help, labels)
_GAUGES = (
    ("xkv_gateway_capacity_bytes", "capacity_bytes", "gauge", "Bytes of the card.", ""),
    ("xkv_gateway_used_bytes", "used_bytes", "gauge", "Bytes of the card held by objects.", ""),
    ("xkv_gateway_object_bytes", "ready_bytes", "gauge", "Bytes held by objects, by state.",
     'state="ready"'),
    ("xkv_gateway_object_bytes", "staged_bytes", "gauge", "", 'state="staged"'),
    ("xkv_gateway_objects", "ready_objects", "gauge", "Stored objects, by state.", 'state="ready"'),
    ("xkv_gateway_objects", "staged_objects", "gauge", "", 'state="staged"'),
    ("xkv_gateway_leased_objects", "leased_objects", "gauge", "Objects held by a lease.", ""),
    ("xkv_gateway_leases", "leases", "gauge", "Live leases.", ""),
    ("xkv_gateway_layouts", "layouts", "gauge", "Registered layouts.", ""),
    ("xkv_gateway_lookups_total", "lookups", "counter", "LOOKUP requests served.", ""),
    ("xkv_gateway_lookup_keys_total", "lookup_keys", "counter", "Keys asked for by lookups.", ""),
    ("xkv_gateway_hit_chunks_total", "hit_chunks", "counter", "Chunks found by lookups.", ""),
    ("xkv_gateway_reserve_results_total", "reserved", "counter", "RESERVE answers per key.",
     'result="ok"'),
    ("xkv_gateway_reserve_results_total", "exists", "counter", "", 'result="exists"'),
    ("xkv_gateway_reserve_results_total", "no_space", "counter", "", 'result="no_space"'),
    ("xkv_gateway_committed_objects_total", "committed", "counter",
     "Objects that became visible (all shards committed).", ""),
    ("xkv_gateway_freed_objects_total", "evicted_lru", "counter", "Objects freed, by reason.",
     'reason="lru"'),
    ("xkv_gateway_freed_objects_total", "evicted_quota", "counter", "", 'reason="quota"'),
    ("xkv_gateway_freed_objects_total", "aborted", "counter", "", 'reason="abort"'),
    ("xkv_gateway_freed_objects_total", "write_expired", "counter", "", 'reason="write_ttl"'),
    ("xkv_gateway_corrupt_reports_total", "corrupt_reports", "counter",
     "Keys named by CORRUPT reports (restored bytes that did not match their checksum words).",
     ""),
    ("xkv_gateway_corrupt_removed_total", "corrupt_removed", "counter",
     "Objects removed by CORRUPT reports (the other reported keys had stale tokens).", ""),
    ("xkv_gateway_corrupt_held_objects", "corrupt_held_objects", "gauge",
     "Objects removed as corrupt whose pages a lease still holds (freed at its release).", ""),
    ("xkv_gateway_lease_expired_total", "lease_expired", "counter",
     "Leases dropped by the lease TTL instead of a RELEASE.", ""),
    # operator's view (issue 16): hits and misses per chunk, bytes, fill, evictions, events
    ("xkv_gateway_lookup_chunks_total", "lookup_chunks", "counter",
     "Chunks asked for by lookups (a chunk of every group counts once).", ""),
    ("xkv_gateway_miss_chunks_total", "miss_chunks", "counter",
     "Chunks asked for and not found (after the first miss of a lookup, all count).", ""),
    ("xkv_gateway_hit_bytes_total", "hit_bytes", "counter",
     "Payload bytes of the chunks lookups found (what the readers may copy).", ""),
    ("xkv_gateway_stored_bytes_total", "stored_bytes", "counter",
     "Payload bytes of the objects that became visible.", ""),
    ("xkv_gateway_card_fill_ratio", "fill_ratio", "gauge",
     "Fraction of the card held by objects (ready and staged).", ""),
    ("xkv_gateway_leases_granted_total", "leases_granted", "counter",
     "Leases taken by lookups that found something.", ""),
    ("xkv_gateway_leases_released_total", "released", "counter",
     "Leases ended by a RELEASE.", ""),
    ("xkv_gateway_kv_events_total", "kv_events_stored", "counter",
     "KV events published, by type (0 unless --kv-events).", 'type="stored"'),
    ("xkv_gateway_kv_events_total", "kv_events_removed", "counter", "", 'type="removed"'),
    ("xkv_gateway_kv_event_batches_total", "kv_event_batches", "counter",
     "KV-event messages (batches) sent.", ""),
    ("xkv_gateway_kv_event_replays_refused_total", "kv_events_replays_refused", "counter",
     "KV-events replay requests answered empty (too many replays in progress).", ""),
    ("xkv_gateway_kv_event_replays_dropped_total", "kv_events_replays_dropped", "counter",
     "KV-events replays dropped: the reader went away or read nothing for 10 s.", ""),
    ("xkv_gateway_kv_event_subscribers", "kv_events_subscribers", "gauge",
     "Connections to the KV-events PUB socket now.", ""),
    ("xkv_gateway_kv_event_subscribers_refused_total", "kv_events_subscribers_refused",
     "counter", "KV-events subscribers shut down past the cap (events.MAX_SUBSCRIBERS).", ""),
    ("xkv_gateway_quarantined_bytes", "quarantined_bytes", "gauge",
     "Pages of expired or aborted reservations held back from reuse (late writers).", ""),
    ("xkv_gateway_refused_total", "refused_commits", "counter",
     "Keys or leases a request named but did not own, by kind.", 'kind="commit"'),
    ("xkv_gateway_refused_total", "refused_releases", "counter", "", 'kind="release"'),
    ("xkv_gateway_refused_connections_total", "refused_connections", "counter",
     "Connections refused by the peer check (other uid, key not allowed).", ""),
)

# The scale-out tier (xkv/gateway/tier.py), rendered only when the gateway runs one.
_TIER = (
    ("xkv_gateway_tier_up", "tier_up", "gauge", "1 while the Mooncake tier is connected.", ""),
    ("xkv_gateway_tier_lookups_total", "tier_lookups", "counter",
     "Lookups that missed in the card and asked Mooncake.", ""),
    ("xkv_gateway_tier_skipped_lookups_total", "tier_skipped", "counter",
     "Lookups that missed in the card and did not ask (tier down or busy).", ""),
    ("xkv_gateway_tier_deadline_total", "tier_deadline", "counter",
     "Lookups answered at --mooncake-wait-ms before Mooncake finished.", ""),
    ("xkv_gateway_tier_hits_total", "tier_hits", "counter",
     "Objects pulled from Mooncake into the card and verified.", ""),
    ("xkv_gateway_tier_misses_total", "tier_misses", "counter",
     "Chunks asked of Mooncake and not served: absent, or failed in the pull.", ""),
    ("xkv_gateway_tier_served_chunks_total", "tier_served_chunks", "counter",
     "Hit chunks that lookups got from Mooncake within their wait.", ""),
    ("xkv_gateway_tier_late_objects_total", "tier_late_objects", "counter",
     "Objects pulled after their lookup was answered (prefetched for the next one).", ""),
    ("xkv_gateway_tier_bad_objects_total", "tier_lost", "counter",
     "Pulls that were a miss, by reason.", 'reason="lost"'),
    ("xkv_gateway_tier_bad_objects_total", "tier_corrupt", "counter", "", 'reason="corrupt"'),
    ("xkv_gateway_tier_bad_objects_total", "tier_truncated", "counter", "",
     'reason="truncated"'),
    ("xkv_gateway_tier_bad_objects_total", "tier_pull_errors", "counter", "", 'reason="error"'),
    ("xkv_gateway_tier_pull_bytes_total", "tier_pull_bytes", "counter",
     "Bytes pulled from Mooncake (verified objects, headers included).", ""),
    ("xkv_gateway_tier_pull_seconds_total", "tier_pull_seconds", "counter",
     "Seconds spent in Mooncake pull calls.", ""),
    ("xkv_gateway_tier_write_backlog", "tier_inflight", "gauge",
     "Objects queued or being written through to Mooncake.", ""),
    ("xkv_gateway_tier_written_total", "tier_written", "counter",
     "Write-through results, by outcome.", 'result="ok"'),
    ("xkv_gateway_tier_written_total", "tier_write_errors", "counter", "", 'result="error"'),
    ("xkv_gateway_tier_written_total", "tier_write_dropped", "counter", "",
     'result="dropped"'),
    ("xkv_gateway_tier_write_bytes_total", "tier_write_bytes", "counter",
     "Bytes written through to Mooncake.", ""),
)


def series(key: str) -> str:
    """The Prometheus series (name and labels) that shows snapshot key ``key``: the one mapping
    the scrape, ``xkv-gateway stats`` and the dashboard share. ``KeyError`` for an unknown key."""
    for name, k, _kind, _help, lab in _GAUGES + _TIER + DISK:
        if k == key:
            return f"{name}{{{lab}}}" if lab else name
    raise KeyError(f"{key!r}: no gateway metric shows this snapshot key")


def derived(snapshot: dict) -> dict:
    """The snapshot plus the numbers computed from it (O(1)): misses, LRU-only evictions, fill,
    leases granted."""
    s = dict(snapshot)
    s["miss_chunks"] = s.get("lookup_chunks", 0) - s.get("hit_chunks", 0)
    s["evicted_lru"] = s.get("evicted", 0) - s.get("evicted_quota", 0)
    s["fill_ratio"] = round(s.get("used_bytes", 0) / max(s.get("capacity_bytes", 0), 1), 6)
    s["leases_granted"] = s.get("released", 0) + s.get("lease_expired", 0) + s.get("leases", 0)
    return s


def render(snapshot: dict, requests: dict[str, int], errors: dict[str, int], hist: Histogram,
           info: dict[str, str]) -> str:
    out: list[str] = []
    snapshot = derived(snapshot)
    # every type and code from the start: a series that appears only at its first error would
    # show "no data" instead of 0 on a dashboard
    requests = {t.name.lower(): 0 for t in RequestType} | requests
    errors = {c.name.lower(): 0 for c in ErrorCode} | errors
    labels = ",".join(f'{k}="{v}"' for k, v in info.items())
    out += ["# HELP xkv_gateway_info Gateway identity (value is always 1).",
            "# TYPE xkv_gateway_info gauge", f"xkv_gateway_info{{{labels}}} 1"]
    seen: set[str] = set()
    tiers = (_TIER if "tier_up" in snapshot else ()) + (DISK if "disk_up" in snapshot else ())
    for name, key, kind, help_, lab in _GAUGES + tiers:
        if name not in seen:
            seen.add(name)
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        out.append(f"{name}{{{lab}}} {snapshot.get(key, 0)}" if lab else f"{name} {snapshot.get(key, 0)}")
    out += ["# HELP xkv_gateway_uptime_seconds Seconds since the gateway started.",
            "# TYPE xkv_gateway_uptime_seconds gauge",
            f"xkv_gateway_uptime_seconds {snapshot.get('uptime_s', 0.0):.3f}"]
    out += ["# HELP xkv_gateway_requests_total Requests received, by type.",
            "# TYPE xkv_gateway_requests_total counter"]
    out += [f'xkv_gateway_requests_total{{type="{k}"}} {v}' for k, v in sorted(requests.items())]
    out += ["# HELP xkv_gateway_errors_total Error replies sent, by code.",
            "# TYPE xkv_gateway_errors_total counter"]
    out += [f'xkv_gateway_errors_total{{code="{k}"}} {v}' for k, v in sorted(errors.items())]
    out += ["# HELP xkv_gateway_request_duration_seconds Time to handle one request, by type.",
            "# TYPE xkv_gateway_request_duration_seconds histogram"]
    for kind, row in sorted(hist.counts.items()):
        total = 0
        for le, n in zip((*BUCKETS, "+Inf"), row, strict=False):
            total += n
            out.append(f'xkv_gateway_request_duration_seconds_bucket{{type="{kind}",le="{le}"}} {total}')
        out.append(f'xkv_gateway_request_duration_seconds_sum{{type="{kind}"}} {hist.sums[kind]:.6f}')
        out.append(f'xkv_gateway_request_duration_seconds_count{{type="{kind}"}} {total}')
    return "\n".join(out) + "\n"


class MetricsCopy:
    """The text /metrics serves: rendered by the gateway loop (the only thread that reads the
    index), handed to HTTP threads as a finished string."""

    def __init__(self, render_text: Callable[[], str]):
        self._render = render_text
        self._text = ""
        self._version = 0
        self._cond = threading.Condition()
        #: Set by an HTTP thread that wants a fresh copy; the loop checks it every iteration.
        self.wanted = threading.Event()

    def publish(self) -> None:
        """Loop thread: render now and wake any waiting scrape."""
        text = self._render()
        with self._cond:
            self._text = text
            self._version += 1
            self.wanted.clear()
            self._cond.notify_all()

    def get(self, wait_s: float = 1.0) -> str:
        """HTTP thread: ask the loop for a fresh rendering and wait up to ``wait_s`` for it; a
        busy loop gets the previous copy served (a scrape never touches the index)."""
        with self._cond:
            seen = self._version
            self.wanted.set()
            self._cond.wait_for(lambda: self._version != seen, wait_s)
            return self._text


#: Seconds an HTTP connection may sit idle or trickle bytes before the server drops it.
HTTP_TIMEOUT_S = 5.0
#: Most scrapes served at once; more connections wait in the listen queue.
MAX_HTTP_THREADS = 8


def serve_metrics(port: int, text: Callable[[], str],
                  allowed_uids: set[int] | None = None) -> ThreadingHTTPServer:
    """Serve ``text()`` at http://127.0.0.1:port/metrics from a daemon thread; returns the server
    (call ``shutdown()`` to stop). Port 0 picks a free port (``server.server_address[1]``).

    ``text`` must return a ready copy (it runs on an HTTP thread). With ``allowed_uids`` a
    connection whose peer process is another local user is closed without a reply."""
    from xkv.gateway.transport import tcp_peer_uid

    class Handler(BaseHTTPRequestHandler):
        timeout = HTTP_TIMEOUT_S  # socket timeout: an idle client cannot hold a thread
        protocol_version = "HTTP/1.0"  # one request per connection

        def do_GET(self) -> None:  # noqa: N802 (http.server naming)
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 64

        def __init__(self, *a):
            super().__init__(*a)
            self._slots = threading.BoundedSemaphore(MAX_HTTP_THREADS)

        def verify_request(self, request, client_address) -> bool:
            if allowed_uids is None:
                return True
            uid = tcp_peer_uid(client_address[:2], self.server_address[:2])
            return uid is not None and uid in allowed_uids

        def process_request(self, request, client_address):
            request.settimeout(HTTP_TIMEOUT_S)
            if not self._slots.acquire(timeout=HTTP_TIMEOUT_S):
                self.shutdown_request(request)
                return
            super().process_request(request, client_address)

        def process_request_thread(self, request, client_address):
            try:
                super().process_request_thread(request, client_address)
            finally:
                self._slots.release()

    server = Server(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, name="xkv-metrics", daemon=True).start()
    return server
