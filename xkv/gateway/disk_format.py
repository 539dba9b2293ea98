"""The disk tier's files: names, header, and the checks a file passes before a byte of it counts.

One card object (one chunk of one layout: ``num_shards`` shards of ``shard_bytes`` each) is one
file ``<root>/xkv-disk-1/<layout digest hex>/<name[:2]>/<name>`` where ``name`` is the card key
in hex (keys over 64 bytes: ``h`` + a 32-byte BLAKE2b of the key, the header holds the key
itself). The layout digest is the Mooncake tier's (:func:`xkv.gateway.tier_store.layout_digest`,
a BLAKE2b of namespace, fingerprint, num_shards, shard_bytes), so keys are what they are in the
card: a restarted gateway, and a restarted vLLM with the same model and namespace, find them.

File layout (every piece a multiple of :data:`BLOCK` bytes, so O_DIRECT moves it whole)::

    [0, BLOCK)                         header (below), zero padded
    [BLOCK + r * stride, ... + stride)  shard r, r < num_shards; stride = round_up(shard_bytes,
                                        BLOCK); bytes past shard_bytes are padding, never read

Header, little-endian: ``magic b"XKVD" | version u16 | key length u16 | num_shards u32 |
shard_bytes u64 | layout digest 16 B | crc32 of the shards u32 | crc32 of the header before it
u32 | key``. The payload checksum covers the ``shard_bytes`` of every shard (not the padding).

Visibility: a file is written under a temporary name (``<name>.tmp-<random>``), made durable
(``fdatasync``), then renamed to its name, and its directory is synced; the loop learns of it
only after that. A name therefore always holds a complete file, unless the disk itself lost
bytes; those, and any other damage, fail the header or checksum test on read: a miss.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

BLOCK = 4096  # bytes: O_DIRECT alignment of buffers, offsets and lengths (safe for 512e/4Kn)
ROOT_NAME = "xkv-disk-1"
MAGIC, VERSION = b"XKVD", 1
HEAD = struct.Struct("<4sHHIQ16sII")
MAX_KEY_BYTES = 512
TMP_MARK = ".tmp-"


def stride(shard_bytes: int) -> int:
    """Bytes one shard takes in a file (``shard_bytes`` rounded up to BLOCK)."""
    return -(-shard_bytes // BLOCK) * BLOCK


def file_bytes(num_shards: int, shard_bytes: int) -> int:
    """Size of an object's file: header block plus every shard's stride."""
    return BLOCK + num_shards * stride(shard_bytes)


def file_name(key: bytes) -> str:
    """The file name of ``key`` (no directory): hex, or ``h`` + BLAKE2b-256 hex for long keys."""
    if len(key) <= 64:
        return key.hex()
    return "h" + hashlib.blake2b(key, digest_size=32).hexdigest()


def rel_path(digest: bytes, name: str) -> str:
    """Path of an object's file below the tier's root directory (``<root>/xkv-disk-1``)."""
    return f"{digest.hex()}/{name[:2]}/{name}"


def pack_header(digest: bytes, key: bytes, num_shards: int, shard_bytes: int, crc: int) -> bytes:
    """The header block (BLOCK bytes) of an object whose shards have checksum ``crc``."""
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes, at most {MAX_KEY_BYTES}")
    fixed = HEAD.pack(MAGIC, VERSION, len(key), num_shards, shard_bytes, digest, crc, 0)[:-4]
    head = fixed + struct.pack("<I", zlib.crc32(fixed + key)) + key
    return head + bytes(BLOCK - len(head))


def check_header(block, digest: bytes, key: bytes, num_shards: int, shard_bytes: int) -> int:
    """The payload crc32 a header block promises, after checking that it is intact and names
    this object (layout, key, geometry); raises ValueError saying what differs."""
    block = bytes(block[:HEAD.size + MAX_KEY_BYTES])
    magic, version, klen, shards, sbytes, dig, crc, hcrc = HEAD.unpack_from(block)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"not an xkv disk object (magic {magic!r}, version {version})")
    if klen > MAX_KEY_BYTES or zlib.crc32(block[:HEAD.size - 4] + block[HEAD.size:HEAD.size + klen]) != hcrc:
        raise ValueError("header checksum mismatch")
    if (dig, shards, sbytes) != (digest, num_shards, shard_bytes):
        raise ValueError(f"header is for another layout ({shards} x {sbytes} B)")
    if block[HEAD.size:HEAD.size + klen] != key:
        raise ValueError("header names another key")
    return crc
