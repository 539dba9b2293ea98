"""Byte-page views of the KV cache tensors vLLM hands a connector.

Every cache form vLLM 0.26-0.33 registers (see ``shared/notes/vllm-connector-api.md`` §4) is reduced to
one :class:`PagePool`: ``num_blocks`` scheduler blocks, each ``block_bytes`` long, made of the same
contiguous byte ``runs`` at a fixed ``block_stride``. Kernels copy those bytes without knowing heads,
tokens or dtypes, so one kernel serves every backend and layout.

Forms understood (the first dim of size ``num_blocks * kernel_block_ratio`` is the block dim):

* 0.26/0.28 attention ``(B, H, N, 2D)`` with NHD or HND strides, one run per block;
* MLA ``(B, N, 576)`` (3-D, 0.26/0.28), ``(B, 1, N, 576)`` (0.29+) and 656-byte ``fp8_ds_mla`` rows;
* 0.29+ ``[B, H, N, C]`` views over one shared int8 buffer in every ``KVCacheLayout``: ``LBNHC``,
  ``LBHNC``, ``BLNHC``, ``BLHNC`` give one run per block; ``LHBNC`` and ``BHLNC`` (H outside B) give
  one run per head;
* Mamba: a list of state tensors (0.26, pages rebuilt from the first tensor's block stride) or one int8
  ``(B, 1, 1, C)`` page per block (0.28+, padded block stride: only the content is copied);
* K/V-first ``(2, B, ...)``: two runs per block (K page, V page);
* block-outermost caches (a block holds every layer): a list of per-layer views, or the 0.26/0.28
  cross-layer tensor with ``block_dim=1``, become one run per block across the layers.

A tensor whose pages are not what the description says raises :class:`LayoutError` naming its shape,
strides, dtype and layout. No vLLM import here: layouts are recognised from strides.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "KV_CACHE_LAYOUTS",
    "LayoutError",
    "PagePool",
    "describe_cache",
]

# vLLM 0.29+ KVCacheLayout names and the legacy 0.26/0.28 aliases (config/cache.py).
KV_CACHE_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
_LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
MAX_RUNS = 4096  # more runs per block than this is not a page layout worth copying run by run
_KINDS = ("attention", "mla", "mamba", "block_outermost")


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
                f"PagePool.base must be a 1-D contiguous uint8 tensor, got {_describe(b)}"
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
        if self.kind is not None and self.kind not in _KINDS:
            raise LayoutError(f"PagePool: kind must be one of {_KINDS}, got {self.kind!r}")

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def span(self) -> int:
        """Bytes from a block's start to the end of its last run."""
        return max((o + n for o, n in self.runs), default=0)

    @property
    def extent(self) -> int:
        """Bytes of ``base`` that blocks ``0 .. num_blocks-1`` touch."""
        if self.num_blocks == 0 or not self.runs:
            return 0
        return (self.num_blocks - 1) * self.block_stride + self.span

    @property
    def data_ptr(self) -> int:
        return self.base.data_ptr()

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


# --------------------------------------------------------------------------------------------------
# describe_cache


