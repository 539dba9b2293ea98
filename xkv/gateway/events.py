"""KV events: the gateway tells routers which prefixes its card holds, in vLLM's wire format.

vLLM's scheduler publishes ``KVEventBatch`` messages on a ZMQ PUB socket (``ZmqEventPublisher``,
``vllm.distributed.kv_events``): three frames ``[topic, sequence, payload]`` where ``sequence`` is
an 8-byte big-endian counter starting at 0 and ``payload`` is one msgpack-encoded batch
``[ts, [event, ...]]`` (array-like struct; each event a tagged map ``{"type": "BlockStored",
...}``). The gateway publishes the same frames, so a router that subscribes to vLLM's events
subscribes to the gateway's the same way and decodes them with ``msgspec.msgpack.Decoder(
KVEventBatch)``. The structs below reproduce vLLM 0.29's field names and order without importing
vLLM (the gateway runs without it); ``tests/gateway/test_events.py`` decodes them with vLLM's own
classes.

What is announced. A stored object is one chunk of one cache group. Its key is vLLM's block hash
of the chunk's last hash block (``xkv.connector.keys``), so the gateway can name a chunk by itself,
but a router matches prefixes block by block. The RESERVE therefore carries, when this gateway
publishes events (``LayoutInfo.events``), each chunk's block hashes, the hash of the block before
it, the tokens per hash block and the cache group; the gateway checks that a chunk's last hash is
its key and announces

* ``BlockStored(block_hashes=<the chunk's hashes>, parent_block_hash, token_ids=[], block_size,
  medium=<the card's tier>, group_idx)`` once every shard committed (the object became visible);
* ``BlockRemoved(block_hashes=<the same>, medium, group_idx)`` when a visible object is freed
  (LRU or quota eviction);
* ``AllBlocksCleared`` when the gateway stops cleanly (its card goes away with it).

Objects reserved without block information (an older client) are announced as vLLM's offloading
connector announces chunks it has no metadata for: ``block_hashes=[key]``, ``block_size=0``.
Token ids are never sent: the gateway does not see tokens (routers that re-hash tokens cannot use
these events; routers that match vLLM's block hashes can). Hashes are converted as vLLM converts
them (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, default on: the low 64 bits of the big-endian hash).
"""

from __future__ import annotations

import contextlib
import struct
import time
from typing import Any

import msgspec
import zmq

from xkv.gateway.replay import END_SEQ, ReplayBuffer
from xkv.gateway.subscribers import MAX_SUBSCRIBERS, SubscriberCap
from xkv.gateway.transport import TCP_DOMAIN

__all__ = ["END_SEQ", "EventPublisher", "KVEventBatch"]

#: Default port of the events socket: not vLLM's events port (5557, +1 per data-parallel rank)
#: nor the gateway's control port (5557).
DEFAULT_EVENTS_PORT = 5657
#: Most events in one batch; a longer burst is sent as several batches.
MAX_BATCH_EVENTS = 1024
#: Bytes of one batch's payload at most, estimated per event (``_event_bytes``; a batch is sent
#: once the estimate reaches it, so a payload is below it plus one event's bytes).
MAX_BATCH_BYTES = 16 << 10
#: Batches queued per subscriber at most (ZMQ's send high-water mark of the PUB socket): a
#: subscriber that does not read costs at most this many batches of memory (so at most about
#: ``SUBSCRIBER_HWM * MAX_BATCH_BYTES``, 16 MiB); past it ZMQ drops its batches (it sees the gap
#: in the sequence numbers) and the others are not slowed. Subscribers past ``MAX_SUBSCRIBERS``
#: are refused (``subscribers.py``).
SUBSCRIBER_HWM = 1000
#: Bytes of past batches kept for the replay socket (oldest dropped first; see replay.py).
REPLAY_BUFFER_BYTES = 64 << 20


