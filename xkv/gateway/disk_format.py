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

Checksum words (issue 25, version 2). An object of a layout with checksum words (HELLO's
``check_words``) carries them, opaque, as the card's index holds them (num_shards x check_words
uint32, shard-major): in a region after the last shard, ``[BLOCK + num_shards * stride, ... +
round_up(check_bytes, BLOCK))``, zero padded. Its header has version 2 and, after the key, the
region's length ``check_bytes`` u32, covered by the header crc32; the payload crc32 goes on over
the words after the shards. Objects without words keep version 1, byte for byte. (The layout
digest of a layout with words includes check_words, so the two never share a directory.)

Visibility: a file is written under a temporary name (``<name>.tmp-<random>``), made durable
(``fdatasync``), then renamed to its name, and its directory is synced (so is the parent of a
directory the write had to make); the loop learns of it only after that
(tests/disk/test_disk_power_loss.py draws power losses at every step). A name therefore always holds a complete file, unless the disk itself lost
bytes; those, and any other damage, fail the header or checksum test on read: a miss.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

BLOCK = 4096  # bytes: O_DIRECT alignment of buffers, offsets and lengths (safe for 512e/4Kn)
ROOT_NAME = "xkv-disk-1"
MAGIC, VERSION = b"XKVD", 1
VERSION_CHECKS = 2  # the object carries checksum words (see above)
CHECKS_LEN = struct.Struct("<I")
HEAD = struct.Struct("<4sHHIQ16sII")
MAX_KEY_BYTES = 512
TMP_MARK = ".tmp-"


def stride(shard_bytes: int) -> int:
    """Bytes one shard takes in a file (``shard_bytes`` rounded up to BLOCK)."""
    return -(-shard_bytes // BLOCK) * BLOCK


def file_bytes(num_shards: int, shard_bytes: int, check_bytes: int = 0) -> int:
    """Size of an object's file: header block, every shard's stride, and the checksum words'
    region (``check_bytes`` rounded up to BLOCK; none without words)."""
    return BLOCK + num_shards * stride(shard_bytes) + stride(check_bytes)


def checks_offset(num_shards: int, shard_bytes: int) -> int:
    """Where the checksum words' region starts in an object's file."""
    return BLOCK + num_shards * stride(shard_bytes)


def file_name(key: bytes) -> str:
    """The file name of ``key`` (no directory): hex, or ``h`` + BLAKE2b-256 hex for long keys."""
    if len(key) <= 64:
        return key.hex()
    return "h" + hashlib.blake2b(key, digest_size=32).hexdigest()


def rel_path(digest: bytes, name: str) -> str:
    """Path of an object's file below the tier's root directory (``<root>/xkv-disk-1``)."""
    return f"{digest.hex()}/{name[:2]}/{name}"


def pack_header(digest: bytes, key: bytes, num_shards: int, shard_bytes: int, crc: int,
                check_bytes: int = 0) -> bytes:
    """The header block (BLOCK bytes) of an object whose payload (shards, then ``check_bytes``
    of checksum words) has checksum ``crc``; version 2 with words, else 1."""
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes, at most {MAX_KEY_BYTES}")
    version = VERSION_CHECKS if check_bytes else VERSION
    fixed = HEAD.pack(MAGIC, version, len(key), num_shards, shard_bytes, digest, crc, 0)[:-4]
    tail = key + (CHECKS_LEN.pack(check_bytes) if check_bytes else b"")
    head = fixed + struct.pack("<I", zlib.crc32(fixed + tail)) + tail
    return head + bytes(BLOCK - len(head))


def check_header(block, digest: bytes, key: bytes, num_shards: int, shard_bytes: int,
                 check_bytes: int = 0) -> int:
    """The payload crc32 a header block promises, after checking that it is intact and names
    this object (layout, key, geometry, bytes of checksum words); raises ValueError saying
    what differs."""
    block = bytes(block[:HEAD.size + MAX_KEY_BYTES + CHECKS_LEN.size])
    magic, version, klen, shards, sbytes, dig, crc, hcrc = HEAD.unpack_from(block)
    want = VERSION_CHECKS if check_bytes else VERSION
    if magic != MAGIC or version != want:
        raise ValueError(f"not an xkv disk object of this kind (magic {magic!r}, version "
                         f"{version}, expected {want})")
    tail = block[HEAD.size:HEAD.size + klen + (CHECKS_LEN.size if check_bytes else 0)]
    if klen > MAX_KEY_BYTES or zlib.crc32(block[:HEAD.size - 4] + tail) != hcrc:
        raise ValueError("header checksum mismatch")
    if check_bytes and CHECKS_LEN.unpack_from(tail, klen)[0] != check_bytes:
        raise ValueError(f"header promises {CHECKS_LEN.unpack_from(tail, klen)[0]} bytes of "
                         f"checksum words, expected {check_bytes}")
    if (dig, shards, sbytes) != (digest, num_shards, shard_bytes):
        raise ValueError(f"header is for another layout ({shards} x {sbytes} B)")
    if block[HEAD.size:HEAD.size + klen] != key:
        raise ValueError("header names another key")
    return crc
