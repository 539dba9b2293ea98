"""What checksum words (issue 25, protocol 3) cost the gateway's control path (CPU only).

For layouts of ``--shards`` shards with 0 and with each of ``--words`` checksum words per shard,
on one gateway: leased LOOKUP latency p50/p99 (1, 64 and 256 stored keys; the RELEASE is not
timed) and the reply size, and the COMMIT rate (objects/s, batches of 64 keys, every shard
committed, the card cycling by LRU). Rows of the same key count differ only in check_words, so
the difference is the words' cost (packing, encoding, decoding, copying them).

    python bench/gateway_checksums.py [--samples 2000] [--shards 1] [--words 16 128] [--json f]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from xkv.gateway import GatewayClient  # noqa: E402
from xkv.gateway import protocol as P  # noqa: E402
from xkv.gateway.testing import spawn_gateway, stop_gateway  # noqa: E402

SHARD_BYTES = 64 << 10  # a 64 KiB slot: up to 2048 words per shard (1/8 of the slot)


def _layout(c: GatewayClient, shards: int, words: int) -> int:
    return c.register_layout("bench", f"fp-{shards}-{words}", shards, SHARD_BYTES,
                             check_words=words).layout_id


def _store(c: GatewayClient, lid: int, keys: list[bytes], shards: int, words: int) -> None:
    for i in range(0, len(keys), 64):
        res = c.reserve(lid, keys[i:i + 64])
        for r in range(shards):
            c.commit(lid, r, res, checksums=[os.urandom(4 * words) for _ in res] if words else None)


def latency(c: GatewayClient, lid: int, keys: list[bytes], samples: int) -> dict:
    for _ in range(100):
        c.release(c.lookup([(lid, keys)]).lease_id)
    times, size = [], 0
    for _ in range(samples):
        t0 = time.perf_counter()
        r = c.lookup([(lid, keys)])
        times.append(time.perf_counter() - t0)
        assert r.num_chunks == len(keys)
        size = len(r.raw_offsets[0]) * 2 + len(r.raw_checksums[0])
        c.release(r.lease_id)
    times.sort()
    return dict(keys=len(keys), p50_us=1e6 * times[len(times) // 2],
                p99_us=1e6 * times[int(len(times) * 0.99)], mean_us=1e6 * statistics.fmean(times),
                packed_reply_bytes=size)


def commit_rate(c: GatewayClient, shards: int, words: int, seconds: float) -> float:
    lid = _layout(c, shards, words)
    n, i, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        keys = [b"commit-%d-%d-%020d" % (shards, words, i + j) for j in range(64)]
        i += 64
        res = c.reserve(lid, keys)
        checks = [b"\1" * (4 * words) for _ in res] if words else None
        done = [c.commit(lid, r, res, checksums=checks) for r in range(shards)]
        n += done[-1]  # objects made visible (every shard committed)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--words", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--seconds", type=float, default=2.0, help="per commit-rate point")
    ap.add_argument("--capacity", default="512M")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    limit = SHARD_BYTES // (4 * P.CHECK_BYTES_PER_SLOT_BYTE)
    if max(args.words) > limit:
        raise SystemExit(f"--words at most {limit} with {SHARD_BYTES}-byte shards")
    proc, port = spawn_gateway(args.capacity)
    rows = []
    try:
        with GatewayClient("localhost", port, timeout_s=5.0) as c:
            for words in [0, *args.words]:
                lid = _layout(c, args.shards, words)
                keys = [b"bench-%d-%026d" % (words, i) for i in range(256)]
                _store(c, lid, keys, args.shards, words)
                for n in (1, 64, 256):
                    rows.append(dict(check_words=words, shards=args.shards,
                                     **latency(c, lid, keys[:n], args.samples)))
                rows[-1]["commits_per_s"] = commit_rate(c, args.shards, words, args.seconds)
    finally:
        stop_gateway(proc)
    print("| check_words | shards | keys | p50 µs | p99 µs | packed reply B | commits/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['check_words']} | {r['shards']} | {r['keys']} | {r['p50_us']:.0f} | "
              f"{r['p99_us']:.0f} | {r['packed_reply_bytes']} | "
              f"{r.get('commits_per_s', float('nan')):.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
