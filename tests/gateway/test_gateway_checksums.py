"""Protocol v3 checksum words (issue 25, docs: checksum-api): HELLO's check_words, COMMIT's
checksums, LOOKUP's checksums. The gateway stores the words as opaque bytes beside each slot and
returns them exactly, chunk-major then shard; wrong lengths are refused before anything changes;
layouts without words behave as before; a reply never passes its size cap."""

from __future__ import annotations

import os
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xkv.gateway import ErrorCode, GatewayClient, GatewayError
from xkv.gateway import protocol as P
from xkv.gateway.index import Index, RequestError
from xkv.gateway.testing import running_gateway

A = 64  # slot alignment of the index-level tests


def _words(rng: random.Random, n: int) -> bytes:
    return struct.pack(f"<{n}I", *(rng.getrandbits(32) for _ in range(n)))


def _expected(checks: dict, keys, num_shards: int) -> bytes:
    """chunk-major then shard: checks[(key, shard)] in that order."""
    return b"".join(checks[(k, r)] for k in keys for r in range(num_shards))


@pytest.fixture(scope="module")
def port():
    with running_gateway("32M") as p:
        yield p


@pytest.fixture
def client(port):
    with GatewayClient("localhost", port, timeout_s=5.0) as c:
        yield c


# ------------------------------------------------------------------ over the socket


def test_round_trip_multi_shard_chunk_major(client):
    rng = random.Random(1)
    shards, words = 3, 5
    info = client.register_layout("cs", "round", shards, 100, check_words=words)
    assert info.check_words == words
    keys = [os.urandom(32) for _ in range(7)]
    res = client.reserve(info.layout_id, keys)
    assert all(r is not None for r in res)
    checks = {(k, r): _words(rng, words) for k in keys for r in range(shards)}
    for r in (2, 0):  # shards commit in any order; not visible until all did
        assert client.commit(info.layout_id, r, res,
                             checksums=[checks[(k, r)] for k in keys]) == len(keys)
    assert client.lookup([(info.layout_id, keys)], lease=False).num_chunks == 0
    assert client.commit(info.layout_id, 1, res, checksums=[checks[(k, 1)] for k in keys]) == 7
    found = client.lookup([(info.layout_id, keys)])
    assert found.num_chunks == 7
    assert found.raw_checksums == [_expected(checks, keys, shards)]
    assert len(found.raw_checksums[0]) == 7 * shards * words * 4
    # word index (c * num_shards + r) * check_words, as the interface says
    flat = memoryview(found.raw_checksums[0]).cast("I")
    c, r = 4, 2
    assert bytes(flat[(c * shards + r) * words:(c * shards + r + 1) * words].cast("B")) == \
        checks[(keys[c], r)]
    # a prefix lookup returns the prefix's words
    part = client.lookup([(info.layout_id, keys[:3] + [b"absent"] + keys[3:])], lease=False)
    assert part.num_chunks == 3 and part.raw_checksums == [_expected(checks, keys[:3], shards)]
    client.release(found.lease_id)


def test_groups_with_and_without_words(client):
    rng = random.Random(2)
    a = client.register_layout("cs", "g-a", 2, 64, check_words=3)
    b = client.register_layout("cs", "g-b", 1, 64)  # no words
    c = client.register_layout("cs", "g-c", 4, 64, check_words=1)
    keys = [os.urandom(16) for _ in range(4)]
    checks = {}
    for info in (a, b, c):
        res = client.reserve(info.layout_id, keys)
        for r in range(info.num_shards):
            cs = [_words(rng, info.check_words) for _ in keys]
            for k, w in zip(keys, cs, strict=True):
                checks[(info.layout_id, k, r)] = w
            if info.check_words:
                assert client.commit(info.layout_id, r, res, checksums=cs) == 4
            else:
                assert client.commit(info.layout_id, r, res) == 4
    found = client.lookup([(a.layout_id, keys), (b.layout_id, keys), (c.layout_id, keys)],
                          lease=False)
    assert found.num_chunks == 4
    for g, info in enumerate((a, b, c)):
        want = b"".join(checks[(info.layout_id, k, r)] for k in keys
                        for r in range(info.num_shards))
        assert found.raw_checksums[g] == want
    assert found.raw_checksums[1] == b""


