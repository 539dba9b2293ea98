"""The tier inside real xkv-gateway processes: hosts A and B (separate cards and ports) on one
real mooncake_master. A lookup that misses in B's card is answered with what A wrote through,
as an ordinary hit; namespaces stay apart across hosts; a dead master costs hits, never service;
a restarted master brings hits back; bad objects are misses, counted and logged."""

from __future__ import annotations

import os
import time
import urllib.request

import pytest
from tier_hosts import check, hosts, store

SHARDS, SHARD_BYTES = 2, 20000


def keys(n):
    return [os.urandom(32) for _ in range(n)]


def layout(host) -> int:
    """The layout every test here registers (same namespace, fingerprint and shards on every host)."""
    return host.client.register_layout("prod", "fp-1", SHARDS, SHARD_BYTES).layout_id


def written_through(host, n: int):
    """``n`` fresh objects committed on ``host`` and written through to Mooncake: (layout id, keys,
    {(key, shard): bytes})."""
    la, ks = layout(host), keys(n)
    data = store(host, la, ks, SHARDS, SHARD_BYTES)
    host.wait(lambda t: t["tier_written"] == n, what="written")
    return la, ks, data


def test_b_serves_what_a_stored_and_namespaces_stay_apart(master, tmp_path):
    with hosts(master, tmp_path, extra=["--mooncake-wait-ms", "5000"]) as (a, b):
        la = layout(a)
        ks = keys(4)
        data = store(a, la, ks, SHARDS, SHARD_BYTES)
        a.wait(lambda t: t["tier_written"] == 4 and t["tier_inflight"] == 0, what="written")
        # another namespace, same fingerprint and keys, on B: asked, nothing found
        other = b.client.register_layout("staging", "fp-1", SHARDS, SHARD_BYTES).layout_id
        r = b.client.lookup([(other, ks)])
        assert r.num_chunks == 0 and r.lease_id == 0
        t = b.tier()
        assert t["tier_lookups"] == 1 and t["tier_misses"] == 4 and t["tier_hits"] == 0
        # the same namespace on B (its own layout id): every chunk, bytes equal, leased
        lb = layout(b)
        r = b.client.lookup([(lb, ks)])
        assert r.num_chunks == 4 and r.lease_id != 0
        check(b, r, ks, data, SHARD_BYTES)
        s = b.client.stats()
        assert s["tier_hits"] == 4 and s["tier_served_chunks"] == 4
        assert s["lookups"] == 2 and s["hit_chunks"] == 4 and s["leases"] == 1
        assert s["tier_written"] == 0  # pulled objects are not written back
        assert b.client.release(r.lease_id) == 1
        # now B's card has them: no second trip to Mooncake
        r = b.client.lookup([(lb, ks + keys(1))])
        assert r.num_chunks == 4 and b.tier()["tier_hits"] == 4
        assert b.tier()["tier_lookups"] == 3  # only the fifth key was asked for, and missed
        assert b.tier()["tier_asked_chunks"] == 4 + 4 + 1


def test_eviction_keeps_the_mooncake_copy(master, tmp_path):
    # A's card holds 4 objects; the 5th..8th evict the first ones, Mooncake still has them
    obj = SHARDS * 20480
    with hosts(master, tmp_path, n=1, capacity=str(4 * obj),
               extra=["--mooncake-wait-ms", "5000"]) as (a,):
        la = layout(a)
        first, second = keys(4), keys(4)
        data = store(a, la, first, SHARDS, SHARD_BYTES)
        a.wait(lambda t: t["tier_written"] == 4, what="first written")
        store(a, la, second, SHARDS, SHARD_BYTES)
        a.wait(lambda t: t["tier_written"] == 8, what="second written")
        assert a.client.stats()["evicted"] == 4
        r = a.client.lookup([(la, first[:2])])
        assert r.num_chunks == 2 and a.tier()["tier_hits"] == 2
        check(a, r, first, data, SHARD_BYTES)


