"""Issue 14 findings at the index level: reservation tokens, late writers, lease ownership, and
bounded work per message (eviction past leased objects, gauges without walks, no memory kept
for finished reservations)."""

from __future__ import annotations

import tracemalloc

import pytest

from xkv.gateway.index import Index, RequestError
from xkv.gateway.protocol import MAX_LAYOUTS_PER_CLIENT, ErrorCode, ReserveStatus

A = 4096


def _token(slots, shard=0):
    return (slots.offsets[shard], slots.generations[shard])


def test_commit_needs_the_token_of_the_live_reservation():
    ix = Index(8 * A, slot_alignment=A, write_ttl_s=10)
    lid = ix.register_layout("ns", "fp", 2, A).layout_id
    [(_, s)] = ix.reserve(lid, [b"k"], now=0)
    wrong_gen = (s.offsets[0], s.generations[0] + 1)
    wrong_off = (s.offsets[1], s.generations[1])  # shard 1's slot presented for shard 0
    assert ix.commit(lid, 0, [b"k"], tokens=[wrong_gen], now=1) == 0
    assert ix.commit(lid, 0, [b"k"], tokens=[wrong_off], now=1) == 0
    assert ix.abort(lid, 0, [b"k"], tokens=[wrong_gen], now=1) == 0
    assert b"k" in ix.layouts[lid].objects and ix.counters["refused_commits"] == 2
    assert ix.commit(lid, 0, [b"k"], tokens=[_token(s, 0)], now=1) == 1
    assert ix.commit(lid, 1, [b"k"], tokens=[_token(s, 1)], now=1) == 1
    assert ix.lookup([(lid, [b"k"])], now=1, lease=False)[0] == 1
    with pytest.raises(RequestError) as e:
        ix.commit(lid, 0, [b"k"], tokens=[], now=1)
    assert e.value.code == ErrorCode.BAD_REQUEST


def test_late_commit_cannot_publish_a_newer_reservation_of_the_same_key():
    ix = Index(8 * A, slot_alignment=A, write_ttl_s=10)
    lid = ix.register_layout("ns", "fp", 1, A).layout_id
    [(_, old)] = ix.reserve(lid, [b"k"], now=0)
    # COMMIT after the write deadline but before the sweep ran: refused
    assert ix.commit(lid, 0, [b"k"], tokens=[_token(old)], now=10) == 0
    ix.expire(10)
    [(status, new)] = ix.reserve(lid, [b"k"], now=11)  # another writer, same key
    assert status == ReserveStatus.OK
    assert ix.commit(lid, 0, [b"k"], tokens=[_token(old)], now=12) == 0
    assert ix.abort(lid, 0, [b"k"], tokens=[_token(old)], now=12) == 0
    assert ix.lookup([(lid, [b"k"])], now=12)[0] == 0  # the unwritten reservation stays hidden
    assert ix.commit(lid, 0, [b"k"], tokens=[_token(new)], now=12) == 1


