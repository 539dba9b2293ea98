"""The card allocator (size classes over extents) and the index's bounded eviction: objects of
two sizes never fragment each other, one RESERVE evicts a bounded number of objects (NO_SPACE
past the bound), leased and staged objects are never evicted, nothing stored is torn."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from xkv.gateway.alloc import CardAllocator
from xkv.gateway.index import MAX_EVICTIONS_PER_KEY, Index
from xkv.gateway.protocol import ReserveStatus

A = 64  # bytes per page: small pages keep the cards small


def _fill_small_then_interleave(ix: Index, small: int, n: int) -> list[bytes]:
    """Fill the card with one-page objects, then use every even one, so the least recently used
    objects (the odd ones) sit between objects that stay: freeing them coalesces nothing."""
    keys = [b"s%d" % i for i in range(n)]
    for i in range(0, n, 256):
        out = ix.reserve(small, keys[i:i + 256], now=0)
        assert all(s == ReserveStatus.OK for s, _ in out)
        ix.commit(small, 0, keys[i:i + 256])
    for k in keys[::2]:
        ix.lookup([(small, [k])], now=0, lease=False)
    return keys


def test_one_reserve_on_a_fragmented_two_size_card_evicts_a_bounded_number():
    ix = Index(4096 * A, slot_alignment=A)
    small = ix.register_layout("a", "fp", 1, A).layout_id
    big = ix.register_layout("b", "fp", 1, 16 * A).layout_id
    _fill_small_then_interleave(ix, small, 4096)
    before = ix.counters["evicted"]
    [(status, slots)] = ix.reserve(big, [b"big"], now=0)
    evicted = ix.counters["evicted"] - before
    assert evicted <= MAX_EVICTIONS_PER_KEY, f"one key evicted {evicted} of 4096 objects"
    assert status == ReserveStatus.OK  # one extent drained within the bound
    # the object's 16 pages are its own: no stored object overlaps them
    mine = set(range(slots.offsets[0] // A, slots.offsets[0] // A + 16))
    for obj in ix.layouts[small].objects.values():
        assert obj.start not in mine


def test_leased_objects_are_never_evicted_and_no_space_comes_within_the_bound():
    ix = Index(4096 * A, slot_alignment=A)
    small = ix.register_layout("a", "fp", 1, A).layout_id
    big = ix.register_layout("b", "fp", 1, 16 * A).layout_id
    keys = _fill_small_then_interleave(ix, small, 4096)
    # lease one object in every extent: no extent can be emptied
    t = ix.alloc.extent_pages
    leased = {obj.key for obj in ix.layouts[small].objects.values() if obj.start % t == t - 1}
    _, lease, _ = ix.lookup([(small, sorted(leased))], now=0)
    for k in sorted(leased):
        ix.lookup([(small, [k])], now=0)
    before = ix.counters["evicted"]
    out = ix.reserve(big, [b"big0", b"big1", b"big2"], now=0)
    assert [s for s, _ in out] == [ReserveStatus.NO_SPACE] * 3
    assert ix.counters["evicted"] - before <= 3 * MAX_EVICTIONS_PER_KEY
    assert leased <= set(ix.layouts[small].objects)
    assert lease and len(keys) == 4096


def test_the_bigger_class_gets_room_within_a_few_reserves_on_a_full_card():
    """A card full of small objects: a large object (more than one extent) gets its run after
    a bounded number of NO_SPACE answers, each bounded in evictions."""
    ix = Index(4096 * A, slot_alignment=A)
    small = ix.register_layout("a", "fp", 1, A).layout_id
    huge = ix.register_layout("h", "fp", 2, 100 * A).layout_id  # 200 pages > one extent (64)
    _fill_small_then_interleave(ix, small, 4096)
    for _ in range(20):
        before = ix.counters["evicted"]
        [(status, _)] = ix.reserve(huge, [b"h"], now=0)
        assert ix.counters["evicted"] - before <= MAX_EVICTIONS_PER_KEY
        if status == ReserveStatus.OK:
            break
    else:
        raise AssertionError("the large object never found room")


sizes = st.sampled_from([1, 2, 3, 5, 8, 16, 40])


@given(st.sampled_from([1, 4, 16, 64]), st.integers(8, 300),
       st.lists(st.tuples(st.booleans(), sizes, st.integers(0, 1 << 30)), max_size=200))
def test_allocator_never_overlaps_and_gives_everything_back(extent, num_pages, ops):
    a = CardAllocator(num_pages, extent)
    live: dict[int, int] = {}  # start -> pages
    owner: dict[int, int] = {}  # page -> start
    for do_alloc, pages, pick in ops:
        if do_alloc or not live:
            start = a.alloc(pages)
            if start is None:
                continue
            assert start >= 0 and start + pages <= a.usable_pages
            for p in range(start, start + pages):
                assert p not in owner, f"page {p} handed out twice"
                owner[p] = start
            live[start] = pages
        else:
            start = sorted(live)[pick % len(live)]
            pages = live.pop(start)
            a.free(start, pages)
            for p in range(start, start + pages):
                del owner[p]
        assert a.used_pages == sum(live.values())
    for start, pages in list(live.items()):
        a.free(start, pages)
    assert a.used_pages == 0 and a.runs.free_ranges() == ([(0, a.num_extents)]
                                                           if a.num_extents else [])
    assert a._tail_free == (a.tail_pages > 0) and not a._ext


def test_a_size_class_reuses_its_own_slots_and_returns_empty_extents():
    a = CardAllocator(64, 16)  # four extents of 16 pages
    ones = [a.alloc(1) for _ in range(16)]  # exactly one extent
    assert sorted(ones) == list(range(16))
    threes = [a.alloc(3) for _ in range(5)]  # 5 slots of 3 pages in the next extent
    assert all(16 <= s < 32 for s in threes)
    for s in ones:
        a.free(s, 1)
    assert a.alloc(16) is not None and a.alloc(16) is not None and a.alloc(16) is not None
    assert a.alloc(16) is None  # 3 extents of 16-page objects + the 3-page class's one


LAYS = [("n1", 1, 1), ("n2", 1, 3), ("n1", 2, 4), ("n3", 1, 12)]  # (ns, shards, pages/shard)
KEYS = [b"k%d" % i for i in range(40)]


class BoundedEviction(RuleBasedStateMachine):
    """Two-size (and large) objects over extents of 8 pages: no two live objects share a page,
    a RESERVE evicts at most MAX_EVICTIONS_PER_KEY per key, leased and STAGED objects are never
    evicted, and an object keeps its slots and generations for as long as it is stored."""

    def __init__(self):
        super().__init__()
        self.ix = Index(512 * A, slot_alignment=A, lease_ttl_s=1e9, write_ttl_s=1e9)
        assert self.ix.alloc.extent_pages == 8
        self.lays = [self.ix.register_layout(ns, f"fp{i}", sh, pg * A)
                     for i, (ns, sh, pg) in enumerate(LAYS)]
        self.seen: dict[tuple[int, bytes], tuple] = {}
        self.leases: list[int] = []

    @rule(li=st.integers(0, 3), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6))
    def reserve(self, li, keys):
        lay = self.lays[li]
        pinned = {(o.layout.layout_id, o.key) for lay_ in self.lays for o in lay_.objects.values()
                  if o.leases or not o.ready}
        before = self.ix.counters["evicted"]
        self.ix.reserve(lay.layout_id, keys, now=0)
        assert self.ix.counters["evicted"] - before <= len(keys) * MAX_EVICTIONS_PER_KEY
        for k in pinned:
            assert k[1] in self.ix.layouts[k[0]].objects, f"evicted pinned {k}"

    @rule(li=st.integers(0, 3), keys=st.lists(st.sampled_from(KEYS), max_size=6))
    def commit(self, li, keys):
        lay = self.lays[li]
        for shard in range(lay.num_shards):
            self.ix.commit(lay.layout_id, shard, keys)

    @rule(li=st.integers(0, 3), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3),
          lease=st.booleans())
    def lookup(self, li, keys, lease):
        _, lease_id, _ = self.ix.lookup([(self.lays[li].layout_id, keys)], now=0, lease=lease)
        if lease_id:
            self.leases.append(lease_id)

    @rule(pick=st.integers(0, 100))
    def release(self, pick):
        if self.leases:
            self.ix.release(self.leases.pop(pick % len(self.leases)))

    @rule(li=st.integers(0, 3), keys=st.lists(st.sampled_from(KEYS), max_size=6))
    def abort(self, li, keys):
        self.ix.abort(self.lays[li].layout_id, 0, keys)

    @invariant()
    def no_overlap_and_stable_slots(self):
        owner: dict[int, bytes] = {}
        now_seen = {}
        for lay in self.lays:
            for key, obj in lay.objects.items():
                for p in range(obj.start, obj.start + lay.object_pages):
                    assert p not in owner, f"page {p} of {key!r} also holds {owner[p]!r}"
                    owner[p] = key
                k = (lay.layout_id, key)
                now_seen[k] = (obj.slots, id(obj))
                if k in self.seen and self.seen[k][1] == id(obj):
                    assert self.seen[k][0] == obj.slots
        self.seen = now_seen
        assert self.ix.used_bytes >= 0


TestBoundedEviction = BoundedEviction.TestCase


def test_index_quarantine_returns_pages_to_the_class():
    ix = Index(515 * A, slot_alignment=A, write_ttl_s=1, quarantine_s=1)
    assert ix.alloc.extent_pages == 8 and ix.alloc.tail_pages == 3
    lid = ix.register_layout("n", "fp", 1, 3 * A).layout_id
    [(st0, slots)] = ix.reserve(lid, [b"a"], now=0)
    ix.expire(1.0)  # write deadline: the pages go to quarantine
    assert b"a" not in ix.layouts[lid].objects and ix.used_bytes == 0
    ix.expire(2.5)
    assert ix.alloc.used_pages == 0
    assert ix.reserve(lid, [b"a"], now=3)[0][0] == ReserveStatus.OK


@pytest.mark.parametrize("pages", [1, 7, 8, 9])
def test_default_extents_leave_tiny_cards_as_they_were(pages):
    ix = Index(24 * A, slot_alignment=A)
    assert ix.alloc.extent_pages == 1 and ix.alloc.usable_pages == 24
    lid = ix.register_layout("n", "fp", 1, pages * A).layout_id
    n = 24 // pages
    assert all(s == ReserveStatus.OK for s, _ in ix.reserve(lid, [b"%d" % i for i in range(n)],
                                                            now=0))