def describe_cache(
    t: torch.Tensor | Sequence[torch.Tensor],
    *,
    num_blocks: int | None = None,
    page_bytes: int | None = None,
    kernel_block_ratio: int | None = None,
    layout: str | object | None = None,
    block_dim: int | None = None,
    kind: str | None = None,
) -> PagePool:
    """Describe a KV cache tensor (or a list of them sharing one buffer) as a :class:`PagePool`.

    Args:
        t: the tensor ``register_kv_caches`` received for one layer; or a list: a 0.26 Mamba layer's
            state tensors, or the per-layer views of a block-outermost cache (BLNHC/BLHNC), which
            become one pool whose block holds every layer.
        num_blocks: scheduler blocks. When the block dim holds ``num_blocks * r`` kernel blocks,
            ``r`` becomes ``kernel_block_ratio`` and block ``b`` = kernel blocks ``[b*r, (b+1)*r)``.
        page_bytes: expected bytes of one kernel block of one tensor (e.g. the spec's
            ``real_page_size_bytes``); a mismatch raises instead of copying something else.
        kernel_block_ratio: alternative to ``num_blocks``; both given must agree.
        layout: the layout vLLM resolved (``"NHD"``, ``"HND"``, a ``KVCacheLayout`` or its name); the
            strides are checked against it.
        block_dim: the block dim; default 0, or 1 for 5-D K/V-first ``(2, B, ...)`` tensors. Pass 1 for
            the 0.26/0.28 cross-layer tensor ``(L, B, ...)``.
        kind: a label stored in the pool for messages (``"attention"``, ``"mla"``, ``"mamba"``,
            ``"block_outermost"``); None when omitted. Nothing reads it to decide anything.
    """
    layout_name = _layout_name(layout)
    tensors = list(t) if isinstance(t, (list, tuple)) else [t]
    if not tensors:
        raise LayoutError("describe_cache: empty list of tensors")
    for x in tensors:
        if not isinstance(x, torch.Tensor):
            raise LayoutError(f"describe_cache: expected tensors, got {type(x).__name__}")
    geoms = [_geometry(x, block_dim, layout_name) for x in tensors]
    first = tensors[0]
    ctx = _describe_many(tensors, layout_name)

    if len(geoms) == 1:
        g = geoms[0]
        runs, byte0 = list(g.runs), g.byte0
        single_product_layout = True
    else:
        g = geoms[0]
        for x, h in zip(tensors[1:], geoms[1:], strict=True):
            if x.device != first.device:
                raise LayoutError(f"tensors are on different devices: {ctx}")
            if _storage_ptr(x) != _storage_ptr(first):
                raise LayoutError(f"tensors do not share one buffer: {ctx}")
            if h.num_kernel_blocks != g.num_kernel_blocks or h.stride != g.stride:
                raise LayoutError(
                    f"tensors disagree on blocks ({h.num_kernel_blocks} vs {g.num_kernel_blocks}) or block "
                    f"stride ({h.stride} vs {g.stride} bytes): {ctx}"
                )
        byte0 = min(h.byte0 for h in geoms)
        runs = sorted((h.byte0 - byte0 + o, n) for h in geoms for o, n in h.runs)
        single_product_layout = False
        if g.num_kernel_blocks > 1 and max(o + n for o, n in runs) > g.stride:
            raise LayoutError(
                "the tensors' pages of one block do not fit inside one block stride "
                f"({g.stride} bytes), so these are not the parts of one block-outermost page "
                f"(layer-outermost layers must be described one by one): {ctx}"
            )
        for (o1, n1), (o2, _) in itertools.pairwise(runs):
            if o1 + n1 > o2:
                raise LayoutError(f"the tensors overlap inside a block: {ctx}")

    content = sum(n for _, n in runs)
    if page_bytes is not None and page_bytes != content:
        raise LayoutError(
            f"page_bytes={page_bytes} but one kernel block of this tensor holds {content} bytes "
            f"in runs {runs[:8]}: {ctx}"
        )

    nkb, kstride = g.num_kernel_blocks, g.stride
    ratio = _ratio(nkb, num_blocks, kernel_block_ratio, ctx)
    if ratio > 1:
        if not single_product_layout and max(o + n for o, n in runs) > kstride:
            raise LayoutError(f"cannot group kernel blocks whose pages exceed their stride: {ctx}")
        runs = sorted((j * kstride + o, n) for j in range(ratio) for o, n in runs)
    runs = _merge(runs)
    if len(runs) > MAX_RUNS:
        raise LayoutError(
            f"{len(runs)} contiguous runs per block (max {MAX_RUNS}): not a page layout: {ctx}"
        )
    nblocks = nkb // ratio
    stride = kstride * ratio
    span = max(o + n for o, n in runs)
    extent = (nblocks - 1) * stride + span if nblocks else 0
    storage = first.untyped_storage()
    if byte0 + extent > storage.nbytes():
        raise LayoutError(
            f"blocks reach byte {byte0 + extent} of a {storage.nbytes()}-byte buffer: {ctx}"
        )
    if kind is not None and kind not in _KINDS:
        raise LayoutError(f"kind must be one of {_KINDS}, got {kind!r}")
    base = torch.empty(0, dtype=torch.uint8, device=first.device)
    base.set_(storage, byte0, (extent,), (1,))
    return PagePool(
        base=base,
        num_blocks=nblocks,
        block_bytes=sum(n for _, n in runs),
        block_stride=stride,
        runs=tuple(runs),
        kernel_block_ratio=ratio,
        kind=kind,
    )


