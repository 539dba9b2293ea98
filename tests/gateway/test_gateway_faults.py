"""The gateway-side fault injection helpers of the verified-restore suite (issue 25,
xkv.gateway.testing): each makes the fault it names in a real gateway (served by a thread of
this process), a reader that checks what it copies against the checksum words the lookup
returned (here crc32 per shard, as a stand-in for the restore kernels) detects every one, and
each undo makes the object whole again."""

from __future__ import annotations

import os
import struct
import zlib

import pytest

from xkv.gateway import ChunkRef, GatewayClient
from xkv.gateway.testing import (
    bump_generation,
    flip_bit,
    gateway_in_thread,
    misdirect,
    on_loop,
    reuse_under_stale_generation,
    torn_commit,
)

SHARDS, SB = 3, 10000


def _words(b: bytes) -> bytes:
    return struct.pack("<I", zlib.crc32(b))


@pytest.fixture(scope="module")
def gw():
    with gateway_in_thread("16M") as g:
        yield g


@pytest.fixture
def stored(gw):
    """A client, a layout with one word per shard, and 4 committed objects of random bytes."""
    with GatewayClient("localhost", gw.port, timeout_s=10) as c:
        lid = c.register_layout("faults", "fp", SHARDS, SB, check_words=1).layout_id
        card = c.map_card()
        keys = [os.urandom(32) for _ in range(4)]
        res = c.reserve(lid, keys)
        data = {}
        for k, r in zip(keys, res, strict=True):
            for s, off in enumerate(r.offsets):
                data[(k, s)] = os.urandom(SB)
                card[off:off + SB] = data[(k, s)]
        for s in range(SHARDS):
            assert c.commit(lid, s, res, checksums=[_words(data[(k, s)]) for k in keys]) == 4
        yield c, lid, keys, data


def _verify(c, lid, keys) -> list[str]:
    """What a verifying reader finds per chunk: "ok", "generation" (the slot's generation moved
    since the lookup: the copy does not count) or "checksum" (bytes != words)."""
    card = c.map_card()
    r = c.lookup([(lid, keys)], lease=False)
    assert r.num_chunks == len(keys)
    words = r.raw_checksums[0]
    out = []
    for i, sl in enumerate(r.slots[0]):
        verdict = "ok"
        for s, (off, gen) in enumerate(zip(sl.offsets, sl.generations, strict=True)):
            got = _words(bytes(card[off:off + SB]))
            if c.slot_generation(off) != gen:
                verdict = "generation"
            elif got != words[(i * SHARDS + s) * 4:(i * SHARDS + s + 1) * 4]:
                verdict = "checksum"
        out.append(verdict)
    return out


def test_flip_bit(stored):
    c, lid, keys, data = stored
    assert _verify(c, lid, keys) == ["ok"] * 4
    card = c.map_card()
    off = c.lookup([(lid, keys[1:2])], lease=False).slots[0][0].offsets[2]
    undo = flip_bit(card, off, 8 * 777 + 5)
    assert bytes(card[off:off + SB]) != data[(keys[1], 2)]
    diff = [i for i in range(SB) if card[off + i] != data[(keys[1], 2)][i]]
    assert diff == [777] and card[off + 777] ^ data[(keys[1], 2)][777] == 1 << 5
    assert _verify(c, lid, keys) == ["ok", "checksum", "ok", "ok"]
    undo()
    assert _verify(c, lid, keys) == ["ok"] * 4
    with pytest.raises(ValueError, match="outside the card"):
        flip_bit(card, len(card) - 1, 8)


def test_misdirected_index_entry(gw, stored):
    c, lid, keys, data = stored
    undo = on_loop(gw, lambda: misdirect(gw.index, lid, keys[0], keys[3]))
    r = c.lookup([(lid, keys)], lease=False)
    assert r.slots[0][0] == r.slots[0][3]  # generation check passes: same live slots
    assert _verify(c, lid, keys) == ["checksum", "ok", "ok", "ok"]
    on_loop(gw, undo)
    assert _verify(c, lid, keys) == ["ok"] * 4
    with pytest.raises(KeyError, match="not a committed object"):
        on_loop(gw, lambda: misdirect(gw.index, lid, keys[0], b"absent"))


def test_slot_reused_under_a_stale_generation(gw, stored):
    c, lid, keys, data = stored
    before = c.lookup([(lid, keys)], lease=False)
    undo = on_loop(gw, lambda: reuse_under_stale_generation(gw.index, gw.card.arena, lid,
                                                            keys[2], keys[1]))
    after = c.lookup([(lid, keys)], lease=False)
    assert after.slots == before.slots  # nothing moved: tokens and generations as noted
    card = c.map_card()
    for s, off in enumerate(after.slots[0][2].offsets):
        assert bytes(card[off:off + SB]) == data[(keys[1], s)]
    assert _verify(c, lid, keys) == ["ok", "ok", "checksum", "ok"]
    on_loop(gw, undo)
    assert _verify(c, lid, keys) == ["ok"] * 4


def test_generation_moved_under_the_reader(gw, stored):
    c, lid, keys, data = stored
    r = c.lookup([(lid, keys)], lease=False)
    undo = on_loop(gw, lambda: bump_generation(gw.index, lid, keys[3], shard=1))
    sl = r.slots[0][3]
    assert c.slot_generation(sl.offsets[1]) == sl.generations[1] + 1
    assert c.slot_generation(sl.offsets[0]) == sl.generations[0]
    assert _verify(c, lid, keys) == ["ok", "ok", "ok", "generation"]
    on_loop(gw, undo)
    assert _verify(c, lid, keys) == ["ok"] * 4


@pytest.mark.parametrize("written", [(SB, 0, SB), (SB, SB, SB - 1), (1, SB, SB), (0, 0, 0)])
def test_torn_and_truncated_commits(stored, written):
    c, lid, keys, data = stored
    card = c.map_card()
    key = os.urandom(32)
    ref = c.reserve(lid, [key])[0]
    for off in ref.offsets:
        card[off:off + SB] = b"\xa5" * SB  # what the slot held before
    full = [os.urandom(SB) for _ in range(SHARDS)]
    assert torn_commit(c, lid, ref, full, [_words(d) for d in full], written) == SHARDS
    r = c.lookup([(lid, [key])], lease=False)
    assert r.num_chunks == 1 and ChunkRef.at(key, r.slots[0][0]) == ref
    for off, d, n in zip(ref.offsets, full, written, strict=True):
        assert bytes(card[off:off + n]) == d[:n]
        assert bytes(card[off + n:off + SB]) == b"\xa5" * (SB - n)
    assert _verify(c, lid, [key]) == ["checksum"]
    with pytest.raises(ValueError, match="one data, checksum and written count per shard"):
        torn_commit(c, lid, ref, full[:2], full, written)
