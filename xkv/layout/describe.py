"""``describe_cache``: a KV cache tensor vLLM registered -> :class:`~xkv.layout.pool.PagePool`.

Layouts are recognised from strides (see the package docstring for the forms understood); a
tensor whose pages are not what the description says raises ``LayoutError`` naming its shape,
strides, dtype and layout.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from xkv.layout.pool import KINDS, LayoutError, PagePool, describe_tensor

__all__ = ["KV_CACHE_LAYOUTS", "MAX_RUNS", "describe_cache"]

# vLLM 0.29+ KVCacheLayout names and the legacy 0.26/0.28 aliases (config/cache.py).
KV_CACHE_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
_LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
MAX_RUNS = 4096  # more runs per block than this is not a page layout worth copying run by run


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
    if kind is not None and kind not in KINDS:
        raise LayoutError(f"kind must be one of {KINDS}, got {kind!r}")
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
    ctx = describe_tensor(t, layout_name)
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


def _describe_many(tensors: list[torch.Tensor], layout_name: str | None) -> str:
    if len(tensors) == 1:
        return describe_tensor(tensors[0], layout_name)
    return (
        "["
        + "; ".join(describe_tensor(x, layout_name) for x in tensors[:4])
        + (" ...]" if len(tensors) > 4 else "]")
    )
