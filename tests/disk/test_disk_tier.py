"""The disk tier's loop side (xkv/gateway/disk_tier.py) over a real Index, a real DiskStore and an
in-process card: objects are written behind the card and stay pinned until durable; what the
card evicted comes back into card slots on a lookup, bit-exact; the disk keeps an LRU within its
capacity; bad files, a full disk, quotas and other namespaces give misses, never wrong bytes."""

from __future__ import annotations

import mmap
import os
import time

import pytest

from xkv.gateway import disk_store as ds
from xkv.gateway import protocol as P
from xkv.gateway.disk_format import BLOCK, file_bytes, file_name, rel_path
from xkv.gateway.disk_store import DiskStore
from xkv.gateway.disk_tier import DiskTier
from xkv.gateway.index import Index
from xkv.gateway.tier import DEFERRED
from xkv.gateway.tier_store import layout_digest

SHARDS, SHARD_BYTES = 2, 10000  # object: 2 slots of 12 KiB in the card, 24 KiB + 4 KiB on disk
OBJ_CARD = 2 * 12288
OBJ_DISK = file_bytes(SHARDS, SHARD_BYTES)


class Rig:
    def __init__(self, tmp, card_objects=8, disk_objects=100, wait_s=10.0, quotas=None,
                 disk_quotas=None, disk_default_quota=0):
        size = card_objects * OBJ_CARD
        self.card = mmap.mmap(-1, size)
        self.ix = Index(size, slot_alignment=4096, quotas=quotas or {})
        self.store = DiskStore(str(tmp / "disk"), self.card, 4096, threads=2)
        self.answers: dict = {}
        self.tier = DiskTier(self.ix, self.store, self._answer,
                             capacity_bytes=disk_objects * OBJ_DISK, wait_s=wait_s,
                             quotas=disk_quotas, default_quota_bytes=disk_default_quota)
        self.until(lambda: self.tier.scanned)
        self.n = 0

    def _answer(self, frames, req):
        self.answers[frames] = self.ix.lookup([(g.layout_id, g.keys) for g in req.groups],
                                              time.monotonic(), req.lease)
        return [frames[0], frames[1], b""]

    def until(self, pred, timeout_s=10.0):
        deadline = time.monotonic() + timeout_s
        while not pred():
            assert time.monotonic() < deadline, "timed out"
            self.tier.poll(time.monotonic())
            time.sleep(0.001)

    def settle(self):
        self.until(lambda: not self.tier._writing and not self.tier._live)

    def layout(self, ns="prod"):
        return self.ix.register_layout(ns, "fp", SHARDS, SHARD_BYTES)

    def put(self, lay, keys):
        data = {}
        out = self.ix.reserve(lay.layout_id, keys, time.monotonic())
        for k, (st, slots) in zip(keys, out, strict=True):
            assert st == P.ReserveStatus.OK, st
            for r, off in enumerate(slots.offsets):
                data[(k, r)] = os.urandom(SHARD_BYTES)
                self.card[off:off + SHARD_BYTES] = data[(k, r)]
        for r in range(SHARDS):
            assert self.ix.commit(lay.layout_id, r, keys) == len(keys)
        return data

    def lookup(self, lay, keys, lease=True):
        """The server's LOOKUP path: card pass, the tier if it wants it, reply when answered."""
        req = P.Lookup(1, [P.LookupGroup(lay.layout_id, keys)], lease)
        now = time.monotonic()
        num, lease_id, hits = self.ix.lookup([(lay.layout_id, keys)], now, lease)
        if not self.tier.wants(req, num):
            return num, lease_id, hits, False
        self.n += 1
        frames = (b"c", self.n.to_bytes(8, "little"))
        assert self.tier.defer(frames, req, num, lease_id, now) is DEFERRED
        self.until(lambda: frames in self.answers)
        return (*self.answers.pop(frames), True)

    def check(self, hits, keys, data):
        for obj, k in zip(hits[0], keys, strict=False):
            for r, off in enumerate(obj.slots.offsets):
                assert self.card[off:off + SHARD_BYTES] == data[(k, r)], (k.hex(), r)

    def path(self, lay, key):
        d = layout_digest(lay.namespace, lay.fingerprint, SHARDS, SHARD_BYTES)
        return os.path.join(self.store.root, rel_path(d, file_name(key)))

    def close(self):
        self.tier.close()
        self.card.close()


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def keys(n):
    return [os.urandom(32) for _ in range(n)]


