"""What the index keeps per layout, per stored object and per lease (see index.py)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

from xkv.gateway.protocol import ChunkSlots, ErrorCode


class RequestError(Exception):
    """A request the index refuses; the server turns it into an ErrorReply with ``code``."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class Layout:
    layout_id: int
    namespace: str
    fingerprint: str
    num_shards: int
    shard_bytes: int
    slot_bytes: int
    slot_pages: int
    lru: OrderedDict[Obj, None]  # unleased READY objects of the namespace, least recent first
    size_lru: OrderedDict[Obj, None]  # the same over every layout of its object size (pages)
    objects: dict[bytes, Obj] = field(default_factory=dict)
    check_words: int = 0  # opaque uint32 checksum words per shard of one object (HELLO)

    @property
    def check_bytes(self) -> int:
        """Bytes of checksum words per shard of one object (check_words * 4)."""
        return self.check_words * 4

    @property
    def object_pages(self) -> int:
        return self.slot_pages * self.num_shards


class Obj(msgspec.Struct, gc=False, eq=False):
    """One stored object. ``leases`` counts live leases; READY objects without a lease are in
    their namespace's LRU, their size class's LRU and the global one.

    Not tracked by the cyclic GC (a card can hold millions of objects and a full collection
    would stall the loop); that is safe because a freed object is unlinked from every dict and
    LRU, so no cycle through it outlives it. Hashed by identity (``eq=False``)."""

    layout: Layout
    key: bytes
    start: int  # first page of its range
    deadline: float  # write deadline while STAGED
    slots: ChunkSlots  # generations only move when an object is freed: fixed while it lives
    packed: tuple[bytes, bytes]  # slots.offsets, slots.generations as little-endian uint64
    lru: OrderedDict  # its namespace's LRU
    ready: bool = False
    committed: int = 0  # bit r set = shard r committed
    leases: int = 0
    alive: bool = True
    #: The COMMITs' opaque checksum words, shard-major (shard r at bytes
    #: ``[r * check_bytes, (r + 1) * check_bytes)``): a bytearray of num_shards * check_bytes
    #: for a layout with check words, b"" without. Fixed once READY.
    checks: bytes | bytearray = b""


class Lease(msgspec.Struct, gc=False):
    deadline: float
    hits: list  # list[list[Obj]]: the lookup's hits per group
    owner: bytes  # the connection that may release it
    client: bytes = b""  # whose lease cap it counts against (index.py)
    chunks: int = 0  # objects it holds (chunks x groups)
