"""The disk tier beside the Mooncake tier (card -> disk -> Mooncake, xkv/gateway/disk_chain.py),
in real xkv-gateway processes on one real mooncake_master: a lookup that misses B's card is
served first from B's disk, and what the disk lacks from Mooncake, in one answer; what came
from Mooncake lands on B's disk too, so B restarted without Mooncake still serves it."""

from __future__ import annotations

import os
import time

from tier_hosts import Host, check, store

from xkv.gateway.client import GatewayClient
from xkv.gateway.testing import spawn_gateway, stop_gateway

SHARDS, SHARD_BYTES = 2, 20000


def keys(n):
    return [os.urandom(32) for _ in range(n)]


def stats_when(host, pred, timeout_s=30.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not pred(s := host.client.stats()):
        assert time.monotonic() < deadline, f"{what}: {s}"
        time.sleep(0.02)
    return s


def test_card_then_disk_then_mooncake(master, tmp_path):
    disk = ["--disk", str(tmp_path / "disk_b"), "--disk-wait-ms", "5000",
            "--mooncake-wait-ms", "5000"]
    a = Host(master, str(tmp_path / "a.log"))
    b = Host(master, str(tmp_path / "b1.log"), capacity="400K", extra=disk)
    try:
        for h in (a, b):
            h.wait(lambda t: t["tier_up"] == 1, what="tier up")
        la = a.client.register_layout("prod", "fp", SHARDS, SHARD_BYTES).layout_id
        ks = keys(4)  # stored on A: in Mooncake only
        data = store(a, la, ks, SHARDS, SHARD_BYTES)
        a.wait(lambda t: t["tier_written"] == 4 and t["tier_inflight"] == 0, what="A written")
        lb = b.client.register_layout("prod", "fp", SHARDS, SHARD_BYTES).layout_id
        xs = keys(2)  # stored on B: on B's disk (and in Mooncake)
        data.update(store(b, lb, xs, SHARDS, SHARD_BYTES))
        stats_when(b, lambda s: s["disk_written"] == 2 and s["tier_written"] == 2, what="B written")
        # fill B's card (10 objects) so it evicts xs; B stays up (its Mooncake segment may hold
        # A's objects: a restarted B would take them away)
        for _ in range(5):
            store(b, lb, keys(2), SHARDS, SHARD_BYTES)
            stats_when(b, lambda s: not s["disk_write_backlog_bytes"] and not s["tier_inflight"],
                       what="fillers written")
        s0 = b.client.stats()
        assert s0["evicted"] >= 2 and s0["ready_objects"] <= 10  # xs, the oldest, went first
        r = b.client.lookup([(lb, xs + ks)])
        assert r.num_chunks == 6  # 2 from B's disk, then 4 from Mooncake, one answer
        check(b, r, xs + ks, data, SHARD_BYTES)
        s = b.client.stats()
        assert s["disk_hits"] - s0["disk_hits"] == 2 and s["tier_hits"] - s0["tier_hits"] == 4
        assert s["lookups"] - s0["lookups"] == 1
        # what came from Mooncake is written to B's disk as well
        stats_when(b, lambda s: s["disk_written"] - s0["disk_written"] == 4
                   and not s["disk_write_backlog_bytes"], what="pulled objects on disk")
        assert b.client.release(r.lease_id) == 1
        b.stop()
        # B again without Mooncake (a gateway whose master is gone does not start in time
        # here): its disk serves what it stored and what it pulled
        proc, port = spawn_gateway("64M", extra_args=disk[:4])
        try:
            with GatewayClient("127.0.0.1", port, timeout_s=10) as c:
                lb = c.register_layout("prod", "fp", SHARDS, SHARD_BYTES).layout_id
                deadline = time.monotonic() + 30
                while not c.stats()["disk_scanned"]:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                r = c.lookup([(lb, xs + ks)])
                assert r.num_chunks == 6 and c.stats()["disk_hits"] == 6
                card = c.map_card()
                for i, k in enumerate(xs + ks):
                    for sh, off in enumerate(r.slots[0][i].offsets):
                        assert bytes(card[off:off + SHARD_BYTES]) == data[(k, sh)]
        finally:
            stop_gateway(proc)
    finally:
        a.stop()
        b.stop()
