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
  3 — checksums (issue 25): HELLO's ``check_words`` (uint32 words per shard of one object, part
      of the layout's identity, echoed in LayoutInfo); COMMIT's ``checksums`` (key-major, exactly
      len(keys) * check_words * 4 bytes); LookupReply's ``checksums`` (per group, chunk-major then
      shard). The gateway stores the words as opaque bytes: it never computes or checks them
      (the restore kernels do). CORRUPT (request type 10) removes objects whose bytes failed
      their words, named by token.
"""

from __future__ import annotations

import enum
import sys
from typing import Annotated

import msgspec

PROTOCOL_VERSION = 3

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
#: Most uint32 checksum words per shard of one object (HELLO's ``check_words``).
MAX_CHECK_WORDS = 4096
#: A layout's words of one shard may take at most 1/8 of its slot (HELLO is refused otherwise):
#: the gateway keeps them in its own memory, which thus stays below 1/8 of the card.
CHECK_BYTES_PER_SLOT_BYTE = 8
#: Most bytes of the packed arrays (offsets, generations, checksums) of one LOOKUP reply: the
#: gateway answers a shorter prefix rather than more (a shorter prefix is always correct). At
#: least MAX_KEYS chunks x MAX_SHARDS shards x 16 bytes, so a layout without checksum words is
#: never shortened; a layout whose one object alone would pass it is refused at HELLO.
MAX_REPLY_BYTES = 64 << 20
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
    CORRUPT = 10


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
    #: uint32 checksum words per shard of one object (0: none); part of the layout's identity.
    check_words: Annotated[int, msgspec.Meta(ge=0, le=MAX_CHECK_WORDS)] = 0


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
    """Shard ``shard`` of each key is written. ``checksums``: the layout's ``check_words``
    little-endian uint32 words of each key's shard, key-major (key i's at bytes
    ``[i * check_words * 4, (i + 1) * check_words * 4)``); exactly that long for a layout with
    check_words > 0, empty for one with 0 (anything else is BAD_REQUEST before anything
    changes). Opaque to the gateway: stored beside the slot, returned by LOOKUP. Its length is
    bounded by the frame (the client splits a COMMIT that would not fit)."""

    checksums: Annotated[bytes, msgspec.Meta(max_length=MAX_MESSAGE_BYTES)] = b""


class Abort(_Tokened, **_S):
    """Give up the reservations of ``keys``."""


class Corrupt(_Tokened, **_S):
    """These shards' bytes did not match their checksum words (the restore kernels found it).
    Each key whose token (offset, generation of ``shard``) matches its LIVE COMMITTED object is
    removed from the index at once (no later LOOKUP returns it; its slots are freed when no lease
    holds them any more); a token that matches nothing (a stale report, an object since removed
    or re-stored) is refused and removes nothing. Reply: Ack(removed, refused)."""


class Release(msgspec.Struct, **_S):
    epoch: U64
    lease_id: U64


class Ping(msgspec.Struct, **_S):
    pass


class Stats(msgspec.Struct, **_S):
    pass


Request = Hello | Card | Lookup | Reserve | Commit | Abort | Release | Ping | Stats | Corrupt

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
    check_words: int = 0  # uint32 checksum words per shard of one object, as HELLO asked


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
    shard r at index ``c * num_shards + r``). ``checksums[g]``: num_chunks x num_shards x
    check_words little-endian uint32 as the COMMITs stored them, chunk-major then shard (chunk c,
    shard r at word ``(c * num_shards + r) * check_words``); b"" for a layout with check_words 0.
    ``num_chunks`` may be shortened to keep the packed arrays under MAX_REPLY_BYTES. ``lease_id``
    0 = no lease taken. The client wraps it in ``client.LookupResult``, whose ``slots[g][c]``
    are ChunkSlots."""

    epoch: int
    num_chunks: int
    lease_id: int
    offsets: list[bytes]
    generations: list[bytes]
    checksums: list[bytes] = []


class ReserveReply(msgspec.Struct, tag=True, gc=False):
    epoch: int
    status: list[int]
    slots: list[ChunkSlots | None]


class Ack(msgspec.Struct, tag=True, gc=False):
    """COMMIT/ABORT/RELEASE/CORRUPT reply; ``count`` = keys (or leases) the request applied to;
    ``refused`` = keys whose token matched no live reservation (expired, aborted, someone
    else's) or, for CORRUPT, no live committed object; or leases that are not this client's."""

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
    RequestType.CORRUPT: (Corrupt, Ack),
}
REQUEST_TYPE: dict[type, RequestType] = {req: t for t, (req, _) in SPEC.items()}

request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
encoder = msgspec.msgpack.Encoder()


def commit_keys_per_message(check_words: int) -> int:
    """Most keys one COMMIT with ``check_words`` words per key may carry and still fit one frame
    (MAX_KEYS without words; 63 at MAX_CHECK_WORDS)."""
    per_key = _PER_KEY_BYTES + 4 * check_words
    return max(1, min(MAX_KEYS, (MAX_MESSAGE_BYTES - _FIXED_BYTES) // per_key))


def _check_limits() -> None:
    # The largest request the schema accepts must fit in one frame (see MAX_KEYS); COMMIT's
    # checksums are bounded by the frame itself (the client splits a COMMIT to fit).
    key = b"k" * MAX_KEY_BYTES
    big = Commit(2**64 - 1, 2**64 - 1, MAX_SHARDS - 1, [key] * MAX_KEYS, [2**64 - 1] * MAX_KEYS,
                 [2**64 - 1] * MAX_KEYS)
    assert len(encoder.encode(big)) <= MAX_MESSAGE_BYTES, "MAX_KEYS does not fit the frame limit"
    for words in (1, 64, MAX_CHECK_WORDS):
        n = commit_keys_per_message(words)
        big = Commit(2**64 - 1, 2**64 - 1, MAX_SHARDS - 1, [key] * n, [2**64 - 1] * n,
                     [2**64 - 1] * n, b"c" * (n * words * 4))
        assert len(encoder.encode(big)) <= MAX_MESSAGE_BYTES, "commit_keys_per_message too high"
    # A layout without checksum words is never shortened by the reply cap.
    assert MAX_REPLY_BYTES >= MAX_KEYS * MAX_SHARDS * 16, "MAX_REPLY_BYTES below the v2 worst case"


_check_limits()

def pack_id(request_id: int) -> bytes:
    return request_id.to_bytes(8, "little")


def unpack_id(frame: bytes) -> int:
    """The request id of an 8-byte frame; 0 when the frame is not 8 bytes (malformed)."""
    return int.from_bytes(frame, "little") if len(frame) == 8 else 0
