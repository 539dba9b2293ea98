"""Page-range allocator of the card (pure logic; pages are ``slot_alignment`` bytes)."""

from __future__ import annotations

import bisect


class PageAllocator:
    """Best-fit allocator of page ranges with coalescing; O(log k) in the number k of distinct
    free-range lengths (one or two when all objects share a layout)."""

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
        """First page of a free range of ``n`` pages, or None if no free range is that long."""
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
