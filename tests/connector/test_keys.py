"""Chunk keys come from vLLM block hashes only; fingerprints."""

import pytest

from xkv.connector.keys import chunk_keys, fingerprint

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
