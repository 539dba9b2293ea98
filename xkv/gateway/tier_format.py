"""The Mooncake tier's object format and keys (see :mod:`xkv.gateway.tier_store` for the format's
description: a 64-byte header, the shards, then the checksum words of a layout that has them).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import msgspec

HEADER = struct.Struct("<4sHHI16s8sQI16s")
SIGNED = HEADER.size - 16  # header bytes the MAC covers (all but itself)
FLAG_MAC = 1
HEADER_BYTES = HEADER.size  # 64
MAGIC, VERSION = b"XKVT", 1
VERSION_CHECKS = 2  # checksum words follow the shards


def layout_digest(namespace: str, fingerprint: str, num_shards: int, shard_bytes: int,
                  check_words: int = 0) -> bytes:
    """16 bytes naming a layout on every host alike (msgpack of the tuple: unambiguous).
    ``check_words`` (issue 25) is part of the layout: it joins the tuple when not 0 (so a layout
    without words keeps its digest, and its objects on disk and in Mooncake)."""
    fields = ["xkv-tier-1", namespace, fingerprint, num_shards, shard_bytes]
    blob = msgspec.msgpack.encode(fields + [check_words] if check_words else fields)
    return hashlib.blake2b(blob, digest_size=16).digest()


def mooncake_key(digest: bytes, key: bytes) -> str:
    return f"xkv1/{digest.hex()}/{key.hex()}"


def key_digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=8).digest()


def pack_header(digest: bytes, key: bytes, num_shards: int, shard_bytes: int, crc: int,
                flags: int = 0, mac: bytes = bytes(16), version: int = VERSION) -> bytes:
    return HEADER.pack(MAGIC, version, flags, num_shards, digest, key_digest(key), shard_bytes,
                       crc, mac)


def mac_key(secret: bytes) -> bytes:
    """The BLAKE2b key (64 bytes) derived from a secret of any length."""
    return hashlib.blake2b(b"xkv-tier-mac-1" + secret).digest()


@dataclass(frozen=True)
class TierItem:
    """One object to move: where its shards are in the card (byte offsets) and its identity."""

    digest: bytes
    key: bytes
    num_shards: int
    shard_bytes: int
    offsets: tuple[int, ...]
    ref: object = None  # the loop's handle (its index object); never touched by the threads
    #: Checksum words (issue 25), a writable buffer: a copy of the index's to push, or the
    #: STAGED object's own buffer that a pull fills. None: the layout has none.
    checks: bytearray | None = None

    @property
    def name(self) -> str:
        return mooncake_key(self.digest, self.key)

    @property
    def check_bytes(self) -> int:
        return len(self.checks) if self.checks is not None else 0

    @property
    def version(self) -> int:
        return VERSION_CHECKS if self.checks is not None else VERSION

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.num_shards * self.shard_bytes + self.check_bytes
