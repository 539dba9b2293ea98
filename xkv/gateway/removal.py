"""How objects leave the index (a part of :class:`xkv.gateway.index.Index`): eviction of READY
objects, freeing of STAGED ones into quarantine, the write and lease deadlines.

Kept apart from index.py (one idea per file); it works on the Index's own state and is only
used as its base class.
"""

from __future__ import annotations

import heapq

from xkv.gateway.objects import Obj


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
        if self.listener is not None:
            self.listener.freed(obj)
        layout = obj.layout
        for r in range(layout.num_shards):
            self.generations[obj.start + r * layout.slot_pages] += 1
        del layout.objects[obj.key]
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