# --------------------------------------------------------------------------------------------------
# internals


@dataclass(frozen=True)
class _Geometry:
    byte0: int  # storage byte offset of element [0, 0, ...]
    num_kernel_blocks: int
    stride: int  # bytes between kernel blocks
    runs: tuple[tuple[int, int], ...]  # (offset from byte0, length), sorted


def _geometry(t: torch.Tensor, block_dim: int | None, layout_name: str | None) -> _Geometry:
    ctx = _describe(t, layout_name)
    if t.dim() < 1:
        raise LayoutError(f"a KV cache tensor has a block dim; got a scalar: {ctx}")
    if t.is_sparse or t.layout != torch.strided:
        raise LayoutError(f"only strided tensors can be paged: {ctx}")
    if block_dim is None:
        block_dim = _default_block_dim(t)
    if not 0 <= block_dim < t.dim():
        raise LayoutError(f"block_dim={block_dim} out of range: {ctx}")
    e = t.element_size()
    if any(s < 0 for s in t.stride()):
        raise LayoutError(f"negative strides: {ctx}")
    if t.numel() == 0 and t.shape[block_dim] != 0:
        raise LayoutError(f"empty pages: {ctx}")
    if layout_name is not None:
        _check_layout(t, block_dim, layout_name, ctx)
    nkb = t.shape[block_dim]
    inner = sorted(
        (
            (t.shape[d], t.stride(d) * e)
            for d in range(t.dim())
            if d != block_dim and t.shape[d] != 1
        ),
        key=lambda x: x[1],
    )
    run = e
    k = 0
    while k < len(inner) and inner[k][1] == run:
        run *= inner[k][0]
        k += 1
    outer = inner[k:]
    nruns = math.prod(n for n, _ in outer)
    if nruns > MAX_RUNS:
        raise LayoutError(
            f"one block is {nruns} separate runs of {run} bytes (max {MAX_RUNS}); the innermost dim "
            f"is not contiguous or the block is scattered: {ctx}"
        )
    stride = t.stride(block_dim) * e
    # Injectivity: every (block, run, byte) must have its own address, or a copy would race.
    dims = [(run, 1), *outer] + ([(nkb, stride)] if nkb > 1 else [])
    reach = 1  # bytes spanned by the dims checked so far (largest offset + 1)
    for size, st in sorted(dims, key=lambda x: x[1]):
        if st < reach:
            raise LayoutError(
                f"blocks or pages overlap in memory (a stride of {st} bytes inside a {reach}-byte span): {ctx}"
            )
        reach += (size - 1) * st
    if nkb <= 1:
        stride = max(stride, reach, 1)
    offs = sorted(
        sum(i * s for i, (_, s) in zip(idx, outer, strict=True))
        for idx in itertools.product(*(range(n) for n, _ in outer))
    )
    return _Geometry(
        byte0=t.storage_offset() * e,
        num_kernel_blocks=nkb,
        stride=stride,
        runs=tuple((o, run) for o in offs),
    )


