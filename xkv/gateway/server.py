"""The ``xkv-gateway`` process: a ZMQ ROUTER loop in front of the index and the card.

One thread owns the socket and the index (no locks on the hot path); a daemon thread hands the
card's file descriptors to local clients, another serves /metrics on 127.0.0.1. A bad message
gets an ErrorReply and never stops the loop.
"""

from __future__ import annotations

import errno
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
from xkv.gateway.events import EventPublisher
from xkv.gateway.index import Index, RequestError
from xkv.gateway.metrics import Histogram, render, serve_metrics
from xkv.gateway.tier import DEFERRED

log = logging.getLogger("xkv.gateway")

_TYPE_NAME = {cls: t.name.lower() for cls, t in P.REQUEST_TYPE.items()}


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.epoch = secrets.randbits(64) or 1
        self.started = time.monotonic()
        self.card = Card(config.capacity_bytes, config.slot_alignment, kind=config.card_kind,
                         prefault=config.prefault, epoch=self.epoch)
        self.index = Index(self.card.capacity_bytes, slot_alignment=config.slot_alignment,
                           lease_ttl_s=config.lease_ttl_s, write_ttl_s=config.write_ttl_s,
                           default_quota_bytes=config.namespace_quota_bytes,
                           quotas=config.quotas, generations=self.card.generations)
        self.tier = _start_tier(self) if config.mooncake_master else None
        self.requests: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.hist = Histogram()
        self._stop = False
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
        self._auth = None
        self.metrics_server = None
        self.port = self._bind()
        self.events = self._bind_events()
        self.index.listener = self.events
        if config.metrics_port is not None:
            self.metrics_server = serve_metrics(config.metrics_port, self.metrics_text)
        self._handlers = {
            P.Hello: self._hello, P.Card: self._card, P.Lookup: self._lookup,
            P.Reserve: self._reserve, P.Commit: self._commit, P.Abort: self._abort,
            P.Release: self._release, P.Ping: self._ping, P.Stats: self._stats,
        }

    # ------------------------------------------------------------------ setup

    def _bind(self) -> int:
        cfg = self.config
        if cfg.curve_secret_key is not None:
            self.sock.curve_server = True
            self.sock.curve_secretkey = cfg.curve_secret_key
            if cfg.curve_allowed_clients is not None:
                from zmq.auth.thread import ThreadAuthenticator

                self._auth = ThreadAuthenticator(self.ctx)
                self._auth.start()
                self._auth.configure_curve(domain="*", location=cfg.curve_allowed_clients)
        address = cfg.bind_address
        if ":" in address:  # IPv6 literal
            self.sock.setsockopt(zmq.IPV6, 1)
            address = f"[{address}]"
        endpoint = f"tcp://{address}:{cfg.port or '*'}"
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as e:
            self.close()
            if e.errno == errno.EADDRINUSE:
                raise SystemExit(
                    f"xkv-gateway: port {cfg.port} on {cfg.bind_address} is already in use. "
                    f"Another xkv-gateway may be running, or vLLM's KV-events publisher, which also "
                    f"defaults to tcp://*:5557 (kv_events_config endpoint). Start the gateway with "
                    f"--port N and set \"xkv_gateway_port\": N in kv_connector_extra_config, or move "
                    f"vLLM's KV-events endpoint.") from None
            raise SystemExit(f"xkv-gateway: cannot bind {endpoint}: {e}") from None
        last = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        return int(last.rsplit(":", 1)[1])

    def _bind_events(self) -> EventPublisher | None:
        cfg = self.config
        if cfg.kv_events_port is None:
            return None
        try:
            return EventPublisher(self.ctx, cfg.bind_address, cfg.kv_events_port,
                                  topic=cfg.kv_events_topic, medium=cfg.kv_events_medium,
                                  int_hashes=cfg.kv_events_int_hashes,
                                  curve_secret_key=cfg.curve_secret_key,
                                  replay_port=cfg.kv_events_replay_port)
        except zmq.ZMQError as e:
            self.close()
            raise SystemExit(
                f"xkv-gateway: cannot bind the KV-events sockets on {cfg.bind_address} (port "
                f"{cfg.kv_events_port}, replay port {cfg.kv_events_replay_port}): {e}. Pass "
                f"--kv-events-port N / --kv-events-replay-port N (0 picks a free port); "
                f"vLLM's own KV-events publisher uses 5557 (+1 per data-parallel rank).") from None

    # ------------------------------------------------------------------ loop

    def stop(self, *_args) -> None:
        self._stop = True

    def serve(self) -> None:
        sock = self.sock
        recv, send_frame = sock.recv_multipart, sock.send
        # plain ints: pyzmq's enum flags cost more than the send itself on a slow CPU
        more, last = int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)

        def send(frames: list[bytes]) -> None:
            send_frame(frames[0], more)
            send_frame(frames[1], more)
            send_frame(frames[2], last)

        expire, stats_every = self.index.expire, self.config.stats_interval_s
        next_stats = time.monotonic() + stats_every if stats_every > 0 else float("inf")
        window = self.index.snapshot()
        sock.setsockopt(zmq.RCVTIMEO, 100)  # wake up for TTLs, stats and SIGTERM
        events, pollin = int(zmq.EVENTS), int(zmq.POLLIN)
        while not self._stop:
            try:
                out = self._serve_one(recv())
                if out is not None:  # None: a lookup the tier answers later
                    send(out)
                # Drain what is queued before looking at the clock (EVENTS: no exception per miss)
                for _ in range(256):
                    if not sock.getsockopt(events) & pollin:
                        break
                    out = self._serve_one(recv())
                    if out is not None:
                        send(out)
            except zmq.Again:
                pass
            now = time.monotonic()
            expire(now)
            if self.events is not None:
                self.events.flush()
                self.events.serve_replay()
            if self.tier is not None:
                for out in self.tier.poll(now):
                    send(out)
                wait = self.tier.timeout_ms()
                if wait != sock.getsockopt(zmq.RCVTIMEO):
                    sock.setsockopt(zmq.RCVTIMEO, wait)
            if now >= next_stats:
                window = self._log_stats(window, stats_every)
                next_stats = now + stats_every

    def _serve_one(self, frames: list[bytes]) -> list[bytes] | None:
        """[identity, request_id, body] -> [identity, request_id, reply body], or None when the
        scale-out tier took the request over (it sends the reply from ``Tier.poll``)."""
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
        self._frames = (ident, rid)
        try:
            reply = self._handlers[type(req)](req)
            if reply is DEFERRED:
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

    def _hello(self, req: P.Hello) -> P.LayoutInfo:
        if req.version != P.PROTOCOL_VERSION:
            raise RequestError(P.ErrorCode.BAD_VERSION,
                               f"client speaks protocol {req.version}, gateway speaks "
                               f"{P.PROTOCOL_VERSION}: upgrade xkv on both sides together")
        lay = self.index.register_layout(req.namespace, req.fingerprint, req.num_shards,
                                         req.shard_bytes)
        return P.LayoutInfo(self.epoch, lay.layout_id, lay.slot_bytes, lay.num_shards,
                            lay.shard_bytes, self.index.capacity_bytes,
                            self.config.lease_ttl_s, self.config.write_ttl_s,
                            self.events is not None)

    def _card(self, req: P.Card) -> P.CardInfo:
        c = self.card
        return P.CardInfo(self.epoch, c.kind, c.path, c.gen_path, c.capacity_bytes,
                          c.slot_alignment)

    def _lookup(self, req: P.Lookup) -> P.LookupReply:
        self._check_epoch(req.epoch)
        total = sum(len(g.keys) for g in req.groups)
        if total > P.MAX_KEYS:
            raise RequestError(P.ErrorCode.TOO_LARGE,
                               f"{total} keys in one lookup, at most {P.MAX_KEYS}")
        now = time.monotonic()
        num, lease_id, hits = self.index.lookup(
            [(g.layout_id, g.keys) for g in req.groups], now, req.lease)
        if self.tier is not None and self.tier.wants(req, num):
            return self.tier.defer(self._frames, req, num, lease_id, now)
        return self._lookup_reply(num, lease_id, hits)

    def _answer_lookup(self, req: P.Lookup) -> bytes:
        """The tier's second pass of a deferred lookup: the card as it is now, encoded."""
        try:
            self._check_epoch(req.epoch)
            num, lease_id, hits = self.index.lookup(
                [(g.layout_id, g.keys) for g in req.groups], time.monotonic(), req.lease)
            return P.encoder.encode(self._lookup_reply(num, lease_id, hits))
        except RequestError as e:
            return self._error(e.code, str(e))

    def _lookup_reply(self, num: int, lease_id: int, hits: list) -> P.LookupReply:
        offsets = [b"".join([obj.packed[0] for obj in row]) for row in hits]
        gens = [b"".join([obj.packed[1] for obj in row]) for row in hits]
        return P.LookupReply(self.epoch, num, lease_id, offsets, gens)

    def _reserve(self, req: P.Reserve) -> P.ReserveReply:
        self._check_epoch(req.epoch)
        if req.blocks and self.events is not None:
            return self._reserve_announced(req)
        out = self.index.reserve(req.layout_id, req.keys, time.monotonic())
        return P.ReserveReply(self.epoch, [int(s) for s, _ in out], [c for _, c in out])

    def _reserve_announced(self, req: P.Reserve) -> P.ReserveReply:
        """RESERVE with block information for KV events: checked before anything is reserved."""
        if len(req.blocks) != len(req.keys):
            raise RequestError(P.ErrorCode.BAD_REQUEST,
                               f"{len(req.blocks)} blocks for {len(req.keys)} keys: expected one "
                               f"BlockInfo per key")
        for key, info in zip(req.keys, req.blocks, strict=True):
            if info.hashes[-1] != key:
                raise RequestError(P.ErrorCode.BAD_REQUEST,
                                   f"the last block hash of key {key.hex()[:16]}... is "
                                   f"{info.hashes[-1].hex()[:16]}...: a chunk's key must be "
                                   f"its last block hash")
        if req.block_size < 1:
            raise RequestError(P.ErrorCode.BAD_REQUEST,
                               f"block_size {req.block_size}: expected the tokens per hash block "
                               f"(>= 1) with blocks")
        out = self.index.reserve(req.layout_id, req.keys, time.monotonic())
        objects = self.index.layouts[req.layout_id].objects
        for key, info, (status, _) in zip(req.keys, req.blocks, out, strict=True):
            if status == P.ReserveStatus.OK:
                self.events.staged(objects[key], info.hashes, info.parent, req.block_size,
                                   req.group_idx)
        return P.ReserveReply(self.epoch, [int(s) for s, _ in out], [c for _, c in out])

    def _commit(self, req: P.Commit) -> P.Ack:
        self._check_epoch(req.epoch)
        return P.Ack(self.epoch, self.index.commit(req.layout_id, req.shard, req.keys))

    def _abort(self, req: P.Abort) -> P.Ack:
        self._check_epoch(req.epoch)
        return P.Ack(self.epoch, self.index.abort(req.layout_id, req.shard, req.keys))

    def _release(self, req: P.Release) -> P.Ack:
        self._check_epoch(req.epoch)
        return P.Ack(self.epoch, self.index.release(req.lease_id))

    def _ping(self, req: P.Ping) -> P.PingReply:
        return P.PingReply(self.epoch, P.PROTOCOL_VERSION, self.index.capacity_bytes,
                           self.index.used_bytes, time.monotonic() - self.started)

    def _stats(self, req: P.Stats) -> P.StatsReply:
        stats = self.snapshot()
        stats.update({f"requests_{k}": v for k, v in self.requests.items()})
        stats.update({f"errors_{k}": v for k, v in self.errors.items()})
        stats.update({f"handling_seconds_{k}": v for k, v in self.hist.sums.items()})
        return P.StatsReply(self.epoch, stats)

    # ------------------------------------------------------------------ observability

    def snapshot(self) -> dict:
        snap = self.index.snapshot()
        snap["uptime_s"] = time.monotonic() - self.started
        if self.events is not None:
            snap.update(self.events.counters, kv_events_port=self.events.port)
            if self.events.replay_port is not None:
                snap["kv_events_replay_port"] = self.events.replay_port
        if self.tier is not None:
            snap.update(self.tier.snapshot())
        return snap

    def metrics_text(self) -> str:
        info = {"epoch": f"{self.epoch:016x}", "card": self.card.kind,
                "protocol_version": str(P.PROTOCOL_VERSION)}
        return render(self.snapshot(), dict(self.requests), dict(self.errors), self.hist, info)

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
        events, self.events = getattr(self, "events", None), None
        if events is not None:
            events.cleared()
            events.close()
        if self.tier is not None:  # before the card: its threads move bytes in and out of it
            self.tier.close()
            self.tier = None
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        if self._auth is not None:
            self._auth.stop()
        self.sock.close(linger=0)
        self.ctx.term()
        self.card.close()


