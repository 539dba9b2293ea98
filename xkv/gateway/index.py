"""The gateway's index: what is stored where, what is being written, who is reading, what to evict.

Pure logic, no sockets and no clock: every call that depends on time takes ``now`` (seconds,
monotonic), so the whole state machine can be driven by a hypothesis stateful test.

Card geometry. The card is ``capacity_bytes`` of shared memory cut into *pages* of
``slot_alignment`` bytes. A layout (namespace, fingerprint, num_shards, shard_bytes) has slots of
``slot_bytes = round_up(shard_bytes, slot_alignment)``; one *object* (one key of one layout) takes
``num_shards`` consecutive slots, one per shard, allocated as one page range.

Object life: RESERVE creates it STAGED (invisible to lookups, write deadline = now + write_ttl);
each shard's COMMIT sets its bit; when all shards committed it is READY (visible). ABORT of any
shard, or the write deadline, frees a STAGED object. READY objects that no lease holds are
evicted, least recently used first (a lookup hit is a use), only when a RESERVE needs room (or its
namespace quota); objects are placed by size class over extents so that one size never cuts
another's room into pieces (alloc.py); which objects go, at most MAX_EVICTIONS_PER_KEY for one key
(NO_SPACE past the bound), is room.py's policy. Leased and STAGED objects are never evicted.

Late writers. The pages of a STAGED object that is freed (ABORT, or the write deadline) may still
receive bytes from a writer that outlived the deadline, so they go to a *quarantine* for
``quarantine_s`` more seconds (counted from the write deadline) before they can be reserved again;
a COMMIT past the deadline is refused. COMMIT and ABORT name the reservation by its token (slot
offset and generation of the shard, see protocol.py), so a stale writer's COMMIT cannot publish
a newer reservation of the same key.

Generations: ``generations[page]`` is a uint64 per page (the card's generation table). When an
object is freed, the generation at each of its slots' first page is incremented, so a reader that
noted the generation at lookup and finds the same value after copying knows the object it read
was still the one stored there.

Work per call is bounded: lookups, commits and aborts are O(keys), reserves O(keys) plus at most
EVICTIONS_PER_CALL evictions (each O(1)), ``expire`` is O(expired items), ``snapshot`` O(1)
(every gauge is kept incrementally).

A STAGED object with ``leases`` > 0 is held by the gateway itself (the scale-out tier is pulling
it into its slots, :mod:`xkv.gateway.tier`): clients' COMMIT and ABORT and the write TTL pass
over it until the tier commits or aborts it. A READY object is pinned with :meth:`Index.pin`
(never by touching ``leases``: a pinned object must leave the eviction lists).
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Callable, MutableSequence, Sequence

from xkv.gateway.alloc import CardAllocator, extent_pages_for
from xkv.gateway.objects import Layout, Lease, Obj, RequestError
from xkv.gateway.protocol import (
    CHECK_BYTES_PER_SLOT_BYTE,
    MAX_CHECK_WORDS,
    MAX_LAYOUTS,
    MAX_LAYOUTS_PER_CLIENT,
    MAX_LEASED_PER_CLIENT,
    MAX_REPLY_BYTES,
    ChunkSlots,
    ErrorCode,
    ReserveStatus,
)
from xkv.gateway.removal import Removals
from xkv.gateway.room import EVICTIONS_PER_CALL, MAX_EVICTIONS_PER_KEY, Room

__all__ = ["MAX_EVICTIONS_PER_KEY", "Index", "Layout", "Lease", "Obj", "RequestError"]


class Index(Removals):
    def __init__(
        self,
        capacity_bytes: int,
        *,
        slot_alignment: int = 4096,
        lease_ttl_s: float = 30.0,
        write_ttl_s: float = 60.0,
        quarantine_s: float | None = None,
        default_quota_bytes: int = 0,
        quotas: dict[str, int] | None = None,
        generations: MutableSequence[int] | None = None,
        extent_pages: int | None = None,
    ):
        """``quarantine_s``: how long past its write deadline a freed reservation's pages stay
        unusable (default ``write_ttl_s``). ``extent_pages``: pages per extent of the allocator
        (default :func:`xkv.gateway.alloc.extent_pages_for`)."""
        if slot_alignment <= 0 or slot_alignment & (slot_alignment - 1):
            raise ValueError(f"slot_alignment must be a power of two, got {slot_alignment}")
        self.alignment = slot_alignment
        self.num_pages = capacity_bytes // slot_alignment
        self.capacity_bytes = self.num_pages * slot_alignment
        self.lease_ttl_s = lease_ttl_s
        self.write_ttl_s = write_ttl_s
        self.quarantine_s = write_ttl_s if quarantine_s is None else quarantine_s
        self.default_quota_bytes = default_quota_bytes
        self.quotas = dict(quotas or {})
        self.generations = generations if generations is not None else [0] * self.num_pages
        if len(self.generations) < self.num_pages:
            raise ValueError("generation table shorter than the number of pages")
        self.alloc = CardAllocator(self.num_pages, extent_pages
                                   or extent_pages_for(self.num_pages, slot_alignment))
        self.room = Room(self.alloc, self._evict)
        self.layouts: dict[int, Layout] = {}
        self._layout_by_name: dict[tuple[str, str], Layout] = {}
        self._layouts_of: dict[bytes, int] = {}  # client -> layouts it created
        self.ns_used: dict[str, int] = {}
        # Insertion-ordered by deadline (the TTLs are fixed and ``now`` never goes back); an
        # entry leaves as soon as it is done, so finished work holds no memory until its TTL.
        self._leases: dict[int, Lease] = {}
        self._leased_by: dict[bytes, int] = {}  # client -> chunks it holds leased
        self._staged: dict[Obj, None] = {}
        self._quarantine: list[tuple[float, int, int]] = []  # heap of (until, start, pages)
        self.quarantined_pages = 0
        # Gauges kept incrementally so metrics never walk the objects.
        self.ready_objects = self.staged_objects = self.leased_objects = 0
        self.ready_bytes = self.staged_bytes = 0
        self.doomed_objects = 0  # reported corrupt, out of the index, pages held by a lease
        self.counters = dict.fromkeys(
            ("lookups", "lookup_keys", "hit_chunks", "reserved", "exists", "no_space",
             "committed", "aborted", "evicted", "write_expired", "lease_expired", "released",
             "refused_commits", "refused_releases", "quarantined", "corrupt_reports",
             "corrupt_removed"), 0)
        #: Called with each object that becomes READY (the scale-out tier's write-through hook).
        self.on_ready: Callable[[Obj], None] | None = None
        #: Called with each object a CORRUPT report removed (the tiers drop their copies).
        self.on_corrupt: Callable[[Obj], None] | None = None
        # Chunks asked for by lookups (not x groups, unlike lookup_keys); payload bytes
        # (num_shards * shard_bytes) found by lookups / made visible by commits; the evictions a
        # namespace quota forced (``evicted`` counts them too).
        self.counters.update(lookup_chunks=0, hit_bytes=0, stored_bytes=0, evicted_quota=0)
        #: Told about object life (``xkv.gateway.events.EventPublisher``): ``stored(obj)`` when
        #: an object becomes visible, ``freed(obj)`` before any object is freed. None = nobody.
        self.listener = None
        #: Most bytes of a lookup's packed arrays (offsets, generations, checksums): a lookup
        #: answers the longest prefix that fits (protocol.MAX_REPLY_BYTES).
        self.max_reply_bytes = MAX_REPLY_BYTES

    # ------------------------------------------------------------- layouts

    def register_layout(self, namespace: str, fingerprint: str, num_shards: int,
                        shard_bytes: int, owner: bytes = b"", check_words: int = 0) -> Layout:
        """The layout of (namespace, fingerprint); registering the same again returns it.
        ``owner`` (the client) may create at most MAX_LAYOUTS_PER_CLIENT layouts.
        ``check_words``: opaque uint32 checksum words per shard of one object (COMMIT stores
        them, LOOKUP returns them); part of the layout's identity."""
        old = self._layout_by_name.get((namespace, fingerprint))
        if old is not None:
            if (old.num_shards, old.shard_bytes, old.check_words) != (num_shards, shard_bytes,
                                                                       check_words):
                raise RequestError(
                    ErrorCode.LAYOUT_MISMATCH,
                    f"namespace {namespace!r} fingerprint {fingerprint!r} is registered with "
                    f"num_shards={old.num_shards} shard_bytes={old.shard_bytes} "
                    f"check_words={old.check_words}, not num_shards={num_shards} "
                    f"shard_bytes={shard_bytes} check_words={check_words}")
            return old
        if num_shards < 1 or shard_bytes < 1:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"num_shards and shard_bytes must be >= 1, got {num_shards}, {shard_bytes}")
        if not 0 <= check_words <= MAX_CHECK_WORDS:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"check_words must be in [0, {MAX_CHECK_WORDS}], got {check_words}")
        if num_shards * (16 + 4 * check_words) > self.max_reply_bytes:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"one object of {num_shards} shards with {check_words} checksum "
                               f"words each would not fit a lookup reply of "
                               f"{self.max_reply_bytes} bytes")
        if len(self.layouts) >= MAX_LAYOUTS:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"{MAX_LAYOUTS} layouts are registered already; restart the "
                               f"gateway (or use fewer namespace/fingerprint pairs)")
        mine = self._layouts_of.get(owner, 0)
        if mine >= MAX_LAYOUTS_PER_CLIENT:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"this client created {mine} layouts already, at most "
                               f"{MAX_LAYOUTS_PER_CLIENT} per client")
        slot_pages = -(-shard_bytes // self.alignment)
        if check_words * 4 * CHECK_BYTES_PER_SLOT_BYTE > slot_pages * self.alignment:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"check_words={check_words} ({check_words * 4} bytes per shard) "
                               f"exceeds 1/{CHECK_BYTES_PER_SLOT_BYTE} of the "
                               f"{slot_pages * self.alignment}-byte slot: the gateway keeps the "
                               f"words in its own memory, bounded by a fraction of the card")
        object_bytes = slot_pages * num_shards * self.alignment
        limit = self._quota(namespace) or self.capacity_bytes
        if object_bytes > min(limit, self.alloc.max_object_pages * self.alignment):
            raise RequestError(ErrorCode.NO_SPACE,
                               f"one object of {object_bytes} bytes ({num_shards} slots) exceeds the "
                               f"card ({self.capacity_bytes} bytes) or the quota of {namespace!r}")
        layout = Layout(len(self.layouts) + 1, namespace, fingerprint, num_shards, shard_bytes,
                        slot_pages * self.alignment, slot_pages,
                        self.room.namespace_lru(namespace),
                        self.room.size_lru(slot_pages * num_shards), check_words=check_words)
        self.layouts[layout.layout_id] = layout
        self._layout_by_name[(namespace, fingerprint)] = layout
        self._layouts_of[owner] = mine + 1
        return layout

    def layout(self, layout_id: int) -> Layout:
        """The registered layout ``layout_id``; RequestError UNKNOWN_LAYOUT if there is none."""
        layout = self.layouts.get(layout_id)
        if layout is None:
            raise RequestError(ErrorCode.UNKNOWN_LAYOUT, f"unknown layout_id {layout_id}")
        return layout

    def _quota(self, namespace: str) -> int:
        return self.quotas.get(namespace, self.default_quota_bytes)

    # ------------------------------------------------------------- reading

    def lookup(self, groups: Sequence[tuple[int, Sequence[bytes]]], now: float,
               lease: bool = True, owner: bytes = b"",
               client: bytes | None = None) -> tuple[int, int, list[list[Obj]]]:
        """(num_chunks, lease_id, hits[g][c]): the longest prefix READY in every group; the
        objects' ``slots`` say where they are.

        With ``lease`` the hit objects are leased (kept from eviction) until ``owner`` releases
        the lease or ``lease_ttl_s`` passed; lease_id (random, 63 bits) is 0 when nothing was hit
        or ``lease`` is False. ``client`` (default ``owner``) may hold at most
        MAX_LEASED_PER_CLIENT chunks leased: past it the lookup is refused (TOO_LARGE) before
        anything is leased. At most the chunks whose reply (offsets, generations and checksum
        words of every group) fits ``max_reply_bytes`` are looked at: a shorter prefix."""
        layouts = [self.layout(layout_id) for layout_id, _ in groups]
        n = len(groups[0][1]) if groups else 0
        if any(len(keys) != n for _, keys in groups):
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"groups must have the same number of keys, got "
                               f"{[len(keys) for _, keys in groups]}")
        self.counters["lookups"] += 1
        self.counters["lookup_keys"] += n * len(groups)
        self.counters["lookup_chunks"] += n
        per_chunk = sum(lay.num_shards * (16 + lay.check_bytes) for lay in layouts)
        n = min(n, self.max_reply_bytes // per_chunk) if per_chunk else n
        if len(groups) == 1:  # the common case, without the per-chunk inner loop
            objects, row = layouts[0].objects, []
            keys = groups[0][1]
            for key in (keys if n == len(keys) else keys[:n]):
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
            if lease:
                client = owner if client is None else client
                held, more = self._leased_by.get(client, 0), num * len(groups)
                if held + more > MAX_LEASED_PER_CLIENT:
                    raise RequestError(ErrorCode.TOO_LARGE,
                                       f"this client holds {held} leased objects; {more} more "
                                       f"would pass the limit of {MAX_LEASED_PER_CLIENT}: release "
                                       f"leases (or look up with lease=False)")
                self._leased_by[client] = held + more
                pin = self.pin
                for row in hits:
                    for obj in row:
                        pin(obj)
                lease_id = secrets.randbits(63)
                while not lease_id or lease_id in self._leases:
                    lease_id = secrets.randbits(63)
                self._leases[lease_id] = Lease(now + self.lease_ttl_s, hits, owner, client, more)
            else:  # a hit is a use: most recently used end of its LRUs
                touch = self.room.touch
                for row in hits:
                    for obj in row:
                        if not obj.leases:
                            touch(obj)
        return num, lease_id, hits

    def release(self, lease_id: int, owner: bytes | None = None) -> int:
        """Drop a lease; returns 1, or 0 for an unknown (expired or released) lease or one that
        another client took (that one stays). ``owner`` None: the gateway itself (any lease)."""
        held = self._leases.get(lease_id)
        if held is None:
            return 0
        if owner is not None and held.owner != owner:
            self.counters["refused_releases"] += 1
            return 0
        self._drop_lease(lease_id)
        self.counters["released"] += 1
        return 1

    def _drop_lease(self, lease_id: int) -> None:
        unpin = self.unpin
        held = self._leases.pop(lease_id)
        left = self._leased_by[held.client] - held.chunks
        if left:
            self._leased_by[held.client] = left
        else:
            del self._leased_by[held.client]
        for row in held.hits:
            for obj in row:
                unpin(obj)

    def pin(self, obj: Obj) -> None:
        """Keep a READY ``obj`` from eviction (one more holder): out of the LRUs while held."""
        if not obj.leases:
            self.room.unlist(obj)
            self.leased_objects += 1
        obj.leases += 1

    def unpin(self, obj: Obj) -> None:
        """One holder less; the last one puts it back at the most recently used end (or frees
        it, if it was reported corrupt meanwhile: removal.py)."""
        obj.leases -= 1
        if not obj.leases:
            self.leased_objects -= 1
            if obj.alive:
                self.room.list(obj)
            else:
                self._release_doomed(obj)

    # ------------------------------------------------------------- writing

    def reserve(self, layout_id: int, keys: Sequence[bytes], now: float,
                present: set[bytes] | None = None) -> list[tuple[ReserveStatus, ChunkSlots | None]]:
        """Per key: (OK, slots to write), (EXISTS, None) or (NO_SPACE, None). First writer wins.
        The slots are the reservation's token: COMMIT/ABORT must present them. ``present``: the
        keys stored when the request arrived (default: now; a request served in slices passes
        the set it found at its start)."""
        layout = self.layout(layout_id)
        out: list[tuple[ReserveStatus, ChunkSlots | None]] = []
        pages = layout.object_pages
        nbytes = pages * self.alignment
        ns = layout.namespace
        quota = self._quota(ns)
        # Answers reflect the index as the request found it: making room for one key may evict
        # another key of the same request, which then still answers EXISTS (never a torn write).
        if present is None:
            present = {key for key in keys if key in layout.objects}
        if self._quarantine and self._quarantine[0][0] <= now:
            self._release_quarantine(now)
        budget = EVICTIONS_PER_CALL  # evictions left beyond one per key
        for key in keys:
            if key in present or key in layout.objects:
                self.counters["exists"] += 1
                out.append((ReserveStatus.EXISTS, None))
                continue
            start = None
            cap = min(MAX_EVICTIONS_PER_KEY, budget + 1)
            left = [cap]
            if quota:
                before = self.counters["evicted"]
                fits = self.room.make_quota_room(
                    ns, lambda: self.ns_used.get(ns, 0) + nbytes > quota, left)
                self.counters["evicted_quota"] += self.counters["evicted"] - before
            if not quota or fits:
                start = self.room.place(layout, left)
            budget -= max(0, cap - left[0] - 1)
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
            if layout.check_words:
                obj.checks = bytearray(layout.num_shards * layout.check_bytes)
            layout.objects[key] = obj
            self.room.placed(obj)
            self.ns_used[ns] = self.ns_used.get(ns, 0) + nbytes
            self._staged[obj] = None
            self.staged_objects += 1
            self.staged_bytes += nbytes
            self.counters["reserved"] += 1
            out.append((ReserveStatus.OK, slots))
        return out

    def _check_shard(self, layout: Layout, shard: int) -> None:
        if not 0 <= shard < layout.num_shards:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"shard {shard} out of range for layout {layout.layout_id} "
                               f"with {layout.num_shards} shards")

    def _live(self, layout: Layout, shard: int, keys: Sequence[bytes],
              tokens: Sequence[tuple[int, int]] | None, now: float | None):
        """The STAGED objects of ``keys`` whose reservation the request may act on: token (slot
        offset, generation of ``shard``) equal to the live reservation's, write deadline not
        passed. ``tokens`` None: no token check (callers inside the gateway only)."""
        if tokens is not None and len(tokens) != len(keys):
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"{len(keys)} keys but {len(tokens)} reservation tokens")
        objects = layout.objects
        for i, key in enumerate(keys):
            obj = objects.get(key)
            if obj is None or obj.ready or obj.leases:  # leases while STAGED: held by the tier
                continue
            if tokens is not None and tokens[i] != (obj.slots.offsets[shard],
                                                    obj.slots.generations[shard]):
                continue  # another (newer) reservation of the same key
            if now is not None and now >= obj.deadline:
                continue  # expired: its pages are about to go to quarantine
            yield i, obj

    def commit(self, layout_id: int, shard: int, keys: Sequence[bytes], *,
               tokens: Sequence[tuple[int, int]] | None = None, now: float | None = None,
               checksums: bytes | None = None) -> int:
        """Mark ``shard`` written for each STAGED key; returns how many keys it applied to
        (a key whose reservation expired, was aborted, or does not match its token is
        skipped and counted in ``refused_commits``). ``checksums``: the shard's opaque check
        words of each key, key-major, exactly ``len(keys) * layout.check_bytes`` bytes (b"" for
        a layout without words), else BAD_REQUEST before anything changes; stored beside the
        slot. None: leave the words alone (callers inside the gateway that set them)."""
        layout = self.layout(layout_id)
        self._check_shard(layout, shard)
        w = layout.check_bytes
        if checksums is not None and len(checksums) != len(keys) * w:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"COMMIT of {len(keys)} keys carries {len(checksums)} checksum "
                               f"bytes; layout {layout_id} has check_words={layout.check_words}, "
                               f"so expected {len(keys)} * {layout.check_words} * 4 = "
                               f"{len(keys) * w} bytes")
        full = (1 << layout.num_shards) - 1
        done = 0
        for i, obj in self._live(layout, shard, keys, tokens, now):
            if w and checksums is not None:
                obj.checks[shard * w:(shard + 1) * w] = checksums[i * w:(i + 1) * w]
            obj.committed |= 1 << shard
            done += 1
            if obj.committed == full:
                obj.ready = True
                if w:
                    obj.checks = bytes(obj.checks)  # fixed from now on
                nbytes = layout.object_pages * self.alignment
                self._staged.pop(obj, None)  # absent if the tier held it past its deadline
                self.staged_objects -= 1
                self.staged_bytes -= nbytes
                self.ready_objects += 1
                self.ready_bytes += nbytes
                self.room.list(obj)
                self.counters["committed"] += 1
                self.counters["stored_bytes"] += layout.num_shards * layout.shard_bytes
                if self.listener is not None:
                    self.listener.stored(obj)
                if self.on_ready is not None:
                    self.on_ready(obj)
        self.counters["refused_commits"] += len(keys) - done
        return done

    def abort(self, layout_id: int, shard: int, keys: Sequence[bytes], *,
              tokens: Sequence[tuple[int, int]] | None = None, now: float | None = None) -> int:
        """Free the STAGED objects of ``keys`` (every shard: the object can no longer complete);
        their pages are quarantined (other shards' writers may still be writing)."""
        layout = self.layout(layout_id)
        self._check_shard(layout, shard)
        done = 0
        for _, obj in self._live(layout, shard, keys, tokens, now):
            self._free(obj, now if now is not None else obj.deadline)
            self.counters["aborted"] += 1
            done += 1
        return done

    # ------------------------------------------------------------- accounting

    @property
    def used_bytes(self) -> int:
        """Bytes held by objects (quarantined pages are neither used nor free)."""
        return (self.alloc.used_pages - self.quarantined_pages) * self.alignment

    @property
    def pending_writes(self) -> int:
        return len(self._staged)

    def snapshot(self) -> dict[str, int]:
        """Counters and gauges (bytes, objects); O(1), safe to call every loop."""
        return dict(self.counters, capacity_bytes=self.capacity_bytes, used_bytes=self.used_bytes,
                    ready_objects=self.ready_objects, staged_objects=self.staged_objects,
                    ready_bytes=self.ready_bytes, staged_bytes=self.staged_bytes,
                    leased_objects=self.leased_objects, leases=len(self._leases),
                    quarantined_bytes=self.quarantined_pages * self.alignment,
                    corrupt_held_objects=self.doomed_objects,
                    layouts=len(self.layouts))
