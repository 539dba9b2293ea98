"""The connector's side of the gateway: a DEALER socket with request ids and a deadline per call.

Transport (see transport.py): without CURVE keys the client talks to the gateway of this user
on its Unix socket (``<socket base>/xkv-<uid>/gateway-<port>/control.sock``; the host must be
this machine); with ``curve_server_key`` it uses TCP ``host:port`` with CURVE. The client keeps
one random routing id for its life, so its leases stay its own across reconnects.

Who it talks to (sockdir.py): before each Unix-socket connection the client finds the socket
(every candidate base, in order), checks its directories (ours, 0700) and the listening
process's uid (``SO_PEERCRED``), and only then lets ZMQ connect, with automatic reconnection
off: a connection that drops is never silently re-made to whatever listens on the path later;
the next call checks again. A socket whose gateway is gone is known at once (nothing listens on
it): the call fails without waiting for its deadline.

No call ever blocks past its deadline: a dead gateway, a restarted one (new epoch) or a deadline
miss raise :class:`GatewayUnavailable`, and the client then stays unavailable (its layout ids and
leases belong to a gateway process that is gone); the connector turns itself off and a new
``GatewayClient`` is needed after the gateway restarts. A refusal of one request (bad input,
unknown layout, ...) raises :class:`GatewayError` and leaves the client usable.

Thread-safe (one lock around each round trip). A client used in a forked child opens a fresh
ZMQ context and socket there (the card mapping is inherited).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
import time
from collections.abc import Sequence

import msgspec
import zmq

from xkv.gateway import protocol as P
from xkv.gateway import sockdir, transport
from xkv.gateway.card import open_card
from xkv.gateway.protocol import ChunkSlots, LayoutInfo, PingReply, ReserveStatus


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
    (e.g. for ``torch.frombuffer(..., dtype=torch.int64)``). Lists are built on first use."""

    __slots__ = ("epoch", "num_chunks", "lease_id", "raw_offsets", "raw_generations",
                 "_offsets", "_generations", "_slots")

    def __init__(self, reply: P.LookupReply):
        self.epoch = reply.epoch
        self.num_chunks = reply.num_chunks
        self.lease_id = reply.lease_id
        self.raw_offsets = reply.offsets
        self.raw_generations = reply.generations
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


_MORE, _NOBLOCK, _RCVTIMEO = int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK), int(zmq.RCVTIMEO)