def test_layout_without_words_is_unchanged(client):
    info = client.register_layout("cs", "plain", 2, 64)
    assert info.check_words == 0
    keys = [b"p%d" % i for i in range(3)]
    res = client.reserve(info.layout_id, keys)
    for r in range(2):
        assert client.commit(info.layout_id, r, res) == 3
    found = client.lookup([(info.layout_id, keys)], lease=False)
    assert found.num_chunks == 3 and found.raw_checksums == [b""]
    assert found.slots[0][2].offsets == res[2].offsets
    # a v2-shaped COMMIT encodes without the new field (omit_defaults): same bytes as before
    body = P.encoder.encode(P.Commit(1, 1, 0, [b"k"], [0], [0]))
    assert b"checksums" not in body
    assert b"check_words" not in P.encoder.encode(P.Hello(P.PROTOCOL_VERSION, "n", "f", 1, 1))
    # words for a layout without words: refused by client and gateway
    more = client.reserve(info.layout_id, [b"p-extra"])
    with pytest.raises(ValueError, match="check_words=0"):
        client.commit(info.layout_id, 0, more, checksums=[b"\0\0\0\0"])
    with pytest.raises(GatewayError) as e:
        client._call(P.Commit(client.epoch, info.layout_id, 0, [b"p-extra"], [more[0].offsets[0]],
                              [more[0].generations[0]], b"\0\0\0\0"), P.Ack, 5.0)
    assert e.value.code == ErrorCode.BAD_REQUEST and "check_words=0" in str(e.value)


def test_check_words_is_part_of_the_layout(client):
    client.register_layout("cs", "ident", 1, 64, check_words=2)
    assert client.register_layout("cs", "ident", 1, 64, check_words=2).check_words == 2
    for other in (0, 1, 3):
        with pytest.raises(GatewayError) as e:
            client.register_layout("cs", "ident", 1, 64, check_words=other)
        assert e.value.code == ErrorCode.LAYOUT_MISMATCH
        assert f"check_words={other}" in str(e.value) and "check_words=2" in str(e.value)
    with pytest.raises(ValueError, match="check_words"):
        client.register_layout("cs", "too-many", 1, 64, check_words=P.MAX_CHECK_WORDS + 1)
    with pytest.raises(ValueError, match="check_words"):
        client.register_layout("cs", "negative", 1, 64, check_words=-1)
    # past the schema's bound straight on the wire: refused by the gateway's decoder
    with pytest.raises(GatewayError) as e:
        client._call(P.Hello(P.PROTOCOL_VERSION, "cs", "wire", 1, 64, 0, P.MAX_CHECK_WORDS + 1),
                     P.LayoutInfo, 5.0)
    assert e.value.code in (ErrorCode.MALFORMED, ErrorCode.TOO_LARGE)
    big = P.MAX_CHECK_WORDS * 4 * P.CHECK_BYTES_PER_SLOT_BYTE  # the words fit 1/8 of the slot
    assert client.register_layout("cs", "max", 1, big,
                                  check_words=P.MAX_CHECK_WORDS).check_words == P.MAX_CHECK_WORDS
    # words over 1/8 of the slot: the gateway's memory for words stays below 1/8 of the card
    with pytest.raises(GatewayError) as e:
        client.register_layout("cs", "max-small", 1, 64, check_words=P.MAX_CHECK_WORDS)
    assert e.value.code == ErrorCode.BAD_REQUEST and "1/8 of the 4096-byte slot" in str(e.value)
    assert client.register_layout("cs", "ratio", 1, 64, check_words=128).check_words == 128
    with pytest.raises(GatewayError, match="check_words=129"):
        client.register_layout("cs", "ratio-over", 1, 64, check_words=129)