def test_master_killed_then_restarted(master, tmp_path):
    with hosts(master, tmp_path, extra=["--mooncake-wait-ms", "3000"]) as (a, b):
        la = layout(a)
        lb = layout(b)
        ks = keys(6)
        data = store(a, la, ks, SHARDS, SHARD_BYTES)
        a.wait(lambda t: t["tier_written"] == 6, what="written")
        r = b.client.lookup([(lb, ks[:3])])
        assert r.num_chunks == 3
        b.client.release(r.lease_id)
        master.kill()
        # B serves its card (3 chunks) and misses the rest, without stalling; several times
        for _ in range(5):
            t0 = time.monotonic()
            r = b.client.lookup([(lb, ks)])
            assert r.num_chunks == 3, r
            assert time.monotonic() - t0 < 3.5  # never more than the wait; then at once
            check(b, r, ks, data, SHARD_BYTES)
            b.client.release(r.lease_id)
        b.wait(lambda t: t["tier_up"] == 0, what="tier down")
        t0 = time.monotonic()
        assert b.client.lookup([(lb, ks)]).num_chunks == 3
        assert time.monotonic() - t0 < 1.0  # down: not even asked (0.3 ms when idle)
        fresh = store(a, la, keys(1), SHARDS, SHARD_BYTES)  # A keeps storing into its card
        assert len(fresh) == SHARDS
        master.start()
        for h in (a, b):
            h.wait(lambda t: t["tier_up"] == 1, timeout_s=60, what="tier back up")
        # the restarted master lost its objects; new writes from A are hits on B again
        deadline = time.monotonic() + 30
        while True:
            ks2 = keys(2)
            before = a.tier()
            data2 = store(a, la, ks2, SHARDS, SHARD_BYTES)
            t = a.wait(lambda t, b0=before: t["tier_written"] + t["tier_write_errors"]
                       >= b0["tier_written"] + b0["tier_write_errors"] + 2, what="write result")
            if t["tier_written"] == before["tier_written"] + 2:
                break
            assert time.monotonic() < deadline, t  # segments re-mount about 1 s after restart
            time.sleep(0.5)
        r = b.client.lookup([(lb, ks2)])
        assert r.num_chunks == 2
        check(b, r, ks2, data2, SHARD_BYTES)
        for h in (a, b):
            log = h.log()
            assert log.count("mooncake tier down") == 1, log[-3000:]
            assert log.count("(reconnected)") == 1, log[-3000:]
        t = a.tier()  # A's write of `fresh` failed (or was dropped, once A knew): counted
        assert t["tier_write_errors"] + t["tier_write_dropped"] >= 1


