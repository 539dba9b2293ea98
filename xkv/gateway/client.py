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
from xkv.gateway.replies import (
    ChunkRef,
    GatewayError,
    GatewayUnavailable,
    LookupResult,
    MessageTooLarge,
    Reservation,
    ReserveResult,
)

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
        #: layout_id -> check_words, for the layouts this client registered (commit checks).
        self._check_words: dict[int, int] = {}

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
                        shard_bytes: int, *, check_words: int = 0,
                        timeout_s: float | None = None) -> LayoutInfo:
        """HELLO. Returns LayoutInfo(epoch, layout_id, slot_bytes, num_shards, shard_bytes,
        capacity_bytes, lease_ttl_s, write_ttl_s, events, check_words); the same arguments give
        the same layout_id. ``check_words``: opaque uint32 checksum words per shard of one object
        (0 <= check_words <= MAX_CHECK_WORDS) that every COMMIT of this layout carries and every
        LOOKUP returns; the same (namespace, fingerprint) with another count is LAYOUT_MISMATCH."""
        if not 0 <= check_words <= P.MAX_CHECK_WORDS:
            raise ValueError(f"check_words {check_words}: expected 0 <= check_words <= "
                             f"{P.MAX_CHECK_WORDS}")
        req = P.Hello(P.PROTOCOL_VERSION, namespace, fingerprint, num_shards, shard_bytes,
                      os.getpid(), check_words)
        info = self._call(req, LayoutInfo, timeout_s or self.setup_timeout_s)
        self.events_enabled = info.events
        self._check_words[info.layout_id] = info.check_words
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
               checksums: Sequence[bytes] | None = None, timeout_s: float | None = None) -> int:
        """This shard of each reservation is written; an object is visible once all shards
        committed. ``reservations``: the ChunkRefs ``reserve`` returned for the keys (None entries
        skipped; anything else raises TypeError). If the card is mapped, a reservation
        whose slot generation moved (it expired or was aborted: the bytes went to a quarantined
        slot) is not sent. Returns how many the gateway applied.

        ``checksums[i]``: reservation i's check_words * 4 bytes (little-endian uint32 words of
        this shard, opaque to the gateway); required for a layout registered with check_words >
        0, None or empty entries for one without. Skipped together with their reservation.
        Wrong lengths raise ValueError before anything is sent. A COMMIT that would not fit one
        frame goes as several (``protocol.commit_keys_per_message``); the counts add up."""
        words = self._check_words.get(layout_id)
        if checksums is not None and len(checksums) != len(reservations):
            raise ValueError(f"{len(checksums)} checksums for {len(reservations)} reservations: "
                             f"expected one per reservation")
        if checksums is None and words:
            raise ValueError(f"layout {layout_id} has check_words={words}: commit needs "
                             f"checksums ({words * 4} bytes per reservation)")
        items = self._live_tokens(shard, reservations, checksums, words)
        if not items:
            return 0
        keys, offs, gens, checks = items
        width = len(checks[0]) if checks else 0
        if words is None and any(len(c) != width for c in checks):
            raise ValueError(f"checksums of different lengths {sorted({len(c) for c in checks})}: "
                             f"every reservation of a layout carries check_words * 4 bytes")
        step = P.commit_keys_per_message(width // 4)
        done, epoch = 0, self._epoch()
        for i in range(0, len(keys), step):
            j = i + step
            done += self._call(P.Commit(epoch, layout_id, shard, keys[i:j], offs[i:j], gens[i:j],
                                        b"".join(checks[i:j])), P.Ack, timeout_s).count
        return done

    def abort(self, layout_id: int, shard: int, reservations: Sequence, *,
              timeout_s: float | None = None) -> int:
        """Give up writing (frees the whole objects); returns how many were freed."""
        items = self._live_tokens(shard, reservations)
        if not items:
            return 0
        return self._call(P.Abort(self._epoch(), layout_id, shard, *items[:3]), P.Ack,
                          timeout_s).count

    def _live_tokens(self, shard: int, reservations: Sequence,
                     checksums: Sequence[bytes] | None = None, words: int | None = None):
        """(keys, offsets, generations, checksums) of the reservations still live per the
        mapped generation table (all of them when the card is not mapped); None when none is.
        ``checksums`` (one per reservation) are kept or dropped with their reservation and
        checked against ``words`` (check_words; None = unknown here, the gateway checks)."""
        _check_keys(reservations)
        keys, offs, gens, checks = [], [], [], []
        table, align = self._gen_q, self._alignment
        for i, r in enumerate(reservations):
            if r is None:  # a key reserve() did not reserve (EXISTS / NO_SPACE)
                continue
            if not isinstance(r, ChunkRef):
                raise TypeError(f"commit/abort take the reservations (ChunkRefs) reserve() "
                                f"returned, not {type(r).__name__}: the gateway needs each "
                                "one's token")
            if checksums is not None:
                c = checksums[i] if checksums[i] is not None else b""
                if words is not None and len(c) != words * 4:
                    raise ValueError(f"checksums[{i}] has {len(c)} bytes; the layout has "
                                     f"check_words={words}, so expected {words * 4}")
                if len(c) % 4:
                    raise ValueError(f"checksums[{i}] has {len(c)} bytes: expected whole "
                                     f"uint32 words")
                checks.append(bytes(c))
            off, gen = r.offsets[shard], r.generations[shard]
            if table is not None and table[off // align] != gen:
                self.stale_reservations += 1
                if checksums is not None:
                    checks.pop()
                continue
            keys.append(bytes(r.key))
            offs.append(off)
            gens.append(gen)
        return (keys, offs, gens, checks) if keys else None

    def report_corrupt(self, layout_id: int, shard: int, refs: Sequence[ChunkRef], *,
                       timeout_s: float | None = None) -> int:
        """CORRUPT: the bytes of ``shard`` of these objects (the ChunkRefs a lookup returned,
        ``ChunkRef.at``) did not match their checksum words. The gateway removes each one whose
        token is still its live committed object (no later lookup returns it; its slots are
        freed once no lease holds them); stale tokens remove nothing. Returns how many were
        removed. Sent whatever the mapped generation table says: a report is never dropped."""
        _check_keys(refs)
        keys, offs, gens = [], [], []
        for r in refs:
            if not isinstance(r, ChunkRef):
                raise TypeError(f"report_corrupt takes ChunkRefs (ChunkRef.at(key, slots)), not "
                                f"{type(r).__name__}: the gateway needs each one's token")
            keys.append(bytes(r.key))
            offs.append(r.offsets[shard])
            gens.append(r.generations[shard])
        if not keys:
            return 0
        return self._call(P.Corrupt(self._epoch(), layout_id, shard, keys, offs, gens), P.Ack,
                          timeout_s).count

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
           "LayoutInfo", "LookupResult", "MessageTooLarge", "PingReply", "Reservation",
           "ReserveResult", "ReserveStatus"]
