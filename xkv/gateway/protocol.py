"""The gateway wire protocol: every message that crosses the control socket, and nothing else.

Transport: the client's ZMQ DEALER sends two frames, ``[request_id, body]``; the gateway's ROUTER
answers ``[request_id, body]`` on the same connection. ``request_id`` is 8 bytes (little-endian
uint64 chosen by the client); ``body`` is one msgpack-encoded tagged :class:`msgspec.Struct`.
The gateway echoes the request id even when it cannot decode the body, so a client can always
match (and discard late) replies. Never pickle.

Every reply carries ``epoch``: a random 64-bit number drawn at each gateway start. Requests that
name gateway state (layout ids, leases) carry the epoch the client learned; the gateway refuses a
stale one with ``ErrorCode.BAD_EPOCH`` because that state died with the previous process.

Who may talk: see :mod:`xkv.gateway.transport` (a Unix socket only the gateway's uid reaches by
default; TCP only with CURVE and an allow-list of client keys). Ownership inside the protocol:

* a *lease* (LOOKUP) has a random 63-bit id and belongs to the client (ZMQ routing id) that took
  it: a RELEASE from any other client does nothing;
* a *reservation* (RESERVE) is named by its token: per shard the slot's byte offset and the slot
  generation at reservation time (``ChunkSlots``). COMMIT/ABORT must present the token of the
  shard they write; a token of an expired, aborted or re-made reservation matches nothing, so a
  late writer can neither publish nor free somebody else's object. The scheduler hands tokens to
  its workers in the connector metadata.

Version history (``PROTOCOL_VERSION``, checked at HELLO):
  1 — first version: HELLO/CARD/LOOKUP/RESERVE/COMMIT/ABORT/RELEASE/PING/STATS.
      Additive, still 1: LayoutInfo.events and RESERVE's optional blocks/block_size/group_idx
      (KV events); a client sends them only to a gateway whose LayoutInfo says events.
  2 — COMMIT/ABORT carry the reservation token (offsets, generations) of every key; lease ids
      are random and owned; key counts derived from the message size limit
      (RESERVE's optional blocks are bounded by the client's size check before sending).
"""

from __future__ import annotations

import enum
import sys
from typing import Annotated

import msgspec

PROTOCOL_VERSION = 2

if sys.byteorder != "little":  # packed uint64 arrays are read with memoryview.cast("Q")
    raise ImportError("xkv.gateway needs a little-endian host")

#: Largest message (one frame) the gateway accepts; ZMQ_MAXMSGSIZE disconnects a bigger sender.
MAX_MESSAGE_BYTES = 1 << 20
#: Longest key; keys are opaque bytes derived from vLLM block hashes (32 bytes for sha256).
MAX_KEY_BYTES = 128
MAX_NAME_CHARS = 256
MAX_GROUPS = 64
MAX_SHARDS = 1024
#: Worst-case encoded bytes per key of any request: the key (msgpack bin8 header + bytes), and
#: in COMMIT/ABORT its token (offset and generation, uint64 = 9 bytes each).
_PER_KEY_BYTES = 2 + MAX_KEY_BYTES + 9 + 9
#: Room for everything that is not a key: tags, field names, epoch, ids, list headers, and the
#: per-group overhead of a LOOKUP with MAX_GROUPS groups.
_FIXED_BYTES = 1024 + MAX_GROUPS * 32
#: Most keys in one request (for LOOKUP: summed over all groups). Derived from the message size
#: limit so that every request the schema accepts fits in one frame (ZMQ would drop a bigger one
#: without a reply); the client checks the encoded size too, before sending.
MAX_KEYS = min(4096, (MAX_MESSAGE_BYTES - _FIXED_BYTES) // _PER_KEY_BYTES)
#: Most layouts one gateway registers, and one client may create (bounds what HELLOs allocate).
MAX_LAYOUTS = 4096
MAX_LAYOUTS_PER_CLIENT = 64
#: Objects (chunks x groups) one client (process, or CURVE key) may hold leased at once.
MAX_LEASED_PER_CLIENT = 1 << 20
#: Most block hashes one chunk's BlockInfo may carry (chunk_size / hash block size).
MAX_HASHES_PER_CHUNK = 1024

Key = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_KEY_BYTES)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
U64 = Annotated[int, msgspec.Meta(ge=0)]
Shard = Annotated[int, msgspec.Meta(ge=0, lt=MAX_SHARDS)]


