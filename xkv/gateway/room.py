"""Room on the card: where objects go (the allocator, alloc.py) and which ones may leave (the
eviction lists), with the bounded eviction policy. Pure logic, driven by the index.

Eviction lists. An unleased READY object sits in three LRUs, least recently used first: its
namespace's (quota eviction), its size class's (exact-fit eviction) and the global one. A leased
or STAGED object is in none, so it is never evicted, and every step below is O(1) however many
objects are leased.

Policy. A key that finds no room evicts, least recently used first: an object of its own size
class when there is one (one eviction frees exactly the room needed); otherwise, when the
globally least recently used object is small, the objects of its extent (the extent is
*drained*: its free slots are no longer reused, and it goes back to the free extents, for any
class, once empty), or when it is large, that object. Each call is given a number of evictions
(``left``); past it the key answers NO_SPACE, and a drained extent keeps draining on later calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from xkv.gateway.alloc import CardAllocator
from xkv.gateway.objects import Layout, Obj

#: Most objects evicted to make room for one key (past it the key answers NO_SPACE).
MAX_EVICTIONS_PER_KEY = 64
#: Most evictions of one RESERVE call (index.py) beyond one per key (the exact-fit ones).
EVICTIONS_PER_CALL = 128


class Room:
    """The allocator and the eviction lists of one index. ``evict(obj)``: the index's eviction
    (unlinks and frees ``obj``, after :meth:`unlist` took it off the lists)."""

    def __init__(self, alloc: CardAllocator, evict: Callable[[Obj], None]):
        self.alloc = alloc
        self._evict_cb = evict
        self.every: OrderedDict[Obj, None] = OrderedDict()
        self.by_namespace: dict[str, OrderedDict[Obj, None]] = {}
        self.by_size: dict[int, OrderedDict[Obj, None]] = {}
        self._in_extent: dict[int, dict[Obj, None]] = {}  # small extent -> its objects

    # ------------------------------------------------------------- lists

    def namespace_lru(self, namespace: str) -> OrderedDict[Obj, None]:
        return self.by_namespace.setdefault(namespace, OrderedDict())

    def size_lru(self, pages: int) -> OrderedDict[Obj, None]:
        return self.by_size.setdefault(pages, OrderedDict())

    def list(self, obj: Obj) -> None:
        """``obj`` became evictable (READY, no lease): most recently used end of its lists."""
        obj.lru[obj] = None
        obj.layout.size_lru[obj] = None
        self.every[obj] = None

    def unlist(self, obj: Obj) -> None:
        """``obj`` is no longer evictable (leased, or leaving)."""
        del obj.lru[obj]
        del obj.layout.size_lru[obj]
        del self.every[obj]

    def touch(self, obj: Obj) -> None:
        """A use of an evictable ``obj``: most recently used end."""
        obj.lru.move_to_end(obj)
        obj.layout.size_lru.move_to_end(obj)
        self.every.move_to_end(obj)

    # ------------------------------------------------------------- placement

    def placed(self, obj: Obj) -> None:
        """``obj`` was given the pages from :meth:`place`."""
        if self.alloc.is_small(obj.layout.object_pages):
            self._in_extent.setdefault(self.alloc.extent_of(obj.start), {})[obj] = None

    def gone(self, obj: Obj) -> None:
        """``obj`` left the index (its pages are freed now or after a quarantine)."""
        if self.alloc.is_small(obj.layout.object_pages):
            e = self.alloc.extent_of(obj.start)
            members = self._in_extent[e]
            del members[obj]
            if not members:
                del self._in_extent[e]

    def make_quota_room(self, namespace: str, excess: Callable[[], bool],
                        left: list[int]) -> bool:
        """Evict the namespace's least recently used objects while ``excess()``, at most
        ``left[0]`` of them (decremented); False if that did not end the excess."""
        lru = self.by_namespace[namespace]
        while excess():
            if not lru or left[0] <= 0:
                return False
            self._evict_cb(next(iter(lru)))
            left[0] -= 1
        return True

    def place(self, layout: Layout, left: list[int]) -> int | None:
        """First page of room for one object of ``layout``, evicting at most ``left[0]`` objects
        (decremented; the policy is in the module docstring); None: no room within the bound."""
        alloc, pages = self.alloc, layout.object_pages
        small = alloc.is_small(pages)
        start = alloc.alloc(pages)
        while start is None and left[0] > 0:
            victim = self._own_victim(layout.size_lru, small, left)
            if victim is not None:
                self._evict_cb(victim)
                left[0] -= 1
            elif not self.every:
                return None
            else:
                head = next(iter(self.every))
                if alloc.is_small(head.layout.object_pages):
                    self._drain(alloc.extent_of(head.start), left)
                else:
                    self._evict_cb(head)
                    left[0] -= 1
            start = alloc.alloc(pages)
        return start

    def _own_victim(self, own: OrderedDict[Obj, None], small: bool, left: list[int]) -> Obj | None:
        """The least recently used evictable object of the size class whose room comes back to
        the class (not in a draining extent); each one passed over counts against ``left``."""
        alloc = self.alloc
        for obj in own:
            if not small or not alloc.draining(alloc.extent_of(obj.start)):
                return obj
            left[0] -= 1
            if left[0] <= 0:
                return None
        return None

    def _drain(self, e: int, left: list[int]) -> None:
        """Stop reuse of small extent ``e`` and evict its evictable objects (at most ``left[0]``,
        decremented): once every object there is gone the extent is free for any class."""
        self.alloc.drain(e)
        victims = []  # picked first (an eviction changes the extent's dict); never a copy of
        for obj in self._in_extent.get(e, ()):  # all of it: 4,096 one-page objects per call
            if len(victims) >= left[0]:
                break
            if obj.ready and not obj.leases:
                victims.append(obj)
        for obj in victims:
            self._evict_cb(obj)
            left[0] -= 1
