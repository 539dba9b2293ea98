"""Checksum words on the Mooncake tier (issue 25), against a real master: an object's opaque
checksum words travel after its shards (header version 2, covered by the crc32 and the MAC) and a
pull puts them back exactly; damaged words are a miss; an object pulled into another gateway's
card is served with the words it was committed with."""

from __future__ import annotations

import os
import time

import pytest
from tier_hosts import check, hosts, start_backends

from xkv.gateway.testing import wait_tier_result
from xkv.gateway.tier_store import (
    HEADER_BYTES,
    TierItem,
    layout_digest,
    mooncake_key,
)

CARD = 4 << 20
SB = 12345
DIGEST = layout_digest("prod", "llama-fp", 2, SB, 5)




@pytest.mark.parametrize("secret", [None, b"0123456789abcdef-cluster"])
def test_words_push_and_pull_exactly_damage_is_a_miss(master, secret):
    out = start_backends(master, [secret, secret])
    (a, card_a), (b, card_b) = out
    try:
        keys = [os.urandom(32) for _ in range(4)]
        words = {k: os.urandom(2 * 5 * 4) for k in keys}
        src = []
        for i, k in enumerate(keys):
            offs = (i * 32768, i * 32768 + 16384)
            for o in offs:
                card_a[o:o + SB] = os.urandom(SB)
            src.append(TierItem(DIGEST, k, 2, SB, offs, None, bytearray(words[k])))
        a.offer(src)
        _, _, ok, nbytes = wait_tier_result(a, "pushed")
        assert ok == [True] * 4 and nbytes == 4 * (HEADER_BYTES + 2 * SB + 40)
        hand = master.client()
        try:
            name = src[1].name
            good = bytearray(hand.get(name))
            assert len(good) == HEADER_BYTES + 2 * SB + 40
            assert bytes(good[-40:]) == words[keys[1]]
            good[-7] ^= 0x04  # one bit of one word
            assert hand.upsert(name, bytes(good)) == 0
            card_b[:] = b"\xa5" * CARD
            dst = [TierItem(DIGEST, k, 2, SB, ((i + 1) << 20, ((i + 1) << 20) + 16384), None,
                            bytearray(b"\x5a" * 40)) for i, k in enumerate(keys)]
            # item 3 asked for without words: another object size, a miss
            dst[3] = TierItem(DIGEST, keys[3], 2, SB, dst[3].offsets)
            b.submit(("pull", 7, dst))
            status = wait_tier_result(b, "pull")[2]
        finally:
            hand.close()
        assert status == ["ok", "corrupt", "ok", "truncated"]
        for i in (0, 2):
            assert bytes(dst[i].checks) == words[keys[i]]
            for so, do in zip(src[i].offsets, dst[i].offsets, strict=True):
                assert card_b[do:do + SB] == card_a[so:so + SB]
    finally:
        for bk, card in out:
            bk.close()
            card.close()


def test_pulled_object_is_served_with_its_words(master, tmp_path):
    shards, shard_bytes, words = 2, 20000, 3
    with hosts(master, tmp_path, extra=["--mooncake-wait-ms", "5000"]) as (a, b):
        la = a.client.register_layout("prod", "fp-w", shards, shard_bytes,
                                      check_words=words).layout_id
        card = a.client.map_card()
        ks = [os.urandom(32) for _ in range(3)]
        res = a.client.reserve(la, ks)
        data, checks = {}, {}
        for k, r in zip(ks, res, strict=True):
            for s, off in enumerate(r.offsets):
                data[(k, s)] = os.urandom(shard_bytes)
                card[off:off + shard_bytes] = data[(k, s)]
                checks[(k, s)] = os.urandom(words * 4)
        for s in range(shards):
            assert a.client.commit(la, s, res, checksums=[checks[(k, s)] for k in ks]) == 3
        a.wait(lambda t: t["tier_written"] == 3 and t["tier_inflight"] == 0, what="written")
        lb = b.client.register_layout("prod", "fp-w", shards, shard_bytes,
                                      check_words=words).layout_id
        r = b.client.lookup([(lb, ks)])
        assert r.num_chunks == 3 and b.tier()["tier_hits"] == 3
        check(b, r, ks, data, shard_bytes)
        assert r.raw_checksums == [b"".join(checks[(k, s)] for k in ks for s in range(shards))]
        b.client.release(r.lease_id)


def test_corrupt_report_removes_the_mooncake_copy(master, tmp_path):
    with hosts(master, tmp_path, extra=["--mooncake-wait-ms", "5000"]) as (a, b):
        la = a.client.register_layout("prod", "fp-c", 1, 8192, check_words=1).layout_id
        ks = [os.urandom(32) for _ in range(2)]
        res = a.client.reserve(la, ks)
        assert a.client.commit(la, 0, res, checksums=[os.urandom(4) for _ in ks]) == 2
        a.wait(lambda t: t["tier_written"] == 2 and t["tier_inflight"] == 0, what="written")
        assert a.client.report_corrupt(la, 0, [res[0]]) == 1
        names = [mooncake_key(layout_digest("prod", "fp-c", 1, 8192, 1), k) for k in ks]
        hand = master.client()
        try:
            deadline = time.monotonic() + 20
            while hand.is_exist(names[0]) == 1:  # removed by A's pull thread
                assert time.monotonic() < deadline, "the corrupt object's Mooncake copy stayed"
                time.sleep(0.05)
            assert hand.is_exist(names[1]) == 1
        finally:
            hand.close()
        lb = b.client.register_layout("prod", "fp-c", 1, 8192, check_words=1).layout_id
        assert b.client.lookup([(lb, ks[:1])], lease=False).num_chunks == 0
        r = b.client.lookup([(lb, ks[1:])], lease=False)
        assert r.num_chunks == 1  # the other object is still served from Mooncake
