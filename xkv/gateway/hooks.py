"""Parts of the gateway loop kept apart from server.py (its size budget): RESERVEs served in
slices (fairness, see server.py), RESERVE with KV-event block information, and the optional
KV-events publisher and Mooncake tier the gateway starts. ``gw`` is the server.Gateway."""

from __future__ import annotations

import logging
import time

import zmq

from xkv.gateway import protocol as P
from xkv.gateway.events import EventPublisher
from xkv.gateway.index import RequestError

log = logging.getLogger("xkv.gateway")

#: Keys of a RESERVE handled before other clients get a turn (see server.py's docstring).
RESERVE_SLICE = 256


class Job:
    """A RESERVE being served in slices: where to answer, and the answers so far."""

    __slots__ = ("sock", "ident", "rid", "req", "present", "out", "pos", "t0")

    def __init__(self, sock, ident, rid, req, present, t0):
        self.sock, self.ident, self.rid, self.req = sock, ident, rid, req
        self.present, self.out, self.pos, self.t0 = present, [], 0, t0


def step(gw, job: Job) -> bool:
    """Serve the next RESERVE_SLICE keys of ``job``; True when it is complete."""
    keys = job.req.keys[job.pos:job.pos + RESERVE_SLICE]
    try:
        job.out += gw.index.reserve(job.req.layout_id, keys, time.monotonic(), job.present)
    except Exception:  # noqa: BLE001 (validated at start; never let the loop die)
        log.exception("internal error in a sliced RESERVE")
        job.out += [(P.ReserveStatus.NO_SPACE, None)] * len(keys)
    job.pos += RESERVE_SLICE
    return job.pos >= len(job.req.keys)


def reserve_reply(gw, job: Job) -> bytes:
    gw.hist.observe("reserve", time.perf_counter() - job.t0)
    return P.encoder.encode(P.ReserveReply(gw.epoch, [int(s) for s, _ in job.out],
                                           [c for _, c in job.out]))


def reserve_announced(gw, req: P.Reserve) -> P.ReserveReply:
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
    out = gw.index.reserve(req.layout_id, req.keys, time.monotonic())
    objects = gw.index.layouts[req.layout_id].objects
    for key, info, (status, _) in zip(req.keys, req.blocks, out, strict=True):
        if status == P.ReserveStatus.OK:
            gw.events.staged(objects[key], info.hashes, info.parent, req.block_size,
                             req.group_idx)
    return P.ReserveReply(gw.epoch, [int(s) for s, _ in out], [c for _, c in out])


def bind_events(gw) -> EventPublisher | None:
    """The KV-events publisher (``--kv-events``), or None."""
    cfg = gw.config
    if cfg.kv_events_port is None:
        return None
    try:
        return EventPublisher(gw.ctx, cfg.bind_address, cfg.kv_events_port,
                              topic=cfg.kv_events_topic, medium=cfg.kv_events_medium,
                              int_hashes=cfg.kv_events_int_hashes,
                              curve_secret_key=cfg.curve_secret_key,
                              replay_port=cfg.kv_events_replay_port)
    except zmq.ZMQError as e:
        raise SystemExit(
            f"xkv-gateway: cannot bind the KV-events sockets on {cfg.bind_address} (port "
            f"{cfg.kv_events_port}, replay port {cfg.kv_events_replay_port}): {e}. Pass "
            f"--kv-events-port N / --kv-events-replay-port N (0 picks a free port); "
            f"vLLM's own KV-events publisher uses 5557 (+1 per data-parallel rank).") from None


def start_tier(gw):
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
