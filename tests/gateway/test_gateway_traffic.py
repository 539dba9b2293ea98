"""A real gateway process on loopback with several client processes writing and reading the card.

Every byte a reader copies out of the card is checked against what the writer of that key put in,
and a reader that did not hold a lease trusts its copy only if the slot generation did not move.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import random

import pytest

from xkv.gateway import GatewayClient, ReserveStatus
from xkv.gateway.testing import spawn_gateway, stop_gateway

SHARDS, SHARD_BYTES = 2, 5000  # slot = 8192 bytes: the tail of each slot is padding


def pattern(key: bytes, shard: int) -> bytes:
    seed = hashlib.blake2b(key + bytes([shard])).digest()
    return (seed * (SHARD_BYTES // len(seed) + 1))[:SHARD_BYTES]


def worker(port: int, wid: int, rounds: int, q) -> None:
    rng = random.Random(wid)
    stats = dict(written=0, exists=0, no_space=0, read_bytes=0, leased_hits=0, peek_skipped=0,
                 mismatches=0)
    try:
        with GatewayClient("127.0.0.1", port, timeout_s=5.0) as c:
            lid = c.register_layout("traffic", "fp", SHARDS, SHARD_BYTES).layout_id
            card = c.map_card()
            pool = [b"key-%03d" % i for i in range(120)]  # shared by all workers: EXISTS races
            for _ in range(rounds):
                keys = rng.sample(pool, 6)
                res = c.reserve(lid, keys)
                written = []
                for key, r, status in zip(keys, res, res.status, strict=False):
                    if r is None:
                        stats["exists" if status == ReserveStatus.EXISTS else "no_space"] += 1
                        continue
                    for shard, off in enumerate(r.offsets):
                        card[off:off + SHARD_BYTES] = pattern(key, shard)
                    written.append(r)
                # each shard commits separately, as each worker rank would
                for shard in range(SHARDS):
                    c.commit(lid, shard, written)
                stats["written"] += len(written)
                chain = rng.sample(pool, 8)
                lease = rng.random() < 0.7
                got = c.lookup([(lid, chain)], lease=lease)
                for i in range(got.num_chunks):
                    slots = got.slots[0][i]
                    for shard, off in enumerate(slots.offsets):
                        data = bytes(card[off:off + SHARD_BYTES])
                        same_gen = c.slot_generation(off) == slots.generations[shard]
                        if lease:
                            stats["mismatches"] += not same_gen  # a lease pins the generation
                        elif not same_gen:
                            stats["peek_skipped"] += 1  # slot reused meanwhile: copy untrusted
                            continue
                        stats["mismatches"] += data != pattern(chain[i], shard)
                        stats["read_bytes"] += len(data)
                    stats["leased_hits"] += lease
                if lease:
                    c.release(got.lease_id)
        q.put(stats)
    except BaseException as e:
        q.put(repr(e))
        raise


@pytest.mark.slow
def test_concurrent_clients_read_back_every_byte():
    # 1 MiB card = 64 objects of 16 KiB for 120 keys: eviction is constant.
    proc, port = spawn_gateway("1M")
    try:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(port, w, 60, q)) for w in range(4)]
        for p in procs:
            p.start()
        results = [q.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        assert all(isinstance(r, dict) for r in results), results
        total = {k: sum(r[k] for r in results) for k in results[0]}
        assert total["mismatches"] == 0, total
        assert total["written"] > 0 and total["exists"] > 0 and total["leased_hits"] > 0, total
        assert total["read_bytes"] > 100 * SHARD_BYTES, total
        with GatewayClient("127.0.0.1", port, timeout_s=2.0) as c:
            s = c.stats()
        assert s["evicted"] > 0 and s["used_bytes"] <= s["capacity_bytes"] == 1 << 20, s
        assert s["leases"] == 0, s  # every lease was released
        assert proc.poll() is None
    finally:
        assert stop_gateway(proc) == 0
