"""The tier's Mooncake side against a real master: write-through from card slots, batched
existence, pulls straight into slots, and every way an object can fail (lost, corrupted,
truncated, foreign header) turning into a miss. Bytes are compared exactly, destinations poisoned."""

from __future__ import annotations

import os

import pytest
from tier_hosts import start_backends

from xkv.gateway.testing import wait_tier_result
from xkv.gateway.tier_store import (
    HEADER_BYTES,
    TierItem,
    layout_digest,
    mooncake_key,
    pack_header,
)

CARD = 4 << 20
DIGEST = layout_digest("prod", "llama-fp", 2, 12345)





@pytest.fixture
def backends(master):
    """Two backends (hosts A and B) on one master, each with its own card."""
    out = start_backends(master, [None, None])
    yield out
    for b, _ in out:
        b.close()


def _items(card, keys, offsets_per_key, shard_bytes=12345, fill=True):
    items, want = [], {}
    for k, offs in zip(keys, offsets_per_key, strict=True):
        for o in offs:
            data = os.urandom(shard_bytes) if fill else b""
            if fill:
                card[o:o + shard_bytes] = data
                want[(k, o)] = data
        items.append(TierItem(DIGEST, k, len(offs), shard_bytes, tuple(offs)))
    return items, want


def test_put_exists_pull_into_slots(backends):
    (a, card_a), (b, card_b) = backends
    keys = [os.urandom(32) for _ in range(3)]
    src, want = _items(card_a, keys, [(0, 16384), (32768, 49152), (65536, 81920)])
    a.offer(src)
    _, done_items, ok, nbytes = wait_tier_result(a, "pushed")
    assert ok == [True] * 3 and nbytes == 3 * (HEADER_BYTES + 2 * 12345)
    names = [mooncake_key(DIGEST, k) for k in keys] + [mooncake_key(DIGEST, b"absent")]
    b.submit(("exists", 1, names))
    assert wait_tier_result(b, "exists") == ("exists", 1, [1, 1, 1, 0])
    # another layout (namespace) with the same card key: a different Mooncake key, absent
    other = layout_digest("staging", "llama-fp", 2, 12345)
    b.submit(("exists", 2, [mooncake_key(other, keys[0])]))
    assert wait_tier_result(b, "exists")[2] == [0]
    card_b[:] = b"\xa5" * CARD  # poison: every byte not pulled must stay 0xa5
    dst = [TierItem(DIGEST, k, 2, 12345, offs) for k, offs in
           zip(keys, [(1 << 20, (1 << 20) + 12345), (2 << 20, 3 << 20), (4096, 8192 + 12345)],
               strict=True)]
    b.submit(("pull", 3, dst))
    _, token, status, nbytes, seconds = wait_tier_result(b, "pull")
    assert token == 3 and status == ["ok"] * 3 and seconds > 0
    assert nbytes == 3 * (HEADER_BYTES + 2 * 12345)
    expect = bytearray(b"\xa5" * CARD)
    for k, s_offs, d_offs in zip(keys, [(0, 16384), (32768, 49152), (65536, 81920)],
                                 [d.offsets for d in dst], strict=True):
        for so, do in zip(s_offs, d_offs, strict=True):
            expect[do:do + 12345] = want[(k, so)]
    assert card_b[:] == bytes(expect)


def test_lost_corrupt_truncated_foreign_are_misses(backends, master):
    (a, card_a), (b, card_b) = backends
    keys = [os.urandom(32) for _ in range(5)]
    offs = [(i * 32768, i * 32768 + 16384) for i in range(5)]
    src, want = _items(card_a, keys, offs)
    a.offer(src)
    assert wait_tier_result(a, "pushed")[2] == [True] * 5
    names = [mooncake_key(DIGEST, k) for k in keys]
    hand = master.client()
    try:
        b.submit(("exists", 1, names))
        assert wait_tier_result(b, "exists")[2] == [1] * 5
        # between the existence check and the pull: one evicted, three rewritten badly
        assert hand.remove(names[1], True) == 0
        good = bytearray(hand.get(names[2]))
        assert len(good) == HEADER_BYTES + 2 * 12345
        flipped = bytearray(good)
        flipped[HEADER_BYTES + 777] ^= 0x01
        assert hand.upsert(names[2], bytes(flipped)) == 0
        assert hand.upsert(names[3], bytes(good[:-100])) == 0
        foreign = pack_header(layout_digest("prod", "other-fp", 2, 12345), keys[4], 2, 12345,
                              int.from_bytes(good[HEADER_BYTES - 20:HEADER_BYTES - 16], "little"))
        assert hand.upsert(names[4], foreign + bytes(good[HEADER_BYTES:])) == 0
        dst = [TierItem(DIGEST, k, 2, 12345, (i * 65536, i * 65536 + 16384))
               for i, k in enumerate(keys)]
        b.submit(("pull", 2, dst))
        status = wait_tier_result(b, "pull")[2]
    finally:  # only now: a re-sized object may live in this client's own segment
        hand.close()
    assert status == ["ok", "lost", "corrupt", "truncated", "corrupt"]
    for i, o in enumerate((0, 16384)):
        assert card_b[o:o + 12345] == want[(keys[0], offs[0][i])]


def test_secret_signed_objects_and_unsigned_or_foreign_signed_are_misses(master):
    key1, key2 = b"0123456789abcdef-cluster", b"another-cluster-secret!!"
    out = start_backends(master, [key1, key1, key2, None])
    try:
        (a, card_a), (b, card_b), (c, _), (d, card_d) = out
        ks = [os.urandom(32) for _ in range(3)]
        src, want = _items(card_a, ks[:2], [(0, 16384), (32768, 49152)])
        a.offer(src)  # signed with key1
        assert wait_tier_result(a, "pushed")[2] == [True, True]
        unsigned, _ = _items(card_d, ks[2:], [(0, 16384)])
        d.offer(unsigned)  # a writer without the secret
        assert wait_tier_result(d, "pushed")[2] == [True]
        dst = [TierItem(DIGEST, k, 2, 12345, (65536 * (i + 1), 65536 * (i + 1) + 16384))
               for i, k in enumerate(ks)]
        b.submit(("pull", 1, dst))  # same secret: signed ones verify, the unsigned one does not
        assert wait_tier_result(b, "pull")[2] == ["ok", "ok", "corrupt"]
        for it, so in zip(dst[:2], [(0, 16384), (32768, 49152)], strict=True):
            for o, s_ in zip(it.offsets, so, strict=True):
                assert card_b[o:o + 12345] == want[(it.key, s_)]
        c.submit(("pull", 2, dst[:2]))  # another secret: nothing verifies
        assert wait_tier_result(c, "pull")[2] == ["corrupt", "corrupt"]
        d.submit(("pull", 3, dst))  # no secret: crc32 only, signed objects are still readable
        assert wait_tier_result(d, "pull")[2] == ["ok", "ok", "ok"]
    finally:
        for bk, _ in out:
            bk.close()