def test_write_behind_pins_until_durable(rig):
    lay = rig.layout()
    ks = keys(3)
    rig.put(lay, ks)
    assert rig.ix.leased_objects == 3  # pinned: the writes read their slots
    rig.settle()
    assert rig.ix.leased_objects == 0 and rig.tier.counters["disk_written"] == 3
    for k in ks:
        assert os.path.getsize(rig.path(lay, k)) == OBJ_DISK
    assert rig.tier.used_bytes == 3 * OBJ_DISK


def test_evicted_object_restored_bit_exact_and_not_written_again(rig):
    lay = rig.layout()
    first = keys(6)
    data = rig.put(lay, first)
    rig.settle()
    data.update(rig.put(lay, keys(6)))  # the card holds 8: four of the first are evicted
    rig.settle()
    assert rig.ix.counters["evicted"] == 4
    num, lease_id, hits, deferred = rig.lookup(lay, first)
    assert deferred and num == 6 and lease_id
    rig.check(hits, first, data)
    c = rig.tier.counters
    # 4 objects read; the lookup gained all 6 chunks (the last 2 were in the card all along)
    assert c["disk_hits"] == 4 and c["disk_served_chunks"] == 6 and c["disk_written"] == 12
    rig.settle()
    assert c["disk_written"] == 12  # restored objects are not written again
    assert rig.ix.counters["lookups"] == 1  # the deferred lookup counts once


def test_lru_within_capacity(tmp_path):
    rig = Rig(tmp_path, card_objects=8, disk_objects=3)
    try:
        lay = rig.layout()
        ks = keys(5)
        for k in ks:
            rig.put(lay, [k])
            rig.settle()
        rig.until(lambda: not rig.tier._deleting)
        assert [os.path.exists(rig.path(lay, k)) for k in ks] == [False, False, True, True, True]
        assert rig.tier.counters["disk_evicted"] == 2 and rig.tier.used_bytes == 3 * OBJ_DISK
    finally:
        rig.close()


def test_bad_files_are_misses(rig):
    lay = rig.layout()
    ks = keys(8)
    data = rig.put(lay, ks)
    rig.settle()
    rig.put(lay, keys(8))  # evicts all of ks from the card
    rig.settle()
    with open(rig.path(lay, ks[1]), "r+b") as f:  # a flipped bit in the second chunk
        f.seek(BLOCK + 7)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    os.truncate(rig.path(lay, ks[3]), OBJ_DISK - BLOCK)
    num, _, hits, _ = rig.lookup(lay, ks)
    assert num == 1  # chunk 0 restored; chunk 1 fails its checksum: the prefix stops there
    rig.check(hits, ks, data)
    c = rig.tier.counters
    assert c["disk_corrupt"] == 1 and c["disk_truncated"] == 1 and c["disk_hits"] == 6
    assert lay.objects.get(ks[1]) is None  # the bad object never became visible
    assert not os.path.exists(rig.path(lay, ks[1]))
    num, _, hits, deferred = rig.lookup(lay, ks[2:])  # what was good was restored as well
    assert num == 1 and not deferred


