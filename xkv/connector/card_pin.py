"""Pinning the gateway's card for the GPU in segments (the default) or at once, so that letting go
of it stalls nobody long.

Segments are the default since the H200 run of 2026-12-03 (stop 32, bench/RESULTS.md): with the
24 GiB card in 1 GiB segments a request sent while the idle engine let go of a dead gateway's card
waited 13.8 ms extra, against 1114 ms with the card as one registration (same call, Llama-3-8B
shape, CUDA graphs; first-token logprobs equal the no-connector run). The first try (stop 30)
stopped with "illegal memory access"; ``bench/card_pieces_probe.py`` found two causes, both fixed
in ``xkv.kernels.host``: only the first segment was ever registered (torch's ``Tensor.is_pinned``
answers for a slice's storage base), and one copy spanning two registrations is refused, by the
copy engine (``cuMemcpyBatchAsync``) and by torch's own copy ("invalid argument"): copies are cut
at segment boundaries (``host.split_at``, ``host.copy_bytes``). On the H200 the Triton kernel, the
copy engine, the staged path and ``copy_bytes`` crossed boundaries bit-exact
(``tests/connector/test_card_pin.py``'s GPU test, the probe). ``XKV_CARD_SEGMENT_MIB=0`` registers
the card at once (a dead gateway's idle release then costs ~45 ms per GiB).

Why: ``cudaHostRegister`` / ``cudaHostUnregister`` hold a driver lock that blocks *every* CUDA call
of the process for their whole duration, whichever thread makes them (measured on the H200,
``bench/cuda_register_lock.py``: ~17 ms per GiB to unregister, ~43 ms per GiB to register). A
40 GiB card unregistered in one call stalled a request 1.5 s (bench/RESULTS.md,
``after_kill_idle``). So the card is registered as adjacent segments of :data:`SEGMENT_BYTES`
(``cudaHostRegister`` of sub-ranges of the one mapping), and ``turnoff.OffPath`` lets go of one
segment at a time, only while the engine is idle: a request that arrives meanwhile waits for one
segment's unregister at most.

Addresses do not change: with unified virtual addressing a registered range's device pointer is
its host pointer, so kernels and copies keep addressing ``card.data_ptr() + offset`` whether the
card is one registration or many (``xkv.kernels.is_host_accessible`` accepts a tensor that spans
adjacent registered pieces).

Segment boundaries are page-aligned in absolute addresses (``cudaHostRegister`` pins whole pages;
two registrations must not share one): boundary ``k`` is ``page_floor(ptr) + k * segment``, so the
first segment is short by ``ptr``'s offset into its page and the last one holds the rest.
``XKV_CARD_SEGMENT_MIB`` (MiB, default 1024) sets the segment size; ``0`` registers at once.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable

import torch

from xkv.kernels import host

#: Bytes of one registered segment by default (one unregister of it stalls CUDA ~17 ms on the
#: H200); ``XKV_CARD_SEGMENT_MIB`` changes it (:func:`segment_bytes`).
SEGMENT_BYTES = 1 << 30
PAGE = mmap.PAGESIZE
#: Seconds to wait between two segments registered at an attach (beside a running engine): the
#: engine's CUDA calls that queued on the driver lock get it before the next segment takes it.
REGISTER_PAUSE_S = 0.005


def segment_bytes() -> int | None:
    """Bytes per registered segment: ``XKV_CARD_SEGMENT_MIB`` MiB when set, :data:`SEGMENT_BYTES`
    when unset; None for ``0`` (the card registered at once)."""
    v = os.environ.get("XKV_CARD_SEGMENT_MIB", "").strip()
    if not v:
        return SEGMENT_BYTES
    try:
        mib = int(v)
    except ValueError:
        mib = -1
    if mib < 0:
        raise ValueError(f"XKV_CARD_SEGMENT_MIB={v!r}: expected a whole number of MiB (0: the card "
                         f"registered at once)")
    return mib << 20 if mib else None


def segments(nbytes: int, ptr: int = 0, seg: int = SEGMENT_BYTES) -> list[tuple[int, int]]:
    """``(offset, bytes)`` of each segment of a buffer of ``nbytes`` bytes at address ``ptr``:
    boundaries at ``page_floor(ptr) + k * seg`` (see the module docstring); ``[]`` for an empty
    buffer. ``seg`` must be a positive multiple of the page size."""
    if seg <= 0 or seg % PAGE:
        raise ValueError(f"segment of {seg} bytes: expected a positive multiple of the page "
                         f"size ({PAGE} bytes)")
    if nbytes < 0:
        raise ValueError(f"buffer of {nbytes} bytes: expected >= 0")
    lead = ptr % PAGE
    out, start = [], 0
    while start < nbytes:
        end = min(nbytes, (start + lead) // seg * seg + seg - lead)
        out.append((start, end - start))
        start = end
    return out


def pin(card: torch.Tensor, seg: int | None = None,
        pause: Callable[[], None] | None = None) -> torch.Tensor:
    """Register ``card`` (a contiguous CPU uint8 tensor) for the GPU, one segment of ``seg``
    bytes per ``cudaHostRegister`` (None: :func:`segment_bytes`; ``XKV_CARD_SEGMENT_MIB=0``: the
    whole card in one call); ``pause()`` runs between two segments. Returns ``card``. A failure
    unregisters the segments registered so far and raises (the card is then not usable)."""
    seg = segment_bytes() if seg is None else seg
    if card.device.type != "cpu" or not card.is_contiguous() or card.element_size() != 1:
        raise ValueError(f"pin needs a contiguous 1-byte CPU tensor, got {card.dtype} on "
                         f"{card.device}")
    if seg is None:
        return host.register_host(card)
    try:
        for i, (off, n) in enumerate(segments(card.numel(), card.data_ptr(), seg)):
            if i and pause is not None:
                pause()
            host.register_host(card[off:off + n])
    except BaseException:
        unpin(card)
        raise
    return card


def pin_beside_engine(card: torch.Tensor) -> torch.Tensor:
    """:func:`pin` with :data:`REGISTER_PAUSE_S` between segments (a background attach)."""
    return pin(card, pause=lambda: time.sleep(REGISTER_PAUSE_S))


def unpin(card: torch.Tensor, limit: int | None = None) -> int:
    """Unregister up to ``limit`` (None: all) of the registered pieces inside ``card``, the
    highest addresses first; returns how many stay registered."""
    ranges = host.registered_ranges(card)
    n = len(ranges) if limit is None else max(0, min(limit, len(ranges)))
    for off, size in reversed(ranges[len(ranges) - n:]):
        host.unregister_host(card[off:off + size])
    return len(ranges) - n
