"""Validation: turns a launcher's arguments into a :class:`Job`, or raises before any byte moves.

A job is ``L`` layers (:class:`~xkv.layout.PagePool`) x ``n`` fragments: fragment ``i`` of layer
``l`` is block ``ids[i]`` of ``pools[l]`` (``block_bytes`` bytes, made of the pool's runs) and the
``block_bytes`` bytes of ``flat`` at byte offset ``flat_off[l, i]`` (or, without a table,
``flat_base + (l * n + i) * block_bytes``). Everything here is host-side numpy; nothing touches a
GPU. Every error is a ``ValueError`` naming the argument, the value and what was expected.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from xkv.kernels._arrays import has_duplicates
from xkv.kernels.host import is_host_accessible
from xkv.kernels.verify import Checks, JobChecks, validate_checks
from xkv.layout import PagePool

__all__ = ["IndexLike", "Job", "as_index", "build_job", "offsets_arg", "pools_arg"]

IndexLike = torch.Tensor | np.ndarray | Sequence[int]
OffsetsArg = tuple[np.ndarray, int, str]  # (offsets, layers they must cover, argument name)


@dataclass
class Job:
    """A validated copy. ``lo``/``hi`` bound the bytes of the concatenation of all fragments
    (layer-major) that are copied; ``sliced`` says a caller asked for a slice."""

    pools: list[PagePool]
    ids: np.ndarray  # int64 [n]
    flat: torch.Tensor  # uint8 1-D
    flat_off: np.ndarray | None  # int64 [L, n] bytes, or None: contiguous from flat_base
    flat_base: int
    save: bool  # pools -> flat (else flat -> pools)
    lo: int
    hi: int
    sliced: bool
    checks: JobChecks | None = None  # checksums computed while copying (xkv.kernels.verify)
    store: bool = True  # False: read and hash only, write nothing (xkv.kernels.hash_pages)

    @property
    def n(self) -> int:
        return int(self.ids.size)

    @property
    def block_bytes(self) -> int:
        return self.pools[0].block_bytes if self.pools else 0

    def flat_offsets(self) -> np.ndarray:
        """int64 [L, n]: byte offset in ``flat`` of every fragment (the table, or the implied one)."""
        if self.flat_off is not None:
            return self.flat_off
        L, n, bb = len(self.pools), self.n, self.block_bytes
        return (self.flat_base + np.arange(L * n, dtype=np.int64) * bb).reshape(L, n)

    def layer(self, k: int) -> Job:
        """Layer ``k`` alone, as a one-layer job (same ids, its row of the offsets)."""
        off = self.flat_offsets()[k : k + 1]
        return Job([self.pools[k]], self.ids, self.flat, off, 0, self.save, 0,
                   self.n * self.block_bytes, False,
                   None if self.checks is None else self.checks.layer(k), self.store)


def pools_arg(pools: Sequence[PagePool], name: str) -> list[PagePool]:
    """``pools`` as a list, or ``ValueError`` unless it is a sequence of :class:`PagePool`."""
    if isinstance(pools, PagePool) or not isinstance(pools, Sequence):
        raise ValueError(f"{name} must be a sequence of PagePool")
    pools = list(pools)
    for p in pools:
        if not isinstance(p, PagePool):
            raise ValueError(f"{name} must hold PagePool objects, got {type(p).__name__}")
    return pools


def as_index(x: IndexLike, name: str) -> np.ndarray:
    """An int64 numpy copy (or view) of an integer tensor / array / list (a device tensor is read
    back: a host synchronisation, so hot paths pass host indices)."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")
        return x.detach().to("cpu", torch.int64).numpy()
    a = np.asarray(x)
    if a.size == 0:
        return a.astype(np.int64).reshape(a.shape)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got {a.dtype}")
    return a.astype(np.int64, copy=False)


def offsets_arg(x: IndexLike, layers: int, name: str) -> OffsetsArg:
    """Byte offsets ``x`` for ``layers`` layers: shape ``[n]`` (one layer) or ``[layers, n]``."""
    return (as_index(x, name), layers, name)


