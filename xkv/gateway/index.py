"""The gateway's index: what is stored where, what is being written, who is reading, what to evict.

Pure logic, no sockets and no clock: every call that depends on time takes ``now`` (seconds,
monotonic), so the whole state machine can be driven by a hypothesis stateful test.

Card geometry. The card is ``capacity_bytes`` of shared memory cut into *pages* of
``slot_alignment`` bytes. A layout (namespace, fingerprint, num_shards, shard_bytes) has slots of
``slot_bytes = round_up(shard_bytes, slot_alignment)``; one *object* (one key of one layout) takes
``num_shards`` consecutive slots, one per shard, allocated as one page range.

Object life: RESERVE creates it STAGED (invisible to lookups, write deadline = now + write_ttl);
each shard's COMMIT sets its bit; when all shards committed it is READY (visible). ABORT of any
shard, or the write deadline, frees a STAGED object. READY objects sit in an LRU (a lookup hit
is a use); those that no lease holds are evicted, least recently used first, only when a RESERVE
needs room (or its namespace quota).

A STAGED object with ``leases`` > 0 is held by the gateway itself (the scale-out tier is pulling
it into its slots, :mod:`xkv.gateway.tier`): clients' COMMIT and ABORT and the write TTL pass
over it until the tier commits or aborts it.

Generations: ``generations[page]`` is a uint64 per page (the card's generation table). When an
object is freed, the generation at each of its slots' first page is incremented, so a reader that
noted the generation at lookup and finds the same value after copying knows the object it read
was still the one stored there.
"""

from __future__ import annotations

import struct
from collections import OrderedDict, deque
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass, field

import msgspec

from xkv.gateway.alloc import PageAllocator
from xkv.gateway.protocol import MAX_LAYOUTS, ChunkSlots, ErrorCode, ReserveStatus


