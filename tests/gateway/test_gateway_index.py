"""Index logic without sockets: unit cases, then a hypothesis state machine against a dict model."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from xkv.gateway.alloc import PageAllocator
from xkv.gateway.index import Index, RequestError
from xkv.gateway.protocol import MAX_LAYOUTS, MAX_LAYOUTS_PER_CLIENT, ErrorCode, ReserveStatus

A = 64  # small alignment keeps the pages few, so eviction and fragmentation happen often


def test_allocator_best_fit_and_coalescing():
    a = PageAllocator(10)
    x, y, z = a.alloc(3), a.alloc(3), a.alloc(4)
    assert sorted([x, y, z]) == [0, 3, 6] and a.free_pages == 0 and a.alloc(1) is None
    a.free(x, 3)
    a.free(z, 4)
    assert a.alloc(4) == z  # best fit takes the 4-page hole, not the 3-page one
    a.free(z, 4)
    a.free(y, 3)
    assert a.free_ranges() == [(0, 10)] and a.free_pages == 10


def test_register_layout_rounds_up_and_checks_shape():
    ix = Index(100 * A, slot_alignment=A)
    lay = ix.register_layout("ns", "fp", 2, 65)
    assert lay.slot_bytes == 2 * A and lay.object_pages == 4
    assert ix.register_layout("ns", "fp", 2, 65) is lay
    assert ix.register_layout("ns2", "fp", 2, 65).layout_id != lay.layout_id
    with pytest.raises(RequestError) as e:
        ix.register_layout("ns", "fp", 1, 65)
    assert e.value.code == ErrorCode.LAYOUT_MISMATCH
    with pytest.raises(RequestError) as e:
        ix.register_layout("big", "fp", 1, 101 * A)
    assert e.value.code == ErrorCode.NO_SPACE


def test_layout_count_is_bounded():
    ix = Index(100 * A, slot_alignment=A)
    for i in range(MAX_LAYOUTS):  # many clients (each may create MAX_LAYOUTS_PER_CLIENT)
        ix.register_layout("ns", f"fp{i}", 1, A, owner=b"c%d" % (i // MAX_LAYOUTS_PER_CLIENT))
    with pytest.raises(RequestError) as e:
        ix.register_layout("ns", "one-more", 1, A, owner=b"new client")
    assert e.value.code == ErrorCode.BAD_REQUEST
    assert ix.register_layout("ns", "fp0", 1, A).layout_id == 1  # known ones still resolve


def test_visible_only_after_every_shard_committed_and_first_writer_wins():
    ix = Index(64 * A, slot_alignment=A)
    lay = ix.register_layout("ns", "fp", 3, A)
    [(st0, slots)] = ix.reserve(lay.layout_id, [b"k"], now=0)
    assert st0 == ReserveStatus.OK and slots.offsets == (0, A, 2 * A)
    assert ix.reserve(lay.layout_id, [b"k"], now=0)[0][0] == ReserveStatus.EXISTS
    for shard in range(3):
        assert ix.lookup([(lay.layout_id, [b"k"])], now=0)[0] == 0
        assert ix.commit(lay.layout_id, shard, [b"k"]) == 1
    num, lease, got = ix.lookup([(lay.layout_id, [b"k", b"missing"])], now=0)
    assert num == 1 and lease and got[0][0].slots.offsets == slots.offsets
    assert ix.reserve(lay.layout_id, [b"k"], now=0)[0][0] == ReserveStatus.EXISTS


def test_namespaces_and_fingerprints_never_share_objects():
    ix = Index(64 * A, slot_alignment=A)
    lids = [ix.register_layout(ns, fp, 1, A).layout_id
            for ns, fp in (("t1", "m"), ("t2", "m"), ("t1", "m-rev2"))]
    ix.reserve(lids[0], [b"same-hash"], now=0)
    ix.commit(lids[0], 0, [b"same-hash"])
    assert ix.lookup([(lids[0], [b"same-hash"])], now=0)[0] == 1  # paired: it is stored
    for other in lids[1:]:
        assert ix.lookup([(other, [b"same-hash"])], now=0)[0] == 0
        assert ix.reserve(other, [b"same-hash"], now=0)[0][0] == ReserveStatus.OK


def test_lookup_prefix_is_common_to_all_groups():
    ix = Index(64 * A, slot_alignment=A)
    g1 = ix.register_layout("ns", "attn", 1, A).layout_id
    g2 = ix.register_layout("ns", "mamba", 1, 2 * A).layout_id
    for lid, keys in ((g1, [b"a", b"b", b"c"]), (g2, [b"a", b"c"])):
        ix.reserve(lid, keys, now=0)
        ix.commit(lid, 0, keys)
    num, _, slots = ix.lookup([(g1, [b"a", b"b", b"c"]), (g2, [b"a", b"b", b"c"])], now=0)
    assert num == 1 and len(slots[0]) == len(slots[1]) == 1
    with pytest.raises(RequestError) as e:
        ix.lookup([(g1, [b"a"]), (g2, [b"a", b"b"])], now=0)
    assert e.value.code == ErrorCode.BAD_REQUEST
    with pytest.raises(RequestError) as e:
        ix.lookup([(99, [b"a"])], now=0)
    assert e.value.code == ErrorCode.UNKNOWN_LAYOUT


def test_lru_eviction_spares_leased_and_staged_objects():
    ix = Index(3 * A, slot_alignment=A)
    lid = ix.register_layout("ns", "fp", 1, A).layout_id
    ix.reserve(lid, [b"a", b"b"], now=0)
    ix.commit(lid, 0, [b"a", b"b"])
    _, lease, _ = ix.lookup([(lid, [b"a"])], now=0)
    ix.reserve(lid, [b"staged"], now=0)
    # full: 'a' leased, 'staged' not committed, so only 'b' may go
    assert ix.reserve(lid, [b"c"], now=0)[0][0] == ReserveStatus.OK
    assert set(ix.layouts[lid].objects) == {b"a", b"staged", b"c"}
    assert ix.reserve(lid, [b"d"], now=0)[0][0] == ReserveStatus.NO_SPACE
    ix.release(lease)
    assert ix.reserve(lid, [b"d"], now=0)[0][0] == ReserveStatus.OK
    assert b"a" not in ix.layouts[lid].objects


def test_eviction_order_is_least_recently_used_across_namespaces():
    ix = Index(4 * A, slot_alignment=A)
    x = ix.register_layout("x", "fp", 1, A).layout_id
    y = ix.register_layout("y", "fp", 1, A).layout_id
    for lid, key in ((x, b"a"), (y, b"b"), (x, b"c"), (y, b"d")):
        ix.reserve(lid, [key], now=0)
        ix.commit(lid, 0, [key])
    ix.lookup([(x, [b"a"])], now=0, lease=False)  # a is now the most recently used
    _, lease, _ = ix.lookup([(y, [b"b"])], now=0)  # b: used, and leased
    ix.release(lease)
    order = []
    for key in (b"n1", b"n2", b"n3", b"n4"):
        before = {k for lay in ix.layouts.values() for k in lay.objects}
        ix.reserve(x, [key], now=0)
        order += sorted(before - {k for lay in ix.layouts.values() for k in lay.objects})
    assert order == [b"c", b"d", b"a", b"b"]


def test_generation_changes_when_a_slot_is_freed_and_ttls_expire():
    ix = Index(4 * A, slot_alignment=A, lease_ttl_s=5, write_ttl_s=10)
    lid = ix.register_layout("ns", "fp", 1, A).layout_id
    [(_, s)] = ix.reserve(lid, [b"a"], now=0)
    ix.commit(lid, 0, [b"a"])
    _, lease, [[hit]] = ix.lookup([(lid, [b"a"])], now=0)
    got = hit.slots
    ix.expire(4.9)
    assert ix.leased_objects == 1
    ix.expire(5.0)
    assert ix.leased_objects == 0 and ix.counters["lease_expired"] == 1
    assert ix.release(lease) == 0
    ix.reserve(lid, [b"w"], now=0)
    ix.expire(10.0)
    assert b"w" not in ix.layouts[lid].objects and ix.counters["write_expired"] == 1
    ix.abort(lid, 0, [b"a"])  # committed objects cannot be aborted
    assert b"a" in ix.layouts[lid].objects
    gen = ix.generations[got.offsets[0] // A]
    for k in (b"x", b"y", b"z", b"v"):  # fill the card so 'a' is evicted
        ix.reserve(lid, [k], now=11)
    assert b"a" not in ix.layouts[lid].objects and ix.generations[s.offsets[0] // A] == gen + 1


def test_namespace_quota_evicts_own_namespace_first():
    ix = Index(10 * A, slot_alignment=A, quotas={"small": 2 * A})
    big = ix.register_layout("big", "fp", 1, A).layout_id
    small = ix.register_layout("small", "fp", 1, A).layout_id
    ix.reserve(big, [b"b1"], now=0)
    ix.commit(big, 0, [b"b1"])
    for k in (b"s1", b"s2", b"s3"):
        assert ix.reserve(small, [k], now=0)[0][0] == ReserveStatus.OK
        ix.commit(small, 0, [k])
    assert ix.ns_used["small"] == 2 * A and b"b1" in ix.layouts[big].objects
    assert set(ix.layouts[small].objects) == {b"s2", b"s3"}
    ix.reserve(small, [b"s4", b"s5"], now=0)  # evict s2 and s3; s4, s5 stay staged (unevictable)
    assert ix.reserve(small, [b"s6"], now=0)[0][0] == ReserveStatus.NO_SPACE


# ------------------------------------------------------------------------ state machine

KEYS = [b"k%d" % i for i in range(6)]
LAYOUTS = [("a", "fp1", 1, A), ("a", "fp2", 2, 3 * A - 7), ("b", "fp1", 3, A)]
LEASE_TTL, WRITE_TTL = 5.0, 8.0


class M:
    """Model of one object."""

    def __init__(self, nbytes, offsets, gens, deadline):
        self.ready = False
        self.committed: set[int] = set()
        self.nbytes, self.offsets, self.gens, self.deadline = nbytes, offsets, gens, deadline
        self.leases = 0


class IndexMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.quota_b = 9 * A
        self.ix = Index(24 * A, slot_alignment=A, lease_ttl_s=LEASE_TTL, write_ttl_s=WRITE_TTL,
                        quotas={"b": self.quota_b})
        self.lays = [self.ix.register_layout(*spec) for spec in LAYOUTS]
        self.model: dict[tuple[int, bytes], M] = {}
        self.leases: dict[int, tuple[float, list[tuple[int, bytes]]]] = {}

    def _gone(self, k, m: M) -> None:
        gens = self.ix.generations
        assert all(gens[o // A] != g for o, g in zip(m.offsets, m.gens, strict=False)), "generation not bumped"
        del self.model[k]

    def _reconcile_evictions(self) -> set[str]:
        evicted_ns = set()
        for k, m in list(self.model.items()):
            if k[1] not in self.ix.layouts[k[0]].objects:
                assert m.ready and m.leases == 0, f"lost {k}: ready={m.ready} leases={m.leases}"
                evicted_ns.add(self.ix.layouts[k[0]].namespace)
                self._gone(k, m)
        return evicted_ns

    @rule(li=st.integers(0, 2), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
    def reserve(self, li, keys):
        lay = self.lays[li]
        out = self.ix.reserve(lay.layout_id, keys, self.now)
        no_space = False
        for key, (status, slots) in zip(keys, out, strict=False):
            k = (lay.layout_id, key)
            if k in self.model:  # stored before, or earlier in this same request
                assert status == ReserveStatus.EXISTS
            elif status == ReserveStatus.OK:
                assert len(slots.offsets) == lay.num_shards
                self.model[k] = M(lay.object_pages * A, slots.offsets, slots.generations,
                                  self.now + WRITE_TTL)
            else:
                assert status == ReserveStatus.NO_SPACE
                no_space = True
        self._reconcile_evictions()
        if no_space:  # everything evictable in that namespace was tried first
            assert not any(m.ready and m.leases == 0 for (lid, _), m in self.model.items()
                           if self.ix.layouts[lid].namespace == lay.namespace)

    @rule(li=st.integers(0, 2), shard=st.integers(0, 2),
          keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def commit(self, li, shard, keys):
        lay = self.lays[li]
        if shard >= lay.num_shards:
            with pytest.raises(RequestError):
                self.ix.commit(lay.layout_id, shard, keys)
            return
        expected = 0
        for key in keys:
            m = self.model.get((lay.layout_id, key))
            if m is not None and not m.ready:
                m.committed.add(shard)
                expected += 1
                m.ready = len(m.committed) == lay.num_shards
        assert self.ix.commit(lay.layout_id, shard, keys) == expected

    @rule(li=st.integers(0, 2), keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def abort(self, li, keys):
        lay = self.lays[li]
        expected = 0
        for key in keys:
            m = self.model.get((lay.layout_id, key))
            if m is not None and m.ready is False:
                expected += 1
                m.ready = None  # freed below, after the index did it
        assert self.ix.abort(lay.layout_id, 0, keys) == expected
        for k, m in list(self.model.items()):
            if m.ready is None:
                self._gone(k, m)

    @rule(lis=st.lists(st.integers(0, 2), min_size=1, max_size=3),
          keys=st.lists(st.sampled_from(KEYS), max_size=5), lease=st.booleans())
    def lookup(self, lis, keys, lease):
        lids = [self.lays[i].layout_id for i in lis]
        num, lease_id, slots = self.ix.lookup([(lid, keys) for lid in lids], self.now, lease)
        expected = 0
        for key in keys:
            ms = [self.model.get((lid, key)) for lid in lids]
            if not all(m is not None and m.ready for m in ms):
                break
            expected += 1
        assert num == expected
        held = []
        for g, lid in enumerate(lids):
            assert len(slots[g]) == num
            for c in range(num):
                m = self.model[(lid, keys[c])]
                got = slots[g][c].slots
                assert got.offsets == m.offsets and got.generations == m.gens
                held.append((lid, keys[c]))
        if num and lease:
            assert lease_id not in self.leases and lease_id > 0
            self.leases[lease_id] = (self.now + LEASE_TTL, held)
            for k in held:
                self.model[k].leases += 1
        else:
            assert lease_id == 0

    def _drop_lease(self, lease_id):
        for k in self.leases.pop(lease_id)[1]:
            self.model[k].leases -= 1

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data):
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        assert self.ix.release(lease_id) == 1
        self._drop_lease(lease_id)
        assert self.ix.release(lease_id) == 0

    @rule(dt=st.sampled_from([0.5, 2.0, LEASE_TTL, WRITE_TTL]))
    def advance(self, dt):
        self.now += dt
        self.ix.expire(self.now)
        for lease_id, (deadline, _) in list(self.leases.items()):
            if deadline <= self.now:
                self._drop_lease(lease_id)
        for k, m in list(self.model.items()):
            if not m.ready and m.deadline <= self.now:
                assert k[1] not in self.ix.layouts[k[0]].objects
                self._gone(k, m)

    @invariant()
    def index_matches_model(self):
        live = {(lay.layout_id, key): obj for lay in self.lays for key, obj in lay.objects.items()}
        assert set(live) == set(self.model)
        ranges = []
        for k, obj in live.items():
            m = self.model[k]
            assert obj.ready == m.ready and obj.leases == m.leases
            ranges.append((obj.start * A, obj.start * A + m.nbytes))
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:], strict=False)), "two objects share a slot"
        assert all(lo >= 0 and hi <= self.ix.capacity_bytes for lo, hi in ranges)
        assert self.ix.used_bytes == sum(m.nbytes for m in self.model.values())
        assert self.ix.ns_used.get("b", 0) <= self.quota_b

    @invariant()
    def leased_slots_keep_their_generation(self):
        gens = self.ix.generations
        for _, held in self.leases.values():
            for k in held:
                m = self.model[k]
                assert all(gens[o // A] == g for o, g in zip(m.offsets, m.gens, strict=False))


TestIndexMachine = IndexMachine.TestCase
