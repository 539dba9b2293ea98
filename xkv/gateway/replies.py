"""What the gateway client returns and raises: errors, object references (ChunkRef) and the
results of LOOKUP and RESERVE. Re-exported by :mod:`xkv.gateway.client`."""

from __future__ import annotations

import msgspec

from xkv.gateway import protocol as P
from xkv.gateway.protocol import ChunkSlots, ReserveStatus


class GatewayError(Exception):
    """The gateway refused a request (bad request, wrong version, unknown layout, ...).
    ``code`` is a :class:`protocol.ErrorCode` or None for client-side failures."""

    def __init__(self, message: str, code: P.ErrorCode | None = None):
        super().__init__(message)
        self.code = code


class MessageTooLarge(GatewayError, ValueError):
    """A request that would exceed the gateway's frame limit (refused before sending: the
    gateway's transport would drop it without a reply). The client stays usable."""


class GatewayUnavailable(GatewayError):
    """The gateway is dead, restarted (its epoch changed) or missed a deadline."""


class ChunkRef(msgspec.Struct, frozen=True, gc=False):
    """One stored object, from LOOKUP (or RESERVE) to COMMIT/ABORT: its key and, per shard, the
    byte offset of its slot in the card and the slot's generation. The (offset, generation) of a
    shard is the token its COMMIT/ABORT presents (only a ChunkRef is accepted there)."""

    key: bytes
    offsets: tuple[int, ...]
    generations: tuple[int, ...]

    @classmethod
    def at(cls, key: bytes, slots: ChunkSlots) -> ChunkRef:
        """``key`` stored where a LOOKUP said (``slots``: its ``ChunkSlots``)."""
        return cls(bytes(key), tuple(slots.offsets), tuple(slots.generations))


Reservation = ChunkRef  # what RESERVE answers per key: the object it may write


class LookupResult:
    """Answer to a lookup: ``num_chunks`` (longest prefix stored in every group), ``lease_id``
    (0 = none taken) and ``slots[g][c]`` = ChunkSlots(offsets per shard, generations per shard).
    ``offsets[g]`` / ``generations[g]`` are the same numbers flat (chunk-major, list[int]);
    ``raw_offsets[g]`` / ``raw_generations[g]`` the little-endian uint64 bytes they came in
    (e.g. for ``torch.frombuffer(..., dtype=torch.int64)``). ``raw_checksums[g]``: the opaque
    uint32 checksum words the COMMITs stored, num_chunks x num_shards x check_words little-endian,
    chunk-major then shard (chunk c, shard r at word ``(c * num_shards + r) * check_words``);
    b"" for a layout without words. Lists are built on first use."""

    __slots__ = ("epoch", "num_chunks", "lease_id", "raw_offsets", "raw_generations",
                 "raw_checksums", "_offsets", "_generations", "_slots")

    def __init__(self, reply: P.LookupReply):
        self.epoch = reply.epoch
        self.num_chunks = reply.num_chunks
        self.lease_id = reply.lease_id
        self.raw_offsets = reply.offsets
        self.raw_generations = reply.generations
        self.raw_checksums = reply.checksums
        self._offsets = self._generations = self._slots = None

    @property
    def offsets(self) -> list[list[int]]:
        if self._offsets is None:
            self._offsets = [memoryview(b).cast("Q").tolist() for b in self.raw_offsets]
        return self._offsets

    @property
    def generations(self) -> list[list[int]]:
        if self._generations is None:
            self._generations = [memoryview(b).cast("Q").tolist() for b in self.raw_generations]
        return self._generations

    @property
    def slots(self) -> list[list[ChunkSlots]]:
        if self._slots is None:
            n, out = self.num_chunks, []
            for offs, gens in zip(self.offsets, self.generations, strict=True):
                k = len(offs) // n if n else 0
                out.append([ChunkSlots(tuple(offs[c * k:(c + 1) * k]),
                                       tuple(gens[c * k:(c + 1) * k])) for c in range(n)])
            self._slots = out
        return self._slots

    def __repr__(self) -> str:
        return (f"LookupResult(epoch={self.epoch}, num_chunks={self.num_chunks}, "
                f"lease_id={self.lease_id}, slots={self.slots!r})")


class ReserveResult(list):
    """``list[ChunkRef | None]`` (None = not reserved) with ``status[i]``: a ReserveStatus
    (OK, EXISTS: stored or being written by someone else, NO_SPACE)."""

    status: list[ReserveStatus]