class RequestType(enum.IntEnum):
    HELLO = 1
    CARD = 2
    LOOKUP = 3
    RESERVE = 4
    COMMIT = 5
    ABORT = 6
    RELEASE = 7
    PING = 8
    STATS = 9


class ErrorCode(enum.IntEnum):
    MALFORMED = 1  # not a decodable request, or a field out of range
    TOO_LARGE = 2  # message or key count over the limits above
    BAD_VERSION = 3  # HELLO with another PROTOCOL_VERSION
    BAD_EPOCH = 4  # request names state of a previous gateway process
    UNKNOWN_LAYOUT = 5
    LAYOUT_MISMATCH = 6  # same (namespace, fingerprint) registered with another shape
    BAD_REQUEST = 7  # well-formed but inconsistent (group lengths differ, shard out of range, ...)
    NO_SPACE = 8  # HELLO: a slot of this layout can never fit in the card or quota
    INTERNAL = 9


class ReserveStatus(enum.IntEnum):
    OK = 0
    EXISTS = 1  # stored or being written by another writer: first writer wins
    NO_SPACE = 2  # nothing evictable frees enough room (or the namespace quota is full)


_S = dict(tag=True, omit_defaults=True, gc=False, forbid_unknown_fields=True)

# ---------------------------------------------------------------- requests


class Hello(msgspec.Struct, **_S):
    """Register (or find) a layout. ``shard_bytes``: bytes of one shard of one object."""

    version: int
    namespace: Name
    fingerprint: Name
    num_shards: Annotated[int, msgspec.Meta(ge=1, le=MAX_SHARDS)]
    shard_bytes: Annotated[int, msgspec.Meta(ge=1, lt=1 << 48)]
    pid: int = 0


class Card(msgspec.Struct, **_S):
    """Ask how to map the card (same host only)."""


class LookupGroup(msgspec.Struct, array_like=True, gc=False, forbid_unknown_fields=True):
    layout_id: U64
    keys: Keys


class Lookup(msgspec.Struct, **_S):
    epoch: U64
    groups: Annotated[list[LookupGroup], msgspec.Meta(min_length=1, max_length=MAX_GROUPS)]
    lease: bool = True


class BlockInfo(msgspec.Struct, array_like=True, gc=False, forbid_unknown_fields=True):
    """For KV events (``xkv.gateway.events``): one chunk's vLLM block hashes in order (the last
    one is the chunk's key) and the hash of the block before the chunk (None for the first)."""

    hashes: Annotated[list[Key], msgspec.Meta(min_length=1, max_length=MAX_HASHES_PER_CHUNK)]
    parent: Key | None = None


class Reserve(msgspec.Struct, **_S):
    """``blocks`` (one per key), ``block_size`` (tokens per hash block) and ``group_idx`` (vLLM's
    KV-cache group) are sent only to a gateway that publishes KV events (``LayoutInfo.events``)."""

    epoch: U64
    layout_id: U64
    keys: Keys
    blocks: Annotated[list[BlockInfo], msgspec.Meta(max_length=MAX_KEYS)] = []
    block_size: Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)] = 0
    group_idx: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)] | None = None


Offsets = Annotated[list[U64], msgspec.Meta(max_length=MAX_KEYS)]


class _Tokened(msgspec.Struct, **_S):
    """Keys of one shard with their reservation tokens: ``offsets[i]``/``generations[i]`` are
    key i's ``ChunkSlots.offsets[shard]``/``.generations[shard]`` as RESERVE returned them; a key
    whose token does not match its live reservation is skipped (counted as refused)."""

    epoch: U64
    layout_id: U64
    shard: Shard
    keys: Keys
    offsets: Offsets
    generations: Offsets


class Commit(_Tokened, **_S):
    """Shard ``shard`` of each key is written."""


class Abort(_Tokened, **_S):
    """Give up the reservations of ``keys``."""


class Release(msgspec.Struct, **_S):
    epoch: U64
    lease_id: U64


class Ping(msgspec.Struct, **_S):
    pass


class Stats(msgspec.Struct, **_S):
    pass


Request = Hello | Card | Lookup | Reserve | Commit | Abort | Release | Ping | Stats

# ---------------------------------------------------------------- replies