def test_other_namespace_finds_nothing_and_quota_limits_restores(tmp_path):
    rig = Rig(tmp_path, card_objects=8, quotas={"small": 2 * OBJ_CARD})
    try:
        lay, other, small = rig.layout(), rig.layout("staging"), rig.layout("small")
        ks = keys(8)
        rig.put(lay, ks)
        rig.settle()
        num, _, _, deferred = rig.lookup(other, ks)
        assert (num, deferred) == (0, False)
        data = rig.put(small, ks[:2])  # the namespace at its quota
        rig.settle()
        rig.put(small, ks[2:4])  # evicts the first two (quota)
        rig.settle()
        num, _, hits, deferred = rig.lookup(small, ks[:4], lease=False)
        # the two restored, within the quota, evict the later two: the prefix is 2 chunks
        assert deferred and num == 2
        rig.check(hits, ks[:2], data)
        assert rig.ix.ns_used["small"] <= 2 * OBJ_CARD
    finally:
        rig.close()


def test_deadline_answers_from_card_and_read_lands_as_prefetch(tmp_path):
    rig = Rig(tmp_path, wait_s=0.0)
    try:
        lay = rig.layout()
        ks = keys(4)
        data = rig.put(lay, ks)
        rig.settle()
        rig.put(lay, keys(8))
        rig.settle()
        num, _, _, deferred = rig.lookup(lay, ks)
        assert deferred and num == 0 and rig.tier.counters["disk_deadline"] == 1
        rig.settle()
        assert rig.tier.counters["disk_late_objects"] == 4
        num, _, hits, deferred = rig.lookup(lay, ks)
        assert num == 4 and not deferred
        rig.check(hits, ks, data)
    finally:
        rig.close()


def test_disk_full_lowers_capacity(rig, monkeypatch):
    lay = rig.layout()
    rig.put(lay, keys(2))
    rig.settle()

    def full(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ds.os, "pwritev", full)
    rig.put(lay, keys(1))
    rig.settle()
    c = rig.tier.counters
    assert c["disk_full"] == 1 and rig.tier.capacity_bytes == 2 * OBJ_DISK
    assert rig.ix.leased_objects == 0 and rig.tier.used_bytes == 2 * OBJ_DISK
    monkeypatch.undo()  # room again: the next write evicts the oldest object to fit
    rig.put(lay, keys(1))
    rig.settle()
    assert c["disk_written"] == 3 and c["disk_evicted"] == 1
    assert rig.tier.used_bytes == 2 * OBJ_DISK


def test_write_errors_take_the_tier_down_for_a_while(rig, monkeypatch):
    lay = rig.layout()

    def broken(*a):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ds.os, "pwritev", broken)
    rig.tier.max_errors = 2
    rig.put(lay, keys(2))
    rig.settle()
    assert rig.tier.counters["disk_write_errors"] == 2 and not rig.tier.up
    rig.put(lay, keys(1))  # not offered while down
    assert rig.tier.counters["disk_write_dropped"] == 1 and rig.ix.leased_objects == 0


def test_metrics_show_the_tier(rig):
    from xkv.gateway.disk_metrics import DISK
    from xkv.gateway.metrics import Histogram, render, series

    snap = rig.tier.snapshot()
    assert {key for _, key, *_ in DISK} <= snap.keys()  # every series has its number
    lay = rig.layout()
    rig.put(lay, keys(2))
    rig.settle()
    text = render(rig.tier.snapshot(), {}, {}, Histogram(), {})
    assert 'xkv_gateway_disk_written_total{result="ok"} 2' in text
    assert "xkv_gateway_disk_up 1" in text
    assert series("disk_corrupt") == 'xkv_gateway_disk_bad_objects_total{reason="corrupt"}'
    assert "xkv_gateway_disk_up" not in render({}, {}, {}, Histogram(), {})  # no tier, no series
    from xkv.gateway.stats_cli import rows

    table = {series: raw for _s, _w, _v, raw, series in rows(rig.tier.snapshot())}
    assert table['xkv_gateway_disk_written_total{result="ok"}'] == 2
    assert not any("disk" in series for *_, series in rows({}))


