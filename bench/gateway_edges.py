"""Gateway edges under hostile load (issue 27): KV-events replay hammered, and RESERVE on a
fragmented two-size card.

``replay``: a gateway with ``--kv-events-port 0 --kv-events-replay-port 0`` is filled with
``--batches`` kept event batches (one RESERVE+COMMIT of one key per loop pass); then a victim
client runs lease-free 1-key lookups for ``--seconds`` while ``--hammer`` DEALER sockets of
another process each send 4 replay requests from sequence 0 every 10 ms without reading. Prints
the victim's lookups completed and latency p50/p99/max, with and without the hammer, and the
gateway's CPU share while hammered (CPU seconds per second: 1.0 is a whole core).

``reserve``: the gateway's index (the work the loop does for a RESERVE; no sockets) on cards of
``--cards`` GiB at 4 KiB pages: filled with 1-page objects, every other one used again (so the
least recently used ones sit between objects that stay), then RESERVEs of one key of a 16-page
layout (64 KiB objects). Prints per-RESERVE time p50/p99/max (wall, and the thread's CPU
time: the work without preemption by other processes) and objects evicted per RESERVE, with and without one leased
object in every 64th page.

    python bench/gateway_edges.py replay [--batches 18800] [--seconds 8] [--json out.json]
    python bench/gateway_edges.py reserve [--cards 1,4] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import multiprocessing as mp
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from xkv.gateway import GatewayClient  # noqa: E402
from xkv.gateway.testing import spawn_gateway, stop_gateway  # noqa: E402

PAGE = 4096


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] if xs else float("nan")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _hammer(port: int, sockets: int, stop) -> None:
    import zmq

    ctx = zmq.Context()
    socks = []
    for _ in range(sockets):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{port}")
        socks.append(s)
    while not stop.is_set():
        for s in socks:
            for _ in range(4):
                with contextlib.suppress(zmq.Again):
                    s.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
        time.sleep(0.01)
    ctx.destroy(linger=0)


def _victim(c: GatewayClient, lay: int, key: bytes, seconds: float) -> dict:
    lat, timeouts, end = [], 0, time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        try:
            c.lookup([(lay, [key])], lease=False, timeout_s=2.0)
            lat.append(time.perf_counter() - t0)
        except Exception:  # noqa: BLE001 (a missed deadline counts as such)
            timeouts += 1
    return {"lookups": len(lat), "timeouts": timeouts, "p50_ms": _pct(lat, 0.5) * 1e3,
            "p99_ms": _pct(lat, 0.99) * 1e3, "max_ms": max(lat, default=float("nan")) * 1e3}


def bench_replay(args) -> dict:
    proc, port = spawn_gateway("64M", extra_args=["--kv-events-port", "0",
                                                  "--kv-events-replay-port", "0"])
    try:
        with GatewayClient("localhost", port, timeout_s=5.0) as c:
            lay = c.register_layout("ns", "fp", 1, PAGE).layout_id
            for i in range(args.batches):
                c.commit(lay, 0, c.reserve(lay, [hashlib.sha256(b"%d" % i).digest()]))
            st = c.stats()
            key = hashlib.sha256(b"%d" % (args.batches - 1)).digest()
            out = {"kept_batches": st["kv_event_batches"], "quiet": _victim(c, lay, key, 2.0)}
            stop = mp.Event()
            h = mp.Process(target=_hammer, args=(st["kv_events_replay_port"], args.hammer, stop))
            h.start()
            time.sleep(0.5)
            cpu0 = _cpu_s(proc.pid)
            out["hammered"] = _victim(c, lay, key, args.seconds)
            # the gateway's CPU seconds per wall second while hammered (1.0 = a whole core)
            out["hammered"]["gateway_cpu_share"] = (_cpu_s(proc.pid) - cpu0) / args.seconds
            stop.set()
            h.join()
            try:  # the old gateway may still be busy with the queued replays
                out["replays_refused"] = c.stats().get("kv_events_replays_refused")
            except Exception as e:  # noqa: BLE001
                out["stats_after"] = repr(e)[:200]
    finally:
        stop_gateway(proc)
    return out


def bench_reserve(args) -> dict:
    from xkv.gateway.index import Index

    out = {}
    for gib in [float(x) for x in args.cards.split(",")]:
        for leased in (False, True):
            n = int(gib * (1 << 30)) // PAGE
            ix = Index(n * PAGE, slot_alignment=PAGE, lease_ttl_s=1e9, write_ttl_s=1e9)
            small = ix.register_layout("a", "fp", 1, PAGE).layout_id
            big = ix.register_layout("b", "fp", 1, 16 * PAGE).layout_id
            keys = [b"s%d" % i for i in range(n)]
            for i in range(0, n, 4096):
                ix.reserve(small, keys[i:i + 4096], now=0)
                ix.commit(small, 0, keys[i:i + 4096])
            for k in keys[::2]:
                ix.lookup([(small, [k])], now=0, lease=False)
            if leased:
                ix.lookup([(small, keys[63::64])], now=0, owner=b"x")
            gc.collect()
            gc.freeze()  # as the gateway does after start-up: the fill is not what is measured
            times, cpu, evicted, ok = [], [], [], 0
            for r in range(args.reserves):
                before = ix.counters["evicted"]
                c0, t0 = time.thread_time(), time.perf_counter()
                [(status, _)] = ix.reserve(big, [b"big%d" % r], now=0)
                times.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
                evicted.append(ix.counters["evicted"] - before)
                ok += status == 0
            out[f"{gib:g}GiB{'_leased' if leased else ''}"] = {
                "objects": n, "reserves": args.reserves, "ok": ok,
                "p50_ms": _pct(times, 0.5) * 1e3, "p99_ms": _pct(times, 0.99) * 1e3,
                "max_ms": max(times) * 1e3, "evicted_max": max(evicted),
                # CPU time of this thread: the work itself, without preemption by other jobs
                "cpu_p50_ms": _pct(cpu, 0.5) * 1e3, "cpu_p99_ms": _pct(cpu, 0.99) * 1e3,
                "cpu_max_ms": max(cpu) * 1e3,
                "evicted_total": sum(evicted)}
            del ix, keys
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["replay", "reserve"])
    ap.add_argument("--batches", type=int, default=18800)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--hammer", type=int, default=8)
    ap.add_argument("--cards", default="1,4")
    ap.add_argument("--reserves", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    res = bench_replay(args) if args.what == "replay" else bench_reserve(args)
    res["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                      "load": os.getloadavg()}
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
