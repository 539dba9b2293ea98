"""The byte-page view of one paged cache: :class:`PagePool`, and :class:`LayoutError`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["KINDS", "LayoutError", "PagePool", "describe_tensor"]

KINDS = ("attention", "mla", "mamba", "block_outermost")  # labels a caller may give a pool


class LayoutError(ValueError):
    """The tensor's memory is not the page layout it claims to be."""


@dataclass(frozen=True, eq=False)
class PagePool:
    """A paged cache seen as bytes.

    Block ``b``'s bytes are the concatenation over ``runs`` of
    ``base[b * block_stride + off : b * block_stride + off + length]``.
    ``base`` is a 1-D uint8 view whose element 0 is the first byte of block 0 and whose length is
    exactly :attr:`extent`.
    """

    base: torch.Tensor
    num_blocks: int
    block_bytes: int
    block_stride: int
    runs: tuple[tuple[int, int], ...]
    kernel_block_ratio: int = 1
    kind: str | None = None  # a label for messages, given by the caller (never guessed)

    def __post_init__(self) -> None:
        b = self.base
        if (
            not isinstance(b, torch.Tensor)
            or b.dtype != torch.uint8
            or b.dim() != 1
            or b.stride(0) != 1
        ):
            raise LayoutError(
                f"PagePool.base must be a 1-D contiguous uint8 tensor, got {describe_tensor(b)}"
            )
        if self.num_blocks < 0 or self.block_stride <= 0 or self.kernel_block_ratio < 1:
            raise LayoutError(
                f"PagePool: bad num_blocks={self.num_blocks} block_stride={self.block_stride} "
                f"kernel_block_ratio={self.kernel_block_ratio}"
            )
        if any(o < 0 or n <= 0 for o, n in self.runs):
            raise LayoutError(
                f"PagePool: runs must have offset >= 0 and length > 0, got {self.runs}"
            )
        if sum(n for _, n in self.runs) != self.block_bytes:
            raise LayoutError(
                f"PagePool: block_bytes={self.block_bytes} != sum of run lengths {self.runs}"
            )
        if b.numel() < self.extent:
            raise LayoutError(
                f"PagePool: base holds {b.numel()} bytes, the blocks need {self.extent}"
            )
        if self.kind is not None and self.kind not in KINDS:
            raise LayoutError(f"PagePool: kind must be one of {KINDS}, got {self.kind!r}")

    # Derived values are cached: every field is fixed (a frozen dataclass over a tensor view
    # whose storage is never replaced), and a restore's host path asks them hundreds of times
    # per step (bench/host_issue.py: 357 ``data_ptr`` reads for a 32-layer restore).

    @cached_property
    def device(self) -> torch.device:
        return self.base.device

    @cached_property
    def span(self) -> int:
        """Bytes from a block's start to the end of its last run."""
        return max((o + n for o, n in self.runs), default=0)

    @cached_property
    def extent(self) -> int:
        """Bytes of ``base`` that blocks ``0 .. num_blocks-1`` touch."""
        if self.num_blocks == 0 or not self.runs:
            return 0
        return (self.num_blocks - 1) * self.block_stride + self.span

    @cached_property
    def data_ptr(self) -> int:
        return self.base.data_ptr()

    @cached_property
    def alignment(self) -> int:
        """gcd of the block stride, the base address and every run offset and length: every
        byte a block's runs start or end at is a multiple of it."""
        return math.gcd(self.block_stride, self.data_ptr, *(x for r in self.runs for x in r))

    def run_view(self, r: int) -> torch.Tensor:
        """``[num_blocks, len]`` strided uint8 view of run ``r`` of every block."""
        off, length = self.runs[r]
        return self.base.as_strided(
            (self.num_blocks, length), (self.block_stride, 1), self.base.storage_offset() + off
        )

    def block(self, b: int) -> torch.Tensor:
        """A copy of block ``b``'s bytes (all runs concatenated)."""
        if not 0 <= b < self.num_blocks:
            raise IndexError(f"block {b} out of range [0, {self.num_blocks})")
        s = b * self.block_stride
        return (
            torch.cat([self.base[s + o : s + o + n] for o, n in self.runs])
            if self.runs
            else self.base[:0]
        )

    def overlaps(self, other: PagePool) -> bool:
        """True if some byte of a block of ``self`` is also a byte of a block of ``other``.

        Exact for pools with the same block stride whose runs lie inside one stride (every
        block-compact layout, interleaved layers included); conservative (address ranges) otherwise.
        """
        if self.base.device != other.base.device or self.extent == 0 or other.extent == 0:
            return False
        a0, b0 = self.data_ptr, other.data_ptr
        if a0 + self.extent <= b0 or b0 + other.extent <= a0:
            return False
        s = self.block_stride
        if s != other.block_stride or self.span > s or other.span > s:
            return True
        delta = (b0 - a0) % s
        mine = [(o, o + n) for o, n in self.runs]
        theirs = [((o + delta) % s, (o + delta) % s + n) for o, n in other.runs]
        for lo, hi in theirs:
            for c0, c1 in ((lo, hi), (lo - s, hi - s)):  # a run may wrap past the stride
                if any(c0 < m1 and m0 < c1 for m0, m1 in mine):
                    return True
        return False

    def describe(self) -> str:
        return (
            f"PagePool(kind={self.kind}, num_blocks={self.num_blocks}, block_bytes={self.block_bytes}, "
            f"block_stride={self.block_stride}, runs={list(self.runs)[:8]}{'...' if len(self.runs) > 8 else ''}, "
            f"kernel_block_ratio={self.kernel_block_ratio}, device={self.device})"
        )


def describe_tensor(t: object, layout_name: str | None = None) -> str:
    """Shape, strides, dtype, offset, device and layout of ``t``, for error messages."""
    if not isinstance(t, torch.Tensor):
        return f"{type(t).__name__}"
    return (
        f"shape={tuple(t.shape)} stride={tuple(t.stride())} dtype={t.dtype} "
        f"storage_offset={t.storage_offset()} device={t.device} layout={layout_name or 'unspecified'}"
    )