def test_corrupted_object_is_a_counted_logged_miss_and_metrics(master, tmp_path):
    from mooncake_master import free_port

    from xkv.gateway.tier_store import layout_digest, mooncake_key

    port = free_port()
    with hosts(master, tmp_path, extra=["--mooncake-wait-ms", "5000"]) as (a, b):
        b.stop()
        b.__init__(master, str(tmp_path / "gateway_B2.log"),
                   extra=["--mooncake-wait-ms", "5000", "--metrics-port", str(port)])
        b.wait(lambda t: t["tier_up"] == 1)
        la = layout(a)
        ks = keys(3)
        store(a, la, ks, SHARDS, SHARD_BYTES)
        a.wait(lambda t: t["tier_written"] == 3)
        name = mooncake_key(layout_digest("prod", "fp-1", SHARDS, SHARD_BYTES), ks[1])
        hand = master.client()
        try:
            blob = bytearray(hand.get(name))
            blob[-1] ^= 0xFF
            assert hand.upsert(name, bytes(blob)) == 0
            lb = layout(b)
            r = b.client.lookup([(lb, ks)])
        finally:  # only now: the rewritten object may live in this client's own segment
            hand.close()
        assert r.num_chunks == 1  # chunk 1 is corrupt: the prefix stops before it
        t = b.tier()
        assert t["tier_corrupt"] == 1 and t["tier_hits"] == 2 and t["tier_misses"] == 1
        assert b.client.stats()["ready_objects"] == 2  # the bad one was never made visible
        assert "fails its checksum" in b.log()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for line in ("xkv_gateway_tier_up 1", "xkv_gateway_tier_hits_total 2",
                     'xkv_gateway_tier_bad_objects_total{reason="corrupt"} 1',
                     "xkv_gateway_tier_write_backlog 0", "xkv_gateway_tier_pull_bytes_total "):
            assert line in text, line
        assert "xkv_gateway_tier_pull_seconds_total" in text
        # `xkv-gateway stats` shows the same numbers, named by their series
        import json
        import subprocess
        import sys

        table = json.loads(subprocess.run(
            [sys.executable, "-m", "xkv.gateway", "stats", "--port", str(b.port), "--json"],
            capture_output=True, text=True, check=True, timeout=60).stdout)
        assert table['xkv_gateway_tier_bad_objects_total{reason="corrupt"}'] == 1
        assert table["xkv_gateway_tier_hits_total"] == 2 and table["xkv_gateway_tier_up"] == 1
        for series, raw in table.items():
            if series.startswith("xkv_gateway_tier_"):
                line = next(ln for ln in text.splitlines() if ln.startswith(series + " "))
                assert float(line.split()[-1]) == pytest.approx(raw, abs=1e-6), series


def test_write_through_off_and_backlog_full(master, tmp_path):
    with hosts(master, tmp_path, extra=["--no-mooncake-write-through"], n=1, tag="off") as (a,):
        la = layout(a)
        store(a, la, keys(2), SHARDS, SHARD_BYTES)
        time.sleep(0.3)
        t = a.tier()
        assert t["tier_written"] == 0 and t["tier_write_dropped"] == 0
    with hosts(master, tmp_path, extra=["--mooncake-backlog", "0"], n=1, tag="full") as (a,):
        la = layout(a)
        store(a, la, keys(2), SHARDS, SHARD_BYTES)
        t = a.tier()
        assert t["tier_written"] == 0 and t["tier_write_dropped"] == 2


def test_lookup_over_its_wait_is_answered_from_the_card_and_prefetches(master, tmp_path):
    # a wait of 0 ms: the lookup cannot be served by the tier, its pull becomes a prefetch
    with hosts(master, tmp_path, extra=["--mooncake-wait-ms", "0"]) as (a, b):
        la, ks, data = written_through(a, 4)
        lb = layout(b)
        r = b.client.lookup([(lb, ks)])
        assert r.num_chunks == 0 and r.lease_id == 0
        t = b.wait(lambda t: t["tier_late_objects"] == 4, what="prefetch landed")
        assert t["tier_deadline"] == 1 and t["tier_served_chunks"] == 0
        r = b.client.lookup([(lb, ks)])
        assert r.num_chunks == 4
        check(b, r, ks, data, SHARD_BYTES)
        t = b.tier()
        assert t["tier_lookups"] == 1 and t["tier_hits"] == 4  # the second one was a card hit
        s = b.client.stats()
        assert s["lookups"] == 2 and s["hit_chunks"] == 4 and s["leases"] == 1