def test_wrong_lengths_refused_before_anything_changes(client):
    rng = random.Random(3)
    words = 4
    info = client.register_layout("cs", "lengths", 2, 64, check_words=words)
    lid = info.layout_id
    keys = [b"L%d" % i for i in range(3)]
    res = client.reserve(lid, keys)
    good = [_words(rng, words) for _ in keys]
    before = client.stats()
    # client side: a clear ValueError naming the value and what was expected; nothing sent
    with pytest.raises(ValueError, match="needs checksums"):
        client.commit(lid, 0, res)
    with pytest.raises(ValueError, match=r"checksums\[1\] has 15 bytes.*expected 16"):
        client.commit(lid, 0, res, checksums=[good[0], good[1][:15], good[2]])
    with pytest.raises(ValueError, match=r"checksums\[2\] has 20 bytes.*expected 16"):
        client.commit(lid, 0, res, checksums=[good[0], good[1], good[2] + b"1234"])
    with pytest.raises(ValueError, match="2 checksums for 3 reservations"):
        client.commit(lid, 0, res, checksums=good[:2])
    after = client.stats()
    assert after.get("requests_commit", 0) == before.get("requests_commit", 0)
    # gateway side: every length but the exact one is BAD_REQUEST, and nothing is committed
    offs = [r.offsets[0] for r in res]
    gens = [r.generations[0] for r in res]
    for n in (0, 1, 3 * 16 - 1, 3 * 16 + 1, 3 * 16 + 4, 2 * 16):
        with pytest.raises(GatewayError) as e:
            client._call(P.Commit(client.epoch, lid, 0, list(keys), offs, gens,
                                  b"".join(good)[:n] if n <= 48 else b"".join(good) + b"x" *
                                  (n - 48)), P.Ack, 5.0)
        assert e.value.code == ErrorCode.BAD_REQUEST
        assert f"carries {n} checksum bytes" in str(e.value) and "expected 3 * 4 * 4 = 48" in \
            str(e.value)
    assert client.stats()["committed"] == after["committed"]
    # nothing changed: shard 1 alone does not make them visible (shard 0 was never marked)
    assert client.commit(lid, 1, res, checksums=[_words(rng, words) for _ in keys]) == 3
    assert client.lookup([(lid, keys)], lease=False).num_chunks == 0
    assert client.commit(lid, 0, res, checksums=good) == 3
    found = client.lookup([(lid, keys)], lease=False)
    assert found.num_chunks == 3
    assert bytes(found.raw_checksums[0][:16]) == good[0]  # the refused bytes were never stored