def test_directory_removed_while_running(rig):
    import shutil

    lay = rig.layout()
    ks = keys(2)
    rig.put(lay, ks)
    rig.settle()
    rig.put(lay, keys(8))  # evicts ks from the card
    rig.settle()
    shutil.rmtree(rig.store.root)  # the files are gone, the tier does not know yet
    num, _, _, deferred = rig.lookup(lay, ks)
    assert deferred and num == 0  # misses, not bytes
    c = rig.tier.counters
    assert c["disk_lost"] == 2 and (lay.objects.get(ks[0]), lay.objects.get(ks[1])) == (None, None)
    assert not rig.tier._chunk(P.Lookup(1, [P.LookupGroup(lay.layout_id, ks)]), 0)  # forgotten
    written = c["disk_written"]
    new = keys(1)
    rig.put(lay, new)  # writes recreate the directories
    rig.settle()
    assert c["disk_written"] == written + 1 and os.path.exists(rig.path(lay, new[0]))


# ---------------------------------------------------------------- per-namespace disk quotas


def on_disk(rig, lay, ks):
    rig.until(lambda: not rig.tier._deleting)
    return [os.path.exists(rig.path(lay, k)) for k in ks]


def put_each(rig, lay, ks):
    """Store ``ks`` one at a time (each written before the next: a definite LRU order)."""
    for k in ks:
        rig.put(lay, [k])
        rig.settle()


def test_namespace_at_its_disk_quota_deletes_its_own_oldest_files(tmp_path):
    rig = Rig(tmp_path, card_objects=16, disk_objects=100, disk_quotas={"a": 3 * OBJ_DISK})
    try:
        a, b = rig.layout("a"), rig.layout("b")
        ka, kb = keys(5), keys(5)
        put_each(rig, b, kb[:2])
        put_each(rig, a, ka)
        put_each(rig, b, kb[2:])
        assert on_disk(rig, a, ka) == [False, False, True, True, True]
        assert on_disk(rig, b, kb) == [True] * 5  # no quota: untouched by a's
        c = rig.tier.counters
        assert c["disk_quota_evicted"] == 2 and c["disk_evicted"] == 2
        assert c["disk_quota_refused"] == 0 and c["disk_written"] == 10
        assert rig.tier.ns_used("a") == 3 * OBJ_DISK and rig.tier.ns_used("b") == 5 * OBJ_DISK
        assert rig.tier.used_bytes == 8 * OBJ_DISK
    finally:
        rig.close()


def test_a_namespace_never_evicts_another_within_its_share(tmp_path):
    """Capacity 6 objects; b's share (quota) 3. a (no quota) fills the disk: its own oldest
    files make room, b's stay. Without b's quota, a's writes delete b's oldest (the control)."""
    for quota, b_kept in (({"b": 3 * OBJ_DISK}, [True] * 3), ({}, [False, False, True])):
        (tmp_path / str(bool(quota))).mkdir()
        rig = Rig(tmp_path / str(bool(quota)), card_objects=16, disk_objects=6,
                  disk_quotas=quota)
        try:
            a, b = rig.layout("a"), rig.layout("b")
            ka, kb = keys(5), keys(3)
            put_each(rig, b, kb)
            put_each(rig, a, ka)
            assert on_disk(rig, b, kb) == b_kept
            assert sum(on_disk(rig, a, ka)) == 6 - sum(b_kept)
            assert on_disk(rig, a, ka)[-1]  # the newest is always written
            assert rig.tier.counters["disk_quota_refused"] == 0
            assert rig.tier.used_bytes <= 6 * OBJ_DISK
        finally:
            rig.close()


