"""The local disk tier behind the card (loop side): which objects the disk holds, what to write,
evict and restore. Everything here runs on the gateway's loop thread and does dictionary work
only; files are read and written by :class:`xkv.gateway.disk_store.DiskStore`'s threads.

* Write-behind. An object that becomes READY (all shards committed) is pinned (kept from the
  card's eviction) and queued for a write to disk; when the write is durable the pin goes and
  the object is on disk. So an object the card evicts later is already on disk: eviction (inside
  a RESERVE, which needs the slot at once) never waits for the disk and no byte is copied on the
  loop. The bytes queued for writing are bounded (``backlog_bytes``); past that, or while the
  tier is down, an object is not written (``disk_write_dropped``). Written at commit rather than
  at eviction, the disk also holds what the card still holds: a restart serves it.
* LRU over ``capacity_bytes`` of files: the disk's least recently used objects (written or
  restored) are deleted to make room; objects being restored are never deleted.
* Namespace quotas: :mod:`xkv.gateway.disk_room` (with the LRU bookkeeping).
* Lookup miss. A LOOKUP whose card prefix stops short and whose next chunk is on disk (in every
  group) is deferred: the run of chunks the disk holds is reserved in the card (STAGED and held,
  as the Mooncake tier does), read into those slots by the threads, checked, and committed; then
  the lookup is answered from the card as an ordinary one, or handed on to the Mooncake tier for
  what the disk lacks. A lookup waits at most ``wait_s``; a read still running then lands as a
  prefetch (the next lookup hits). Why wait rather than answer "miss, prefetch" at once: vLLM
  asks once per scheduling of a request and recomputes on a miss; restores of a few chunks take
  a few ms at disk speed (bench/RESULTS.md "Disk tier"). The connector's asynchronous load path
  cannot be used instead: the worker copies the slots at the next step without asking the
  gateway whether the read finished.
* Faults. Lost, truncated, corrupt or foreign files are misses (the store removes bad files);
  ENOSPC shrinks the capacity to what the disk holds and is logged; ``max_errors`` failed writes
  in a row take the tier down for ``retry_s`` (no writes offered; lookups still try the disk).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

from xkv.gateway.disk_format import file_bytes, file_name
from xkv.gateway.disk_room import DiskRoom
from xkv.gateway.disk_store import DiskItem, DiskStore
from xkv.gateway.protocol import ReserveStatus
from xkv.gateway.tier import DEFERRED, _Pending  # one home: a deferred lookup; held = (obj, name)
from xkv.gateway.tier_store import layout_digest

log = logging.getLogger("xkv.gateway")

_COUNTERS = ("disk_lookups", "disk_skipped", "disk_deadline", "disk_asked_chunks", "disk_hits",
             "disk_misses", "disk_served_chunks", "disk_late_objects", "disk_lost",
             "disk_corrupt", "disk_truncated", "disk_foreign", "disk_read_errors",
             "disk_read_bytes", "disk_written", "disk_write_bytes", "disk_write_errors",
             "disk_write_dropped", "disk_full", "disk_evicted", "disk_quota_evicted",
             "disk_quota_refused", "disk_scan_found", "disk_scan_skipped", "disk_scan_removed")
_FAILED = {"lost": "disk_lost", "corrupt": "disk_corrupt", "truncated": "disk_truncated",
           "foreign": "disk_foreign"}


class DiskTier(DiskRoom):
    """``index``: the gateway's Index (its ``on_ready`` hook is chained); ``answer(frames, req)``:
    the reply frames for a lookup from the card as it is now, or None when another tier took it
    over. ``quotas``: bytes of disk per namespace; ``default_quota_bytes``: for the others (0:
    none)."""

    def __init__(self, index, store: DiskStore, answer: Callable[[tuple, object], list | None], *,
                 capacity_bytes: int, wait_s: float = 0.020, backlog_bytes: int = 256 << 20,
                 max_deferred: int = 64, max_errors: int = 8, retry_s: float = 5.0,
                 quotas: dict[str, int] | None = None, default_quota_bytes: int = 0):
        self.index = index
        self.store = store
        self.answer = answer
        self.capacity_bytes = capacity_bytes
        self.wait_s = wait_s
        self.backlog_bytes = backlog_bytes
        self.max_deferred = max_deferred
        self.max_errors, self.retry_s = max_errors, retry_s
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.read_seconds = self.write_seconds = 0.0
        DiskRoom.__init__(self, quotas, default_quota_bytes)
        self._writing: dict[tuple[bytes, str], int] = {}
        self._deleting: set[tuple[bytes, str]] = set()
        self._corrupt_writing: set[tuple[bytes, str]] = set()  # reported corrupt while being written
        self._backlog = 0
        self._offer: list[DiskItem] = []
        self._digests: dict[int, bytes] = {}
        self._live: dict[int, _Pending] = {}
        self._now: list[_Pending] = []  # deferred lookups with nothing to read: answered next turn
        self._tokens = itertools.count(1)
        self._suppress = False  # our own commits of restored objects are not written again
        self._errors, self._down_until = 0, 0.0
        self.scanned = False
        prev = index.on_ready
        index.on_ready = self._on_ready if prev is None else (
            lambda obj: (prev(obj), self._on_ready(obj)))
        store.start()

    # ------------------------------------------------------------------ helpers

    def _digest(self, layout) -> bytes:
        """The layout's name on disk (the Mooncake tier's digest), computed once per layout."""
        d = self._digests.get(layout.layout_id)
        if d is None:
            d = layout_digest(layout.namespace, layout.fingerprint, layout.num_shards,
                              layout.shard_bytes, layout.check_words)
            self._digests[layout.layout_id] = d
            self._ns[d] = layout.namespace
        return d

    def _item(self, obj, name: str) -> DiskItem:
        lay = obj.layout
        # checksum words (issue 25): READY, the index's bytes to write; STAGED for a read, the
        # object's own buffer, filled by the read and served once it commits
        return DiskItem(self._digest(lay), obj.key, name, lay.num_shards, lay.shard_bytes,
                        obj.slots.offsets, obj, obj.checks or None)

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def timeout_ms(self) -> int:
        """How long the loop may block in recv: short while results are to be expected."""
        return 1 if self._live or self._writing or self._now or not self.scanned else 100

    # ------------------------------------------------------------------ write-behind

    def _on_ready(self, obj) -> None:
        if self._suppress:
            return
        lay = obj.layout
        k = (self._digest(lay), file_name(obj.key))
        if k in self.entries:  # on disk already (restored, or stored again after eviction)
            self._touch(k)
            return
        nbytes = file_bytes(lay.num_shards, lay.shard_bytes, len(obj.checks))
        if (k in self._writing or k in self._deleting or not self.up
                or self._backlog + nbytes > self.backlog_bytes
                or not self._make_room(nbytes, lay.namespace)):
            self.counters["disk_write_dropped"] += 1
            return
        self.index.pin(obj)  # until the write is durable: its slots are the write's source
        self._writing[k] = nbytes
        self._charge(k[0], nbytes)
        self._backlog += nbytes
        self._offer.append(self._item(obj, k[1]))  # handed to the threads once per loop turn

    def _written(self, items: list[DiskItem], status: list[str], nbytes: int,
                 seconds: float) -> None:
        self.counters["disk_write_bytes"] += nbytes
        self.write_seconds += seconds
        for it, st in zip(items, status, strict=True):
            self.index.unpin(it.ref)
            k = (it.digest, it.name)
            size = self._writing.pop(k)
            self._backlog -= size
            forget = k in self._corrupt_writing
            self._corrupt_writing.discard(k)
            if st == "ok":
                self._add(k, size)
                self.counters["disk_written"] += 1
                self._errors = 0
                if forget:
                    self._forget_file(k)
                continue
            self._charge(k[0], -size)
            if st == "full":
                self.counters["disk_full"] += 1
                shrunk = self.used_bytes  # what fits: the next write evicts to make room
                if shrunk < self.capacity_bytes:
                    log.warning("disk tier: the disk under %s is full with %d B of objects; "
                                "capacity lowered from %d to %d B (old objects make room)",
                                self.store.root, self.used_bytes, self.capacity_bytes, shrunk)
                    self.capacity_bytes = shrunk
                    self._make_room(0)
            else:
                self.counters["disk_write_errors"] += 1
                self._errors += 1
                if self._errors >= self.max_errors and self.up:
                    log.warning("disk tier: %d writes in a row failed; no writes for %g s",
                                self._errors, self.retry_s)
                    self._down_until = time.monotonic() + self.retry_s
                    self._errors = 0

    def forget(self, obj) -> None:
        """``obj`` was reported corrupt (CORRUPT, issue 25): its file is deleted, now or when
        its write lands, so the disk does not restore the same bad bytes again."""
        k = (self._digest(obj.layout), file_name(obj.key))
        if k in self._writing:
            self._corrupt_writing.add(k)
        else:
            self._forget_file(k)

    def _forget_file(self, k: tuple[bytes, str]) -> None:
        e = self.entries.get(k)
        if e is None or e[1]:  # not on disk, or being restored (into another object)
            return
        self._forget(k)  # the room's accounting (usage, namespace share, LRU)
        self._deleting.add(k)
        self.store.delete([k])

    # ------------------------------------------------------------------ lookup miss

    def _chunk(self, req, c: int) -> list | None:
        """Chunk ``c`` of a lookup per group: the card's READY object, or None where the disk
        must supply it; None for the whole chunk when some group has it in neither."""
        layouts, entries, row = self.index.layouts, self.entries, []
        for g in req.groups:
            lay = layouts[g.layout_id]
            obj = lay.objects.get(g.keys[c])
            if obj is not None and obj.ready:
                row.append(obj)
            elif obj is None and (self._digest(lay), file_name(g.keys[c])) in entries:
                row.append(None)
            else:  # absent, or STAGED in the card (being written or restored): stop here
                return None
        return row

    def wants(self, req, num: int) -> bool:
        """Whether a lookup that found ``num`` chunks in the card should restore from disk."""
        if num >= len(req.groups[0].keys) or not self.entries:
            return False
        row = self._chunk(req, num)
        if row is None or None not in row:
            return False
        if len(self._live) + len(self._now) >= self.max_deferred:
            self.counters["disk_skipped"] += 1
            return False
        return True

    def defer(self, frames: tuple[bytes, bytes], req, num: int, lease_id: int,
              now: float) -> object:
        """Take over a lookup the server just ran on the card (``num`` hits, ``lease_id``)."""
        n = len(req.groups[0].keys)
        rows = []
        while num + len(rows) < n and (row := self._chunk(req, num + len(rows))) is not None:
            rows.append(row)
        p = _Pending(frames, req, num, lease_id, now + self.wait_s)  # held: (obj, file name)
        self.counters["disk_lookups"] += 1
        self.counters["disk_asked_chunks"] += sum(None in row for row in rows)
        items = self._reserve(p, rows, now)
        if not items:
            self._now.append(p)
            return DEFERRED
        token = next(self._tokens)
        self._live[token] = p
        self.store.read(token, items)
        return DEFERRED

    def _reserve(self, p: _Pending, rows: list[list], now: float) -> list[DiskItem]:
        """Reserve the disk's chunks of ``rows`` (chunks num, num+1, ... of the lookup) in the
        card, up to the first one some group cannot reserve (stored meanwhile, no room or
        quota); those objects are *held*. The card's own objects of ``rows`` are used first
        (latest chunk first), so making room evicts other objects before them, and a later
        chunk of this prefix before an earlier one (a prefix is worth its beginning)."""
        for row in reversed(rows):
            for obj in row:
                if obj is not None and not obj.leases:
                    self.index.pin(obj)
                    self.index.unpin(obj)  # back at the most recently used end
        m = len(rows)
        results = []
        for g, grp in enumerate(p.req.groups):
            want = [c for c in range(len(rows)) if rows[c][g] is None]
            out = self.index.reserve(grp.layout_id, [grp.keys[p.num + c] for c in want], now)
            ok = {c for c, (st, _) in zip(want, out, strict=True) if st == ReserveStatus.OK}
            m = min([m] + [c for c in want if c not in ok])
            results.append((want, ok))
        self.counters["disk_misses"] += sum(None in row for row in rows[m:])
        items = []
        for grp, (want, ok) in zip(p.req.groups, results, strict=True):
            layout = self.index.layouts[grp.layout_id]
            digest = self._digest(layout)
            late = [grp.keys[p.num + c] for c in want if c in ok and c >= m]
            if late:  # reserved past the first gap: give the room back
                self.index.abort(grp.layout_id, 0, late)
            for c in want:
                if c >= m:
                    break
                key = grp.keys[p.num + c]
                obj = layout.objects[key]
                obj.leases = 1  # held: Index.commit/abort/expire leave it to us
                name = file_name(key)
                self.entries[(digest, name)][1] += 1
                self._touch((digest, name))  # a use
                p.held.append((obj, name))
                items.append(self._item(obj, name))
        return items

    def _read(self, token: int, status: list[str], nbytes: int, seconds: float) -> list:
        p = self._live.pop(token)
        self.counters["disk_read_bytes"] += nbytes
        self.read_seconds += seconds
        self._suppress = True
        try:
            for (obj, name), st in zip(p.held, status, strict=True):
                obj.leases = 0
                lay = obj.layout
                k = (self._digest(lay), name)
                entry = self.entries.get(k)
                if entry is not None:
                    entry[1] -= 1
                if st == "ok":
                    self.counters["disk_hits"] += 1
                    for r in range(lay.num_shards):
                        self.index.commit(lay.layout_id, r, [obj.key])
                    continue
                self.counters["disk_misses"] += 1
                self.counters[_FAILED.get(st, "disk_read_errors")] += 1
                self.index.abort(lay.layout_id, 0, [obj.key])
                if entry is not None:  # the file is gone, bad (removed) or not ours: forget it
                    self._forget(k)
        finally:
            self._suppress = False
        if p.answered:
            self.counters["disk_late_objects"] += status.count("ok")
            return []
        return self._finish(p)

    def _finish(self, p: _Pending) -> list:
        """Answer a deferred lookup from the card as it is now (or hand it on); its first-pass
        lease goes."""
        p.answered = True
        c = self.index.counters
        # the first pass was not an answer: count the lookup once, as answered
        c["lookups"] -= 1
        c["lookup_keys"] -= len(p.req.groups[0].keys) * len(p.req.groups)
        c["lookup_chunks"] -= len(p.req.groups[0].keys)
        c["hit_chunks"] -= p.num
        before = c["hit_chunks"]
        out = self.answer(p.frames, p.req)
        self.counters["disk_served_chunks"] += max(c["hit_chunks"] - before - p.num, 0)
        if p.lease_id and self.index.release(p.lease_id):
            c["released"] -= 1
        return [out] if out is not None else []

    # ------------------------------------------------------------------ the loop's turn

    def _scanned(self, found: list, skipped: int, removed: int) -> None:
        self.scanned = True
        c = self.counters
        c["disk_scan_skipped"], c["disk_scan_removed"] = skipped, removed
        for digest_hex, name, size, _mtime in reversed(found):  # newest first: each goes in
            # front of the ones before it, so the oldest file ends up least recently used
            k = (bytes.fromhex(digest_hex), name)
            if k in self.entries or k in self._writing:
                continue
            # entries of this start (written already) stay the most recent
            self._charge(k[0], size)
            self._add(k, size, oldest=True)
            c["disk_scan_found"] += 1
        self._learn_layouts()
        self._make_room(0)
        log.info("disk tier: %d objects (%d B) found in %s, capacity %d B%s", c["disk_scan_found"],
                 self.used_bytes, self.store.root, self.capacity_bytes,
                 f"; {removed} unfinished writes removed" if removed else "")

    def poll(self, now: float) -> list[list[bytes]]:
        """Apply the threads' results and answer lookups that are done or out of time; returns
        the reply frames to send."""
        out: list[list[bytes]] = []
        if self._offer:
            self.store.write(self._offer)
            self._offer = []
        while self._now:
            out += self._finish(self._now.pop())
        done = self.store.done
        while not done.empty():
            msg = done.get_nowait()
            if msg[0] == "read":
                out += self._read(*msg[1:])
            elif msg[0] == "written":
                self._written(*msg[1:])
            elif msg[0] == "deleted":
                self._deleting.difference_update(msg[1])
            else:
                self._scanned(*msg[1:])
        for p in self._live.values():
            if not p.answered and now >= p.deadline:
                self.counters["disk_deadline"] += 1
                out += self._finish(p)  # the read goes on as a prefetch
        return out

    def snapshot(self) -> dict:
        return dict(self.counters, disk_up=int(self.up), disk_objects=len(self.entries),
                    disk_used_bytes=self.used_bytes, disk_capacity_bytes=self.capacity_bytes,
                    disk_write_backlog_bytes=self._backlog, disk_scanned=int(self.scanned),
                    disk_direct=int(self.store.direct),
                    disk_read_depth=self.store.read_depth,
                    disk_depth_measuring=int(self.store.depth_measuring),
                    disk_read_seconds=round(self.read_seconds, 6),
                    disk_write_seconds=round(self.write_seconds, 6),
                    disk_deferred=sum(not p.answered for p in self._live.values()))

    def close(self) -> None:
        self.store.close()
