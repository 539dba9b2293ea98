"""CORRUPT (issue 25): a client whose restore found bytes that did not match their checksum words
reports the object by its token; the gateway removes the live committed object with exactly that
token at once, refuses stale tokens (never removes a newer object), keeps the pages of a leased
object until the last lease goes (never handing them to a writer before), warns (rate-limited)
naming namespace and key, and counts reports and removals in STATS and the metrics."""

from __future__ import annotations

import logging
import os
import random
import socket
import tempfile
import urllib.request

import pytest

from xkv.gateway import ChunkRef, ErrorCode, GatewayClient, GatewayError
from xkv.gateway import protocol as P
from xkv.gateway.corrupt import CorruptWarnings
from xkv.gateway.index import Index, RequestError
from xkv.gateway.testing import spawn_gateway, stop_gateway

A = 64


def _store(ix: Index, lid: int, keys, now: float = 0.0):
    """Reserve and commit every shard of ``keys``; returns their ChunkSlots."""
    out = ix.reserve(lid, keys, now=now)
    slots = [s for _, s in out]
    assert all(s is not None for s in slots)
    for r in range(ix.layouts[lid].num_shards):
        assert ix.commit(lid, r, keys, tokens=[(s.offsets[r], s.generations[r]) for s in slots],
                         now=now) == len(keys)
    return slots


def _tok(slots, shard=0):
    return (slots.offsets[shard], slots.generations[shard])