class RequestError(Exception):
    """A request the index refuses; the server turns it into an ErrorReply with ``code``."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class Layout:
    layout_id: int
    namespace: str
    fingerprint: str
    num_shards: int
    shard_bytes: int
    slot_bytes: int
    slot_pages: int
    lru: OrderedDict[Obj, None]  # READY objects of the namespace, least recently used first
    objects: dict[bytes, Obj] = field(default_factory=dict)

    @property
    def object_pages(self) -> int:
        return self.slot_pages * self.num_shards


class Obj(msgspec.Struct, gc=False, eq=False):
    """One stored object. ``leases`` counts live leases; READY objects are in their namespace's
    LRU, and eviction passes over those with a lease.

    Not tracked by the cyclic GC (a card can hold millions of objects and a full collection
    would stall the loop); that is safe because a freed object is unlinked from every dict and
    LRU, so no cycle through it outlives it. Hashed by identity (``eq=False``)."""

    layout: Layout
    key: bytes
    start: int  # first page of its range
    deadline: float  # write deadline while STAGED
    slots: ChunkSlots  # generations only move when an object is freed: fixed while it lives
    packed: tuple[bytes, bytes]  # slots.offsets, slots.generations as little-endian uint64
    lru: OrderedDict  # its namespace's LRU
    ready: bool = False
    committed: int = 0  # bit r set = shard r committed
    leases: int = 0
    alive: bool = True
    stamp: int = 0  # when it last entered or moved in its LRU: orders namespaces' LRUs


class Index:
    def __init__(
        self,
        capacity_bytes: int,
        *,
        slot_alignment: int = 4096,
        lease_ttl_s: float = 30.0,
        write_ttl_s: float = 60.0,
        default_quota_bytes: int = 0,
        quotas: dict[str, int] | None = None,
        generations: MutableSequence[int] | None = None,
    ):
        if slot_alignment <= 0 or slot_alignment & (slot_alignment - 1):
            raise ValueError(f"slot_alignment must be a power of two, got {slot_alignment}")
        self.alignment = slot_alignment
        self.num_pages = capacity_bytes // slot_alignment
        self.capacity_bytes = self.num_pages * slot_alignment
        self.lease_ttl_s = lease_ttl_s
        self.write_ttl_s = write_ttl_s
        self.default_quota_bytes = default_quota_bytes
        self.quotas = dict(quotas or {})
        self.generations = generations if generations is not None else [0] * self.num_pages
        if len(self.generations) < self.num_pages:
            raise ValueError("generation table shorter than the number of pages")
        self.alloc = PageAllocator(self.num_pages)
        self.layouts: dict[int, Layout] = {}
        self._layout_by_name: dict[tuple[str, str], Layout] = {}
        # One LRU per namespace (quota eviction stays O(1)); global eviction takes the oldest head.
        self._lru: dict[str, OrderedDict[Obj, None]] = {}
        self._clock = 0
        self.ns_used: dict[str, int] = {}
        self._leases: dict[int, list[list[Obj]]] = {}  # lease id -> the lookup's hits per group
        self._lease_q: deque[tuple[float, int]] = deque()
        self._write_q: deque[tuple[float, Obj]] = deque()
        self._next_lease = 1
        #: Called with each object that becomes READY (the scale-out tier's write-through hook).
        self.on_ready: Callable[[Obj], None] | None = None
        # Gauges kept incrementally so metrics never walk the objects.
        self.ready_objects = self.staged_objects = 0
        self.ready_bytes = self.staged_bytes = 0
        self.counters = dict.fromkeys(
            ("lookups", "lookup_keys", "hit_chunks", "reserved", "exists", "no_space",
             "committed", "aborted", "evicted", "write_expired", "lease_expired", "released"), 0)
        # Chunks asked for by lookups (not x groups, unlike lookup_keys); payload bytes
        # (num_shards * shard_bytes) found by lookups / made visible by commits; the evictions a
        # namespace quota forced (``evicted`` counts them too).
        self.counters.update(lookup_chunks=0, hit_bytes=0, stored_bytes=0, evicted_quota=0)
        #: Told about object life (``xkv.gateway.events.EventPublisher``): ``stored(obj)`` when
        #: an object becomes visible, ``freed(obj)`` before any object is freed. None = nobody.
        self.listener = None

    # ------------------------------------------------------------- layouts

    def register_layout(self, namespace: str, fingerprint: str, num_shards: int,
                        shard_bytes: int) -> Layout:
        """The layout of (namespace, fingerprint); registering the same again returns it."""
        old = self._layout_by_name.get((namespace, fingerprint))
        if old is not None:
            if (old.num_shards, old.shard_bytes) != (num_shards, shard_bytes):
                raise RequestError(
                    ErrorCode.LAYOUT_MISMATCH,
                    f"namespace {namespace!r} fingerprint {fingerprint!r} is registered with "
                    f"num_shards={old.num_shards} shard_bytes={old.shard_bytes}, not "
                    f"num_shards={num_shards} shard_bytes={shard_bytes}")
            return old
        if num_shards < 1 or shard_bytes < 1:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"num_shards and shard_bytes must be >= 1, got {num_shards}, {shard_bytes}")
        if len(self.layouts) >= MAX_LAYOUTS:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"{MAX_LAYOUTS} layouts are registered already; restart the "
                               f"gateway (or use fewer namespace/fingerprint pairs)")
        slot_pages = -(-shard_bytes // self.alignment)
        object_bytes = slot_pages * num_shards * self.alignment
        limit = self._quota(namespace) or self.capacity_bytes
        if object_bytes > min(limit, self.capacity_bytes):
            raise RequestError(ErrorCode.NO_SPACE,
                               f"one object of {object_bytes} bytes ({num_shards} slots) exceeds the "
                               f"card ({self.capacity_bytes} bytes) or the quota of {namespace!r}")
        layout = Layout(len(self.layouts) + 1, namespace, fingerprint, num_shards, shard_bytes,
                        slot_pages * self.alignment, slot_pages,
                        self._lru.setdefault(namespace, OrderedDict()))
        self.layouts[layout.layout_id] = layout
        self._layout_by_name[(namespace, fingerprint)] = layout
        return layout

    def _layout(self, layout_id: int) -> Layout:
        layout = self.layouts.get(layout_id)
        if layout is None:
            raise RequestError(ErrorCode.UNKNOWN_LAYOUT, f"unknown layout_id {layout_id}")
        return layout

    def _quota(self, namespace: str) -> int:
        return self.quotas.get(namespace, self.default_quota_bytes)

    # ------------------------------------------------------------- reading

    def lookup(self, groups: Sequence[tuple[int, Sequence[bytes]]], now: float,
               lease: bool = True) -> tuple[int, int, list[list[Obj]]]:
        """(num_chunks, lease_id, hits[g][c]): the longest prefix READY in every group; the
        objects' ``slots`` say where they are.

        With ``lease`` the hit objects are leased (kept from eviction) until release or
        ``lease_ttl_s``; lease_id is 0 when nothing was hit or ``lease`` is False."""
        layouts = [self._layout(layout_id) for layout_id, _ in groups]
        n = len(groups[0][1]) if groups else 0
        if any(len(keys) != n for _, keys in groups):
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"groups must have the same number of keys, got "
                               f"{[len(keys) for _, keys in groups]}")
        self.counters["lookups"] += 1
        self.counters["lookup_keys"] += n * len(groups)
        self.counters["lookup_chunks"] += n
        if len(groups) == 1:  # the common case, without the per-chunk inner loop
            objects, row = layouts[0].objects, []
            for key in groups[0][1]:
                obj = objects.get(key)
                if obj is None or not obj.ready:
                    break
                row.append(obj)
            hits, num = [row], len(row)
        else:
            hits = [[] for _ in groups]
            num = 0
            for c in range(n):
                found = []
                for layout, (_, keys) in zip(layouts, groups, strict=True):
                    obj = layout.objects.get(keys[c])
                    if obj is None or not obj.ready:
                        break
                    found.append(obj)
                else:
                    for g, obj in enumerate(found):
                        hits[g].append(obj)
                    num += 1
                    continue
                break
        self.counters["hit_chunks"] += num
        if num:
            self.counters["hit_bytes"] += num * sum(lay.num_shards * lay.shard_bytes
                                                    for lay in layouts)
        lease_id = 0
        if num:
            clock = self._clock
            self._clock += 1
            # A hit is a use: most recently used end of its LRU. Two loops, no branch per object.
            if lease:
                for row in hits:
                    for obj in row:
                        obj.lru.move_to_end(obj)
                        obj.stamp = clock
                        obj.leases += 1
                lease_id = self._next_lease
                self._next_lease += 1
                self._leases[lease_id] = hits
                self._lease_q.append((now + self.lease_ttl_s, lease_id))
            else:
                for row in hits:
                    for obj in row:
                        obj.lru.move_to_end(obj)
                        obj.stamp = clock
        return num, lease_id, hits

    def release(self, lease_id: int) -> int:
        """Drop a lease; returns 1, or 0 for an unknown (expired or released) lease."""
        held = self._leases.pop(lease_id, None)
        if held is None:
            return 0
        for row in held:
            for obj in row:
                obj.leases -= 1
        self.counters["released"] += 1
        return 1

    # ------------------------------------------------------------- writing

    def reserve(self, layout_id: int, keys: Sequence[bytes],
                now: float) -> list[tuple[ReserveStatus, ChunkSlots | None]]:
        """Per key: (OK, slots to write), (EXISTS, None) or (NO_SPACE, None). First writer wins."""
        layout = self._layout(layout_id)
        out: list[tuple[ReserveStatus, ChunkSlots | None]] = []
        pages = layout.object_pages
        nbytes = pages * self.alignment
        ns = layout.namespace
        quota = self._quota(ns)
        # Answers reflect the index as the request found it: making room for one key may evict
        # another key of the same request, which then still answers EXISTS (never a torn write).
        present = {key for key in keys if key in layout.objects}
        for key in keys:
            if key in present or key in layout.objects:
                self.counters["exists"] += 1
                out.append((ReserveStatus.EXISTS, None))
                continue
            start = None
            if not quota or self._make_quota_room(ns, nbytes, quota):
                start = self.alloc.alloc(pages)
                while start is None:
                    victim = self._oldest()
                    if victim is None:
                        break
                    self._evict(victim)
                    start = self.alloc.alloc(pages)
            if start is None:
                self.counters["no_space"] += 1
                out.append((ReserveStatus.NO_SPACE, None))
                continue
            firsts = [start + r * layout.slot_pages for r in range(layout.num_shards)]
            slots = ChunkSlots(tuple(p * self.alignment for p in firsts),
                               tuple(self.generations[p] for p in firsts))
            fmt = f"<{layout.num_shards}Q"
            packed = (struct.pack(fmt, *slots.offsets), struct.pack(fmt, *slots.generations))
            obj = Obj(layout, key, start, now + self.write_ttl_s, slots, packed, layout.lru)
            layout.objects[key] = obj
            self.ns_used[ns] = self.ns_used.get(ns, 0) + nbytes
            self._write_q.append((obj.deadline, obj))
            self.staged_objects += 1
            self.staged_bytes += nbytes
            self.counters["reserved"] += 1
            out.append((ReserveStatus.OK, slots))
        return out

    def _make_quota_room(self, ns: str, nbytes: int, quota: int) -> bool:
        lru = self._lru[ns]
        while self.ns_used.get(ns, 0) + nbytes > quota:
            victim = self._head(lru)
            if victim is None:
                return False
            self._evict(victim)
            self.counters["evicted_quota"] += 1
        return True

    def _check_shard(self, layout: Layout, shard: int) -> None:
        if not 0 <= shard < layout.num_shards:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"shard {shard} out of range for layout {layout.layout_id} "
                               f"with {layout.num_shards} shards")

    def commit(self, layout_id: int, shard: int, keys: Sequence[bytes]) -> int:
        """Mark ``shard`` written for each STAGED key; returns how many keys it applied to
        (a key whose reservation expired or was aborted is skipped)."""
        layout = self._layout(layout_id)
        self._check_shard(layout, shard)
        full = (1 << layout.num_shards) - 1
        done = 0
        for key in keys:
            obj = layout.objects.get(key)
            if obj is None or obj.ready or obj.leases:  # leases while STAGED: held by the tier
                continue
            obj.committed |= 1 << shard
            done += 1
            if obj.committed == full:
                obj.ready = True
                nbytes = layout.object_pages * self.alignment
                self.staged_objects -= 1
                self.staged_bytes -= nbytes
                self.ready_objects += 1
                self.ready_bytes += nbytes
                obj.lru[obj] = None
                obj.stamp = self._clock
                self._clock += 1
                self.counters["committed"] += 1
                self.counters["stored_bytes"] += layout.num_shards * layout.shard_bytes
                if self.listener is not None:
                    self.listener.stored(obj)
                if self.on_ready is not None:
                    self.on_ready(obj)
        return done

    def abort(self, layout_id: int, shard: int, keys: Sequence[bytes]) -> int:
        """Free the STAGED objects of ``keys`` (every shard: the object can no longer complete)."""
        layout = self._layout(layout_id)
        self._check_shard(layout, shard)
        done = 0
        for key in keys:
            obj = layout.objects.get(key)
            if obj is not None and not obj.ready and not obj.leases:
                self._free(obj)
                self.counters["aborted"] += 1
                done += 1
        return done

    # ------------------------------------------------------------- freeing

    def _head(self, lru: OrderedDict[Obj, None]) -> Obj | None:
        """The least recently used unleased object of one LRU. Leased objects met on the way
        are in use, so they move to the recent end (each is passed over once per cycle)."""
        for _ in range(len(lru)):
            obj = next(iter(lru))
            if not obj.leases:
                return obj
            lru.move_to_end(obj)
            obj.stamp = self._clock
        return None

    def _oldest(self) -> Obj | None:
        """The least recently used evictable object of any namespace."""
        heads = [h for h in map(self._head, self._lru.values()) if h is not None]
        return min(heads, key=lambda o: o.stamp) if heads else None

    def _evict(self, obj: Obj) -> None:
        del obj.lru[obj]
        self._free(obj)
        self.counters["evicted"] += 1

    def _free(self, obj: Obj) -> None:
        if self.listener is not None:
            self.listener.freed(obj)
        layout = obj.layout
        for r in range(layout.num_shards):
            self.generations[obj.start + r * layout.slot_pages] += 1
        self.alloc.free(obj.start, layout.object_pages)
        del layout.objects[obj.key]
        nbytes = layout.object_pages * self.alignment
        self.ns_used[layout.namespace] -= nbytes
        if obj.ready:
            self.ready_objects -= 1
            self.ready_bytes -= nbytes
        else:
            self.staged_objects -= 1
            self.staged_bytes -= nbytes
        obj.alive = False

    def expire(self, now: float) -> None:
        """Drop leases and unfinished writes whose deadline is <= now."""
        q = self._lease_q
        while q and q[0][0] <= now:
            if self.release(q.popleft()[1]):
                self.counters["released"] -= 1
                self.counters["lease_expired"] += 1
        w = self._write_q
        while w and w[0][0] <= now:
            obj = w.popleft()[1]
            if obj.alive and not obj.ready and not obj.leases:
                self._free(obj)
                self.counters["write_expired"] += 1

    # ------------------------------------------------------------- accounting

    @property
    def leased_objects(self) -> int:
        """Distinct objects held by at least one lease (walks the leases: for metrics only)."""
        return len({id(obj) for hits in self._leases.values() for row in hits for obj in row})

    @property
    def used_bytes(self) -> int:
        return (self.num_pages - self.alloc.free_pages) * self.alignment

    def snapshot(self) -> dict[str, int]:
        """Counters and gauges (bytes, objects); O(1), safe to call every loop."""
        return dict(self.counters, capacity_bytes=self.capacity_bytes, used_bytes=self.used_bytes,
                    ready_objects=self.ready_objects, staged_objects=self.staged_objects,
                    ready_bytes=self.ready_bytes, staged_bytes=self.staged_bytes,
                    leased_objects=self.leased_objects, leases=len(self._leases),
                    layouts=len(self.layouts))