def test_two_groups_pull_the_common_prefix(master, tmp_path):
    # a hybrid model's lookup names one layout per cache group; a chunk counts only if every
    # group has it, in Mooncake as in the card
    with hosts(master, tmp_path, extra=["--mooncake-wait-ms", "5000"]) as (a, b):
        g1a = a.client.register_layout("prod", "fp-attn", 2, 12000).layout_id
        g2a = a.client.register_layout("prod", "fp-state", 1, 30000).layout_id
        k1, k2 = keys(4), keys(4)
        d1 = store(a, g1a, k1, 2, 12000)
        d2 = store(a, g2a, k2[:2] + k2[3:], 1, 30000)  # group 2 lacks chunk 2
        a.wait(lambda t: t["tier_written"] == 7, what="written")
        g1b = b.client.register_layout("prod", "fp-attn", 2, 12000).layout_id
        g2b = b.client.register_layout("prod", "fp-state", 1, 30000).layout_id
        r = b.client.lookup([(g1b, k1), (g2b, k2)])
        assert r.num_chunks == 2
        card = b.client.map_card()
        for c in range(2):
            for s, off in enumerate(r.slots[0][c].offsets):
                assert bytes(card[off:off + 12000]) == d1[(k1[c], s)]
            off = r.slots[1][c].offsets[0]
            assert bytes(card[off:off + 30000]) == d2[(k2[c], 0)]
        t = b.tier()
        assert t["tier_hits"] == 4 and t["tier_served_chunks"] == 2 and t["tier_misses"] == 2
        assert b.client.stats()["ready_objects"] == 4  # nothing pulled past the gap


def test_secret_file_signs_and_checks_through_the_gateways(master, tmp_path):
    secret = tmp_path / "tier.secret"
    secret.write_bytes(os.urandom(24).hex().encode())
    secret.chmod(0o600)
    with hosts(master, tmp_path, extra=["--mooncake-wait-ms", "5000",
                                        "--mooncake-secret-file", str(secret)]) as (a, b):
        la, ks, data = written_through(a, 2)
        lb = layout(b)
        r = b.client.lookup([(lb, ks)])
        assert r.num_chunks == 2 and b.tier()["tier_corrupt"] == 0
        check(b, r, ks, data, SHARD_BYTES)
    # a gateway without the secret wrote them: a gateway with it refuses them
    with hosts(master, tmp_path, n=1, tag="plain",
               extra=["--mooncake-wait-ms", "5000"]) as (plain,):
        lp = plain.client.register_layout("prod", "fp-2", SHARDS, SHARD_BYTES).layout_id
        ks = keys(2)
        store(plain, lp, ks, SHARDS, SHARD_BYTES)
        plain.wait(lambda t: t["tier_written"] == 2, what="written")
        with hosts(master, tmp_path, n=1, tag="signed", extra=[
                "--mooncake-wait-ms", "5000", "--mooncake-secret-file", str(secret)]) as (s,):
            ls = s.client.register_layout("prod", "fp-2", SHARDS, SHARD_BYTES).layout_id
            assert s.client.lookup([(ls, ks)]).num_chunks == 0
            assert s.tier()["tier_corrupt"] == 2
            assert "not signed with this cluster's secret" in s.log()


def _flat(x):
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    else:
        yield x


def test_pulled_objects_are_announced_as_stored_kv_events(master, tmp_path):
    import msgspec
    import zmq

    with hosts(master, tmp_path, extra=["--mooncake-wait-ms", "5000", "--kv-events-port", "0"]
               ) as (a, b):
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{b.client.stats()['kv_events_port']}")
        try:
            def received(timeout_s):
                out, deadline = [], time.monotonic() + timeout_s
                while time.monotonic() < deadline:
                    if sub.poll(50):
                        out += list(_flat(msgspec.msgpack.decode(sub.recv_multipart()[2])))
                return out
            lb = layout(b)
            for _ in range(100):  # ZMQ's slow joiner: until B's own stores are seen
                store(b, lb, keys(1), SHARDS, SHARD_BYTES)
                if received(0.1):
                    break
            received(0.3)
            la = layout(a)
            ks = keys(3)
            store(a, la, ks, SHARDS, SHARD_BYTES)
            a.wait(lambda t: t["tier_written"] == 3, what="written")
            assert b.client.lookup([(lb, ks)]).num_chunks == 3
            seen = received(1.0)
            for k in ks:  # under the card key (its low 64 bits, vLLM's int block hashes)
                assert int.from_bytes(k, "big") & (2**64 - 1) in seen
            assert "BlockStored" in seen
        finally:
            sub.close(linger=0)
            ctx.term()
