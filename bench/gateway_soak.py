"""Gateway soaks (issue 14): traffic of several engines, and the same under faults.

* ``soak``: N client processes, each like one busy engine (a scheduler and 2 TP workers on one
  connection, ~40 new prompts/s): leased lookups of a prompt chain with the connector's 50 ms deadline, reserve of
  the missing chunks, bytes written to the card, one COMMIT per shard, release; plus a scraper
  doing STATS and /metrics every 100 ms. A client counts a *turn-off* when 3 calls in a row miss
  their deadline (the connector's MAX_FAILURES rule). Target: 0 turn-offs.
* ``fault``: the same traffic with content checks while client processes are SIGKILLed at
  random, late writers (a reservation written and committed after its write TTL, with garbage)
  and a gateway restart. Every object's bytes are a hash of its key; a reader that holds a lease
  compares what it copied with the hash. Target: 0 wrong bytes.

    python bench/gateway_soak.py soak --duration 600 --clients 4
    python bench/gateway_soak.py fault --duration 120
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from xkv.gateway import GatewayClient, GatewayError, GatewayUnavailable  # noqa: E402
from xkv.gateway.testing import spawn_gateway, stop_gateway  # noqa: E402

SHARDS, SHARD_BYTES, CHUNKS = 2, 8 << 10, 16
MAX_FAILURES = 3  # the connector's rule: 3 failed calls in a row turn a rank off
#: Pause between an engine's requests: ~40 new prompts/s per engine, each a lookup of 16 chunks,
#: a reserve, two commits (one per TP rank) and a release: a busy engine's control traffic.
PACE_S = 0.025


def pattern(key: bytes, shard: int) -> bytes:
    seed = hashlib.sha256(key + bytes([shard])).digest()
    return (seed * (SHARD_BYTES // len(seed) + 1))[:SHARD_BYTES]


def engine(port: int, wid: int, seconds: float, late_writer: bool, q) -> None:
    """One engine's worth of traffic; puts ``(wid, counts so far, done)`` on ``q`` every 0.5 s
    and at the end (so an engine that is SIGKILLed still counts what it saw)."""
    rng = random.Random(wid * 7919 + os.getpid())
    st = dict(calls=0, misses=0, turn_offs=0, lookups=0, hit_chunks=0, checked_bytes=0,
              wrong_bytes=0, written=0, late_commits=0, late_applied=0, reconnects=0)
    deadline = time.monotonic() + seconds
    pool = [b"prompt-%03d" % i for i in range(40)]  # shared prefixes across engines
    c = lid = card = None
    row, fresh, next_report = 0, 0, time.monotonic() + 0.5

    def connect():
        nonlocal c, lid, card
        if c is not None:
            c.close()
        c = GatewayClient("localhost", port, timeout_s=0.05)
        lid = c.register_layout("soak", "fp", SHARDS, SHARD_BYTES, timeout_s=2.0).layout_id
        card = c.map_card(timeout_s=2.0)

    def call(fn, *a, **kw):
        nonlocal row
        st["calls"] += 1
        try:
            out = fn(*a, **kw)
            row = 0
            return out
        except GatewayUnavailable:
            st["misses"] += 1
            row += 1
            if row == MAX_FAILURES:
                st["turn_offs"] += 1
            if c._broken is not None:  # restarted gateway: a new client, as after a re-probe
                raise
            return None

    while time.monotonic() < deadline:
        time.sleep(PACE_S)
        if time.monotonic() >= next_report:
            q.put((wid, dict(st), False))
            next_report = time.monotonic() + 0.5
        try:
            if c is None or c._broken is not None:
                connect()
                st["reconnects"] += 1
            if rng.random() < 0.3:  # a new prompt: reserves, writes and evictions go on
                fresh += 1
                base = b"new-%d-%d-%d" % (wid, os.getpid(), fresh)
            else:
                base = rng.choice(pool)
            keys = [hashlib.sha256(base + b"%d" % i).digest() for i in range(CHUNKS)]
            got = call(c.lookup, [(lid, keys)])
            if got is None:
                continue
            st["lookups"] += 1
            st["hit_chunks"] += got.num_chunks
            for i in range(got.num_chunks):  # leased: the bytes must be exactly the key's
                for shard, off in enumerate(got.slots[0][i].offsets):
                    data = bytes(card[off:off + SHARD_BYTES])
                    want = pattern(keys[i], shard)
                    if data != want:
                        st["wrong_bytes"] += sum(a != b for a, b in zip(data, want, strict=True))
                    st["checked_bytes"] += SHARD_BYTES
            if got.lease_id:
                call(c.release, got.lease_id)
            missing = keys[got.num_chunks:]
            if not missing:
                continue
            res = call(c.reserve, lid, missing, timeout_s=1.0)
            if res is None:
                continue
            late = late_writer and rng.random() < 0.05
            mine = [r for r in res if r is not None]
            if late and mine:  # outlive the write TTL, then write garbage and commit
                time.sleep(1.3)
            for r in mine:
                for shard, off in enumerate(r.offsets):
                    card[off:off + SHARD_BYTES] = (b"\xee" * SHARD_BYTES if late
                                                   else pattern(r.key, shard))
            for shard in range(SHARDS):
                n = call(c.commit, lid, shard, mine, timeout_s=1.0) if mine else 0
                if late:
                    st["late_commits"] += len(mine)
                    st["late_applied"] += n or 0
            st["written"] += 0 if late else len(mine)
        except (GatewayUnavailable, GatewayError, OSError):
            time.sleep(0.05)
            try:
                connect()
                st["reconnects"] += 1
            except (GatewayError, OSError):
                time.sleep(0.2)
    q.put((wid, st, True))


def scraper(port: int, metrics_port: int, stop: threading.Event, out: dict) -> None:
    """STATS and /metrics every 100 ms (what a dashboard and a Prometheus agent add)."""
    out.update(scrapes=0, scrape_errors=0)
    while not stop.wait(0.1):
        try:
            with GatewayClient("localhost", port, timeout_s=1.0) as c:
                c.stats(timeout_s=1.0)
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).read()
            out["scrapes"] += 1
        except (GatewayError, OSError):
            out["scrape_errors"] += 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(mode: str, seconds: float, clients: int = 4, capacity: str = "16M") -> dict:
    """``mode`` "soak" or "fault"; returns the summed counts (plus scrape counts, faults)."""
    mport = _free_port()
    extra = ["--metrics-port", str(mport), "--write-ttl", "1", "--quarantine", "2",
             "--lease-ttl", "5"]
    proc, port = spawn_gateway(capacity, extra_args=extra)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    stop, scrape = threading.Event(), {}
    t = threading.Thread(target=scraper, args=(port, mport, stop, scrape), daemon=True)
    t.start()
    faults = dict(killed_clients=0, gateway_restarts=0)
    procs = [ctx.Process(target=engine, args=(port, w, seconds, mode == "fault", q))
             for w in range(clients)]
    for p in procs:
        p.start()
    latest: dict[int, dict] = {}
    done: set[int] = set()

    def drain(block_s: float = 0.0) -> None:
        import queue

        try:
            while True:
                wid, counts, finished = q.get(timeout=block_s) if block_s else q.get_nowait()
                latest[wid] = counts
                if finished:
                    done.add(wid)
                block_s = 0.0
        except queue.Empty:
            pass

    wids = list(range(clients))
    try:
        rng = random.Random(1)
        end = time.monotonic() + seconds
        restarted = False
        while mode == "fault" and time.monotonic() < end - 3:
            time.sleep(rng.uniform(1.0, 3.0))
            drain()
            victim = rng.randrange(clients)
            if procs[victim].is_alive():  # SIGKILL an engine mid-traffic; start a new one
                os.kill(procs[victim].pid, signal.SIGKILL)
                procs[victim].join()
                faults["killed_clients"] += 1
                left = max(1.0, end - time.monotonic())
                wids[victim] = 1000 + faults["killed_clients"]
                procs[victim] = ctx.Process(target=engine,
                                            args=(port, wids[victim], left, True, q))
                procs[victim].start()
            if not restarted and time.monotonic() > end - seconds / 2:
                proc.send_signal(signal.SIGKILL)  # the gateway dies; a new one takes the port
                proc.wait()
                proc, _ = spawn_gateway(capacity, port=port, extra_args=extra)
                faults["gateway_restarts"] += 1
                restarted = True
        deadline = time.monotonic() + seconds + 60
        while not set(wids) <= done and time.monotonic() < deadline:
            drain(1.0)
            if not any(p.is_alive() for p in procs):
                drain()
                break
        for p in procs:
            p.join(10)
    finally:
        stop.set()
        t.join(5)
        stop_gateway(proc)
    results = list(latest.values())
    total = {k: sum(r[k] for r in results) for k in results[0]} if results else {}
    return dict(total, engines_reported=len(done & set(wids)), **scrape, **faults)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["soak", "fault"])
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=4)
    args = ap.parse_args()
    out = run(args.mode, args.duration, args.clients)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
