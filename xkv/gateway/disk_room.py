"""The disk tier's room: which files it keeps, in which order they go, and the namespaces'
shares (a base class of :class:`xkv.gateway.disk_tier.DiskTier`, on the gateway's loop thread:
dictionary work only; the files are deleted by the store's threads).

* LRU over ``capacity_bytes`` of files: the least recently used (written or restored) are
  deleted to make room; files being restored are never deleted. The order is kept per layout
  digest (oldest first, each entry stamped with its last use), so a namespace's own files and
  the evictable ones are found without walking the others'.
* Namespace quotas (``quotas``, ``default_quota_bytes``: ``--disk-quota NS=SIZE``,
  ``--disk-namespace-quota SIZE``, as the card's ``--quota``/``--namespace-quota``). A namespace
  at its quota makes room by deleting its own least recently used files; room under the
  capacity is made from files of namespaces without a quota, over their quota, or not known yet
  (a layout not registered since the restart), never from another namespace's files within its
  quota (its share): a write that finds no such room is not made (``disk_quota_refused``). A
  file's namespace is its layout's (the layout digest names the file's directory), learned when
  the layout is registered.

The subclass provides ``index``, ``store``, ``counters``, ``capacity_bytes``, ``_deleting`` and
``_digest(layout)`` (which records each layout digest's namespace in ``_ns``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable


class DiskRoom:
    """``quotas``: bytes of disk per namespace; ``default_quota_bytes``: for the others (0:
    none)."""

    def __init__(self, quotas: dict[str, int] | None, default_quota_bytes: int):
        self.quotas = dict(quotas or {})
        self.default_quota_bytes = default_quota_bytes
        # on disk: (digest, name) -> [bytes, readers, last use]
        self.entries: dict[tuple[bytes, str], list[int]] = {}
        self._lru: dict[bytes, OrderedDict[str, None]] = {}
        self._tick = itertools.count(1)
        self.used_bytes = 0  # files on disk + writes in flight
        self._digest_used: dict[bytes, int] = {}  # the same per layout digest
        self._ns: dict[bytes, str] = {}  # layout digest -> namespace (from registered layouts)
        self._known_layouts = 0

    def _learn_layouts(self) -> None:
        """Attribute files to namespaces: every layout registered since the last call."""
        layouts = self.index.layouts
        if len(layouts) != self._known_layouts:
            for lay in layouts.values():
                self._digest(lay)
            self._known_layouts = len(layouts)

    # ------------------------------------------------------------------ entries (LRU)

    def _add(self, k: tuple[bytes, str], size: int, oldest: bool = False) -> None:
        """A file on disk (its bytes already in used_bytes); most recently used, or the least
        (``oldest``: found by the scan, ordered before everything of this start)."""
        lru = self._lru.get(k[0])
        if lru is None:
            lru = self._lru[k[0]] = OrderedDict()
        lru[k[1]] = None
        tick = next(self._tick)
        if oldest:
            lru.move_to_end(k[1], last=False)
            tick = -tick  # the scan hands them oldest first: older ones get lower ticks later
        self.entries[k] = [size, 0, tick]

    def _touch(self, k: tuple[bytes, str]) -> None:
        self._lru[k[0]].move_to_end(k[1])
        self.entries[k][2] = next(self._tick)

    def _forget(self, k: tuple[bytes, str]) -> int:
        """Drop an entry (its file deleted or gone); returns its bytes (taken off the usage)."""
        size = self.entries.pop(k)[0]
        lru = self._lru[k[0]]
        del lru[k[1]]
        if not lru:
            del self._lru[k[0]]
        self.used_bytes -= size
        self._digest_used[k[0]] -= size
        return size

    def _charge(self, digest: bytes, nbytes: int) -> None:
        self.used_bytes += nbytes
        self._digest_used[digest] = self._digest_used.get(digest, 0) + nbytes

    def _quota(self, ns: str) -> int:
        return self.quotas.get(ns, self.default_quota_bytes)

    def ns_used(self, ns: str) -> int:
        """Bytes of ``ns``'s files on disk and being written (of its registered layouts)."""
        self._learn_layouts()
        return sum(b for d, b in self._digest_used.items() if self._ns.get(d) == ns)

    def _oldest(self, digests: Iterable[bytes]) -> tuple[bytes, str] | None:
        """The least recently used entry of these layout digests that no restore is reading."""
        best, best_tick = None, None
        for d in digests:
            for name in self._lru.get(d, ()):
                e = self.entries[(d, name)]
                if not e[1]:
                    if best_tick is None or e[2] < best_tick:
                        best, best_tick = (d, name), e[2]
                    break
        return best

    def _evictable(self, ns: str | None) -> list[bytes]:
        """Layout digests whose files may make room for a write of ``ns`` (None: the tier's
        own, after a scan or a full disk: all): its own, and those of namespaces unknown, without
        a quota or over it; not another namespace's within its quota."""
        if ns is None:
            return list(self._lru)
        out, over = [], {}
        for d in self._lru:
            owner = self._ns.get(d)
            if owner is None or owner == ns or not self._quota(owner):
                out.append(d)
                continue
            if owner not in over:
                over[owner] = self.ns_used(owner) > self._quota(owner)
            if over[owner]:
                out.append(d)
        return out

    def _make_room(self, nbytes: int, ns: str | None = None) -> bool:
        """Delete least recently used files (not being read) until ``nbytes`` more of namespace
        ``ns`` fit: within its quota (its own files go) and the capacity (files of namespaces
        that :meth:`_evictable` allows go). False: they do not fit (``disk_quota_refused`` when
        the quota, or other namespaces' shares, were in the way)."""
        if nbytes > self.capacity_bytes:
            return False
        quota = self._quota(ns) if ns is not None else 0
        if quota and nbytes > quota:
            self.counters["disk_quota_refused"] += 1
            return False
        gone: list[tuple[bytes, str]] = []
        fits = True
        if quota:
            mine = [d for d in self._lru if self._ns.get(d) == ns]
            used = self.ns_used(ns)
            while used + nbytes > quota:
                k = self._oldest(mine)
                if k is None:
                    fits = False
                    self.counters["disk_quota_refused"] += 1
                    break
                used -= self._forget(k)
                gone.append(k)
                self.counters["disk_quota_evicted"] += 1
        if fits and self.used_bytes + nbytes > self.capacity_bytes:
            if ns is not None:
                self._learn_layouts()
            while self.used_bytes + nbytes > self.capacity_bytes:
                # anew each time: a namespace over its quota is evictable only down to it
                digests = self._evictable(ns)
                k = self._oldest(digests)
                if k is None:
                    fits = False
                    if len(digests) < len(self._lru):  # other namespaces' shares were kept
                        self.counters["disk_quota_refused"] += 1
                    break
                self._forget(k)
                gone.append(k)
        if gone:
            self._deleting.update(gone)
            self.counters["disk_evicted"] += len(gone)
            self.store.delete(gone)
        return fits
