"""How objects leave the index (a part of :class:`xkv.gateway.index.Index`): eviction of READY
objects, freeing of STAGED ones into quarantine, the write and lease deadlines, and removal of
objects reported corrupt (CORRUPT).

A corrupt report names each object by its token (slot offset and generation of one shard): only
the live READY object with exactly that token goes, so a stale report (the object was evicted and
its slot or key re-used since) removes nothing. The object leaves the index at once and its slots'
generations move (a reader still copying it sees the change); its pages stay allocated while a
lease (or a tier's pin) holds it and are freed when the last holder lets go: a slot someone may
still read is never handed to a writer.

Kept apart from index.py (one idea per file); it works on the Index's own state and is only
used as its base class.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from xkv.gateway.objects import Obj, RequestError
from xkv.gateway.protocol import ErrorCode


class Removals:
    """Eviction, freeing and deadlines; mixed into Index, whose attributes it uses."""

    def _evict(self, obj: Obj) -> None:
        self.room.unlist(obj)
        self._free(obj)
        self.counters["evicted"] += 1

    def _free(self, obj: Obj, now: float | None = None) -> None:
        """Unlink ``obj`` and bump its slots' generations. A READY object's pages are free at
        once; a STAGED one's (``now`` given) are quarantined until its write deadline plus
        ``quarantine_s``: a writer that outlived its deadline can only hit pages nobody uses."""
        layout = self._unlink(obj)
        self.room.gone(obj)
        nbytes = layout.object_pages * self.alignment
        self.ns_used[layout.namespace] -= nbytes
        if obj.ready:
            self.ready_objects -= 1
            self.ready_bytes -= nbytes
            self.alloc.free(obj.start, layout.object_pages)
        else:
            self._staged.pop(obj, None)
            self.staged_objects -= 1
            self.staged_bytes -= nbytes
            until = max(obj.deadline, now if now is not None else obj.deadline) + self.quarantine_s
            heapq.heappush(self._quarantine, (until, obj.start, layout.object_pages))
            self.quarantined_pages += layout.object_pages
            self.counters["quarantined"] += 1
        obj.alive = False

    def _release_quarantine(self, now: float) -> None:
        q = self._quarantine
        while q and q[0][0] <= now:
            _, start, pages = heapq.heappop(q)
            self.quarantined_pages -= pages
            self.alloc.free(start, pages)

    def expire(self, now: float) -> None:
        """Drop leases and unfinished writes whose deadline is <= now; end quarantines."""
        leases = self._leases
        while leases:
            lease_id, held = next(iter(leases.items()))
            if held.deadline > now:
                break
            self._drop_lease(lease_id)
            self.counters["lease_expired"] += 1
        staged = self._staged
        while staged:
            obj = next(iter(staged))
            if obj.deadline > now:
                break
            if obj.leases:  # held by the tier: it commits or aborts it, no TTL applies
                del staged[obj]
                continue
            self._free(obj, now)
            self.counters["write_expired"] += 1
        self._release_quarantine(now)

    def corrupt(self, layout_id: int, shard: int, keys: Sequence[bytes],
                tokens: Sequence[tuple[int, int]]) -> list[Obj]:
        """Remove the READY objects of ``keys`` whose token (offset, generation of ``shard``)
        matches; returns them (the rest were refused). O(keys)."""
        layout = self.layout(layout_id)
        self._check_shard(layout, shard)
        if len(tokens) != len(keys):
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"{len(keys)} keys but {len(tokens)} tokens: one token per key")
        self.counters["corrupt_reports"] += len(keys)
        objects, removed = layout.objects, []
        for key, token in zip(keys, tokens, strict=True):
            obj = objects.get(key)
            if (obj is None or not obj.ready
                    or token != (obj.slots.offsets[shard], obj.slots.generations[shard])):
                continue  # stale, someone else's, or not committed: nothing to remove
            if obj.leases:
                self._doom(obj)
            else:
                self.room.unlist(obj)
                self._free(obj)
            removed.append(obj)
            if self.on_corrupt is not None:
                self.on_corrupt(obj)
        self.counters["corrupt_removed"] += len(removed)
        return removed

    def _unlink(self, obj: Obj):
        """Out of the index (announced to the listener), its slots' generations moved; returns
        its layout."""
        if self.listener is not None:
            self.listener.freed(obj)
        layout = obj.layout
        for r in range(layout.num_shards):
            self.generations[obj.start + r * layout.slot_pages] += 1
        del layout.objects[obj.key]
        return layout

    def _doom(self, obj: Obj) -> None:
        """A leased READY object leaves the index now; its pages when the last holder unpins
        (``_release_doomed``)."""
        layout = self._unlink(obj)
        self.ready_objects -= 1
        self.ready_bytes -= layout.object_pages * self.alignment
        self.doomed_objects += 1
        obj.alive = False

    def _release_doomed(self, obj: Obj) -> None:
        layout = obj.layout
        self.room.gone(obj)
        self.ns_used[layout.namespace] -= layout.object_pages * self.alignment
        self.alloc.free(obj.start, layout.object_pages)
        self.doomed_objects -= 1