def test_big_commit_is_split_to_fit_the_frame(client):
    rng = random.Random(4)
    words = P.MAX_CHECK_WORDS
    per_msg = P.commit_keys_per_message(words)
    assert 1 <= per_msg < 100
    info = client.register_layout("cs", "split", 1, words * 4 * P.CHECK_BYTES_PER_SLOT_BYTE,
                                  check_words=words)
    keys = [b"S%03d" % i for i in range(100)]
    res = client.reserve(info.layout_id, keys)
    cs = [_words(rng, words) for _ in keys]
    before = client.stats().get("requests_commit", 0)
    assert client.commit(info.layout_id, 0, res, checksums=cs) == 100
    assert client.stats()["requests_commit"] - before == -(-100 // per_msg)
    found = client.lookup([(info.layout_id, keys)], lease=False)
    assert found.num_chunks == 100 and found.raw_checksums == [b"".join(cs)]


def test_stale_reservation_drops_its_checksum_in_step(client):
    """A reservation whose slot generation moved is not sent; its words go with it, so the
    remaining keys keep their own words (a shifted list would pair keys with wrong words)."""
    rng = random.Random(5)
    client.map_card()
    info = client.register_layout("cs", "stale", 1, 64, check_words=2)
    keys = [b"T0", b"T1", b"T2"]
    res = client.reserve(info.layout_id, keys)
    assert client.abort(info.layout_id, 0, [res[1]]) == 1  # its generation moves
    cs = [_words(rng, 2) for _ in keys]
    stale = client.stale_reservations
    assert client.commit(info.layout_id, 0, [res[0], None, res[1], res[2]],
                         checksums=[cs[0], b"ignored", cs[1], cs[2]]) == 2
    assert client.stale_reservations == stale + 1
    assert client.lookup([(info.layout_id, keys[:1])], lease=False).raw_checksums == [cs[0]]
    assert client.lookup([(info.layout_id, keys[2:])], lease=False).raw_checksums == [cs[2]]


# ------------------------------------------------------------------ index level


def _filled(ix: Index, lid: int, keys, rng) -> dict:
    lay = ix.layouts[lid]
    out = ix.reserve(lid, keys, now=0)
    checks = {}
    for r in range(lay.num_shards):
        cs = [_words(rng, lay.check_words) for _ in keys]
        for k, w in zip(keys, cs, strict=True):
            checks[(k, r)] = w
        tokens = [(s.offsets[r], s.generations[r]) for _, s in out]
        assert ix.commit(lid, r, keys, tokens=tokens, now=0, checksums=b"".join(cs)) == len(keys)
    return checks


def test_reply_size_cap_shortens_the_prefix_and_leases_only_it():
    rng = random.Random(6)
    ix = Index(256 * A, slot_alignment=A)
    a = ix.register_layout("ns", "a", 2, 2 * A, check_words=3)  # 2 * (16 + 12) = 56 B per chunk
    b = ix.register_layout("ns", "b", 1, A)  # 16 B per chunk
    keys = [b"c%d" % i for i in range(9)]
    _filled(ix, a.layout_id, keys, rng)
    _filled(ix, b.layout_id, keys, rng)
    assert ix.lookup([(a.layout_id, keys)], now=0, lease=False)[0] == 9
    ix.max_reply_bytes = 56 * 5 + 55
    num, lease, hits = ix.lookup([(a.layout_id, keys)], now=0)
    assert num == 5 and len(hits[0]) == 5 and ix.leased_objects == 5
    assert ix.release(lease) == 1
    ix.max_reply_bytes = 72 * 4  # two groups: 56 + 16 per chunk
    assert ix.lookup([(a.layout_id, keys), (b.layout_id, keys)], now=0, lease=False)[0] == 4
    ix.max_reply_bytes = 55  # not one chunk fits: a miss, nothing leased
    assert ix.lookup([(a.layout_id, keys)], now=0) == (0, 0, [[]])
    assert ix.leased_objects == 0
    # a layout whose one object alone would not fit is refused at HELLO
    with pytest.raises(RequestError) as e:
        ix.register_layout("ns", "huge", 2, A, check_words=10)
    assert e.value.code == ErrorCode.BAD_REQUEST and "lookup reply" in str(e.value)
    # the default cap never shortens a layout without words (the v2 worst case fits)
    assert P.MAX_REPLY_BYTES // (P.MAX_SHARDS * 16) >= P.MAX_KEYS


@settings(max_examples=60, deadline=None)
@given(shards=st.integers(1, 5), words=st.integers(0, 7), n=st.integers(0, 12),
       order=st.randoms(use_true_random=False), seed=st.integers(0, 2**32 - 1))
def test_index_stores_words_exactly(shards, words, n, order, seed):
    rng = random.Random(seed)
    ix = Index(1024 * A, slot_alignment=A)
    lid = ix.register_layout("ns", "fp", shards, 4 * A + 3, check_words=words).layout_id
    keys = [b"h%d" % i for i in range(n)]
    out = ix.reserve(lid, keys, now=0)
    checks = {}
    rs = list(range(shards))
    order.shuffle(rs)
    for r in rs:
        cs = [_words(rng, words) for _ in keys]
        checks.update({(k, r): w for k, w in zip(keys, cs, strict=True)})
        tokens = [(s.offsets[r], s.generations[r]) for _, s in out]
        assert ix.commit(lid, r, keys, tokens=tokens, now=0, checksums=b"".join(cs)) == n
    num, _, hits = ix.lookup([(lid, keys)], now=0, lease=False)
    assert num == n
    got = b"".join(obj.checks for obj in hits[0])
    assert got == _expected(checks, keys, shards)
    assert all(isinstance(obj.checks, bytes) for obj in hits[0])  # fixed once READY
