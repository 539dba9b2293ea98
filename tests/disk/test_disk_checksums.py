"""Checksum words on the disk tier (issue 25): an object's opaque checksum words go to disk with
its shards (disk_format version 2) and come back exactly, with O_DIRECT and buffered I/O, for odd
sizes; damage to the words' region is a miss like damage to the shards; objects without words
keep the version-1 format byte for byte; through real gateways, a restart serves the restored
objects with the words they were committed with."""

from __future__ import annotations

import mmap
import os
import struct
import time
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from store_results import object_files, wait  # noqa: E402

from xkv.gateway.client import GatewayClient
from xkv.gateway.disk_format import (
    BLOCK,
    HEAD,
    MAGIC,
    VERSION,
    check_header,
    checks_offset,
    file_bytes,
    file_name,
    pack_header,
    stride,
)
from xkv.gateway.disk_store import DiskItem, DiskStore
from xkv.gateway.testing import spawn_gateway, stop_gateway
from xkv.gateway.tier_store import layout_digest

DIGEST = bytes(range(16))
CARD = 8 << 20


def make_store(tmp, card, direct):
    s = DiskStore(str(tmp / "disk"), card, 4096, threads=2, direct=direct)
    s.start()
    assert wait(s, "scanned")[1] == []
    return s


def _item(key, shards, shard_bytes, base, checks):
    slot = stride(shard_bytes)
    return DiskItem(DIGEST, key, file_name(key), shards, shard_bytes,
                    tuple(base + r * slot for r in range(shards)), None, checks)


@pytest.mark.parametrize("direct", [True, False])
@settings(max_examples=25, deadline=None)
@given(shards=st.integers(1, 3), shard_bytes=st.integers(1, 20000),
       words=st.integers(1, 1500), key=st.binary(min_size=1, max_size=80))
def test_words_round_trip_bit_exact(tmp_path_factory, direct, shards, shard_bytes, words, key):
    tmp = tmp_path_factory.mktemp("w")
    card = mmap.mmap(-1, CARD)
    s = make_store(tmp, card, direct)
    try:
        checks = os.urandom(shards * words * 4)
        src = _item(key, shards, shard_bytes, 0, checks)
        data = [os.urandom(shard_bytes) for _ in range(shards)]
        for off, d in zip(src.offsets, data, strict=True):
            card[off:off + shard_bytes] = d
        s.write([src])
        msg = wait(s, "written")
        assert msg[2] == ["ok"] and msg[3] == file_bytes(shards, shard_bytes, len(checks))
        path = os.path.join(s.root, src.rel)
        assert os.path.getsize(path) == file_bytes(shards, shard_bytes, len(checks))
        with open(path, "rb") as f:
            raw = f.read()
        off = checks_offset(shards, shard_bytes)
        assert raw[off:off + len(checks)] == checks
        assert raw[off + len(checks):] == bytes(len(raw) - off - len(checks))  # zero padded
        # read into poisoned slots and a poisoned words buffer
        card[:] = b"\xa5" * CARD
        got = bytearray(b"\x5a" * len(checks))
        dst = _item(key, shards, shard_bytes, 4 << 20, got)
        s.read(1, [dst])
        assert wait(s, "read")[2] == ["ok"]
        assert bytes(got) == checks
        for off, d in zip(dst.offsets, data, strict=True):
            assert card[off:off + shard_bytes] == d
        assert card[:4 << 20] == b"\xa5" * (4 << 20)
    finally:
        s.close()
        card.close()


@pytest.mark.parametrize("direct", [True, False])
def test_damaged_words_or_wrong_word_count_are_misses(tmp_path, direct):
    card = mmap.mmap(-1, CARD)
    s = make_store(tmp_path, card, direct)
    try:
        items = [_item(b"k%d" % i, 2, 5000, i * 65536, os.urandom(2 * 7 * 4)) for i in range(4)]
        for it in items:
            for off in it.offsets:
                card[off:off + 5000] = os.urandom(5000)
        s.write(items)
        assert wait(s, "written")[2] == ["ok"] * 4
        paths = [os.path.join(s.root, it.rel) for it in items]
        off = checks_offset(2, 5000)
        with open(paths[0], "r+b") as f:  # one bit of one word
            f.seek(off + 13)
            b = f.read(1)
            f.seek(off + 13)
            f.write(bytes([b[0] ^ 0x10]))
        with open(paths[1], "r+b") as f:  # the words' region torn off
            f.truncate(off)
        dst = [_item(it.key, 2, 5000, (1 << 20) + i * 65536, bytearray(len(it.checks)))
               for i, it in enumerate(items)]
        # item 2 read as if its layout had another number of words; item 3 intact
        dst[2] = _item(items[2].key, 2, 5000, dst[2].offsets[0], bytearray(2 * 6 * 4))
        s.read(1, dst)
        status = wait(s, "read")[2]
        assert status[0] == "corrupt" and status[1] == "truncated"
        assert status[2] in ("truncated", "corrupt") and status[3] == "ok"
        assert bytes(dst[3].checks) == items[3].checks
        assert not os.path.exists(paths[0]) and not os.path.exists(paths[1])
    finally:
        s.close()
        card.close()