def test_write_refused_when_only_other_shares_are_left(tmp_path):
    """b's share is the whole disk and b holds it: a's write is refused and counted, b's files
    stay, a's object is not pinned in the card; an object larger than a's own quota is refused
    too, before any file of a goes."""
    rig = Rig(tmp_path, card_objects=16, disk_objects=4,
              disk_quotas={"b": 4 * OBJ_DISK, "tiny": OBJ_DISK - 1})
    try:
        a, b, tiny = rig.layout("a"), rig.layout("b"), rig.layout("tiny")
        kb = keys(4)
        put_each(rig, b, kb)
        ka = keys(1)
        rig.put(a, ka)
        rig.settle()
        c = rig.tier.counters
        assert c["disk_quota_refused"] == 1 and c["disk_write_dropped"] == 1
        assert on_disk(rig, b, kb) == [True] * 4 and on_disk(rig, a, ka) == [False]
        assert rig.ix.leased_objects == 0  # nothing left pinned for a write
        rig.put(tiny, keys(1))
        rig.settle()
        assert c["disk_quota_refused"] == 2 and c["disk_evicted"] == 0
        assert rig.tier.used_bytes == 4 * OBJ_DISK
    finally:
        rig.close()


def test_quota_shares_hold_across_a_restart(tmp_path):
    """After a restart the scanned files belong to no namespace until their layout is
    registered again; from then on b's share is kept from a's writes."""
    rig = Rig(tmp_path, card_objects=16, disk_objects=5, disk_quotas={"b": 3 * OBJ_DISK})
    a, b = rig.layout("a"), rig.layout("b")
    kb, ka = keys(3), keys(2)
    put_each(rig, b, kb)
    put_each(rig, a, ka)
    rig.close()
    rig = Rig(tmp_path, card_objects=16, disk_objects=5, disk_quotas={"b": 3 * OBJ_DISK})
    try:
        assert rig.tier.counters["disk_scan_found"] == 5
        assert rig.tier.ns_used("b") == 0  # no layout of b registered yet: nobody's
        b, a = rig.layout("b"), rig.layout("a")  # registered: the scanned files are attributed
        assert rig.tier.ns_used("b") == 3 * OBJ_DISK
        ka2 = keys(3)
        put_each(rig, a, ka2)
        assert on_disk(rig, b, kb) == [True] * 3
        assert on_disk(rig, a, ka + ka2) == [False, False, False, True, True]
        assert rig.tier.ns_used("b") == 3 * OBJ_DISK and rig.tier.ns_used("a") == 2 * OBJ_DISK
        # and b's files are still served
        num, _, _, deferred = rig.lookup(b, kb, lease=False)
        assert deferred and num == 3
    finally:
        rig.close()


def test_after_a_restart_the_oldest_file_goes_first(tmp_path):
    """The scan orders files by their last use (mtime): the least recently used is deleted first
    when a new write needs room (not the most recent one, nor one of this start's)."""
    rig = Rig(tmp_path, card_objects=16, disk_objects=3)
    lay = rig.layout()
    ks = keys(3)
    put_each(rig, lay, ks)
    rig.close()
    for i, k in enumerate(ks):  # file times a second apart, whatever the file system's clock
        os.utime(rig.path(lay, k), (1_000_000 + i, 1_000_000 + i))
    rig = Rig(tmp_path, card_objects=16, disk_objects=3)
    try:
        lay = rig.layout()
        new = keys(2)
        put_each(rig, lay, new)
        assert on_disk(rig, lay, ks + new) == [False, False, True, True, True]
    finally:
        rig.close()


def test_a_namespace_over_its_quota_loses_files_only_down_to_it(tmp_path):
    """b wrote 4 files without a quota; restarted with b's quota at 2 and a capacity of 5, a's
    writes take b's oldest files while b is over its quota, then only a's own."""
    rig = Rig(tmp_path, card_objects=16, disk_objects=5)
    b = rig.layout("b")
    kb = keys(4)
    put_each(rig, b, kb)
    rig.close()
    rig = Rig(tmp_path, card_objects=16, disk_objects=5, disk_quotas={"b": 2 * OBJ_DISK})
    try:
        b, a = rig.layout("b"), rig.layout("a")
        ka = keys(4)
        put_each(rig, a, ka)
        assert on_disk(rig, b, kb) == [False, False, True, True]
        assert on_disk(rig, a, ka) == [False, True, True, True]
        assert rig.tier.ns_used("b") == 2 * OBJ_DISK
        assert rig.tier.counters["disk_quota_refused"] == 0
    finally:
        rig.close()