def _flat_tensor(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"{name} must be a uint8 (or int8) tensor, got {t.dtype}")
    if t.dim() != 1 or (t.numel() > 1 and t.stride(0) != 1):
        raise ValueError(
            f"{name} must be 1-D and contiguous, got shape {tuple(t.shape)} stride {tuple(t.stride())}"
        )
    return t.view(torch.uint8) if t.dtype == torch.int8 else t


def build_job(
    pools: list[PagePool],
    block_ids: IndexLike,
    flat: torch.Tensor,
    offsets: OffsetsArg | None,
    *,
    save: bool,
    lo: int | None = None,
    hi: int | None = None,
    flat_name: str | None = None,
    per_layer: bool = False,
    checks: Checks | None = None,
) -> Job:
    """Validate everything and return the job; ``ValueError`` with nothing written otherwise.

    ``per_layer=True`` checks what ``L`` one-layer jobs would check (no cross-layer aliasing or
    overlap checks): for copies issued layer after layer on one stream, as by
    :mod:`xkv.kernels.prepared`.

    ``checks`` (:class:`~xkv.kernels.verify.Checks`): compute checksums while copying; a
    restore's ``hash_only`` fragments are read and hashed, never written (their block ids are
    ignored: any value).
    """
    flat_name = flat_name or ("dst" if save else "src")
    flat = _flat_tensor(flat, flat_name)
    ids = as_index(block_ids, "block_ids")
    if ids.ndim != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {ids.shape}")
    n, L = int(ids.size), len(pools)
    written = None  # bool [n]: the fragments a verified restore writes (others: hash only)
    if checks is not None and not save and getattr(checks, "hash_only", None) is not None:
        ho = np.asarray(checks.hash_only)
        if ho.shape == ids.shape and ho.dtype == np.bool_ and ho.any():
            written = ~ho
    if L:
        _check_pools(pools, ids if written is None else ids[written], flat, flat_name, save)
        if written is not None:  # never dereferenced for writing: any valid block id
            ids = np.where(written, ids, ids[written].min() if written.any() else 0)
    bb = pools[0].block_bytes if L else 0
    flat_off = None
    if offsets is not None:
        flat_off = _check_offsets(offsets, n, bb, flat, flat_name, save, per_layer or L == 1)
    elif L * n * bb > flat.numel():
        raise ValueError(
            f"{flat_name} holds {flat.numel()} bytes, {L} x {n} blocks of {bb} need {L * n * bb}"
        )
    total = L * n * bb
    sliced = lo is not None or hi is not None
    if sliced:
        if L != 1:
            raise ValueError("a slice restores one layer")
        if not (isinstance(lo, (int, np.integer)) and isinstance(hi, (int, np.integer))):
            raise ValueError(f"lo and hi must be ints, got {lo!r}, {hi!r}")
        if not 0 <= lo <= hi <= total:
            raise ValueError(
                f"slice [{lo}, {hi}) not inside [0, {total}) of the concatenated fragments"
            )
        lo, hi = int(lo), int(hi)
    else:
        lo, hi = 0, total
    if not save and L > 1 and n and not per_layer:
        _check_no_alias(pools)
    if L and n and bb:
        _check_flat_vs_pools(flat, flat_off, total, pools, flat_name)
    jc = None
    if checks is not None:
        jc = validate_checks(checks, L=L, n=n, save=save, pools=pools, flat=flat,
                             flat_off=flat_off, sliced=sliced)
    return Job(pools, ids, flat, flat_off, 0, save, lo, hi, sliced, jc)


def _check_pools(pools, ids, flat, flat_name, save) -> None:
    p0, n = pools[0], int(ids.size)
    for p in pools[1:]:
        if p.block_bytes != p0.block_bytes:
            raise ValueError(f"layers differ in block_bytes: {p0.describe()} vs {p.describe()}")
        if p.device != p0.device:
            raise ValueError(f"layers are on different devices: {p0.device} vs {p.device}")
    _check_devices(p0.device, flat, flat_name)
    if not n:
        return
    limit = min(p.num_blocks for p in pools)
    if ids.min() < 0 or ids.max() >= limit:
        bad = ids[(ids < 0) | (ids >= limit)][:4]
        raise ValueError(f"block_ids out of range [0, {limit}): {bad.tolist()}")
    if not save and has_duplicates(ids):
        raise ValueError("block_ids has duplicates: two fragments would write the same block")