@pytest.mark.parametrize("how", ["abort", "expire"])
def test_pages_of_dead_reservations_are_quarantined_before_reuse(how):
    ix = Index(2 * A, slot_alignment=A, write_ttl_s=10, quarantine_s=5)
    lid = ix.register_layout("ns", "fp", 1, A).layout_id
    [(_, s)] = ix.reserve(lid, [b"late"], now=0)
    gen = ix.generations[s.offsets[0] // A]
    if how == "abort":
        ix.abort(lid, 0, [b"late"], tokens=[_token(s)], now=1)
    else:
        ix.expire(10)
    assert ix.generations[s.offsets[0] // A] == gen + 1  # the late writer's own check fails
    assert ix.snapshot()["quarantined_bytes"] == A and ix.used_bytes == 0
    # A late writer may still write into those pages until deadline (10) + quarantine (5):
    # nobody else gets them before then.
    got = [ix.reserve(lid, [b"n%d" % i], now=14.9)[0][1] for i in range(2)]
    assert got[0] is not None and got[0].offsets != s.offsets and got[1] is None
    ix.expire(15)
    [(status, again)] = ix.reserve(lid, [b"n9"], now=15)
    assert status == ReserveStatus.OK and again.offsets == s.offsets
    assert again.generations[0] == gen + 1


def test_lease_ids_are_random_and_only_their_owner_releases_them():
    ix = Index(4 * A, slot_alignment=A)
    lid = ix.register_layout("ns", "fp", 1, A).layout_id
    [(_, s)] = ix.reserve(lid, [b"a", b"b"], now=0)[:1]
    ix.commit(lid, 0, [b"a", b"b"])
    ids = [ix.lookup([(lid, [b"a"])], now=0, owner=b"victim")[1] for _ in range(32)]
    assert len(set(ids)) == 32 and max(ids) > 1 << 40  # not 1, 2, 3, ...
    for lease in ids:
        assert ix.release(lease, owner=b"attacker") == 0
    assert ix.counters["refused_releases"] == 32 and ix.leased_objects == 1
    # still leased, so the attacker cannot evict it by filling the card either
    assert [st for st, _ in ix.reserve(lid, [b"x", b"y", b"z"], now=0)] == [
        ReserveStatus.OK, ReserveStatus.OK, ReserveStatus.OK]
    assert b"a" in ix.layouts[lid].objects and b"b" not in ix.layouts[lid].objects
    assert all(ix.release(lease, owner=b"victim") == 1 for lease in ids)
    assert ix.leased_objects == 0


def test_layouts_per_client_are_capped():
    ix = Index(4 * A, slot_alignment=A)
    for i in range(MAX_LAYOUTS_PER_CLIENT):
        ix.register_layout("ns", f"fp{i}", 1, A, owner=b"greedy")
    with pytest.raises(RequestError, match="per client"):
        ix.register_layout("ns", "more", 1, A, owner=b"greedy")
    ix.register_layout("ns", "fp0", 1, A, owner=b"greedy")  # known ones still resolve
    ix.register_layout("ns", "other", 1, A, owner=b"someone else")


def test_leased_objects_are_out_of_the_eviction_scan_and_gauges_need_no_walk():
    ix = Index(1001 * A, slot_alignment=A)
    lid = ix.register_layout("ns", "fp", 1, A).layout_id
    keys = [b"k%d" % i for i in range(1000)]
    ix.reserve(lid, keys, now=0)
    ix.commit(lid, 0, keys)
    leases = [ix.lookup([(lid, [k])], now=0)[1] for k in keys[:999]]
    lay = ix.layouts[lid]
    assert len(lay.lru) == 1 and len(ix.room.every) == 1  # only the unleased object is a candidate
    assert ix.snapshot()["leased_objects"] == 999 == len(
        {id(o) for h in ix._leases.values() for row in h.hits for o in row})
    assert ix.reserve(lid, [b"new1", b"new2"], now=0)[1][0] == ReserveStatus.OK  # evicts k999
    assert ix.reserve(lid, [b"new3"], now=0)[0][0] == ReserveStatus.NO_SPACE
    for lease in leases[:10]:
        ix.release(lease)
    assert ix.snapshot()["leased_objects"] == 989 and len(lay.lru) == 10


def test_finished_reservations_hold_no_memory_until_their_ttl():
    ix = Index(64 * A, slot_alignment=A, write_ttl_s=3600)
    lid = ix.register_layout("ns", "fp", 1, A).layout_id
    for i in range(500):  # warm up: the card is full and cycling by LRU
        [(_, s)] = ix.reserve(lid, [b"w%d" % i], now=0)
        ix.commit(lid, 0, [b"w%d" % i], tokens=[_token(s)], now=0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20000):
            key = b"c%d" % i
            [(_, s)] = ix.reserve(lid, [key], now=0)
            ix.commit(lid, 0, [key], tokens=[_token(s)], now=0)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert ix.pending_writes == 0
    assert grown < 200_000, f"{grown} bytes kept by 20000 finished reservations"
