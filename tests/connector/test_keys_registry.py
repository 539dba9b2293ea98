"""Chunk keys come from vLLM block hashes only; fingerprints; the registry's decisions."""

import pytest

from xkv.connector.keys import chunk_keys, fingerprint
from xkv.connector.registry import CacheGroup, RegistryError, build_registry

H = [bytes([i]) * 32 for i in range(10)]


def test_chunk_key_is_last_block_hash():
    assert chunk_keys(H, 2, 0, 3) == [H[1], H[3], H[5]]
    assert chunk_keys(H, 4, 1, 2) == [H[7]]
    assert chunk_keys(H, 3, 0, 0) == []
    with pytest.raises(ValueError, match="full chunk"):
        chunk_keys(H, 4, 0, 3)  # only 2 full chunks of 4


def test_fingerprint_changes_with_every_field():
    base = {"model": "m", "dtype": "float32", "block_size": 32, "chunk_size": 64, "tp_size": 1,
            "group": 0}
    fp = fingerprint(base)
    assert fp == fingerprint(dict(reversed(list(base.items()))))
    for k, v in [("model", "n"), ("dtype", "bf16"), ("block_size", 16), ("chunk_size", 128),
                 ("tp_size", 2), ("group", 1)]:
        assert fingerprint({**base, k: v}) != fp, k


def _g(i=0, kind="attention", layers=("a", "b"), bs=32, bb=1024):
    return CacheGroup(i, kind, tuple(layers), bs, bb, "Spec")


def test_attention_sharded_mla_replicated():
    r = build_registry([_g(0, "attention"), _g(1, "mla", ("c",))], tp_size=4, pp_size=1,
                       chunk_size=64)
    a, m = r.groups
    assert (a.num_shards, a.writer_ranks, a.reader_ranks) == (4, (0, 1, 2, 3), (0, 1, 2, 3))
    assert [a.shard_of(r) for r in range(4)] == [0, 1, 2, 3]
    assert (m.num_shards, m.writer_ranks) == (1, (0,))
    assert [m.shard_of(r) for r in range(4)] == [0, 0, 0, 0] and not m.writes(1)
    assert a.blocks_per_chunk == 2 and a.shard_bytes == 2 * 2 * 1024
    lines = r.log_lines()
    assert lines[0].startswith("KV cache registry: 3 cache(s) in 2 group(s); writers: ")
    assert " ; readers: " in lines[0]
    assert lines[1] == "KV cache layout: 2 group(s)"


@pytest.mark.parametrize("kind", ["MambaSpec", "SlidingWindowSpec", "CrossAttentionSpec"])
def test_cache_nobody_writes_is_refused(kind):
    with pytest.raises(RegistryError, match="has no writer"):
        build_registry([_g(0), _g(1, kind)], tp_size=1, pp_size=1, chunk_size=64)


def test_registry_refusals():
    with pytest.raises(RegistryError, match="pipeline"):
        build_registry([_g()], tp_size=1, pp_size=2, chunk_size=64)
    with pytest.raises(RegistryError, match="multiple"):
        build_registry([_g()], tp_size=1, pp_size=1, chunk_size=48)
    with pytest.raises(RegistryError, match="no KV cache group"):
        build_registry([], tp_size=1, pp_size=1, chunk_size=64)


def test_slot_alignment_rounds_registered_size():
    r = build_registry([_g(bb=1000)], tp_size=1, pp_size=1, chunk_size=64, slot_alignment=4096)
    (p,) = r.groups
    assert p.shard_bytes == 2 * 2 * 1000 and p.registered_bytes == 4096