def _check_offsets(offsets, n, bb, flat, flat_name, save, rows_apart) -> np.ndarray:
    """The ``[L, n]`` table, in bounds; saves: no two fragments of a row (``rows_apart``) or of
    the whole table overlap in ``flat``."""
    off, layers, oname = offsets
    want = (n,) if layers == 1 and off.ndim == 1 else (layers, n)
    if off.shape != want:
        raise ValueError(f"{oname} must have shape {want}, got {off.shape}")
    flat_off = off.reshape(layers, n)
    if not flat_off.size:
        return flat_off
    if flat_off.min() < 0 or flat_off.max() + bb > flat.numel():
        raise ValueError(
            f"{oname} out of bounds: fragments of {bb} bytes at [{flat_off.min()}, "
            f"{flat_off.max()}] in a {flat.numel()}-byte {flat_name}"
        )
    if save and bb:
        rows = flat_off if rows_apart else flat_off.reshape(1, -1)
        if rows.shape[1] > 1 and (np.diff(np.sort(rows, axis=1), axis=1) < bb).any():
            raise ValueError(f"{oname}: two fragments of {bb} bytes overlap in {flat_name}")
    return flat_off


def _check_devices(dev: torch.device, flat: torch.Tensor, name: str) -> None:
    if dev.type == "cuda":
        if flat.device.type == "cuda":
            if flat.device != dev:
                raise ValueError(f"{name} is on {flat.device}, the cache on {dev}")
        elif flat.device.type == "cpu":
            if flat.numel() and not is_host_accessible(flat):  # an empty buffer is never read
                raise ValueError(
                    f"{name} is host memory that is neither pinned nor registered: the GPU cannot "
                    "read it directly (pin it, or call xkv.kernels.register_host once)"
                )
        else:
            raise ValueError(f"{name} is on {flat.device}, the cache on {dev}")
    elif flat.device != dev:
        raise ValueError(
            f"{name} is on {flat.device}, the cache on {dev}: CPU caches take CPU buffers"
        )


def _check_no_alias(pools: list[PagePool]) -> None:
    """No byte of one layer's blocks may be a byte of another's (two writers, one byte)."""
    order = sorted(pools, key=lambda p: p.data_ptr)
    comp = [order[0]]
    end = order[0].data_ptr + order[0].extent
    comps = []
    for p in order[1:]:
        if p.data_ptr < end:
            comp.append(p)
        else:
            comps.append(comp)
            comp = [p]
        end = max(end, p.data_ptr + p.extent)
    comps.append(comp)
    for c in comps:
        if len(c) < 2:
            continue
        s = c[0].block_stride
        if all(p.block_stride == s and p.span <= s for p in c):
            ivs = []
            for p in c:
                d = (p.data_ptr - c[0].data_ptr) % s
                for o, ln in p.runs:
                    a = (o + d) % s
                    ivs += [(a, a + ln)] if a + ln <= s else [(a, s), (0, a + ln - s)]
            ivs.sort()
            if any(b0 > a1 for (_, b0), (a1, _) in itertools.pairwise(ivs)):
                raise ValueError("two destination layers share bytes (the same pool twice?)")
        else:
            for i, p in enumerate(c):
                for q in c[i + 1 :]:
                    if p.overlaps(q):
                        raise ValueError(
                            f"destination layers overlap: {p.describe()} and {q.describe()}"
                        )


def _check_flat_vs_pools(flat, flat_off, total, pools, name) -> None:
    if flat.device != pools[0].device:
        return
    if flat_off is not None and flat_off.size:
        a = flat.data_ptr() + int(flat_off.min())
        b = flat.data_ptr() + int(flat_off.max()) + pools[0].block_bytes
    else:
        a, b = flat.data_ptr(), flat.data_ptr() + total
    for p in pools:
        if a < p.data_ptr + p.extent and p.data_ptr < b:
            raise ValueError(f"{name} overlaps the paged cache it is copied to or from")