def test_objects_without_words_keep_version_1_byte_for_byte():
    key, crc = b"key", 0x12345678
    fixed = HEAD.pack(MAGIC, VERSION, len(key), 2, 777, DIGEST, crc, 0)[:-4]
    old = fixed + struct.pack("<I", zlib.crc32(fixed + key)) + key
    assert pack_header(DIGEST, key, 2, 777, crc) == old + bytes(BLOCK - len(old))
    assert file_bytes(2, 777) == BLOCK + 2 * BLOCK
    # a version-1 header is not accepted for an object with words, nor the reverse
    with pytest.raises(ValueError, match="version 1, expected 2"):
        check_header(pack_header(DIGEST, key, 2, 777, crc), DIGEST, key, 2, 777, 8)
    with pytest.raises(ValueError, match="version 2, expected 1"):
        check_header(pack_header(DIGEST, key, 2, 777, crc, 8), DIGEST, key, 2, 777)
    with pytest.raises(ValueError, match="promises 8 bytes"):
        check_header(pack_header(DIGEST, key, 2, 777, crc, 8), DIGEST, key, 2, 777, 12)
    assert check_header(pack_header(DIGEST, key, 2, 777, crc, 8), DIGEST, key, 2, 777, 8) == crc
    # the layout digest of a layout without words is unchanged; with words it differs
    assert layout_digest("ns", "fp", 2, 777) == layout_digest("ns", "fp", 2, 777, 0)
    assert layout_digest("ns", "fp", 2, 777) != layout_digest("ns", "fp", 2, 777, 3)