class _Event(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """vLLM's ``KVCacheEvent``: a map tagged with the class name."""


class BlockStored(_Event):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _Meta(msgspec.Struct, array_like=True, gc=False):
    """What one object's events say (kept from RESERVE until the object is freed). ``hashes``:
    with int hashes, the 64-bit values packed big-endian (8 bytes per hash block instead of a
    list of Python ints); else the tuple of the hashes' bytes."""

    hashes: bytes | tuple[bytes, ...]
    parent: bytes | int | None
    block_size: int
    group_idx: int | None

    def block_hashes(self) -> list[bytes | int]:
        h = self.hashes
        return list(struct.unpack(f">{len(h) // 8}Q", h)) if isinstance(h, bytes) else list(h)


def external_hash(block_hash: bytes, as_int: bool) -> bytes | int:
    """vLLM's ``maybe_convert_block_hash``: bytes as they are, or their low 64 bits (big-endian)."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF if as_int else block_hash


class EventPublisher:
    """PUB socket + pending batch; single-threaded (the gateway loop calls every method).

    The index calls :meth:`stored` when an object becomes visible and :meth:`freed` whenever one
    is freed; the server calls :meth:`staged` after a RESERVE and :meth:`flush` once per loop
    pass. A PUB socket never blocks: with no subscriber, or one slower than ``hwm`` batches, ZMQ
    drops batches (subscribers see a gap in the sequence numbers)."""

    def __init__(self, ctx: zmq.Context, address: str, port: int, *, topic: str = "",
                 medium: str = "CPU", int_hashes: bool = True, hwm: int = SUBSCRIBER_HWM,
                 curve_secret_key: bytes | None = None, replay_port: int | None = None,
                 max_subscribers: int = MAX_SUBSCRIBERS):
        self.topic = topic.encode()
        self.medium = medium
        self.int_hashes = int_hashes
        self.sock, self.port = _bound(ctx, zmq.PUB, address, port, curve_secret_key, hwm)
        self._cap = SubscriberCap(self.sock, self.port, max_subscribers)
        # vLLM's replay protocol: a REQ sends an 8-byte big-endian start sequence number, the
        # ROUTER answers every kept batch from there, then END_SEQ (bounded work: replay.py)
        self.replay, self.replay_port, self._replay = None, None, None
        if replay_port is not None:
            try:
                self.replay, self.replay_port = _bound(ctx, zmq.ROUTER, address, replay_port,
                                                       curve_secret_key, 1000)
            except zmq.ZMQError:
                self._cap.close()
                self.sock.close(linger=0)
                raise
            self._replay = ReplayBuffer(self.replay, self.topic, REPLAY_BUFFER_BYTES)
        self._meta: dict[Any, _Meta] = {}  # Obj (hashed by identity) -> its event payload
        self._pending: list[Any] = []
        self._pending_bytes = 0  # estimated payload of the pending events
        self._seq = 0
        self._encode = msgspec.msgpack.Encoder().encode
        self.counters = {"kv_events_stored": 0, "kv_events_removed": 0, "kv_event_batches": 0,
                         "kv_events_replays_refused": 0, "kv_events_replays_dropped": 0,
                         "kv_events_subscribers": 0,
                         "kv_events_subscribers_refused": 0}

    # ------------------------------------------------------------- object life (hooks)

    def staged(self, obj: Any, hashes: list[bytes], parent: bytes | None, block_size: int,
               group_idx: int | None) -> None:
        """Remember what ``obj``'s events will say (the RESERVE's block information)."""
        conv = self.int_hashes
        packed = (struct.pack(f">{len(hashes)}Q", *[external_hash(h, True) for h in hashes])
                  if conv else tuple(hashes))
        self._meta[obj] = _Meta(packed, None if parent is None else external_hash(parent, conv),
                                block_size, group_idx)

    def stored(self, obj: Any) -> None:
        """``obj`` became visible (all shards committed)."""
        m = self._meta.get(obj)
        if m is None:
            self._add(BlockStored([external_hash(obj.key, self.int_hashes)], None, [], 0, None,
                                  self.medium, None))
        else:
            self._add(BlockStored(m.block_hashes(), m.parent, [], m.block_size, None,
                                  self.medium, None, group_idx=m.group_idx))
        self.counters["kv_events_stored"] += 1

    def freed(self, obj: Any) -> None:
        """``obj`` is being freed; announced only if it was visible."""
        m = self._meta.pop(obj, None)
        if not obj.ready:
            return
        if m is None:
            self._add(BlockRemoved([external_hash(obj.key, self.int_hashes)], self.medium))
        else:
            self._add(BlockRemoved(m.block_hashes(), self.medium, group_idx=m.group_idx))
        self.counters["kv_events_removed"] += 1

    def cleared(self) -> None:
        """Everything is gone (clean shutdown): AllBlocksCleared, sent now."""
        self._meta.clear()
        self._add(AllBlocksCleared())
        self.flush()

    # ------------------------------------------------------------- sending

    def _add(self, event: Any) -> None:
        self._pending.append(event)
        self._pending_bytes += _event_bytes(event)
        if len(self._pending) >= MAX_BATCH_EVENTS or self._pending_bytes >= MAX_BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        """Send the pending events as one batch (nothing when there are none)."""
        if not self._pending:
            return
        batch, self._pending = KVEventBatch(time.time(), self._pending), []
        self._pending_bytes = 0
        payload = self._encode(batch)
        frames = (self.topic, self._seq.to_bytes(8, "big"), payload)
        if self._replay is not None:
            self._replay.keep(self._seq, payload)
        self._seq += 1
        self.counters["kv_event_batches"] += 1
        with contextlib.suppress(zmq.Again):  # PUB drops at its high-water mark, never blocks
            self.sock.send_multipart(frames, zmq.NOBLOCK)

    def serve_replay(self) -> None:
        """Once per loop pass, bounded work: count subscribers and refuse those past the cap
        (subscribers.py), answer replay requests (replay.py)."""
        self._cap.poll()
        self.counters["kv_events_subscribers"] = self._cap.subscribers
        self.counters["kv_events_subscribers_refused"] = self._cap.refused
        if self._replay is not None:
            self._replay.serve()
            self.counters["kv_events_replays_refused"] = self._replay.refused
            self.counters["kv_events_replays_dropped"] = self._replay.dropped

    @property
    def replaying(self) -> bool:
        """Replays in progress: the loop must come back without sleeping."""
        return self._replay is not None and self._replay.replaying

    def close(self) -> None:
        self._cap.close()
        self.sock.close(linger=200)  # ms: lets the last batch (AllBlocksCleared) leave
        if self.replay is not None:
            self.replay.close(linger=0)


def _event_bytes(ev: Any) -> int:
    """An upper estimate of ``ev``'s msgpack bytes: its field names and scalars (< 200 B) plus
    each block hash (an int: 9 B; bytes: 2 + their length)."""
    hashes = getattr(ev, "block_hashes", ())
    if not hashes or isinstance(hashes[0], int):
        return 200 + 9 * len(hashes)
    return 200 + sum(2 + len(h) for h in hashes)


def _bound(ctx: zmq.Context, kind: int, address: str, port: int, curve_secret_key: bytes | None,
           hwm: int) -> tuple[zmq.Socket, int]:
    """A socket of ``kind`` bound to ``address:port`` (0 = a free port) and its port; ZMQError
    (EADDRINUSE, ...) goes to the caller."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.set_hwm(hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 10)  # subscriptions and replay requests are tiny
    if curve_secret_key is not None:
        sock.curve_server = True
        sock.curve_secretkey = curve_secret_key
        # the gateway's authentication domain: allowed client keys only (transport.Authenticator)
        sock.zap_domain = TCP_DOMAIN
    if ":" in address:
        sock.setsockopt(zmq.IPV6, 1)
        address = f"[{address}]"
    try:
        sock.bind(f"tcp://{address}:{port or '*'}")
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock, int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
