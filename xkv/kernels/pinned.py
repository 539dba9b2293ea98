"""Page-locked host buffers reused from step to step: no copy step allocates pinned memory.

Allocating page-locked host memory is an implicit synchronisation in CUDA (the CUDA C++
Programming Guide, "Implicit Synchronization"): the host waits there for work already queued on
the device. torch's caching host allocator serves a request only from a free block of the same
power-of-two size, so the first step whose tables, expected words or flags readback needs a size
never seen before allocates, inside the restore: the host then waits for the copies it has just
queued (the first checked restore after start, a step restoring more objects than any before).

:class:`PinnedPool` keeps its buffers: :meth:`~PinnedPool.take` returns the smallest free buffer
of at least the bytes asked (a uint8 view of exactly that many), and allocates only when none
is free; :meth:`~PinnedPool.give` returns one once the device work that reads or writes it is
queued, with an event recorded after it: the buffer is taken again only after that event
completed (queried, never waited for). :meth:`~PinnedPool.reserve` allocates ahead (warmup), so
a serving step allocates only when more buffers are in flight at once than ever before.
:func:`pool` is the process's pool (the kernels' tables, checksum words and readbacks).
"""

from __future__ import annotations

import threading
import weakref

import torch

__all__ = ["MIN_BYTES", "RESERVE_COUNT", "PinnedPool", "pool", "record_event", "upload"]

MIN_BYTES = 64 * 1024  # smallest buffer allocated: small requests share a few buffers
#: large buffers :func:`reserve_for` keeps by default (its docstring says why six)
RESERVE_COUNT = 6


def _round(nbytes: int) -> int:
    """Capacity of a new buffer for ``nbytes``: a power of two, at least :data:`MIN_BYTES`."""
    return max(MIN_BYTES, 1 << max(0, int(nbytes) - 1).bit_length())


class PinnedPool:
    """Reusable page-locked host buffers (see the module docstring). Thread-safe.

    ``pin``: allocate page-locked memory (False: plain host memory, for CPU tests of the
    bookkeeping). ``allocations``: buffers allocated so far (reserve included)."""

    def __init__(self, pin: bool = True) -> None:
        self._pin = pin
        self._lock = threading.Lock()
        self._free: list[tuple[torch.Tensor, object]] = []  # (buffer, event or None), by size
        self._out: dict[int, torch.Tensor] = {}  # data_ptr of a taken view -> its whole buffer
        self.allocations = 0

    def _alloc(self, nbytes: int) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(_round(nbytes), dtype=torch.uint8, pin_memory=self._pin)

    def reserve(self, nbytes: int, count: int = 1) -> None:
        """Make at least ``count`` free buffers of at least ``nbytes`` bytes available."""
        if nbytes < 0 or count < 0:
            raise ValueError(f"reserve({nbytes}, {count}): expected bytes >= 0 and count >= 0")
        with self._lock:
            have = sum(1 for b, _ in self._free if b.numel() >= nbytes)
            for _ in range(count - have):
                self._free.append((self._alloc(nbytes), None))
            self._free.sort(key=lambda be: be[0].numel())

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 ``[nbytes]`` view of a free buffer (16-byte aligned start), allocating one
        only when no free buffer is large enough and idle. Return it with :meth:`give`."""
        if nbytes < 0:
            raise ValueError(f"take({nbytes}): expected a byte count >= 0")
        with self._lock:
            buf = None
            for i, (b, ev) in enumerate(self._free):  # ascending size: the best fit first
                if b.numel() >= nbytes and (ev is None or ev.query()):
                    buf = self._free.pop(i)[0]
                    break
            if buf is None:
                buf = self._alloc(nbytes)
            view = buf[:nbytes]
            self._out[view.data_ptr()] = buf
            return view

    def give(self, view: torch.Tensor | int, event=None) -> None:
        """Return a view :meth:`take` gave (or its ``data_ptr()``); ``event`` (a CUDA event
        recorded after every device operation that uses it, or None when none is pending) must
        complete before it is taken again. A view given twice, or not from this pool, is
        refused."""
        ptr = view if isinstance(view, int) else view.data_ptr()
        with self._lock:
            buf = self._out.pop(ptr, None)
            if buf is None:
                raise ValueError("give(): this buffer was not taken from this pool, or was given "
                                 "back already")
            self._free.append((buf, event))
            self._free.sort(key=lambda be: be[0].numel())

    def give_when_collected(self, view: torch.Tensor, event=None) -> None:
        """:meth:`give` ``view`` once this tensor object is garbage-collected (a readback whose
        reader only drops it). A numpy array or another tensor made from it does not keep it:
        the holder copies what it keeps before dropping it."""
        weakref.finalize(view, self.give, view.data_ptr(), event)

    def free_count(self) -> int:
        with self._lock:
            return len(self._free)


_POOL: PinnedPool | None = None
_POOL_LOCK = threading.Lock()


def pool() -> PinnedPool:
    """The process's pool of page-locked buffers (created on first use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = PinnedPool()
        return _POOL


def record_event() -> torch.cuda.Event:
    """An event on the current CUDA stream (after the copies just queued there)."""
    ev = torch.cuda.Event()
    ev.record()
    return ev


def upload(numel: int, dtype: torch.dtype, device: torch.device, fill) -> torch.Tensor:
    """A ``[numel]`` tensor of ``dtype`` on the CUDA ``device``: ``fill(host)`` writes a staging
    buffer of the pool, one non-blocking H2D copy on the current stream moves it, and the buffer
    goes back to the pool with an event after that copy (the one staged upload of the kernels'
    tables and checksum words)."""
    raw = pool().take(numel * torch.empty(0, dtype=dtype).element_size())
    host = raw.view(dtype)
    fill(host)
    out = host.to(device, non_blocking=True)
    pool().give(raw, record_event())
    return out


def reserve_for(num_blocks: int, num_layers: int, *, count: int = RESERVE_COUNT,
                cap_bytes: int = 256 << 20) -> int:
    """Reserve (:meth:`PinnedPool.reserve`) what copy steps over caches of ``num_layers`` layers
    of ``num_blocks`` blocks use at once: 8 buffers of :data:`MIN_BYTES` (small steps) and
    ``count`` buffers for a step that moves every block (its int64 tables, ~``L + 8`` per
    block; the checksum words, 4 bytes per layer and object), together at most ``cap_bytes``.
    Returns the large buffers' size in bytes. ``count`` 6: a restore's tables go up in two
    uploads (``prepare_restore(defer_rest=True)``), beside its words, its readback and the
    previous step's buffers still in flight."""
    if num_blocks < 0 or num_layers < 0 or count < 1:
        raise ValueError(f"reserve_for({num_blocks}, {num_layers}, count={count}): expected "
                         f"counts >= 0 and count >= 1")
    large = min(8 * num_blocks * (num_layers + 8), cap_bytes // count)
    p = pool()
    p.reserve(MIN_BYTES, 8)
    if large > MIN_BYTES:
        p.reserve(large, count)
    return max(large, MIN_BYTES)
