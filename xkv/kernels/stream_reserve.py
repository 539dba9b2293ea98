"""Device memory held for the copy streams until serving starts: no copy step calls ``cudaMalloc``.

A device memory allocation is an implicit synchronisation in CUDA (the CUDA C++ Programming
Guide, "Implicit Synchronization"): work issued after it on one stream does not run beside work
issued before it on another. torch's caching allocator serves a request on a stream from the
blocks freed on that stream and calls ``cudaMalloc`` when none fits, so the first step whose
tables, expected words or flags need more device memory on a copy stream than any step before
allocates inside the step, after its first copies were queued, and the forward issued after it
waits for the whole copy. Measured (bench/RESULTS.md): stop 48's 8 x 16k restore step (17.2 GB,
Triton kernel) left the compute stream idle 348.6 ms in one gap, the forward after the copy;
stop 49's trace of the same step shows a ``cudaMalloc`` inside ``start_load_kv`` 50 ms after the
first copy and the forward's first matmul then blocking the host 197 ms; stop 56's 8 x 16k step
counted one device allocation (``XKV_TIMING`` ``device_allocs=1``), its only one among the
restores of that engine after its first.

Blocks freed at the worker's start do not help by themselves: vLLM empties the allocator's cache
after it captures CUDA graphs (``capture_model``), after the connector started. So
:class:`StreamReserve` allocates, on each copy stream, one large block (what a step that moves
every block needs: the pinned pool's large buffers' worth, ``pinned.reserve_for``) and a few
small ones (the allocator serves requests up to 1 MiB from 2 MiB segments of their own), holds
them through vLLM's capture and frees them into those streams' caches at the first copy step
(:meth:`~StreamReserve.release`), where that step's allocations and every later one find them.
Not covered: an allocation larger than the large block, the allocator's own release of every
cached block when an allocation fails (``XKV_TIMING``'s ``alloc_retries``), the NVLink fan-out's
own copy stream (``xkv.fanout``), and vLLM's allocations on the compute stream.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["LARGE_CAP_BYTES", "SMALL_BYTES", "SMALL_COUNT", "StreamReserve"]

#: the small blocks held per stream: the caching allocator's small pool (requests of at most 1
#: MiB) carves them out of 2 MiB segments, four to a segment
SMALL_BYTES = 512 << 10
SMALL_COUNT = 8
#: the most one stream holds in its large block (a 200k-block cache of 32 layers needs ~64 MB)
LARGE_CAP_BYTES = 64 << 20


class StreamReserve:
    """Device blocks of the caching allocator held for copy streams (the module's docstring)."""

    def __init__(self) -> None:
        self._held: list[torch.Tensor] = []

    def hold(self, streams: Iterable[torch.cuda.Stream], large_bytes: int) -> None:
        """Allocate on each of ``streams`` one block of ``min(large_bytes, LARGE_CAP_BYTES)``
        (none below 1 MiB: the small blocks serve those) and :data:`SMALL_COUNT` of
        :data:`SMALL_BYTES`, and hold them until :meth:`release`."""
        if large_bytes < 0:
            raise ValueError(f"StreamReserve.hold: large_bytes must be >= 0, got {large_bytes}")
        large = min(int(large_bytes), LARGE_CAP_BYTES)
        for s in streams:
            with torch.cuda.stream(s):  # a block remembers the stream it was allocated on
                if large > 1 << 20:
                    self._held.append(torch.empty(large, dtype=torch.uint8, device=s.device))
                self._held += [torch.empty(SMALL_BYTES, dtype=torch.uint8, device=s.device)
                               for _ in range(SMALL_COUNT)]

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() for t in self._held)

    def release(self) -> None:
        """Free every held block into its stream's cache (once; later calls do nothing)."""
        if self._held:
            self._held.clear()