def test_live_token_removes_the_object_and_frees_its_pages():
    ix = Index(8 * A, slot_alignment=A)
    lid = ix.register_layout("ns", "fp", 2, A).layout_id
    s = _store(ix, lid, [b"a", b"b"])
    used = ix.used_bytes
    gens = [ix.generations[o // A] for o in s[0].offsets]
    removed = ix.corrupt(lid, 1, [b"a"], [_tok(s[0], 1)])
    assert [o.key for o in removed] == [b"a"]
    assert ix.lookup([(lid, [b"a"])], now=0)[0] == 0
    assert ix.lookup([(lid, [b"b"])], now=0, lease=False)[0] == 1
    assert [ix.generations[o // A] for o in s[0].offsets] == [g + 1 for g in gens]
    assert ix.used_bytes == used - 2 * A and ix.ready_objects == 1
    snap = ix.snapshot()
    assert snap["corrupt_reports"] == 1 and snap["corrupt_removed"] == 1
    assert snap["corrupt_held_objects"] == 0
    # the same report again: nothing left to remove
    assert ix.corrupt(lid, 1, [b"a"], [_tok(s[0], 1)]) == []
    assert ix.snapshot()["corrupt_reports"] == 2 and ix.snapshot()["corrupt_removed"] == 1


def test_tokens_that_match_nothing_are_refused():
    ix = Index(16 * A, slot_alignment=A)
    lid = ix.register_layout("ns", "fp", 2, A).layout_id
    s = _store(ix, lid, [b"a"])
    staged = ix.reserve(lid, [b"staged"], now=0)[0][1]
    ix.commit(lid, 0, [b"staged"], tokens=[_tok(staged, 0)], now=0)  # one shard of two
    off, gen = _tok(s[0], 0)
    for key, token, shard in [
        (b"a", (off, gen + 1), 0),  # future generation
        (b"a", (off + A, gen), 0),  # another slot
        (b"a", _tok(s[0], 0), 1),  # shard 0's token presented for shard 1
        (b"absent", (off, gen), 0),
        (b"staged", _tok(staged, 0), 0),  # not committed: a writer's business, not a reader's
        (b"staged", _tok(staged, 1), 1),
    ]:
        assert ix.corrupt(lid, shard, [key], [token]) == []
    assert ix.lookup([(lid, [b"a"])], now=0, lease=False)[0] == 1
    assert ix.snapshot()["corrupt_removed"] == 0 and ix.snapshot()["corrupt_reports"] == 6
    with pytest.raises(RequestError) as e:
        ix.corrupt(lid, 2, [b"a"], [(off, gen)])
    assert e.value.code == ErrorCode.BAD_REQUEST and "shard 2" in str(e.value)
    with pytest.raises(RequestError) as e:
        ix.corrupt(lid, 0, [b"a", b"b"], [(off, gen)])
    assert e.value.code == ErrorCode.BAD_REQUEST
    with pytest.raises(RequestError) as e:
        ix.corrupt(99, 0, [b"a"], [(off, gen)])
    assert e.value.code == ErrorCode.UNKNOWN_LAYOUT
    assert ix.snapshot()["corrupt_reports"] == 6  # refused requests count nothing


def test_stale_report_after_the_slot_was_reused_keeps_the_new_object():
    ix = Index(2 * A, slot_alignment=A)  # room for two one-slot objects
    lid = ix.register_layout("ns", "fp", 1, A).layout_id
    a = _store(ix, lid, [b"a"])[0]
    _store(ix, lid, [b"b"])
    old = _tok(a)
    assert ix.corrupt(lid, 0, [b"a"], [old])  # removed: its slot is free again
    a2 = _store(ix, lid, [b"a"])[0]  # the same key, stored again in the same slot
    assert a2.offsets == a.offsets and a2.generations[0] == a.generations[0] + 1
    assert ix.corrupt(lid, 0, [b"a"], [old]) == []  # the late duplicate report
    assert ix.lookup([(lid, [b"a"])], now=0, lease=False)[0] == 1
    # another key in a reused slot: the old token names neither
    ix.corrupt(lid, 0, [b"a"], [_tok(a2)])
    c = _store(ix, lid, [b"c"])[0]
    assert c.offsets == a.offsets
    assert ix.corrupt(lid, 0, [b"c", b"a"], [old, old]) == []
    assert ix.corrupt(lid, 0, [b"c"], [_tok(a2)]) == []
    assert ix.lookup([(lid, [b"c"])], now=0, lease=False)[0] == 1


def test_leased_object_leaves_the_index_but_keeps_its_pages_until_released():
    ix = Index(4 * A, slot_alignment=A)  # two objects of two slots
    lid = ix.register_layout("ns", "fp", 2, A).layout_id
    a = _store(ix, lid, [b"a"])[0]
    _store(ix, lid, [b"b"])
    num, lease, _ = ix.lookup([(lid, [b"a"])], now=0, owner=b"reader")
    assert num == 1 and lease
    assert [o.key for o in ix.corrupt(lid, 0, [b"a"], [_tok(a)])] == [b"a"]
    assert ix.lookup([(lid, [b"a"])], now=0, lease=False)[0] == 0  # gone from the index
    assert ix.snapshot()["corrupt_held_objects"] == 1 and ix.ready_objects == 1
    assert ix.generations[a.offsets[0] // A] == a.generations[0] + 1  # the reader sees it moved
    # a writer needs room: b is evicted, a's pages are not handed out
    got = ix.reserve(lid, [b"c"], now=0)[0][1]
    assert got is not None and not set(got.offsets) & set(a.offsets)
    assert ix.reserve(lid, [b"d"], now=0)[0][0] == P.ReserveStatus.NO_SPACE
    assert ix.release(lease, b"reader") == 1  # the last holder: pages free now
    assert ix.snapshot()["corrupt_held_objects"] == 0
    d = ix.reserve(lid, [b"a"], now=0)[0][1]
    assert d is not None and d.offsets == a.offsets and d.generations != a.generations
    assert ix.leased_objects == 0 and ix.used_bytes == 4 * A


def test_leased_by_two_and_expiring_lease_frees_once():
    ix = Index(2 * A, slot_alignment=A, lease_ttl_s=5)
    lid = ix.register_layout("ns", "fp", 1, A).layout_id
    a = _store(ix, lid, [b"a"])[0]
    l1 = ix.lookup([(lid, [b"a"])], now=0, owner=b"x")[1]
    ix.lookup([(lid, [b"a"])], now=1, owner=b"y")
    ix.corrupt(lid, 0, [b"a"], [_tok(a)])
    assert ix.release(l1, b"x") == 1
    assert ix.used_bytes == A and ix.snapshot()["corrupt_held_objects"] == 1
    ix.expire(10)  # the other lease runs out
    assert ix.used_bytes == 0 and ix.snapshot()["corrupt_held_objects"] == 0
    assert ix.alloc.used_pages == 0


def test_tier_pin_holds_the_pages_like_a_lease_and_events_announce_once():
    class Listener:
        def __init__(self):
            self.freed_keys = []

        def stored(self, obj):
            pass

        def freed(self, obj):
            self.freed_keys.append(obj.key)

    ix = Index(2 * A, slot_alignment=A)
    ix.listener = listener = Listener()
    lid = ix.register_layout("ns", "fp", 1, A).layout_id
    a = _store(ix, lid, [b"a"])[0]
    obj = ix.layouts[lid].objects[b"a"]
    ix.pin(obj)  # e.g. the disk tier writing it out
    ix.corrupt(lid, 0, [b"a"], [_tok(a)])
    assert listener.freed_keys == [b"a"] and ix.used_bytes == A
    ix.unpin(obj)
    assert listener.freed_keys == [b"a"] and ix.used_bytes == 0


def test_random_operations_never_overlap_live_and_held_pages():
    """Random reserve/commit/lookup/release/corrupt (live and stale)/expire: pages of objects
    in the index and of removed objects still leased never overlap; what was removed is never
    looked up again under its token; when every lease is gone the card's accounting balances."""
    rng = random.Random(25)
    ix = Index(24 * A, slot_alignment=A, lease_ttl_s=3, write_ttl_s=2, quarantine_s=1)
    lids = [ix.register_layout("ns", "one", 1, A).layout_id,
            ix.register_layout("ns", "two", 2, A).layout_id]
    tokens, leases, removed = {}, [], set()
    now = 0.0
    for _ in range(3000):
        now += rng.random() * 0.05
        lid = rng.choice(lids)
        key = b"k%d" % rng.randrange(12)
        op = rng.random()
        if op < 0.3:
            for _st, s in ix.reserve(lid, [key], now=now):
                if s is not None:
                    for r in range(ix.layouts[lid].num_shards):
                        ix.commit(lid, r, [key], tokens=[_tok(s, r)], now=now)
                    tokens[(lid, key)] = s
        elif op < 0.55:
            num, lease, hits = ix.lookup([(lid, [key])], now=now, owner=b"o")
            if num:
                hit = hits[0][0].slots
                assert (lid, key, hit.offsets, hit.generations) not in removed
            if lease:
                leases.append(lease)
        elif op < 0.7 and leases:
            ix.release(leases.pop(rng.randrange(len(leases))), b"o")
        elif op < 0.95 and (lid, key) in tokens:
            s = tokens[(lid, key)]
            shard = rng.randrange(ix.layouts[lid].num_shards)
            for obj in ix.corrupt(lid, shard, [key], [_tok(s, shard)]):
                removed.add((lid, key, obj.slots.offsets, obj.slots.generations))
        else:
            ix.expire(now)
        pages: dict[int, object] = {}
        for lay in ix.layouts.values():
            for obj in lay.objects.values():
                for p in range(obj.start, obj.start + lay.object_pages):
                    assert p not in pages, "two objects share a page"
                    pages[p] = obj
    for lease in leases:
        ix.release(lease, b"o")
    ix.expire(now + 100)
    assert ix.snapshot()["corrupt_held_objects"] == 0 and ix.leased_objects == 0
    assert ix.used_bytes == ix.ready_bytes + ix.staged_bytes
    assert ix.snapshot()["corrupt_removed"] == len(removed) > 50


def test_warnings_are_rate_limited(caplog):
    t = [0.0]
    w = CorruptWarnings(per_window=3, window_s=10.0, clock=lambda: t[0])

    class Lay:
        namespace = "tenant-a"

    class Removed:
        layout = Lay()

        def __init__(self, key):
            self.key = key

    with caplog.at_level(logging.WARNING, logger="xkv.gateway"):
        w.removed([Removed(bytes([i]) * 32) for i in range(100)])
        assert len(caplog.records) == 3 and w.suppressed == 97
        msg = caplog.records[0].getMessage()
        assert "'tenant-a'" in msg and ("00" * 16 + "...") in msg
        t[0] = 10.5
        w.removed([Removed(b"\xab" * 8)])
    assert len(caplog.records) == 5
    assert "97 more objects" in caplog.records[3].getMessage()
    assert "abababababababab from" in caplog.records[4].getMessage()


# ------------------------------------------------------------------ over the socket


def test_report_from_another_client_stats_metrics_and_warning(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        mport = s.getsockname()[1]
    log_path = tmp_path / "gw.log"
    with open(log_path, "w") as err:
        proc, port = spawn_gateway("4M", extra_args=["--metrics-port", str(mport)], stderr=err)
    try:
        with GatewayClient("localhost", port, timeout_s=5.0) as writer, \
                GatewayClient("localhost", port, timeout_s=5.0) as reader, \
                GatewayClient("localhost", port, timeout_s=5.0) as other:
            info = writer.register_layout("tenant-x", "fp", 2, 1000, check_words=2)
            lid = info.layout_id
            for c in (reader, other):
                assert c.register_layout("tenant-x", "fp", 2, 1000, check_words=2).layout_id == lid
            keys = [bytes([7]) * 32, b"second"]
            res = writer.reserve(lid, keys)
            for r in range(2):
                writer.commit(lid, r, res, checksums=[b"\1" * 8, b"\2" * 8])
            found = reader.lookup([(lid, keys)])
            assert found.num_chunks == 2
            refs = [ChunkRef.at(k, sl) for k, sl in zip(keys, found.slots[0], strict=True)]
            with pytest.raises(TypeError):
                other.report_corrupt(lid, 0, [keys[0]])
            assert other.report_corrupt(lid, 1, refs[:1]) == 1  # another client's report counts
            assert other.report_corrupt(lid, 1, refs[:1]) == 0  # stale now
            ack = other._call(P.Corrupt(other.epoch, lid, 0, [keys[1]], [refs[1].offsets[0]],
                                        [refs[1].generations[0] + 1]), P.Ack, 5.0)
            assert (ack.count, ack.refused) == (0, 1)
            assert reader.lookup([(lid, keys)], lease=False).num_chunks == 0
            assert reader.lookup([(lid, keys[1:])], lease=False).num_chunks == 1
            with pytest.raises(GatewayError) as e:
                other._call(P.Corrupt(other.epoch, lid, 5, [keys[1]], [0], [0]), P.Ack, 5.0)
            assert e.value.code == ErrorCode.BAD_REQUEST
            stats = reader.stats()
            assert stats["corrupt_reports"] == 3 and stats["corrupt_removed"] == 1
            assert stats["corrupt_held_objects"] == 1  # the reader's lease holds its pages
            reader.release(found.lease_id)
            assert reader.stats()["corrupt_held_objects"] == 0
            text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics",
                                          timeout=5).read().decode()
            assert "xkv_gateway_corrupt_reports_total 3" in text
            assert "xkv_gateway_corrupt_removed_total 1" in text
            assert 'xkv_gateway_requests_total{type="corrupt"} 4' in text
    finally:
        stop_gateway(proc)
    logged = log_path.read_text()
    lines = [ln for ln in logged.splitlines() if "did not match their checksums" in ln]
    assert len(lines) == 1 and "'tenant-x'" in lines[0] and "07" * 16 + "..." in lines[0]


def test_hostile_flood_is_bounded_and_removes_nothing_live(tmp_path):
    """A client floods CORRUPT with guessed tokens (every key of the request, at the key cap)
    and with the real keys under wrong generations: each request is one bounded pass over its
    keys, the live objects survive, other clients keep being served, the log stays short."""
    err_path = os.path.join(tempfile.mkdtemp(dir=tmp_path), "gw.log")
    with open(err_path, "w") as err:
        proc, port = spawn_gateway("4M", stderr=err)
    try:
        with GatewayClient("localhost", port, timeout_s=10.0) as victim, \
                GatewayClient("localhost", port, timeout_s=10.0) as hostile:
            lid = victim.register_layout("ns", "fp", 1, 4096).layout_id
            hostile.register_layout("ns", "fp", 1, 4096)
            keys = [b"live%d" % i for i in range(40)]
            res = victim.reserve(lid, keys)
            victim.commit(lid, 0, res)
            found = victim.lookup([(lid, keys)], lease=False)
            offs = found.offsets[0]
            rng = random.Random(9)
            for i in range(12):
                n = P.MAX_KEYS
                ks = [keys[j % 40] if i % 2 else os.urandom(32) for j in range(n)]
                os_ = [rng.choice(offs) for _ in range(n)]
                gs = [rng.randrange(1, 1 << 40) for _ in range(n)]  # never the live one (0)
                ack = hostile._call(P.Corrupt(hostile.epoch, lid, 0, ks, os_, gs), P.Ack, 10.0)
                assert (ack.count, ack.refused) == (0, n)
                assert victim.ping().protocol_version == P.PROTOCOL_VERSION
            assert victim.lookup([(lid, keys)], lease=False).num_chunks == 40
            # the real tokens do remove (the reports are honoured), warnings stay bounded
            refs = [ChunkRef.at(k, sl) for k, sl in zip(keys, found.slots[0], strict=True)]
            assert hostile.report_corrupt(lid, 0, refs) == 40
            stats = victim.stats()
            assert stats["corrupt_reports"] == 12 * P.MAX_KEYS + 40
            assert stats["corrupt_removed"] == 40
    finally:
        stop_gateway(proc)
    with open(err_path) as f:
        warned = [ln for ln in f if "did not match their checksums" in ln]
    assert 1 <= len(warned) <= 10
