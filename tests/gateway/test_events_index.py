"""KV events against the index's state machine: whatever sequence of reserves, commits, aborts,
leases, TTLs, LRU and quota evictions happens, the events (decoded with vLLM's decoder) replay to
exactly the set of visible objects, and nothing is removed that was not stored."""

from __future__ import annotations

import hashlib
from collections import Counter

import msgspec
import pytest
import zmq
from hypothesis import event, given
from hypothesis import strategies as st

from xkv.gateway.index import Index
from xkv.gateway.testing import capturing_publisher

pytestmark = pytest.mark.vllm
PAGE = 4096
K = 3  # hash blocks per chunk


def _hashes(key_id: int) -> list[bytes]:
    return [hashlib.sha256(b"%d/%d" % (key_id, j)).digest() for j in range(K)]


op = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 2), st.lists(st.integers(0, 11), max_size=4)),
    st.tuples(st.just("store"), st.integers(0, 2), st.lists(st.integers(0, 11), max_size=4)),
    st.tuples(st.just("store"), st.integers(0, 2), st.lists(st.integers(0, 11), max_size=4)),
    st.tuples(st.just("reserve"), st.integers(0, 2), st.lists(st.integers(0, 11), max_size=4)),
    st.tuples(st.just("commit"), st.integers(0, 2), st.lists(st.integers(0, 11), max_size=4)),
    st.tuples(st.just("abort"), st.integers(0, 2), st.lists(st.integers(0, 11), max_size=4)),
    st.tuples(st.just("lookup"), st.integers(0, 2), st.lists(st.integers(0, 11), max_size=4)),
    st.tuples(st.just("release"), st.integers(0, 2), st.just([])),
    st.tuples(st.just("tick"), st.integers(0, 2), st.just([])),
)


@given(st.lists(op, min_size=10, max_size=80), st.booleans())
def test_events_replay_to_the_visible_objects(ops, int_hashes):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    idx = Index(6 * PAGE, slot_alignment=PAGE, lease_ttl_s=5, write_ttl_s=7,
                quotas={"q": 2 * PAGE})
    ctx = zmq.Context()
    pub, cap = capturing_publisher(ctx, int_hashes=int_hashes)
    idx.listener = pub
    layouts = [idx.register_layout("a", "f1", 1, PAGE), idx.register_layout("a", "f2", 2, 100),
               idx.register_layout("q", "f1", 1, PAGE)]
    now, leases = 0.0, []
    conv = (lambda h: int.from_bytes(h, "big") & (2**64 - 1)) if int_hashes else (lambda h: h)
    try:
        for kind, li, ids in ops:
            lay = layouts[li]
            keys = [_hashes(i)[-1] for i in ids]
            if kind in ("reserve", "store"):
                for i, key, (status, _) in zip(ids, keys, idx.reserve(lay.layout_id, keys, now),
                                               strict=True):
                    if status == 0 and key in lay.objects and not lay.objects[key].ready:
                        pub.staged(lay.objects[key], _hashes(i), None, 16, li)
                if kind == "store":
                    for shard in range(lay.num_shards):
                        idx.commit(lay.layout_id, shard, keys)
            elif kind in ("commit", "abort"):
                for shard in range(lay.num_shards if kind == "commit" else 1):
                    getattr(idx, kind)(lay.layout_id, shard, keys)
            elif kind == "lookup" and keys:
                leases.append(idx.lookup([(lay.layout_id, keys)], now)[1])
            elif kind == "release" and leases:
                idx.release(leases.pop(0))
            elif kind == "tick":
                now += 3.0
                idx.expire(now)
            pub.flush()
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        live: Counter = Counter()
        for n, (_topic, seq, payload) in enumerate(cap.frames):
            assert int.from_bytes(seq, "big") == n
            for e in decoder.decode(payload).events:
                h = (e.group_idx, tuple(e.block_hashes))
                if isinstance(e, BlockStored):
                    assert live[h] == 0, "stored twice without a removal"
                    live[h] += 1
                else:
                    assert isinstance(e, BlockRemoved) and live[h] == 1, "removed, never stored"
                    live[h] -= 1
        visible = {(li, tuple(conv(x) for x in _hashes(i)))
                   for li, lay in enumerate(layouts) for i in range(12)
                   if (o := lay.objects.get(_hashes(i)[-1])) is not None and o.ready}
        event(f"evictions: {idx.counters['evicted'] > 0}, quota: {idx.counters['evicted_quota'] > 0}")
        assert {h for h, n in live.items() if n} == visible
        assert len(pub._meta) <= sum(len(lay.objects) for lay in layouts)  # nothing leaks
    finally:
        ctx.term()