class GatewayClient:
    def __init__(self, host: str | None = None, port: int = transport.DEFAULT_PORT, *, timeout_s: float = 0.05,
                 setup_timeout_s: float = 2.0, curve_server_key: bytes | str | None = None,
                 curve_client_keys: tuple[bytes, bytes] | None = None):
        """``timeout_s``: deadline of lookup/reserve/commit/abort/release/ping (seconds);
        ``setup_timeout_s``: of register_layout, map_card and stats. ``curve_server_key``: the
        gateway's z85 public key (bytes), or a path to its public certificate, when it runs
        with CURVE: the client then talks TCP and uses ``curve_client_keys`` (public, secret),
        or a path to its secret certificate, or a fresh key pair (refused by an allow-list)."""
        self.host = host or transport.gateway_host()
        self.port = port
        self._ipv6 = ":" in self.host  # an IPv6 literal such as ::1
        #: Set when this client can never reach the gateway (the first call raises it).
        self._broken: str | None = None
        self._ipc = curve_server_key is None
        self._used = False  # the current socket got a reply (its connection was made)
        if curve_server_key is not None:
            self.endpoint = (f"tcp://[{self.host}]:{port}" if self._ipv6
                             else f"tcp://{self.host}:{port}")
        else:
            self.endpoint = f"ipc://{transport.control_path(port)}"  # until found (_socket)
            if not transport.is_local(self.host):
                self._broken = (
                    f"the xkv gateway host {self.host!r} is not this machine: a remote gateway "
                    f"is reached over TCP with CURVE only (set xkv_gateway_curve_server_key and "
                    f"xkv_gateway_curve_client_key, and run the gateway with --curve-secret-key "
                    f"and --curve-allowed-clients)")
        self.timeout_s = timeout_s
        self.setup_timeout_s = setup_timeout_s
        #: When set, no call waits longer than this (seconds), whatever its own deadline: the
        #: connector's session sets it after a call got no answer, until one is answered.
        self.deadline_cap_s: float | None = None
        if isinstance(curve_server_key, str):
            curve_server_key, curve_client_keys = transport.load_curve(curve_server_key,
                                                              curve_client_keys)
        self._curve = curve_server_key
        if curve_server_key is not None and curve_client_keys is None:
            curve_client_keys = zmq.curve_keypair()
        self._curve_client = curve_client_keys
        #: The gateway's epoch, learned from the first reply (None before any).
        self.epoch: int | None = None
        self._identity = transport.routing_id()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._ctx = zmq.Context(io_threads=1)
        self._pid = os.getpid()
        self._sock: zmq.Socket | None = None
        self._card = None
        self._gens = None
        self._gen_q: memoryview | None = None
        self._alignment = 0
        #: Reservations commit/abort skipped because their slot generation had moved.
        self.stale_reservations = 0

    # ------------------------------------------------------------------ transport

    def _after_fork(self) -> None:
        # Used in a forked child: the parent's ZMQ context (and maybe its lock) do not survive.
        self._lock = threading.Lock()
        self._ctx = zmq.Context(io_threads=1)
        self._sock = None
        #: The gateway publishes KV events (learned at register_layout): reserve() sends blocks.
        self.events_enabled = False
        self._pid = os.getpid()
        self._identity = transport.routing_id()  # two live processes must not share one

    def _socket(self, deadline: float) -> zmq.Socket:
        if self._sock is None:
            if self._ipc:  # never talk to a socket another user could have planted
                waited_ms = _ms(deadline)
                try:
                    self.endpoint = "ipc://" + sockdir.find_control(self.port, deadline)
                except PermissionError as e:
                    raise GatewayUnavailable(f"xkv gateway socket refused: {e}") from None
                except FileNotFoundError as e:  # waited until the deadline
                    raise GatewayUnavailable(
                        f"no xkv gateway found within {waited_ms} ms: {e.strerror or e} "
                        f"(is xkv-gateway running?)") from None
                except OSError as e:  # a dead gateway's socket: known at once
                    raise GatewayUnavailable(f"xkv gateway unreachable: {e.strerror or e} "
                                             f"(is xkv-gateway running?)") from None
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a gateway that is not there
            # Unix socket: checked above, so never re-connected behind our back (-1: off)
            s.setsockopt(zmq.RECONNECT_IVL, -1 if self._ipc else 50)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            s.setsockopt(zmq.ROUTING_ID, self._identity)
            self._used = False
            if self._ipv6:
                s.setsockopt(zmq.IPV6, 1)
            if self._curve is not None:
                s.curve_serverkey = self._curve
                s.curve_publickey, s.curve_secretkey = self._curve_client
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    def _drop_socket(self) -> None:
        # A request lost in a dead connection would otherwise be answered later, out of turn.
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _call(self, req, expect: type, timeout_s: float | None):
        if self._broken is not None:
            raise GatewayUnavailable(self._broken)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if self.deadline_cap_s is not None:
            timeout = min(timeout, self.deadline_cap_s)
        name = type(req).__name__.upper()
        body = P.encoder.encode(req)
        if len(body) > P.MAX_MESSAGE_BYTES:  # the gateway's transport would drop it unanswered
            raise MessageTooLarge(f"{name} of {len(body)} bytes exceeds the gateway's message limit of "
                             f"{P.MAX_MESSAGE_BYTES} bytes: send fewer or shorter keys")
        if self._pid != os.getpid():
            self._after_fork()
        with self._lock:
            deadline = time.monotonic() + timeout
            rid = next(self._ids)
            sock = self._socket(deadline)
            try:
                try:
                    sock.send(P.pack_id(rid), _MORE)
                except zmq.Again:  # no connection (IMMEDIATE)
                    if self._ipc and self._used:  # it dropped and is never re-made: check again
                        self._drop_socket()
                        sock = self._socket(deadline)
                    if not sock.poll(_ms(deadline), zmq.POLLOUT):  # connecting: wait for it
                        raise
                    sock.send(P.pack_id(rid), _MORE)
                sock.send(body, _NOBLOCK)
                while True:
                    # RCVTIMEO instead of poll(): no Poller object per call on the hot path
                    sock.setsockopt(_RCVTIMEO, _ms(deadline))
                    frames = sock.recv_multipart()
                    if len(frames) == 2 and P.unpack_id(frames[0]) == rid:
                        self._used = True
                        break  # anything else is a late reply to an abandoned request
            except zmq.Again:
                self._drop_socket()
                raise GatewayUnavailable(
                    f"no reply from the xkv gateway at {self.endpoint} to {name} within "
                    f"{timeout * 1000:.0f} ms (is xkv-gateway running?)") from None
            except zmq.ZMQError as e:
                self._drop_socket()
                raise GatewayUnavailable(f"xkv gateway at {self.endpoint}: {e}") from None
        try:
            reply = P.reply_decoder.decode(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise GatewayError(f"undecodable reply to {name} from {self.endpoint}: {e}") from None
        if self.epoch is None:
            self.epoch = reply.epoch
        elif reply.epoch != self.epoch:
            self._broken = (f"the xkv gateway at {self.endpoint} restarted (epoch "
                            f"{self.epoch:016x} -> {reply.epoch:016x}): its layouts, leases and "
                            f"card are gone")
            raise GatewayUnavailable(self._broken)
        if isinstance(reply, P.ErrorReply):
            code = P.ErrorCode(reply.code) if reply.code in P.ErrorCode._value2member_map_ else None
            if code is P.ErrorCode.BAD_EPOCH:
                self._broken = reply.message
                raise GatewayUnavailable(reply.message)
            raise GatewayError(f"{name} refused ({code.name if code else reply.code}): "
                               f"{reply.message}", code)
        if not isinstance(reply, expect):
            raise GatewayError(f"{name}: expected {expect.__name__}, got {type(reply).__name__}")
        return reply

    def _epoch(self) -> int:
        if self.epoch is None:
            raise GatewayError("no layout registered yet: call register_layout() first")
        return self.epoch

    # ------------------------------------------------------------------ API

    def register_layout(self, namespace: str, fingerprint: str, num_shards: int,
                        shard_bytes: int, *, timeout_s: float | None = None) -> LayoutInfo:
        """HELLO. Returns LayoutInfo(epoch, layout_id, slot_bytes, num_shards, shard_bytes,
        capacity_bytes, lease_ttl_s, write_ttl_s); the same arguments give the same layout_id."""
        req = P.Hello(P.PROTOCOL_VERSION, namespace, fingerprint, num_shards, shard_bytes,
                      os.getpid())
        info = self._call(req, LayoutInfo, timeout_s or self.setup_timeout_s)
        self.events_enabled = info.events
        return info

    def lookup(self, groups: Sequence[tuple[int, Sequence[bytes]]], *, lease: bool = True,
               timeout_s: float | None = None) -> LookupResult:
        """Longest prefix of chunks stored in every group. ``groups``: (layout_id, ordered keys),
        same number of keys each. Result: num_chunks, lease_id (0 = none taken) and
        ``slots[g][c]`` = ChunkSlots(offsets per shard, generations per shard)."""
        if not groups:
            raise ValueError("lookup needs at least one (layout_id, keys) group")
        total = sum(len(keys) for _, keys in groups)
        if total > P.MAX_KEYS:
            raise ValueError(f"lookup of {total} keys: at most {P.MAX_KEYS} per request")
        req = P.Lookup(self._epoch(), [P.LookupGroup(lid, list(keys)) for lid, keys in groups],
                       lease)
        return LookupResult(self._call(req, P.LookupReply, timeout_s))

    def reserve(self, layout_id: int, keys: Sequence[bytes], *,
                blocks: Sequence[tuple[Sequence[bytes], bytes | None]] | None = None,
                block_size: int = 0, group_idx: int | None = None,
                timeout_s: float | None = None) -> ReserveResult:
        """Slots to write each key, or None (see ``.status``: EXISTS or NO_SPACE).

        ``blocks`` (for the gateway's KV events, sent only when ``events_enabled``): per key, the
        chunk's vLLM block hashes in order (the last is the key) and the hash before the chunk
        (None for the first chunk); ``block_size``: tokens per hash block; ``group_idx``: vLLM's
        KV-cache group."""
        _check_keys(keys)
        req = P.Reserve(self._epoch(), layout_id, list(keys))
        if blocks is not None and self.events_enabled:
            req.blocks = [P.BlockInfo(list(h), p) for h, p in blocks]
            req.block_size, req.group_idx = block_size, group_idx
        reply = self._call(req, P.ReserveReply, timeout_s)
        out = ReserveResult(None if c is None else ChunkRef(k, c.offsets, c.generations)
                            for k, c in zip(keys, reply.slots, strict=False))
        out.status = [ReserveStatus(s) for s in reply.status]
        return out

    def commit(self, layout_id: int, shard: int, reservations: Sequence, *,
               timeout_s: float | None = None) -> int:
        """This shard of each reservation is written; an object is visible once all shards
        committed. ``reservations``: the ChunkRefs ``reserve`` returned for the keys (None entries
        skipped; anything else raises TypeError). If the card is mapped, a reservation
        whose slot generation moved (it expired or was aborted: the bytes went to a quarantined
        slot) is not sent. Returns how many the gateway applied."""
        items = self._live_tokens(shard, reservations)
        if not items:
            return 0
        return self._call(P.Commit(self._epoch(), layout_id, shard, *items), P.Ack,
                          timeout_s).count

    def abort(self, layout_id: int, shard: int, reservations: Sequence, *,
              timeout_s: float | None = None) -> int:
        """Give up writing (frees the whole objects); returns how many were freed."""
        items = self._live_tokens(shard, reservations)
        if not items:
            return 0
        return self._call(P.Abort(self._epoch(), layout_id, shard, *items), P.Ack,
                          timeout_s).count

    def _live_tokens(self, shard: int, reservations: Sequence):
        """(keys, offsets, generations) of the reservations still live per the mapped
        generation table (all of them when the card is not mapped); None when none is."""
        _check_keys(reservations)
        keys, offs, gens = [], [], []
        table, align = self._gen_q, self._alignment
        for r in reservations:
            if r is None:  # a key reserve() did not reserve (EXISTS / NO_SPACE)
                continue
            if not isinstance(r, ChunkRef):
                raise TypeError(f"commit/abort take the reservations (ChunkRefs) reserve() "
                                f"returned, not {type(r).__name__}: the gateway needs each "
                                "one's token")
            off, gen = r.offsets[shard], r.generations[shard]
            if table is not None and table[off // align] != gen:
                self.stale_reservations += 1
                continue
            keys.append(bytes(r.key))
            offs.append(off)
            gens.append(gen)
        return (keys, offs, gens) if keys else None

    def release(self, lease_id: int, *, timeout_s: float | None = None) -> int:
        """Drop a lookup's lease; returns 0 if it had already expired. lease_id 0 is a no-op."""
        if not lease_id:
            return 0
        return self._call(P.Release(self._epoch(), lease_id), P.Ack, timeout_s).count

    def ping(self, *, timeout_s: float | None = None) -> PingReply:
        """PingReply(epoch, protocol_version, capacity_bytes, used_bytes, uptime_s)."""
        return self._call(P.Ping(), PingReply, timeout_s)

    def stats(self, *, timeout_s: float | None = None) -> dict:
        """Counters and gauges (bytes, objects, requests by type, errors by code)."""
        return self._call(P.Stats(), P.StatsReply, timeout_s or self.setup_timeout_s).stats

    def map_card(self, *, timeout_s: float | None = None) -> memoryview:
        """Writable view of the whole card (mapped once; same host only)."""
        if self._card is None:
            info = self._call(P.Card(), P.CardInfo, timeout_s or self.setup_timeout_s)
            try:
                arena, gens = open_card(info.kind, info.path, info.gen_path,
                                        info.capacity_bytes, info.epoch,
                                        timeout_s or self.setup_timeout_s)
            except OSError as e:
                raise GatewayError(f"cannot map the card of {self.endpoint} ({info.kind} "
                                   f"{info.path}): {e}; the card is only reachable from the "
                                   f"gateway's host, by the same user") from None
            self._card, self._gens = arena, gens
            self._gen_q = memoryview(gens).cast("Q")
            self._alignment = info.slot_alignment
        return memoryview(self._card)

    def slot_generation(self, offset: int) -> int:
        """Current generation of the slot starting at byte ``offset`` of the card (read from the
        mapped generation table, no round trip). Maps the card on first use."""
        if self._gen_q is None:
            self.map_card()
        page, rem = divmod(offset, self._alignment)
        if rem or not 0 <= offset < len(self._card):
            raise ValueError(f"offset {offset} is not a slot offset of the card "
                             f"({len(self._card)} bytes, slots aligned to {self._alignment})")
        return self._gen_q[page]

    def close(self) -> None:
        if self._pid != os.getpid():
            self._after_fork()  # never terminate the parent's context from a child
        with self._lock:
            self._drop_socket()
            self._ctx.term()
            self._broken = self._broken or "client closed"
        if self._gen_q is not None:
            with contextlib.suppress(BufferError):
                self._gen_q.release()
                self._gens.close()
                self._card.close()  # BufferError while a view (e.g. a tensor) still uses it

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_keys(keys: Sequence[bytes]) -> None:
    if len(keys) > P.MAX_KEYS:
        raise ValueError(f"{len(keys)} keys in one request: at most {P.MAX_KEYS}")


def _ms(deadline: float) -> int:
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))


__all__ = ["ChunkRef", "ChunkSlots", "GatewayClient", "GatewayError", "GatewayUnavailable",
           "LayoutInfo", "LookupResult", "PingReply", "Reservation", "ReserveResult",
           "ReserveStatus"]
