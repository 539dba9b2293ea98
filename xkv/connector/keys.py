"""Keys on the card: a layout fingerprint per cache group, and one key per chunk.

Keys come from vLLM's block hashes only (they already carry cache_salt,
LoRA and multimodal hashes); we never hash tokens. A stored object is identified by
``(key_namespace, fingerprint(group), chunk key)``: the namespace and fingerprint are bound once
per gateway connection by ``register_layout`` (the gateway keeps them apart), and the chunk key is
the block hash of the chunk's last hash block — because vLLM chains hashes, it covers every token
before it, the salt and the adapters. The shard (TP rank) is a slot inside the object, not part of
the key: the gateway makes an object visible only once every shard committed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

#: Bumped whenever the bytes of a stored object would change meaning (layout-major order, ...).
OBJECT_FORMAT_VERSION = 1


def fingerprint(fields: Mapping[str, Any]) -> str:
    """Hex SHA-256 of the canonical JSON of ``fields`` (model, dtype, block size, chunk size,
    TP size, group, bytes per block, layout name, hash algorithm, ...).

    Every field that changes the bytes of a stored object, or which tokens a key stands for, must
    be in ``fields``: two engines share objects only if their fingerprints are equal.
    """
    body = {"xkv_object_format": OBJECT_FORMAT_VERSION, **fields}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def num_full_chunks(num_hashes: int, hashes_per_chunk: int) -> int:
    """Chunks fully covered by ``num_hashes`` block hashes."""
    if hashes_per_chunk <= 0:
        raise ValueError(f"hashes_per_chunk={hashes_per_chunk}: expected >= 1")
    return num_hashes // hashes_per_chunk


def chunk_keys(
    block_hashes: Sequence[bytes], hashes_per_chunk: int, start: int, stop: int
) -> list[bytes]:
    """Keys of chunks ``[start, stop)``: the hash of each chunk's last block, as bytes.

    ``block_hashes`` is ``request.block_hashes`` (one per full hash block, in order);
    ``hashes_per_chunk`` = chunk_size // hash_block_size. Chunks must be complete.
    """
    n = num_full_chunks(len(block_hashes), hashes_per_chunk)
    if not 0 <= start <= stop <= n:
        raise ValueError(
            f"chunks [{start}, {stop}) requested but only {n} full chunk(s) of "
            f"{hashes_per_chunk} block hashes exist ({len(block_hashes)} hashes)"
        )
    out = []
    for c in range(start, stop):
        h = block_hashes[(c + 1) * hashes_per_chunk - 1]
        out.append(bytes(h))
    return out


def event_fields(block_hashes: Sequence[bytes], hashes_per_chunk: int, chunks: Sequence[int],
                 hash_block_size: int, group_idx: int) -> dict[str, Any]:
    """RESERVE's fields for the gateway's KV events (``GatewayClient.reserve`` keywords): per
    chunk, its block hashes (the last is its key) and the hash of the block before it (None for
    chunk 0); the tokens per hash block; vLLM's KV-cache group."""
    blocks = []
    for c in chunks:
        lo, hi = c * hashes_per_chunk, (c + 1) * hashes_per_chunk
        if c < 0 or hi > len(block_hashes):
            raise ValueError(f"chunk {c} of {hashes_per_chunk} hashes needs {hi} block hashes, "
                             f"{len(block_hashes)} exist")
        blocks.append(([bytes(h) for h in block_hashes[lo:hi]],
                       bytes(block_hashes[lo - 1]) if lo else None))
    return {"blocks": blocks, "block_size": hash_block_size, "group_idx": group_idx}
