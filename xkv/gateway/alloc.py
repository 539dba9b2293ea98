"""Card allocator: size classes over extents, so objects of one size never fragment another's.

Pure logic. Pages are ``slot_alignment`` bytes; the card's pages are grouped in *extents* of
``extent_pages`` (T) pages, plus a shorter *tail* extent of the last ``num_pages mod T`` pages
(small classes only). An object of P pages is placed by its size:

* P <= T (*small*): its size class owns whole extents, each cut into ``T // P`` slots (the last
  ``T mod P`` pages of such an extent stay unused: none when P divides T, and T is a power of
  two). A class takes a free extent when its own are full and gives an extent back the moment
  its last slot is freed. alloc and free are O(1).
* P > T (*large*): a run of ``ceil(P / T)`` consecutive extents from a best-fit run allocator with
  coalescing (:class:`PageAllocator` counting extents): O(log k) in the number k of distinct
  free-run lengths.

Free extents are shared by every class, so two sizes never cut each other's ranges into pieces
neither can use: a freed small slot is reused by its own class, a freed extent by anybody.
:meth:`CardAllocator.drain` stops the reuse of one extent's free slots, so that evicting its
objects (the index does it, a bounded number per request) hands the whole extent back.
"""

from __future__ import annotations

import bisect

#: Target extent size: extents of at most this many bytes, at least 64 extents per card.
EXTENT_BYTES = 16 << 20
MIN_EXTENTS = 64


def extent_pages_for(num_pages: int, alignment: int) -> int:
    """Default extent size in pages for a card of ``num_pages`` pages of ``alignment`` bytes:
    a power of two, the card in at least MIN_EXTENTS extents of at most EXTENT_BYTES (1 page on
    tiny cards)."""
    t = max(1, min(num_pages // MIN_EXTENTS, EXTENT_BYTES // alignment))
    return 1 << (t.bit_length() - 1)


class _Extent:
    """A small class's extent: ``nslots`` slots of ``pages`` pages; ``free`` slot numbers
    freed, ``bump`` the first slot never handed out; ``live`` slots handed out."""

    __slots__ = ("pages", "nslots", "free", "bump", "live", "draining")

    def __init__(self, pages: int, nslots: int):
        self.pages, self.nslots = pages, nslots
        self.free: list[int] = []
        self.bump = self.live = 0
        self.draining = False


class CardAllocator:
    """Pages of a card placed by size class (see the module docstring)."""

    def __init__(self, num_pages: int, extent_pages: int):
        if extent_pages < 1:
            raise ValueError(f"extent_pages must be >= 1, got {extent_pages}")
        self.extent_pages = extent_pages
        self.num_extents = num_pages // extent_pages  # full ones (the tail extent follows)
        self.tail_pages = num_pages - self.num_extents * extent_pages
        self._tail_free = self.tail_pages > 0
        self.usable_pages = num_pages
        #: Largest object that can be placed (a large one needs whole extents).
        self.max_object_pages = max(self.num_extents * extent_pages, self.tail_pages)
        self.used_pages = 0  # pages handed out (objects' own pages, not the unused tails)
        self.runs = PageAllocator(self.num_extents)
        self._ext: dict[int, _Extent] = {}  # extent -> its small class's record
        self._partial: dict[int, dict[int, None]] = {}  # class pages -> extents with room

    def is_small(self, pages: int) -> bool:
        return pages <= self.extent_pages

    def alloc(self, pages: int) -> int | None:
        """First page of ``pages`` free pages placed by size class, or None (no room)."""
        t = self.extent_pages
        if pages > t:
            e = self.runs.alloc(-(-pages // t))
            if e is None:
                return None
            self.used_pages += pages
            return e * t
        partial = self._partial.get(pages)
        if partial is None:
            partial = self._partial[pages] = {}
        if partial:
            e = next(iter(partial))
            ext = self._ext[e]
        else:
            e, size = self.runs.alloc(1), t
            if e is None:
                if not (self._tail_free and pages <= self.tail_pages):
                    return None
                e, size, self._tail_free = self.num_extents, self.tail_pages, False
            ext = self._ext[e] = _Extent(pages, size // pages)
            partial[e] = None
        if ext.free:
            slot = ext.free.pop()
        else:
            slot = ext.bump
            ext.bump += 1
        ext.live += 1
        if not ext.free and ext.bump == ext.nslots:
            del partial[e]
        self.used_pages += pages
        return e * t + slot * pages

    def free(self, start: int, pages: int) -> None:
        """Give back what :meth:`alloc` returned for ``pages``."""
        t = self.extent_pages
        self.used_pages -= pages
        if pages > t:
            self.runs.free(start // t, -(-pages // t))
            return
        e = start // t
        ext = self._ext[e]
        ext.live -= 1
        if not ext.live:  # the extent goes back to everybody
            del self._ext[e]
            self._partial[pages].pop(e, None)
            if e == self.num_extents:
                self._tail_free = True
            else:
                self.runs.free(e, 1)
            return
        ext.free.append((start - e * t) // pages)
        if not ext.draining:
            self._partial[pages][e] = None

    def extent_of(self, start: int) -> int:
        return start // self.extent_pages

    def drain(self, e: int) -> None:
        """Hand out no more slots of small extent ``e``: once its slots in use are freed, the
        extent returns to the free extents (for any class)."""
        ext = self._ext.get(e)
        if ext is not None and not ext.draining:
            ext.draining = True
            self._partial[ext.pages].pop(e, None)

    def draining(self, e: int) -> bool:
        ext = self._ext.get(e)
        return ext is not None and ext.draining

    @property
    def free_pages(self) -> int:
        """Pages not handed out (free extents, free slots and unused extent tails)."""
        return self.usable_pages - self.used_pages


class PageAllocator:
    """Best-fit allocator of unit ranges with coalescing (units: extents here); O(log k) in the
    number k of distinct free-range lengths."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free_pages = 0
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._by_size: dict[int, dict[int, None]] = {}
        self._sizes: list[int] = []
        if num_pages:
            self._add(0, num_pages)

    def _add(self, start: int, n: int) -> None:
        self._by_start[start] = n
        self._by_end[start + n] = start
        bucket = self._by_size.get(n)
        if bucket is None:
            bucket = self._by_size[n] = {}
            bisect.insort(self._sizes, n)
        bucket[start] = None
        self.free_pages += n

    def _remove(self, start: int, n: int) -> None:
        del self._by_start[start]
        del self._by_end[start + n]
        bucket = self._by_size[n]
        del bucket[start]
        if not bucket:
            del self._by_size[n]
            del self._sizes[bisect.bisect_left(self._sizes, n)]
        self.free_pages -= n

    def alloc(self, n: int) -> int | None:
        """First unit of a free range of ``n`` units, or None if no free range is that long."""
        i = bisect.bisect_left(self._sizes, n)
        if i == len(self._sizes):
            return None
        size = self._sizes[i]
        start = next(iter(self._by_size[size]))
        self._remove(start, size)
        if size > n:
            self._add(start + n, size - n)
        return start

    def free(self, start: int, n: int) -> None:
        prev_start = self._by_end.get(start)
        if prev_start is not None:
            prev_n = self._by_start[prev_start]
            self._remove(prev_start, prev_n)
            start, n = prev_start, n + prev_n
        next_n = self._by_start.get(start + n)
        if next_n is not None:
            self._remove(start + n, next_n)
            n += next_n
        self._add(start, n)

    def free_ranges(self) -> list[tuple[int, int]]:
        return sorted(self._by_start.items())
