"""The order of the tiers behind the card: card -> local disk -> Mooncake Store.

A lookup that misses in the card goes to the disk tier when the disk holds its next chunk, else
to the Mooncake tier; after a disk restore, what the disk lacked goes on to Mooncake. Why the
disk first: it is local (a restore costs no network and no other host's memory) and it holds
what this host stored most recently. :class:`Tiers` has the Mooncake tier's interface, so the
server drives one object whatever is configured (``gw.tier``)."""

from __future__ import annotations

import logging
import os
import time

from xkv.gateway import protocol as P
from xkv.gateway.index import RequestError

log = logging.getLogger("xkv.gateway")


class Tiers:
    """``disk``: a DiskTier or None; ``mooncake``: a Tier or None (at least one is set)."""

    def __init__(self, disk, mooncake):
        self.disk, self.mooncake = disk, mooncake
        self._parts = [t for t in (disk, mooncake) if t is not None]
        self._next = None

    def wants(self, req, num: int) -> bool:
        for t in self._parts:
            if t.wants(req, num):
                self._next = t
                return True
        return False

    def defer(self, frames, req, num: int, lease_id: int, now: float) -> object:
        return self._next.defer(frames, req, num, lease_id, now)

    def poll(self, now: float) -> list:
        out = []
        for t in self._parts:
            try:
                out += t.poll(now)
            except Exception:  # a bug in one tier must not stop the gateway's loop
                log.exception("internal error in the %s tier", type(t).__name__)
        return out

    def timeout_ms(self) -> int:
        return min(t.timeout_ms() for t in self._parts)

    def forget(self, obj) -> None:
        """``obj`` was reported corrupt (CORRUPT): every tier drops its copy (issue 25)."""
        for t in self._parts:
            t.forget(obj)

    def snapshot(self) -> dict:
        snap = {}
        for t in self._parts:
            snap.update(t.snapshot())
        return snap

    def close(self) -> None:
        for t in self._parts:
            t.close()


def resume(gw, frames: tuple[bytes, bytes], req) -> list | None:
    """A lookup the disk tier restored for, answered from the card as it is now, or handed on to
    the Mooncake tier when the card still stops short (None: that tier answers it later)."""
    owner, peer = gw._deferred_owner.pop(id(req), (b"", b""))
    try:
        gw._check_epoch(req.epoch)
        now = time.monotonic()
        num, lease_id, hits = gw.index.lookup([(g.layout_id, g.keys) for g in req.groups], now,
                                              req.lease, owner, peer)
        moon = gw.tier.mooncake if gw.tier is not None else None
        if moon is not None and moon.wants(req, num):
            gw._deferred_owner[id(req)] = (owner, peer)
            moon.defer(frames, req, num, lease_id, now)
            return None
        body = P.encoder.encode(gw._lookup_reply(num, lease_id, hits))
    except RequestError as e:
        body = gw._error(e.code, str(e))
    return [frames[0], frames[1], body]


def start_tiers(gw) -> Tiers | None:
    """The tiers the configuration asks for (``--disk``, ``--mooncake-master``), or None."""
    cfg = gw.config
    moon = None
    if cfg.mooncake_master:
        moon = gw.mooncake_tier()
    disk = None
    if cfg.disk_path:
        from xkv.gateway.disk_store import DiskError, DiskStore
        from xkv.gateway.disk_tier import DiskTier

        try:
            store = DiskStore(cfg.disk_path, gw.card.arena, cfg.slot_alignment,
                              threads=cfg.disk_threads, direct=cfg.disk_direct,
                              nice=cfg.disk_io_nice, read_depth=cfg.disk_read_depth)
        except DiskError as e:
            if moon is not None:
                moon.close()
            raise SystemExit(f"xkv-gateway: {e}") from None
        capacity = cfg.disk_capacity_bytes
        if not capacity:  # default: 90 % of what the file system has free now
            st = os.statvfs(store.root)
            capacity = int(st.f_bavail * st.f_frsize * 0.9)
        disk = DiskTier(gw.index, store, lambda frames, req: resume(gw, frames, req),
                        capacity_bytes=capacity, wait_s=cfg.disk_wait_ms / 1000,
                        backlog_bytes=cfg.disk_backlog_bytes, quotas=cfg.disk_quotas,
                        default_quota_bytes=cfg.disk_namespace_quota_bytes)
        log.info("disk tier at %s: capacity %d B, %s I/O, %d threads, %d reads in flight (%s), "
                 "wait %g ms, crc32 by %s", store.root, capacity,
                 "O_DIRECT" if store.direct else "buffered", cfg.disk_threads, store.read_depth,
                 store.depth_source, cfg.disk_wait_ms, store.crc_kind)
        shares = sum(cfg.disk_quotas.values())
        if shares > capacity:  # the shares kept from other namespaces cannot all be kept
            log.warning("disk tier: the --disk-quota values add up to %d B, more than the "
                        "capacity %d B: a namespace within its quota may find no room", shares,
                        capacity)
    if disk is None and moon is None:
        return None
    return Tiers(disk, moon)