def _stats_when(c, pred, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not pred(s := c.stats()):
        assert time.monotonic() < deadline, s
        time.sleep(0.01)
    return s


def test_restart_serves_restored_objects_with_their_words(tmp_path):
    shards, shard_bytes, words = 2, 30000, 9
    d = str(tmp_path / "disk")
    args = ["--disk", d, "--disk-wait-ms", "5000"]
    keys = [os.urandom(32) for _ in range(5)]
    data, checks = {}, {}
    proc, port = spawn_gateway("16M", extra_args=args)
    try:
        with GatewayClient("127.0.0.1", port, timeout_s=10) as c:
            lid = c.register_layout("prod", "fp", shards, shard_bytes, check_words=words).layout_id
            card = c.map_card()
            res = c.reserve(lid, keys)
            for k, r in zip(keys, res, strict=True):
                for s, off in enumerate(r.offsets):
                    data[(k, s)] = os.urandom(shard_bytes)
                    card[off:off + shard_bytes] = data[(k, s)]
                    checks[(k, s)] = os.urandom(words * 4)
            for s in range(shards):
                assert c.commit(lid, s, res, checksums=[checks[(k, s)] for k in keys]) == 5
            _stats_when(c, lambda s: s["disk_written"] == 5 and not s["disk_write_backlog_bytes"])
    finally:
        stop_gateway(proc)
    files = object_files(d)
    assert len(files) == 5
    victim = [f for f in files if os.path.basename(f) == keys[3].hex()][0]
    with open(victim, "r+b") as f:  # one word of chunk 3 damaged while the gateway was down
        f.seek(checks_offset(shards, shard_bytes) + 4 * words + 2)
        f.write(b"\xee")
    proc, port = spawn_gateway("16M", extra_args=args)
    try:
        with GatewayClient("127.0.0.1", port, timeout_s=10) as c:
            # another word count is another layout: nothing of this one on disk for it
            other = c.register_layout("prod", "fp-other", shards, shard_bytes,
                                      check_words=words).layout_id
            assert c.lookup([(other, keys)], lease=False).num_chunks == 0
            lid = c.register_layout("prod", "fp", shards, shard_bytes, check_words=words).layout_id
            card = c.map_card()
            _stats_when(c, lambda s: s["disk_scanned"])
            r = c.lookup([(lid, keys)])
            assert r.num_chunks == 3  # chunk 3's words fail the file's checksum: a miss
            assert r.raw_checksums == [b"".join(checks[(k, s)] for k in keys[:3]
                                                for s in range(shards))]
            for i, k in enumerate(keys[:3]):
                for s, off in enumerate(r.slots[0][i].offsets):
                    assert bytes(card[off:off + shard_bytes]) == data[(k, s)]
            s = c.stats()
            assert s["disk_corrupt"] == 1 and not os.path.exists(victim)
    finally:
        stop_gateway(proc)


def test_corrupt_report_deletes_the_disk_copy(tmp_path):
    """An object reported corrupt is not restored from disk again (its file may hold the same
    bad bytes: a torn write reaches the disk as it reached the card)."""
    d = str(tmp_path / "disk")
    proc, port = spawn_gateway("16M", extra_args=["--disk", d, "--disk-wait-ms", "5000"])
    try:
        with GatewayClient("127.0.0.1", port, timeout_s=10) as c:
            lid = c.register_layout("prod", "fp", 1, 8192, check_words=2).layout_id
            keys = [os.urandom(32) for _ in range(3)]
            res = c.reserve(lid, keys)
            assert c.commit(lid, 0, res, checksums=[os.urandom(8) for _ in keys]) == 3
            _stats_when(c, lambda s: s["disk_written"] == 3 and not s["disk_write_backlog_bytes"])
            files = object_files(d)
            assert len(files) == 3
            assert c.report_corrupt(lid, 0, [res[1]]) == 1
            deadline = time.monotonic() + 10
            while any(os.path.basename(f) == keys[1].hex() for f in object_files(d)):
                assert time.monotonic() < deadline, "the corrupt object's file stayed"
                time.sleep(0.01)
            # evict nothing; the card lost keys[1]: a lookup stops there, the disk has no copy
            r = c.lookup([(lid, keys)], lease=False)
            assert r.num_chunks == 1
            assert c.stats()["disk_hits"] == 0
    finally:
        stop_gateway(proc)


def test_corrupt_report_while_the_write_behind_runs(tmp_path):
    """Reported corrupt before its disk write landed: the object leaves the index at once, its
    pages stay pinned by the write, and when the write lands the file is deleted (never served)
    and the pages are freed."""
    from xkv.gateway.disk_tier import DiskTier
    from xkv.gateway.index import Index

    card = mmap.mmap(-1, 1 << 20)
    ix = Index(1 << 20, slot_alignment=4096)
    store = DiskStore(str(tmp_path / "disk"), card, 4096, threads=2)
    tier = DiskTier(ix, store, lambda frames, req: None, capacity_bytes=64 << 20, wait_s=5.0)
    ix.on_corrupt = tier.forget

    def until(pred):
        deadline = time.monotonic() + 10
        while not pred():
            assert time.monotonic() < deadline, "timed out"
            tier.poll(time.monotonic())
            time.sleep(0.001)

    try:
        until(lambda: tier.scanned)
        lay = ix.register_layout("prod", "fp", 1, 5000, check_words=3)
        ks = [b"a" * 32, b"b" * 32]
        out = ix.reserve(lay.layout_id, ks, time.monotonic())
        tokens = [(s.offsets[0], s.generations[0]) for _, s in out]
        assert ix.commit(lay.layout_id, 0, ks, tokens=tokens, checksums=os.urandom(24)) == 2
        assert len(tier._writing) == 2  # queued, not landed: pinned
        removed = ix.corrupt(lay.layout_id, 0, ks[:1], tokens[:1])
        assert len(removed) == 1 and ix.snapshot()["corrupt_held_objects"] == 1
        until(lambda: not tier._writing and not tier._deleting)
        digest = layout_digest("prod", "fp", 1, 5000, 3)
        assert (digest, file_name(ks[0])) not in tier.entries
        assert (digest, file_name(ks[1])) in tier.entries
        names = {f for _, _, fs in os.walk(store.root) for f in fs}
        assert file_name(ks[0]) not in names and file_name(ks[1]) in names
        assert ix.snapshot()["corrupt_held_objects"] == 0  # the write's pin went: pages free
        assert tier.used_bytes == file_bytes(1, 5000, 12)
    finally:
        tier.close()
        card.close()
