"""Scale-out tier benchmark: Mooncake Store over TCP on loopback, one real mooncake_master.

    python bench/tier.py                          # both parts, default sizes
    python bench/tier.py --sizes 256K,4M --repeat 20 --json bench/results/tier.json

Part 1 (store): two tier backends (hosts A and B, each its own card) as the gateway runs them.
A writes objects through (batch_put_from_multi_buffers from its card); B asks existence
(batch_is_exist) and pulls them into its card (batch_get_into_multi_buffers + header and crc32
check). Per object size and batch: median latency of the Mooncake call, of the whole pull job
(call + checksum + thread hand-over), and throughput.

Part 2 (gateways): two real xkv-gateway processes. A prompt of N chunks is stored on A; the
restore on A is a LOOKUP that hits A's card; the restore on B is a LOOKUP that misses B's card,
waits for the tier (existence + pull of N objects) and hits. The page copy that follows a lookup
(card -> KV pages) is the same on both hosts and is measured once (memcpy of the chunk bytes).

Part 3 (``--parts engines``, real vLLM CPU engines on the tiny test Llama, tests/e2e's driver): time of
one ``generate`` (prefill + 1 token) of a 960-token prompt with no connector (recompute), with
the connector storing it on A, on a fresh engine of host A restoring from A's card, and on a fresh
engine of host B restoring through the tier; each engine's first prompt is a warm-up, left out. The tiny model's KV is 1 KiB per token, so this shows the fixed costs of each path, not
bandwidth.

Needs Mooncake Store (pip install 'xkv[mooncake-cpu]', libibverbs1). Numbers from a loaded
2-core machine are lower bounds; loopback TCP is not a network.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "tier"))

from mooncake_master import Master  # noqa: E402

from xkv.gateway.config import parse_size  # noqa: E402
from xkv.gateway.testing import wait_tier_result  # noqa: E402
from xkv.gateway.tier_store import (  # noqa: E402
    HEADER_BYTES,
    MooncakeBackend,
    MooncakeSettings,
    TierItem,
    layout_digest,
)


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def bench_store(master, sizes, batches, repeat, card_bytes):
    settings = MooncakeSettings(master.address, master.metadata, segment_bytes=card_bytes)
    a_card, b_card = mmap.mmap(-1, card_bytes), mmap.mmap(-1, card_bytes)
    a, b = MooncakeBackend(settings, a_card), MooncakeBackend(settings, b_card)
    a.start()
    b.start()
    while a.state != "up" or b.state != "up":
        time.sleep(0.01)
    rows = []
    try:
        for size in sizes:
            for batch in batches:
                if size * batch > card_bytes // 2:
                    continue
                digest = layout_digest("bench", f"{size}", 1, size)
                a_card[:size * batch] = os.urandom(size * batch)
                put_s, call_s, job_s, exist_s = [], [], [], []
                for r in range(repeat):
                    keys = [os.urandom(16) for _ in range(batch)]
                    src = [TierItem(digest, k, 1, size, (i * size,)) for i, k in enumerate(keys)]
                    t0 = time.perf_counter()
                    a.offer(src)
                    ok = wait_tier_result(a, "pushed")[2]
                    put_s.append(time.perf_counter() - t0)
                    assert all(ok), ok
                    names = [it.name for it in src]
                    t0 = time.perf_counter()
                    b.submit(("exists", r, names))
                    assert wait_tier_result(b, "exists")[2] == [1] * batch
                    exist_s.append(time.perf_counter() - t0)
                    dst = [TierItem(digest, k, 1, size, (card_bytes // 2 + i * size,))
                           for i, k in enumerate(keys)]
                    t0 = time.perf_counter()
                    b.submit(("pull", r, dst))
                    _, _, status, nbytes, seconds = wait_tier_result(b, "pull")
                    job_s.append(time.perf_counter() - t0)
                    call_s.append(seconds)
                    assert status == ["ok"] * batch, status
                    assert nbytes == batch * (size + HEADER_BYTES)
                    # free the pool for the next round (forced: the pull's lease is still on)
                    assert a.store.batch_remove(names, True) == [0] * batch
                moved = batch * size
                rows.append({
                    "object_bytes": size, "batch": batch, "repeat": repeat,
                    "put_ms": 1e3 * _med(put_s), "exists_ms": 1e3 * _med(exist_s),
                    "pull_call_ms": 1e3 * _med(call_s), "pull_job_ms": 1e3 * _med(job_s),
                    "pull_call_MBps": moved / _med(call_s) / 1e6,
                    "pull_job_MBps": moved / _med(job_s) / 1e6,
                    "put_MBps": moved / _med(put_s) / 1e6,
                })
                print(json.dumps(rows[-1]), flush=True)
    finally:
        a.close()
        b.close()
    return rows


def bench_gateways(master, chunk_bytes, chunks, repeat, log_dir):
    from tier_hosts import Host, store

    cap = f"{max(4 * chunk_bytes * chunks, 64 << 20)}"
    pool = f"{max(2 * chunk_bytes * chunks * repeat, 64 << 20)}"  # every round stays stored
    extra = ["--mooncake-wait-ms", "30000", "--mooncake-segment-size", pool]
    hosts = [Host(master, os.path.join(log_dir, f"bench_gateway_{n}.log"), capacity=cap,
                  extra=extra) for n in "AB"]
    a, b = hosts
    try:
        for h in hosts:
            h.wait(lambda t: t["tier_up"] == 1, what="tier up")
        la = a.client.register_layout("bench", "fp", 1, chunk_bytes).layout_id
        lb = b.client.register_layout("bench", "fp", 1, chunk_bytes).layout_id
        local, remote, again, copy = [], [], [], []
        card = a.client.map_card()
        dst = bytearray(chunk_bytes * chunks)
        for _ in range(repeat):
            keys = [os.urandom(32) for _ in range(chunks)]
            n0 = a.tier()["tier_written"]
            store(a, la, keys, 1, chunk_bytes)
            a.wait(lambda t, n0=n0: t["tier_written"] >= n0 + chunks, timeout_s=120,
                   what="write-through")
            t0 = time.perf_counter()
            r = a.client.lookup([(la, keys)])
            local.append(time.perf_counter() - t0)
            assert r.num_chunks == chunks
            t0 = time.perf_counter()
            for c, slots in enumerate(r.slots[0]):
                off = slots.offsets[0]
                dst[c * chunk_bytes:(c + 1) * chunk_bytes] = card[off:off + chunk_bytes]
            copy.append(time.perf_counter() - t0)
            a.client.release(r.lease_id)
            t0 = time.perf_counter()
            r = b.client.lookup([(lb, keys)], timeout_s=60)
            remote.append(time.perf_counter() - t0)
            assert r.num_chunks == chunks, r.num_chunks
            b.client.release(r.lease_id)
            t0 = time.perf_counter()
            r = b.client.lookup([(lb, keys)])
            again.append(time.perf_counter() - t0)
            b.client.release(r.lease_id)
        moved = chunk_bytes * chunks
        row = {"chunk_bytes": chunk_bytes, "chunks": chunks, "repeat": repeat,
               "a_local_lookup_ms": 1e3 * _med(local), "b_tier_lookup_ms": 1e3 * _med(remote),
               "b_second_lookup_ms": 1e3 * _med(again), "page_copy_ms": 1e3 * _med(copy),
               "a_restore_ms": 1e3 * (_med(local) + _med(copy)),
               "b_restore_ms": 1e3 * (_med(remote) + _med(copy)),
               "b_tier_MBps": moved / _med(remote) / 1e6}
        print(json.dumps(row), flush=True)
        return [row]
    finally:
        for h in hosts:
            h.stop()


def bench_engines(master, repeat, log_dir):
    sys.path.insert(0, str(ROOT / "tests" / "e2e"))
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    from e2e_harness import run_engine
    from tier_hosts import Host
    from tiny_models import ensure_model

    models = {"llama": str(ensure_model("llama"))}
    extra = ["--mooncake-wait-ms", "1500"]
    hosts = [Host(master, os.path.join(log_dir, f"bench_engine_gateway_{n}.log"),
                  capacity="256M", extra=extra) for n in "AB"]
    a, b = hosts
    try:
        for h in hosts:
            h.wait(lambda t: t["tier_up"] == 1, what="tier up")
        # prompt 0 warms each engine up (first-call costs) and is left out of the figures
        prompts = [[(7 + 31 * i + 101 * r) % 1000 + 4 for i in range(960)]
                   for r in range(repeat + 1)]
        gen = [{"op": "generate", "name": f"p{r}", "max_tokens": 1, "prompts": [{"tokens": p}]}
               for r, p in enumerate(prompts)]

        def on(h):
            return {"op": "engine", "extra": {"xkv_gateway_port": h.port}}

        steps = ([{"op": "engine", "connector": False}] + _named(gen, "recompute")
                 + [on(a)] + _named(gen, "store_a") + [on(a)] + _named(gen, "restore_a")
                 + [on(b)] + _named(gen, "restore_b"))
        res, _ = run_engine(models, "llama", (master.proc, b.port), steps,
                            extra={"chunk_size": 64}, timeout=900)
        tier_b = b.tier()  # where B's lookups spent their time
    finally:
        for h in hosts:
            h.stop()
    rows = {}
    for run in res["runs"]:
        kind, name = run["name"].split(":")
        if name == "p0":
            continue
        rows.setdefault(kind, {"seconds": [], "cached": []})
        rows[kind]["seconds"].append(run["seconds"])
        rows[kind]["cached"].append(run["cached"][0])
    out = [{"case": k, "generate_ms": 1e3 * _med(v["seconds"]), "cached_tokens": v["cached"],
            "runs": len(v["seconds"])} for k, v in rows.items()]
    out.append({"case": "gateway_b_tier", **{k: tier_b[k] for k in (
        "tier_lookups", "tier_hits", "tier_served_chunks", "tier_deadline", "tier_pull_bytes",
        "tier_pull_seconds")}})
    for row in out:
        print(json.dumps(row), flush=True)
    return out


def _named(gen, prefix):
    return [{**g, "name": f"{prefix}:{g['name']}"} for g in gen]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64K,256K,1M,4M,16M",
                   help="object sizes for part 1 (comma-separated, K/M suffixes)")
    p.add_argument("--batches", default="1,8", help="objects per call for part 1")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--chunk-bytes", type=parse_size, default="2M",
                   help="one chunk object in part 2 (Llama-3-8B: 128 KiB/token, 16 tokens = 2M)")
    p.add_argument("--chunks", type=int, default=16, help="chunks of the prompt in part 2")
    p.add_argument("--card", type=parse_size, default="512M", help="card of each host, part 1")
    p.add_argument("--parts", default="store,gateways",
                   help="which parts to run: store,gateways,engines (engines: real vLLM CPU "
                        "engines on hosts A and B, about 2 minutes)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--log-dir", default="/tmp")
    args = p.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True).stdout.strip(),
            "host": platform.node(), "cpus": os.cpu_count(),
            "loadavg_before": os.getloadavg(), "command": " ".join(sys.argv)}
    master = Master(os.path.join(args.log_dir, "bench_mooncake_master.log"),
                    lease_ttl_ms=5000).start()
    try:
        parts = set(args.parts.split(","))
        store_rows = (bench_store(master, sizes, batches, args.repeat, args.card)
                      if "store" in parts else [])
        gw_rows = (bench_gateways(master, args.chunk_bytes, args.chunks, args.repeat,
                                  args.log_dir) if "gateways" in parts else [])
        engine_rows = (bench_engines(master, min(args.repeat, 5), args.log_dir)
                       if "engines" in parts else [])
    finally:
        master.stop()
    info["loadavg_after"] = os.getloadavg()
    out = {"info": info, "store": store_rows, "gateways": gw_rows, "engines": engine_rows}
    print("\n| object | batch | put ms | exists ms | pull call ms | pull job ms | pull MB/s (call / job) |")
    print("|---|---|---|---|---|---|---|")
    for r in store_rows:
        print(f"| {r['object_bytes'] >> 10} KiB | {r['batch']} | {r['put_ms']:.2f} | "
              f"{r['exists_ms']:.2f} | {r['pull_call_ms']:.2f} | {r['pull_job_ms']:.2f} | "
              f"{r['pull_call_MBps']:.0f} / {r['pull_job_MBps']:.0f} |")
    for r in gw_rows:
        print(f"\nrestore of {r['chunks']} x {r['chunk_bytes'] >> 10} KiB: A local lookup "
              f"{r['a_local_lookup_ms']:.2f} ms, B lookup via the tier {r['b_tier_lookup_ms']:.2f} ms "
              f"({r['b_tier_MBps']:.0f} MB/s), B again {r['b_second_lookup_ms']:.2f} ms; page copy "
              f"{r['page_copy_ms']:.2f} ms -> restore A {r['a_restore_ms']:.2f} ms, "
              f"B {r['b_restore_ms']:.2f} ms")
    for r in engine_rows:
        if "generate_ms" not in r:
            print(f"engines, {r}")
            continue
        print(f"engines, {r['case']}: generate {r['generate_ms']:.1f} ms (median of {r['runs']}), "
              f"cached tokens {r['cached_tokens']}")
    print(json.dumps(info))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