def _check_layout(t: torch.Tensor, block_dim: int, name: str, ctx: str) -> None:
    """Check a 4-D [B, H, N, C] view against the layout vLLM says it resolved."""
    if t.dim() != 4 or block_dim != 0:
        return  # 3-D MLA, K/V-first, cross-layer: the layout name does not describe these dims
    (_, H, N, _), (sB, sH, sN, sC) = t.shape, t.stride()
    bad = []
    if t.shape[3] > 1 and sC != 1:
        bad.append("C (last dim) is not contiguous")
    if H > 1 and N > 1:
        nhc = name.endswith("NHC")
        if nhc and not sN > sH:
            bad.append("expected N outside H (..NHC)")
        if not nhc and not sH > sN:
            bad.append("expected H outside N (..HNC)")
    if t.shape[0] > 1 and H > 1:
        if name == "LHBNC" and not sH > sB:
            bad.append("expected H outside B (LHBNC)")
        if name != "LHBNC" and not sB > sH:
            bad.append("expected B outside H")
    if t.shape[0] > 1 and N > 1 and not sB > sN:
        bad.append("expected B outside N")
    if bad:
        raise LayoutError(f"strides do not match layout {name}: {'; '.join(bad)}: {ctx}")


def _ratio(nkb: int, num_blocks: int | None, kernel_block_ratio: int | None, ctx: str) -> int:
    if num_blocks is not None:
        if num_blocks <= 0 or nkb % num_blocks:
            raise LayoutError(
                f"num_blocks={num_blocks} does not divide the {nkb} kernel blocks: {ctx}"
            )
        r = nkb // num_blocks
        if kernel_block_ratio is not None and kernel_block_ratio != r:
            raise LayoutError(
                f"kernel_block_ratio={kernel_block_ratio} but {nkb} kernel blocks / num_blocks="
                f"{num_blocks} = {r}: {ctx}"
            )
        return r
    r = 1 if kernel_block_ratio is None else kernel_block_ratio
    if r < 1 or nkb % r:
        raise LayoutError(f"kernel_block_ratio={r} does not divide the {nkb} kernel blocks: {ctx}")
    return r


def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for o, n in sorted(runs):
        if out and out[-1][0] + out[-1][1] == o:
            out[-1][1] += n
        else:
            out.append([o, n])
    return [(o, n) for o, n in out]


def _is_kv_first(t: torch.Tensor) -> bool:
    """ROCm-style ``(2, B, N, H, D)``: K pages of every block, then V pages."""
    return t.dim() == 5 and t.shape[0] == 2 and t.stride(0) > t.stride(1)


def _default_block_dim(t: torch.Tensor) -> int:
    return 1 if _is_kv_first(t) else 0


def _layout_name(layout: str | object | None) -> str | None:
    if layout is None:
        return None
    name = getattr(layout, "name", layout)
    if not isinstance(name, str):
        raise LayoutError(f"layout must be a name or a KVCacheLayout, got {layout!r}")
    name = _LAYOUT_ALIASES.get(name.upper(), name.upper())
    if name not in KV_CACHE_LAYOUTS:
        raise LayoutError(
            f"unknown KV cache layout {layout!r}; known: NHD, HND, {', '.join(KV_CACHE_LAYOUTS)}"
        )
    return name


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _describe(t: object, layout_name: str | None = None) -> str:
    if not isinstance(t, torch.Tensor):
        return f"{type(t).__name__}"
    return (
        f"shape={tuple(t.shape)} stride={tuple(t.stride())} dtype={t.dtype} "
        f"storage_offset={t.storage_offset()} device={t.device} layout={layout_name or 'unspecified'}"
    )


def _describe_many(tensors: list[torch.Tensor], layout_name: str | None) -> str:
    if len(tensors) == 1:
        return _describe(tensors[0], layout_name)
    return (
        "["
        + "; ".join(_describe(x, layout_name) for x in tensors[:4])
        + (" ...]" if len(tensors) > 4 else "]")
    )