def _start_tier(gw: Gateway):
    """The Mooncake tier (config.mooncake_master set); its threads connect in the background."""
    from xkv.gateway.tier import Tier
    from xkv.gateway.tier_store import MooncakeBackend, MooncakeSettings

    c = gw.config
    settings = MooncakeSettings(c.mooncake_master, c.mooncake_metadata, c.mooncake_protocol,
                                c.mooncake_device, c.mooncake_local_hostname,
                                c.mooncake_segment_bytes, secret=c.mooncake_secret)
    return Tier(gw.index, MooncakeBackend(settings, gw.card.arena), gw._answer_lookup,
                write_through=c.mooncake_write_through, wait_s=c.mooncake_wait_ms / 1000,
                backlog_objects=c.mooncake_backlog)


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
        raise SystemExit(f"xkv-gateway: cannot create the card: {e}") from None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, gw.stop)
    if config.port_file:
        tmp = config.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{gw.port}\n")
        os.replace(tmp, config.port_file)
    log.info("listening on tcp://%s:%d (epoch %016x, protocol %d); card %s %d B at %s, slot "
             "alignment %d B, lease TTL %gs, write TTL %gs%s%s%s", config.bind_address, gw.port,
             gw.epoch, P.PROTOCOL_VERSION, gw.card.kind, gw.card.capacity_bytes, gw.card.path,
             config.slot_alignment, config.lease_ttl_s, config.write_ttl_s,
             ", CURVE on" if config.curve_secret_key else "",
             f", metrics http://127.0.0.1:{gw.metrics_server.server_address[1]}/metrics"
             if gw.metrics_server else "",
             f", KV events tcp://{config.bind_address}:{gw.events.port}" if gw.events else "")
    gc.freeze()  # start-up objects never need scanning again: keeps collections short
    try:
        gw.serve()
    finally:
        gw.close()
        log.info("stopped (epoch %016x); card names removed", gw.epoch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
