"""The ``xkv-gateway`` process: a ZMQ ROUTER loop in front of the index and the card.

One thread owns the sockets and the index (no locks on the hot path); a daemon thread hands the
card's file descriptors to local clients, one answers ZAP (who may connect, transport.py), one
serves /metrics on 127.0.0.1 from a copy the loop renders. A bad message gets an ErrorReply and
never stops the loop.

Fairness: every request does O(keys) work (a RESERVE plus at most one eviction per key and
EVICTIONS_PER_CALL more per call, room.py; a replay request O(1), replay.py), and the ROUTER
queues each connection separately and takes one message from each in turn. A RESERVE (the one
request whose keys cost an allocation and maybe an eviction each) of more than RESERVE_SLICE
keys is served in slices of RESERVE_SLICE keys (reserves.py), with one message of every socket
served between two slices. So a client's LOOKUP waits behind at most one slice of every RESERVE
in progress plus one other request (dictionary work only) of every other connection; STATS and
/metrics are O(1).
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import secrets
import signal
import sys
import time

import msgspec
import zmq

from xkv.gateway import protocol as P
from xkv.gateway.card import Card
from xkv.gateway.config import GatewayConfig, parse_args
from xkv.gateway.corrupt import CorruptWarnings
from xkv.gateway.disk_chain import start_tiers
from xkv.gateway.endpoints import bind_events, bind_tcp, instance_dir, router
from xkv.gateway.index import Index, RequestError
from xkv.gateway.metrics import Histogram, MetricsCopy, render, serve_metrics
from xkv.gateway.reserves import SlicedReserve, reserve_announced
from xkv.gateway.reserves import reply as reserve_reply
from xkv.gateway.tier import DEFERRED
from xkv.gateway.transport import IPC_DOMAIN, TCP_DOMAIN, Authenticator, load_client_keys

log = logging.getLogger("xkv.gateway")

_TYPE_NAME = {cls: t.name.lower() for cls, t in P.REQUEST_TYPE.items()}


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.epoch = secrets.randbits(64) or 1
        self.started = time.monotonic()
        self.requests: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.hist = Histogram()
        self._jobs: collections.deque[SlicedReserve] = collections.deque()
        self.corrupt_warnings = CorruptWarnings()
        #: Callables run on the loop thread once per turn (tests: xkv.gateway.testing.on_loop).
        self.loop_calls: collections.deque = collections.deque()
        self._stop = False
        self.ctx = zmq.Context()
        self._auth = None
        self.tcp = None
        self.events = None
        self.tier = None
        #: Lookups the tier answers later: (identity, request id) -> socket; id(req) -> client.
        self._deferred_sock: dict[tuple[bytes, bytes], zmq.Socket] = {}
        self._deferred_owner: dict[int, tuple[bytes, bytes]] = {}  # (owner, peer)
        self._frames: tuple[bytes, bytes] = (b"", b"")
        self._peer = b""
        self._sock = None
        self.metrics_server = None
        self.dir = None
        self.card = None
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        self._handlers = {
            P.Hello: self._hello, P.Card: self._card, P.Lookup: self._lookup,
            P.Reserve: self._reserve, P.Commit: self._commit, P.Abort: self._abort,
            P.Release: self._release, P.Ping: self._ping, P.Stats: self._stats,
            P.Corrupt: self._corrupt,
        }

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        cfg = self.config
        curve_keys = None
        if cfg.curve_secret_key is not None:
            curve_keys = load_client_keys(cfg.curve_allowed_clients)
        self._auth = Authenticator(self.ctx, {os.geteuid(), 0}, curve_keys)
        port = cfg.port
        if cfg.curve_secret_key is not None:
            self.tcp = router(self.ctx, TCP_DOMAIN)
            self.tcp.curve_server = True
            self.tcp.curve_secretkey = cfg.curve_secret_key
            port = bind_tcp(self.tcp, cfg)
        self.dir = instance_dir(port)
        self.port = self.dir.port
        self.card = Card(cfg.capacity_bytes, cfg.slot_alignment, kind=cfg.card_kind,
                         prefault=cfg.prefault, epoch=self.epoch,
                         handover_path=self.dir.file("card.sock"))
        self.index = Index(self.card.capacity_bytes, slot_alignment=cfg.slot_alignment,
                           lease_ttl_s=cfg.lease_ttl_s, write_ttl_s=cfg.write_ttl_s,
                           quarantine_s=cfg.quarantine_s,
                           default_quota_bytes=cfg.namespace_quota_bytes,
                           quotas=cfg.quotas, generations=self.card.generations)
        self.tier = start_tiers(self)  # card -> disk -> Mooncake (disk_chain.py)
        if self.tier is not None:  # a copy of an object reported corrupt is not restored again
            self.index.on_corrupt = self.tier.forget
        self.events = bind_events(self.ctx, cfg)
        self.index.listener = self.events
        self.ipc = router(self.ctx, IPC_DOMAIN)
        self.control_path = self.dir.file("control.sock")
        old = os.umask(0o177)  # the socket file itself is 0600 too
        try:
            self.ipc.bind(f"ipc://{self.control_path}")
        finally:
            os.umask(old)
        # Metrics: the loop renders, the HTTP thread serves the latest copy (never the index).
        self.metrics = MetricsCopy(self.metrics_text)
        if cfg.metrics_port is not None:
            self.metrics.publish()
            self.metrics_server = serve_metrics(cfg.metrics_port, self.metrics.get,
                                                allowed_uids={os.geteuid(), 0,
                                                              *cfg.metrics_allowed_uids})

    def mooncake_tier(self):
        """The Mooncake tier (config.mooncake_master set); its threads connect in the background."""
        from xkv.gateway.tier import Tier
        from xkv.gateway.tier_store import MooncakeBackend, MooncakeSettings

        c = self.config
        settings = MooncakeSettings(c.mooncake_master, c.mooncake_metadata, c.mooncake_protocol,
                                    c.mooncake_device, c.mooncake_local_hostname,
                                    c.mooncake_segment_bytes, secret=c.mooncake_secret)
        return Tier(self.index, MooncakeBackend(settings, self.card.arena), self.answer_lookup,
                    write_through=c.mooncake_write_through, wait_s=c.mooncake_wait_ms / 1000,
                    backlog_objects=c.mooncake_backlog)

    # ------------------------------------------------------------------ loop

    def stop(self, *_args) -> None:
        self._stop = True

    def serve(self) -> None:
        socks = [(self.ipc, b"i")] + ([(self.tcp, b"t")] if self.tcp is not None else [])
        poller = zmq.Poller()
        for sock, _ in socks:
            poller.register(sock, zmq.POLLIN)
        ev = self.events
        if ev is not None and ev.replay is not None:
            poller.register(ev.replay, zmq.POLLIN)  # a replay request wakes the loop
        # plain ints: pyzmq's enum flags cost more than the send itself on a slow CPU
        more, last = int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)
        events, pollin, noblock = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
        expire, stats_every = self.index.expire, self.config.stats_interval_s
        next_stats = time.monotonic() + stats_every if stats_every > 0 else float("inf")
        window = self.index.snapshot()
        wanted, jobs = self.metrics.wanted, self._jobs

        def send(sock, out):
            try:
                sock.send(out[0], more)
                sock.send(out[1], more)
                sock.send(out[2], last)
            except zmq.ZMQError:  # peer gone (or HWM): its reply is dropped
                pass

        while not self._stop:
            wait = 100 if self.tier is None else self.tier.timeout_ms()
            # wake up for TTLs, stats, metrics and SIGTERM; not at all while work is waiting
            poller.poll(0 if jobs or (ev is not None and ev.replaying) else wait)
            # Take turns between the sockets (each ROUTER between its connections) and the
            # slices of big RESERVEs in progress.
            for _ in range(256):
                served = False
                for sock, tag in socks:
                    if not sock.getsockopt(events) & pollin:
                        continue
                    try:
                        frames = sock.recv_multipart(noblock, copy=False)
                    except zmq.Again:
                        continue
                    served = True
                    out = self._serve_one([f.bytes for f in frames], tag, sock, _peer(frames))
                    if out is not None:
                        send(sock, out)
                if jobs:
                    served = True
                    job = jobs[0]
                    if job.step(self.index):
                        jobs.popleft()
                        self.hist.observe("reserve", time.perf_counter() - job.t0)
                        send(job.sock, [job.ident, job.rid,
                                        P.encoder.encode(reserve_reply(self.epoch, job.out))])
                    else:
                        jobs.rotate(-1)
                if not served:
                    break
                if wanted.is_set():
                    self.metrics.publish()
            now = time.monotonic()
            expire(now)
            while self.loop_calls:
                self.loop_calls.popleft()()
            if self.events is not None:
                self.events.flush()
                self.events.serve_replay()
            if self.tier is not None:
                for out in self.tier.poll(now):
                    send(self._deferred_sock.pop((out[0], out[1]), self.ipc), out)
            if wanted.is_set():
                self.metrics.publish()
            if now >= next_stats:
                window = self._log_stats(window, stats_every)
                next_stats = now + stats_every

    def _serve_one(self, frames: list[bytes], tag: bytes = b"i", sock=None,
                   peer: bytes = b"") -> list[bytes] | None:
        """[identity, request_id, body] -> [identity, request_id, reply body], or None when the
        request became a sliced job (answered later). ``peer``: who is connected, as the
        authenticator named it (uid and pid, or CURVE key: nothing the client chooses); the
        per-client caps are keyed by it. ``tag`` + peer + the ROUTER identity name the connection:
        leases belong to it."""
        ident = frames[0]
        rid = frames[1] if len(frames) > 1 and len(frames[1]) == 8 else P.pack_id(0)
        if len(frames) != 3 or len(frames[1]) != 8:
            return [ident, rid, self._error(P.ErrorCode.MALFORMED,
                                            "expected two frames: 8-byte request id, body")]
        body = frames[2]
        if len(body) > P.MAX_MESSAGE_BYTES:
            return [ident, rid, self._error(P.ErrorCode.TOO_LARGE, "message too large")]
        t0 = time.perf_counter()
        try:
            req = P.request_decoder.decode(body)
        except msgspec.ValidationError as e:
            code = P.ErrorCode.TOO_LARGE if "length <=" in str(e) else P.ErrorCode.MALFORMED
            return [ident, rid, self._error(code, f"invalid request: {e}")]
        except (msgspec.DecodeError, ValueError, TypeError, OverflowError) as e:
            return [ident, rid, self._error(P.ErrorCode.MALFORMED, f"undecodable request: {e}")]
        kind = _TYPE_NAME[type(req)]
        self.requests[kind] = self.requests.get(kind, 0) + 1
        if sock is not None and SlicedReserve.wanted(req, self.events is not None):
            try:
                self._check_epoch(req.epoch)
                self._jobs.append(SlicedReserve(self.index, sock, ident, rid, req, t0))
            except RequestError as e:
                return [ident, rid, self._error(e.code, str(e))]
            return None
        self._frames, self._sock, self._peer = (ident, rid), sock, peer
        try:
            reply = self._handlers[type(req)](req, b"%s%s/%s" % (tag, peer, ident))
            if reply is DEFERRED:  # the scale-out tier answers it from Tier.poll
                return None
        except RequestError as e:
            return [ident, rid, self._error(e.code, str(e))]
        except Exception as e:  # the loop must survive a bug in one handler
            log.exception("internal error handling %s", kind)
            return [ident, rid, self._error(P.ErrorCode.INTERNAL, f"internal error: {e!r}")]
        self.hist.observe(kind, time.perf_counter() - t0)
        return [ident, rid, P.encoder.encode(reply)]

    def _error(self, code: P.ErrorCode, message: str) -> bytes:
        self.errors[code.name.lower()] = self.errors.get(code.name.lower(), 0) + 1
        return P.encoder.encode(P.ErrorReply(self.epoch, int(code), message[:1000]))

    def _check_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise RequestError(P.ErrorCode.BAD_EPOCH,
                               f"request is for gateway epoch {epoch}, this gateway is epoch "
                               f"{self.epoch} (it restarted: layouts and leases are gone)")

    # ------------------------------------------------------------------ handlers

    def _hello(self, req: P.Hello, owner: bytes) -> P.LayoutInfo:
        if req.version != P.PROTOCOL_VERSION:
            raise RequestError(P.ErrorCode.BAD_VERSION,
                               f"client speaks protocol {req.version}, gateway speaks "
                               f"{P.PROTOCOL_VERSION}: upgrade xkv on both sides together")
        lay = self.index.register_layout(req.namespace, req.fingerprint, req.num_shards,
                                         req.shard_bytes, self._peer, req.check_words)
        return P.LayoutInfo(self.epoch, lay.layout_id, lay.slot_bytes, lay.num_shards,
                            lay.shard_bytes, self.index.capacity_bytes,
                            self.config.lease_ttl_s, self.config.write_ttl_s,
                            self.events is not None, lay.check_words)

    def _card(self, req: P.Card, owner: bytes) -> P.CardInfo:
        c = self.card
        return P.CardInfo(self.epoch, c.kind, c.path, c.gen_path, c.capacity_bytes,
                          c.slot_alignment)

    def _lookup(self, req: P.Lookup, owner: bytes) -> P.LookupReply:
        self._check_epoch(req.epoch)
        total = sum(len(g.keys) for g in req.groups)
        if total > P.MAX_KEYS:
            raise RequestError(P.ErrorCode.TOO_LARGE,
                               f"{total} keys in one lookup, at most {P.MAX_KEYS}")
        now = time.monotonic()
        num, lease_id, hits = self.index.lookup(
            [(g.layout_id, g.keys) for g in req.groups], now, req.lease, owner, self._peer)
        if self.tier is not None and self.tier.wants(req, num):
            self._deferred_sock[self._frames] = self._sock
            self._deferred_owner[id(req)] = (owner, self._peer)
            return self.tier.defer(self._frames, req, num, lease_id, now)
        return self._lookup_reply(num, lease_id, hits)

    def answer_lookup(self, req: P.Lookup) -> bytes:
        """The tier's second pass of a deferred lookup: the card as it is now, encoded; the
        lease belongs to the client that asked."""
        owner, peer = self._deferred_owner.pop(id(req), (b"", b""))
        try:
            self._check_epoch(req.epoch)
            num, lease_id, hits = self.index.lookup(
                [(g.layout_id, g.keys) for g in req.groups], time.monotonic(), req.lease, owner,
                peer)
            return P.encoder.encode(self._lookup_reply(num, lease_id, hits))
        except RequestError as e:
            return self._error(e.code, str(e))

    def _lookup_reply(self, num: int, lease_id: int, hits: list) -> P.LookupReply:
        offsets = [b"".join([obj.packed[0] for obj in row]) for row in hits]
        gens = [b"".join([obj.packed[1] for obj in row]) for row in hits]
        # opaque words as the COMMITs stored them, chunk-major then shard (b"" without words)
        checks = [b"".join([obj.checks for obj in row]) for row in hits]
        return P.LookupReply(self.epoch, num, lease_id, offsets, gens, checks)

    def _reserve(self, req: P.Reserve, owner: bytes) -> P.ReserveReply:
        self._check_epoch(req.epoch)
        if req.blocks and self.events is not None:
            return reserve_reply(self.epoch, reserve_announced(self.index, self.events, req))
        return reserve_reply(self.epoch, self.index.reserve(req.layout_id, req.keys,
                                                            time.monotonic()))

    @staticmethod
    def _tokens(req: P.Commit | P.Abort | P.Corrupt) -> list[tuple[int, int]]:
        if not len(req.keys) == len(req.offsets) == len(req.generations):
            raise RequestError(P.ErrorCode.BAD_REQUEST,
                               f"{len(req.keys)} keys, {len(req.offsets)} offsets and "
                               f"{len(req.generations)} generations: one token per key")
        return list(zip(req.offsets, req.generations, strict=True))

    def _commit(self, req: P.Commit, owner: bytes) -> P.Ack:
        self._check_epoch(req.epoch)
        done = self.index.commit(req.layout_id, req.shard, req.keys, tokens=self._tokens(req),
                                 now=time.monotonic(), checksums=req.checksums)
        return P.Ack(self.epoch, done, len(req.keys) - done)

    def _abort(self, req: P.Abort, owner: bytes) -> P.Ack:
        self._check_epoch(req.epoch)
        done = self.index.abort(req.layout_id, req.shard, req.keys, tokens=self._tokens(req),
                                now=time.monotonic())
        return P.Ack(self.epoch, done, len(req.keys) - done)

    def _corrupt(self, req: P.Corrupt, owner: bytes) -> P.Ack:
        self._check_epoch(req.epoch)
        removed = self.index.corrupt(req.layout_id, req.shard, req.keys, self._tokens(req))
        self.corrupt_warnings.removed(removed)
        return P.Ack(self.epoch, len(removed), len(req.keys) - len(removed))

    def _release(self, req: P.Release, owner: bytes) -> P.Ack:
        self._check_epoch(req.epoch)
        done = self.index.release(req.lease_id, owner)
        return P.Ack(self.epoch, done, 1 - done)

    def _ping(self, req: P.Ping, owner: bytes) -> P.PingReply:
        return P.PingReply(self.epoch, P.PROTOCOL_VERSION, self.index.capacity_bytes,
                           self.index.used_bytes, time.monotonic() - self.started)

    def _stats(self, req: P.Stats, owner: bytes) -> P.StatsReply:
        stats = self.snapshot()
        stats.update({f"requests_{k}": v for k, v in self.requests.items()})
        stats.update({f"errors_{k}": v for k, v in self.errors.items()})
        stats.update({f"handling_seconds_{k}": v for k, v in self.hist.sums.items()})
        return P.StatsReply(self.epoch, stats)

    # ------------------------------------------------------------------ observability

    def snapshot(self) -> dict:
        snap = self.index.snapshot()
        snap["uptime_s"] = time.monotonic() - self.started
        snap["refused_connections"] = self._auth.refused if self._auth else 0
        if self.events is not None:
            snap.update(self.events.counters, kv_events_port=self.events.port)
            if self.events.replay_port is not None:
                snap["kv_events_replay_port"] = self.events.replay_port
        if self.tier is not None:
            snap.update(self.tier.snapshot())
        return snap

    def metrics_text(self) -> str:
        """Render the metrics (loop thread only: it reads the index)."""
        info = {"epoch": f"{self.epoch:016x}", "card": self.card.kind,
                "protocol_version": str(P.PROTOCOL_VERSION)}
        return render(self.snapshot(), self.requests, self.errors, self.hist, info)

    def _log_stats(self, prev: dict, interval: float) -> dict:
        s = self.index.snapshot()
        cap = max(s["capacity_bytes"], 1)
        rate = (s["lookups"] - prev["lookups"]) / interval
        hits, keys = s["hit_chunks"] - prev["hit_chunks"], s["lookup_keys"] - prev["lookup_keys"]
        log.info("stats: used %.1f%% of %d B, ready %d (%d B), staged %d, leases %d, "
                 "lookups %.1f/s, hit %d/%d keys, reserved %d, no_space %d, evicted %d, errors %d",
                 100.0 * s["used_bytes"] / cap, cap, s["ready_objects"], s["ready_bytes"],
                 s["staged_objects"], s["leases"], rate, hits, keys,
                 s["reserved"] - prev["reserved"], s["no_space"] - prev["no_space"],
                 s["evicted"] - prev["evicted"], sum(self.errors.values()))
        return s

    def close(self) -> None:
        events, self.events = self.events, None
        if events is not None:
            events.cleared()
            events.close()
        if self.tier is not None:  # before the card: its threads move bytes in and out of it
            self.tier.close()
            self.tier = None
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        for sock in (getattr(self, "ipc", None), self.tcp):
            if sock is not None:
                sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()
        if self.card is not None:
            self.card.close()
        if self.dir is not None:
            self.dir.close()


def _peer(frames: list[zmq.Frame]) -> bytes:
    """The authenticator's name for the sender of ``frames`` (ZMQ's ``User-Id``)."""
    try:
        return frames[-1].get("User-Id").encode()
    except (zmq.ZMQError, AttributeError):
        return b""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["stats"]:  # ``xkv-gateway stats``: a client, not a gateway
        from xkv.gateway.stats_cli import main as stats_main

        return stats_main(argv[1:])
    config = parse_args(argv)
    logging.basicConfig(level=config.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s xkv-gateway: %(message)s")
    try:
        gw = Gateway(config)
    except OSError as e:
        raise SystemExit(f"xkv-gateway: cannot create the card or its sockets: {e}") from None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, gw.stop)
    if config.port_file:
        tmp = config.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{gw.port}\n")
        os.replace(tmp, config.port_file)
    tcp = (f", tcp://{config.bind_address}:{gw.port} (CURVE, allow-list)"
           if gw.tcp is not None else "")
    log.info("listening on ipc://%s%s (epoch %016x, protocol %d); card %s %d B at %s, slot "
             "alignment %d B, lease TTL %gs, write TTL %gs, quarantine %gs%s", gw.control_path,
             tcp, gw.epoch, P.PROTOCOL_VERSION, gw.card.kind, gw.card.capacity_bytes,
             gw.card.path, config.slot_alignment, config.lease_ttl_s, config.write_ttl_s,
             config.quarantine_s,
             f", metrics http://127.0.0.1:{gw.metrics_server.server_address[1]}/metrics"
             if gw.metrics_server else "")
    if gw.events is not None:
        log.info("KV events on tcp://%s:%d", config.bind_address, gw.events.port)
    gc.freeze()  # start-up objects never need scanning again: keeps collections short
    try:
        gw.serve()
    finally:
        gw.close()
        log.info("stopped (epoch %016x); card names removed", gw.epoch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
