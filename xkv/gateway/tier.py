"""The optional scale-out tier: Mooncake Store behind the card (loop side).

Everything here runs on the gateway's loop thread and never waits on Mooncake: calls to it go to
the backend's threads (:mod:`xkv.gateway.tier_store`) and their results come back through a queue
that :meth:`Tier.poll` drains on every turn of the loop.

* Write-through. When an object becomes READY (all shards committed), it is pinned (one lease, so
  eviction passes over it) and queued for the push thread, which writes it to Mooncake in batches
  straight from its slots. The store path never waits. The backlog is bounded
  (``backlog_objects``); when it is full, or the tier is down, the object is not written and
  ``tier_write_dropped`` counts it. Eviction from the card leaves the Mooncake copy alone.
* Lookup miss. A LOOKUP whose card prefix stops short of its keys is *deferred*: its card hits
  stay leased, the missing keys go to Mooncake in one ``batch_is_exist``; the contiguous run found
  is reserved in the card (STAGED and *held*: clients' COMMIT/ABORT and the write TTL leave it
  alone) and pulled into those slots in one batch, verified, and committed. Then the lookup is
  answered from the card as an ordinary one (leases, generations, the same reply). A lookup waits
  at most ``wait_s`` (default 20 ms, below the connector's 50 ms lookup deadline); at the
  deadline it is answered with what the card holds, and the pull goes on as a prefetch, so the
  next lookup of that prefix hits. Why wait at all instead of always answering "miss, prefetch":
  vLLM asks once per scheduling of a request and recomputes on a miss, so a pure prefetch would
  never serve the first request of a prefix on a new host — the common case of a router spreading
  one long system prompt over hosts. A pull of a few chunks over TCP takes single-digit ms. The cost:
  vLLM's scheduler waits for that lookup, and its whole step with it; ``wait_s`` 0 is the pure
  prefetch policy for deployments that value decode latency over first-request hits.
* Failure. Tier down (master gone, setup failing), or too many deferred lookups already: the
  lookup is answered at once from the card. A pulled object that is lost, truncated or fails its
  checksum is aborted (a miss), counted, and logged by the backend.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from xkv.gateway.protocol import ReserveStatus
from xkv.gateway.tier_store import MooncakeBackend, TierItem, layout_digest, mooncake_key

log = logging.getLogger("xkv.gateway")

#: Returned by the server's LOOKUP handler when the tier will send the reply later.
DEFERRED = object()

_COUNTERS = ("tier_lookups", "tier_skipped", "tier_deadline", "tier_asked_chunks", "tier_hits",
             "tier_misses", "tier_served_chunks", "tier_late_objects", "tier_lost", "tier_corrupt",
             "tier_truncated", "tier_pull_errors", "tier_pull_bytes", "tier_written",
             "tier_write_bytes", "tier_write_errors", "tier_write_dropped")
_FAILED = {"lost": "tier_lost", "corrupt": "tier_corrupt", "truncated": "tier_truncated"}


@dataclass(eq=False)
class _Pending:
    frames: tuple[bytes, bytes]  # ROUTER identity, request id
    req: object  # the Lookup
    num: int  # chunks the card held at the first pass
    lease_id: int  # the first pass's lease, released once the reply went out
    deadline: float
    missing: list[list[bytes]] = field(default_factory=list)  # keys[g][num:]
    held: list = field(default_factory=list)  # index objects reserved for the pull, in order
    answered: bool = False


class Tier:
    """``index``: the gateway's Index (this object sets its ``on_ready`` hook); ``answer(req)``:
    encodes the reply to a Lookup from the card as it is now (the server's handler body)."""

    def __init__(self, index, backend: MooncakeBackend, answer: Callable[[object], bytes], *,
                 write_through: bool = True, wait_s: float = 0.020, backlog_objects: int = 4096,
                 max_deferred: int = 64):
        self.index = index
        self.backend = backend
        self.answer = answer
        self.write_through = write_through
        self.wait_s = wait_s
        self.backlog_objects = backlog_objects
        self.max_deferred = max_deferred
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.pull_seconds = 0.0
        self._digests: dict[int, bytes] = {}
        self._live: dict[int, _Pending] = {}  # token -> lookup whose tier work is under way
        self._tokens = itertools.count(1)
        self._inflight = 0  # writes queued or in flight (pinned objects)
        self._suppress = False  # our own commits of pulled objects are not written back
        index.on_ready = self._on_ready
        backend.start()

    # ------------------------------------------------------------------ helpers

    def _digest(self, layout) -> bytes:
        d = self._digests.get(layout.layout_id)
        if d is None:
            d = self._digests[layout.layout_id] = layout_digest(
                layout.namespace, layout.fingerprint, layout.num_shards, layout.shard_bytes,
                layout.check_words)
        return d

    def _item(self, obj) -> TierItem:
        lay = obj.layout
        # checksum words (issue 25): READY, a copy of the index's to push (the thread needs a
        # writable buffer's address); STAGED for a pull, the object's own buffer, which it fills
        checks = None
        if obj.checks:
            checks = bytearray(obj.checks) if obj.ready else obj.checks
        return TierItem(self._digest(lay), obj.key, lay.num_shards, lay.shard_bytes,
                        obj.slots.offsets, obj, checks)

    @property
    def up(self) -> bool:
        return self.backend.state == "up"

    def timeout_ms(self) -> int:
        """How long the loop may block in recv: short while the tier has results to expect."""
        return 1 if self._live or self._inflight else 100

    # ------------------------------------------------------------------ write-through

    def _on_ready(self, obj) -> None:
        if not self.write_through or self._suppress:
            return
        if not self.up or self._inflight >= self.backlog_objects:
            self.counters["tier_write_dropped"] += 1
            return
        self.index.pin(obj)  # pinned until the push thread is done with its slots
        self._inflight += 1
        self.backend.offer([self._item(obj)])

    def _pushed(self, items: list[TierItem], ok: list[bool], nbytes: int) -> None:
        for it, good in zip(items, ok, strict=True):
            self.index.unpin(it.ref)
            self.counters["tier_written" if good else "tier_write_errors"] += 1
        self._inflight -= len(items)
        self.counters["tier_write_bytes"] += nbytes

    def forget(self, obj) -> None:
        """``obj`` was reported corrupt (CORRUPT, issue 25): its Mooncake copy is removed (by
        the pull thread; best effort: a copy another host is reading stays)."""
        if self.up:
            self.backend.submit(("remove", 0, [mooncake_key(self._digest(obj.layout), obj.key)]))

    # ------------------------------------------------------------------ lookup miss

    def wants(self, req, num: int) -> bool:
        """Whether a lookup that found ``num`` chunks in the card should ask the tier."""
        if num >= len(req.groups[0].keys):
            return False
        if not self.up or len(self._live) >= self.max_deferred:
            self.counters["tier_skipped"] += 1
            return False
        return True

    def defer(self, frames: tuple[bytes, bytes], req, num: int, lease_id: int,
              now: float) -> object:
        """Take over a lookup the server just ran on the card (``num`` hits, ``lease_id``)."""
        p = _Pending(frames, req, num, lease_id, now + self.wait_s,
                     [list(g.keys[num:]) for g in req.groups])
        token = next(self._tokens)
        self._live[token] = p
        names = []
        for g, keys in zip(req.groups, p.missing, strict=True):
            d = self._digest(self.index.layouts[g.layout_id])
            names += [mooncake_key(d, k) for k in keys]
        self.counters["tier_lookups"] += 1
        self.counters["tier_asked_chunks"] += len(p.missing[0])
        self.backend.submit(("exists", token, names))
        return DEFERRED

    def _exists(self, token: int, found: list[int], now: float) -> list:
        p = self._live[token]
        n = len(p.missing[0])
        rows = [found[g * n:(g + 1) * n] for g in range(len(p.missing))]
        m = 0
        while m < n and all(row[m] for row in rows):
            m += 1
        self.counters["tier_misses"] += n - m
        items = self._reserve(p, m, now) if m else []
        if not items:
            del self._live[token]
            return [] if p.answered else self._finish(p)
        self.backend.submit(("pull", token, items))
        return []

    def _reserve(self, p: _Pending, m: int, now: float) -> list[TierItem]:
        """Reserve chunks [0, m) of the missing keys in every group, up to the first chunk some
        group cannot reserve (present already, or no room); those objects are *held*."""
        results = [self.index.reserve(g.layout_id, keys[:m], now)
                   for g, keys in zip(p.req.groups, p.missing, strict=True)]
        for out in results:
            ok = 0
            while ok < len(out) and out[ok][0] == ReserveStatus.OK:
                ok += 1
            m = min(m, ok)
        items = []
        for g, keys, out in zip(p.req.groups, p.missing, results, strict=True):
            layout = self.index.layouts[g.layout_id]
            mine = [k for k, (st, _) in zip(keys, out, strict=False) if st == ReserveStatus.OK]
            if mine[m:]:  # reserved beyond the first gap: give the room back
                self.index.abort(g.layout_id, 0, mine[m:])
            for key in mine[:m]:
                obj = layout.objects[key]
                obj.leases = 1  # held: Index.commit/abort/expire leave it to us
                p.held.append(obj)
                items.append(self._item(obj))
        return items

    def _pulled(self, token: int, status: list[str], nbytes: int, seconds: float) -> list:
        p = self._live.pop(token)
        self.counters["tier_pull_bytes"] += nbytes
        self.pull_seconds += seconds
        self._suppress = True
        try:
            for obj, st in zip(p.held, status, strict=True):
                obj.leases = 0
                lay = obj.layout
                if st == "ok":
                    self.counters["tier_hits"] += 1
                    for r in range(lay.num_shards):
                        self.index.commit(lay.layout_id, r, [obj.key])
                else:
                    self.counters["tier_misses"] += 1
                    self.counters[_FAILED.get(st, "tier_pull_errors")] += 1
                    self.index.abort(lay.layout_id, 0, [obj.key])
        finally:
            self._suppress = False
        if p.answered:
            self.counters["tier_late_objects"] += status.count("ok")
            return []
        return self._finish(p)

    def _finish(self, p: _Pending) -> list:
        """Answer a deferred lookup from the card as it is now; its first-pass lease goes."""
        p.answered = True
        c = self.index.counters
        # the first pass was not an answer: count the lookup once, as answered
        c["lookups"] -= 1
        c["lookup_keys"] -= len(p.req.groups[0].keys) * len(p.req.groups)
        c["hit_chunks"] -= p.num
        before = c["hit_chunks"]
        body = self.answer(p.req)
        self.counters["tier_served_chunks"] += max(c["hit_chunks"] - before - p.num, 0)
        if p.lease_id and self.index.release(p.lease_id):
            c["released"] -= 1
        return [[p.frames[0], p.frames[1], body]]

    # ------------------------------------------------------------------ the loop's turn

    def poll(self, now: float) -> list[list[bytes]]:
        """Apply the threads' results and answer lookups that are done or out of time; returns
        the reply frames to send."""
        out: list[list[bytes]] = []
        done = self.backend.done
        while not done.empty():
            msg = done.get_nowait()
            if msg[0] == "exists":
                out += self._exists(msg[1], msg[2], now)
            elif msg[0] == "pull":
                out += self._pulled(msg[1], msg[2], msg[3], msg[4])
            elif msg[0] == "removed":
                continue
            else:
                self._pushed(msg[1], msg[2], msg[3])
        for p in self._live.values():
            if not p.answered and now >= p.deadline:
                self.counters["tier_deadline"] += 1
                out += self._finish(p)  # the tier's work goes on as a prefetch
        return out

    def snapshot(self) -> dict:
        return dict(self.counters, tier_up=int(self.up), tier_backlog=self.backend.backlog,
                    tier_inflight=self._inflight, tier_pull_seconds=round(self.pull_seconds, 6),
                    tier_deferred=sum(not p.answered for p in self._live.values()))

    def close(self) -> None:
        self.backend.close()
