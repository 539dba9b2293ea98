"""The gateway's KV events decoded with each vLLM's own classes (issue 27 item 8): this module
runs under every vLLM of the matrix (scripts/matrix.sh runs tests/compat on each), so a router
built against any of them reads the gateway's frames. The one wire format: vLLM's
``[topic, 8-byte big-endian sequence, msgpack KVEventBatch]`` where a batch is an array
``[ts, [event, ...]]`` and an event a map tagged ``type``; the gateway sends only fields that every
version in the matrix knows (docs/operations.md, "KV events"), later ones being optional."""

from __future__ import annotations

import hashlib

import msgspec
import pytest
import zmq

from xkv.gateway.index import Index
from xkv.gateway.testing import capturing_publisher

PAGE = 4096


@pytest.mark.parametrize("int_hashes", [True, False])
def test_gateway_events_decode_with_this_vllms_classes(int_hashes):
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    ctx = zmq.Context()
    pub, cap = capturing_publisher(ctx, int_hashes=int_hashes, medium="CPU")
    ix = Index(2 * PAGE, slot_alignment=PAGE)
    ix.listener = pub
    lid = ix.register_layout("ns", "fp", 1, PAGE).layout_id
    hashes = [[hashlib.sha256(b"%d/%d" % (c, j)).digest() for j in range(3)] for c in range(3)]
    conv = (lambda h: int.from_bytes(h, "big") & (2**64 - 1)) if int_hashes else (lambda h: h)
    try:
        keys = [h[-1] for h in hashes]
        ix.reserve(lid, keys[:2], now=0)
        pub.staged(ix.layouts[lid].objects[keys[0]], hashes[0], b"p" * 32, 16, 1)
        ix.commit(lid, 0, keys[:2])  # keys[1] has no block information: the placeholder form
        ix.reserve(lid, keys[2:], now=0)  # evicts keys[0] (least recently used)
        pub.cleared()
    finally:
        ctx.destroy(linger=0)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    events, seqs = [], []
    for topic, seq, payload in cap.frames:
        assert topic == b"" and len(seq) == 8
        seqs.append(int.from_bytes(seq, "big"))
        batch = decoder.decode(payload)
        assert isinstance(batch.ts, float)
        events += batch.events
    assert seqs == list(range(len(seqs)))
    stored, placeholder, removed, cleared = events
    assert isinstance(stored, BlockStored) and isinstance(placeholder, BlockStored)
    assert stored.block_hashes == [conv(h) for h in hashes[0]]
    assert stored.parent_block_hash == conv(b"p" * 32)
    assert (stored.token_ids, stored.block_size, stored.medium, stored.group_idx) == ([], 16,
                                                                                     "CPU", 1)
    assert stored.lora_id is None and stored.lora_name is None
    assert placeholder.block_hashes == [conv(keys[1])] and placeholder.block_size == 0
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [conv(h) for h in hashes[0]] and removed.group_idx == 1
    assert isinstance(cleared, AllBlocksCleared)
    # every key the gateway sends is a field of this version's class (a router that decodes with
    # forbid_unknown_fields, or a version without a field, would choke on any other)
    known = {cls.__name__: {f.encode_name for f in msgspec.structs.fields(cls)} | {"type"}
             for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
    for _, _, payload in cap.frames:
        for ev in msgspec.msgpack.decode(payload)[1]:
            assert set(ev) <= known[ev["type"]], (ev["type"], set(ev) - known[ev["type"]])