class ChunkSlots(msgspec.Struct, array_like=True, gc=False):
    """Where one object lives: per shard, its byte offset in the card and the slot generation."""

    offsets: tuple[int, ...]
    generations: tuple[int, ...]


class LayoutInfo(msgspec.Struct, tag=True, gc=False):
    """HELLO reply. ``slot_bytes`` = shard_bytes rounded up to the slot alignment."""

    epoch: int
    layout_id: int
    slot_bytes: int
    num_shards: int
    shard_bytes: int
    capacity_bytes: int
    lease_ttl_s: float
    write_ttl_s: float
    events: bool = False  # this gateway publishes KV events: send RESERVE's block information


class CardInfo(msgspec.Struct, tag=True, gc=False):
    """CARD reply. kind "memfd": fetch both fds from the unix socket ``path``; kind "shm":
    open ``path`` (card) and ``gen_path`` (generation table) directly."""

    epoch: int
    kind: str
    path: str
    gen_path: str
    capacity_bytes: int
    slot_alignment: int


class LookupReply(msgspec.Struct, tag=True, gc=False):
    """LOOKUP reply, packed for cheap encoding and decoding: for group g, ``offsets[g]`` and
    ``generations[g]`` are num_chunks x num_shards little-endian uint64, chunk-major (chunk c,
    shard r at index ``c * num_shards + r``). ``lease_id`` 0 = no lease taken. The client wraps
    it in ``client.LookupResult``, whose ``slots[g][c]`` are ChunkSlots."""

    epoch: int
    num_chunks: int
    lease_id: int
    offsets: list[bytes]
    generations: list[bytes]


class ReserveReply(msgspec.Struct, tag=True, gc=False):
    epoch: int
    status: list[int]
    slots: list[ChunkSlots | None]


class Ack(msgspec.Struct, tag=True, gc=False):
    """COMMIT/ABORT/RELEASE reply; ``count`` = keys (or leases) the request applied to;
    ``refused`` = keys whose token matched no live reservation (expired, aborted, someone
    else's), or leases that are not this client's."""

    epoch: int
    count: int = 0
    refused: int = 0


class PingReply(msgspec.Struct, tag=True, gc=False):
    epoch: int
    protocol_version: int
    capacity_bytes: int
    used_bytes: int
    uptime_s: float


class StatsReply(msgspec.Struct, tag=True, gc=False):
    epoch: int
    stats: dict[str, int | float]


class ErrorReply(msgspec.Struct, tag=True, gc=False):
    epoch: int
    code: int
    message: str


Reply = (LayoutInfo | CardInfo | LookupReply | ReserveReply | Ack | PingReply | StatsReply
         | ErrorReply)

#: The type table: request type -> (request struct, success reply struct).
SPEC: dict[RequestType, tuple[type, type]] = {
    RequestType.HELLO: (Hello, LayoutInfo),
    RequestType.CARD: (Card, CardInfo),
    RequestType.LOOKUP: (Lookup, LookupReply),
    RequestType.RESERVE: (Reserve, ReserveReply),
    RequestType.COMMIT: (Commit, Ack),
    RequestType.ABORT: (Abort, Ack),
    RequestType.RELEASE: (Release, Ack),
    RequestType.PING: (Ping, PingReply),
    RequestType.STATS: (Stats, StatsReply),
}
REQUEST_TYPE: dict[type, RequestType] = {req: t for t, (req, _) in SPEC.items()}

request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
encoder = msgspec.msgpack.Encoder()


def _check_limits() -> None:
    # The largest request the schema accepts must fit in one frame (see MAX_KEYS).
    key = b"k" * MAX_KEY_BYTES
    big = Commit(2**64 - 1, 2**64 - 1, MAX_SHARDS - 1, [key] * MAX_KEYS, [2**64 - 1] * MAX_KEYS,
                 [2**64 - 1] * MAX_KEYS)
    assert len(encoder.encode(big)) <= MAX_MESSAGE_BYTES, "MAX_KEYS does not fit the frame limit"


_check_limits()

def pack_id(request_id: int) -> bytes:
    return request_id.to_bytes(8, "little")


def unpack_id(frame: bytes) -> int:
    """The request id of an 8-byte frame; 0 when the frame is not 8 bytes (malformed)."""
    return int.from_bytes(frame, "little") if len(frame) == 8 else 0
