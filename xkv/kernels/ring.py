"""The staging ring of prepared staged restores: a few slots of GPU memory kept for the process.

A staged restore (:mod:`xkv.kernels.staged_restore`) brings each chunk of host bytes into a slot
with the copy engine, then unpacks the slot into the pages with the Triton kernel. Allocating its
slots per copy made every launch an allocation (and, with the caching allocator's stream
bookkeeping, a new block per layer); the ring is allocated once per device and reused by every
staged restore of the process.

Ordering is on the GPU, never on the host: per slot, ``free`` is the event recorded after the
last kernel that read it (a copy into the slot waits for it on its own stream) and ``landed``
the one after its copy (the unpack waits for it); :meth:`Ring.events`. Every use is
issued under :attr:`Ring.lock`, so two issuers (threads) cannot interleave a slot's wait and its
new event. Size: :data:`SLOTS` x ``slot_bytes`` (env ``XKV_STAGED_SLOT_BYTES``, default 16 MiB:
48 MiB of GPU memory beside vLLM's KV cache, taken from the memory vLLM leaves unused). Only
pages up to a slot are staged through it (``staged_restore.MAX_PAGE_BYTES``).
"""

from __future__ import annotations

import threading

import torch

from xkv.kernels._launch import _env_count

__all__ = ["SLOTS", "SLOT_BYTES", "Ring", "reserve", "ring"]

SLOTS = 3  # two would do while the unpack is far faster than the copy; a third absorbs host jitter
SLOT_BYTES = _env_count("XKV_STAGED_SLOT_BYTES", 16 << 20)


class Ring:
    """``slots`` buffers of ``slot_bytes`` on ``device`` and their events (:meth:`events`)."""

    def __init__(self, device: torch.device, slot_bytes: int, slots: int = SLOTS) -> None:
        if slot_bytes < 1 or slots < 1:
            raise ValueError(f"a ring needs slots >= 1 of >= 1 byte, got {slots} x {slot_bytes}")
        self.device = torch.device(device)
        # 16-byte slots: every unpack reads the widest words (and 4-byte words, which checksums need)
        self.slot_bytes, self.slots = -(-int(slot_bytes) // 16) * 16, int(slots)
        self.buf = torch.empty(self.slots * self.slot_bytes, dtype=torch.uint8, device=device)
        self._landed: list | None = None
        self._free: list | None = None
        self.lock = threading.Lock()
        self._streams: set[int] = set()

    def events(self) -> tuple[list, list]:
        """CUDA: per slot the event after its copy landed and the one after its last unpack
        (created once, re-recorded by each use: a wait takes the record before it)."""
        if self._landed is None:
            self._landed = [torch.cuda.Event() for _ in range(self.slots)]
            self._free = [torch.cuda.Event() for _ in range(self.slots)]
        return self._landed, self._free

    def used_on(self, stream) -> None:
        """Tell the caching allocator that ``stream`` uses the ring (once per stream): if the
        ring is ever dropped, its memory is reused only after that stream's work so far."""
        if stream is None or stream.cuda_stream in self._streams:
            return
        self._streams.add(stream.cuda_stream)
        self.buf.record_stream(stream)


_lock = threading.Lock()
_rings: dict[tuple[str, int], Ring] = {}


def ring(device: torch.device) -> Ring:
    """The device's ring (:data:`SLOTS` x :data:`SLOT_BYTES`), allocated on first use."""
    dev = torch.device(device)
    key = (dev.type, dev.index if dev.index is not None else
           (torch.cuda.current_device() if dev.type == "cuda" else -1))
    with _lock:
        r = _rings.get(key)
        if r is None:
            r = _rings[key] = Ring(dev, SLOT_BYTES)
        return r


def reserve(device: torch.device) -> Ring | None:
    """Allocate ``device``'s ring and its events and resolve the copy engine's batch call now (a
    worker's start-up), so the first staged restore allocates nothing; None where staged
    restores do not run (no CUDA device, or no batch call in the driver)."""
    from xkv.kernels import copy_engine

    dev = torch.device(device)
    if dev.type != "cuda" or not copy_engine.available():
        return None
    r = ring(dev)
    with torch.cuda.device(dev):
        r.events()
    return r
