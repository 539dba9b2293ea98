"""The checksum of stored KV bytes: its definition and its torch reference.

What it covers: one uint32 word per **(object shard, layer)**. A stored object (one chunk of one
cache group, one shard) is layer-major on the card: layer ``l``'s ``k`` pages
(``blocks_per_object``) are ``k * page_bytes`` contiguous bytes. Their word is

    W = sum over p in [0, k * page_bytes / 4) of  mix(x_p, p)   (mod 2**32)

where ``x_p`` is the p-th little-endian 4-byte word of those bytes (page ``j``, word ``w`` of the
page: ``p = j * page_bytes / 4 + w``) and

    mix(x, p) = fmix32(x XOR ((p + 1) * 0x9E3779B9 mod 2**32))

with ``fmix32`` MurmurHash3's 32-bit finaliser (xor-shift / multiply rounds: a bijection of the
32-bit words). Properties this gives (the tests check each):

* any change of ONE word (a single bit flip, any burst inside 4 bytes) always changes ``W``:
  ``mix(., p)`` is a bijection, the other terms do not move;
* it depends on positions: swapping two different words, two different pages of a layer, or a
  page and a zero page changes ``W`` except by a 2**-32 coincidence (the terms of different
  positions are unrelated); pages of different layers are in different words, so swapped layers
  are caught unless the two layers' words coincide (equal bytes are harmless);
* it is a plain sum: Triton programs add the terms of the tiles they copy with atomic adds in any
  order, and a restore that moves only some pages of an object can still check it by hashing the
  others without writing them (``xkv.kernels.jobs`` "hash-only" fragments).

Three statements of it: :func:`words_numpy` (the definition, for tests), :func:`words_device`
(torch ops on any device: the torch engine's hash of CUDA pages) and :func:`words_host` (CPU
pages: numpy's uint32 arithmetic, which wraps mod 2**32 by itself, a cache-sized tile at a time);
:func:`words_torch` takes the host one for CPU tensors, the device one otherwise.

A page whose size is not a multiple of 4 bytes has no checksum: :func:`check_page_bytes` raises
(callers turn verification off for such a cache and say so); there is no padding rule.
An empty range has the word 0. Multi-word corruptions (torn, swapped or foreign pages) are
caught with probability ``1 - 2**-32`` per (object, layer) word, not with certainty.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

__all__ = [
    "GOLDEN",
    "M1",
    "M2",
    "check_page_bytes",
    "mix_numpy",
    "words_device",
    "words_host",
    "words_numpy",
    "words_torch",
]

GOLDEN = 0x9E3779B9  # position key: (p + 1) * GOLDEN
M1 = 0x85EBCA6B  # fmix32 multipliers
M2 = 0xC2B2AE35
_MASK = 0xFFFFFFFF
# words per tile of words_host: its five passes over a tile stay in a core's L2 (~64 KiB here)
HOST_TILE_WORDS = 1 << 14


def check_page_bytes(page_bytes: int, what: str = "page") -> None:
    """``ValueError`` unless ``page_bytes`` is a multiple of 4 (the checksum's word)."""
    if page_bytes % 4:
        raise ValueError(
            f"checksums cover 4-byte words: a {what} of {page_bytes} bytes is not a multiple of 4"
        )


def mix_numpy(x: np.ndarray, p: np.ndarray) -> np.ndarray:
    """``mix(x, p)`` on uint32 arrays (numpy's uint32 arithmetic wraps mod 2**32)."""
    x = np.asarray(x, dtype=np.uint32)
    p = np.asarray(p, dtype=np.uint64)
    h = np.array(x ^ (((p + 1) * GOLDEN) & _MASK).astype(np.uint32), dtype=np.uint32)
    with np.errstate(over="ignore"):  # a 0-d array's product is scalar math, which warns
        _fmix_inplace(h, np.empty_like(h))
    return h


def words_numpy(data: bytes | np.ndarray, start: int = 0) -> int:
    """The word of ``data`` (bytes, a multiple of 4), its first 4 bytes at position ``start``
    (in words). An independent (numpy) statement of the definition, for tests."""
    a = np.frombuffer(bytes(data), dtype="<u4")
    p = np.arange(a.size, dtype=np.uint64) + np.uint64(start)
    return int(mix_numpy(a, p).astype(np.uint64).sum() & _MASK)


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``h * c mod 2**32`` for int64 ``h`` in [0, 2**32): split so no product leaves int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + ((h * hi) << 16)) & _MASK


def _mix_torch(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``mix`` on int64 tensors holding uint32 values (any device)."""
    h = x ^ _mul32((p + 1) & _MASK, GOLDEN)
    h = h ^ (h >> 16)
    h = _mul32(h, M1)
    h = h ^ (h >> 13)
    h = _mul32(h, M2)
    return h ^ (h >> 16)


def words_torch(pages: torch.Tensor, start: torch.Tensor | int = 0) -> torch.Tensor:
    """Terms of the checksum summed per row: ``pages`` uint8 ``[m, b]`` (``b`` a multiple of 4,
    any device, any strides along dim 0), row ``i``'s first word at position ``start[i]``
    (int64 ``[m]`` or an int, in words). Returns int64 ``[m]`` in ``[0, 2**32)`` on the pages'
    device: row ``i``'s contribution to its object-layer word. The torch engine's
    (``engine="reference"``) hash: :func:`words_host` for CPU pages (5-24 x faster there on the
    2-CPU box from 4 KiB pages: torch's int64 passes over the whole array leave the cache),
    :func:`words_device` elsewhere."""
    if pages.device.type != "cpu":
        return words_device(pages, start)
    if isinstance(start, torch.Tensor):
        start = start.cpu().numpy()
    return torch.from_numpy(words_host(pages.contiguous().numpy(), start).astype(np.int64))


def words_device(pages: torch.Tensor, start: torch.Tensor | int = 0) -> torch.Tensor:
    """:func:`words_torch` with torch ops on the pages' own device (int64 arithmetic, split
    products), whatever the device."""
    m, b = pages.shape
    check_page_bytes(b)
    if m == 0 or b == 0:
        return torch.zeros(m, dtype=torch.int64, device=pages.device)
    pages = pages.contiguous()
    if pages.storage_offset() % 4:  # a dtype view needs an aligned start
        pages = pages.clone()
    raw = pages.view(torch.int32).to(torch.int64) & _MASK  # [m, b/4], little-endian words
    pos = torch.arange(b // 4, dtype=torch.int64, device=pages.device)
    if isinstance(start, torch.Tensor):
        pos = pos[None, :] + start.to(pages.device, torch.int64)[:, None]
    else:
        pos = pos[None, :] + int(start)
    return _mix_torch(raw, pos).sum(1) & _MASK


@functools.lru_cache(maxsize=64)
def _column_keys(w: int) -> np.ndarray:
    """``(c + 1) * GOLDEN mod 2**32`` for ``c`` in ``[0, w)``, uint32 (read-only, shared)."""
    k = ((np.arange(1, w + 1, dtype=np.uint64) * np.uint64(GOLDEN)) & np.uint64(_MASK))
    k = k.astype(np.uint32)
    k.flags.writeable = False
    return k


def words_host(pages: np.ndarray, start: np.ndarray | int = 0) -> np.ndarray:
    """:func:`words_torch` on the host: ``pages`` uint8 ``[m, b]`` (a numpy array, copied first
    when not C-contiguous; ``b`` a multiple of 4), ``start`` int64 ``[m]`` or an int; returns
    uint32 ``[m]``.

    Row ``i``'s position key splits into a row term and a column term,
    ``(start[i] + c + 1) * GOLDEN = start[i] * GOLDEN + (c + 1) * GOLDEN (mod 2**32)``, so a tile
    costs one add for its keys; uint32 arithmetic wraps by itself. Tiles of about
    :data:`HOST_TILE_WORDS` words (whole rows, or a row's columns in parts when a row is
    longer) keep every pass in cache. numpy lets go of the GIL inside each pass."""
    pages = np.ascontiguousarray(pages, dtype=np.uint8)
    m, b = pages.shape
    check_page_bytes(b)
    out = np.zeros(m, dtype=np.uint64)
    if m == 0 or b == 0:
        return out.astype(np.uint32)
    w = b // 4
    x = pages.view("<u4")  # [m, w]
    st = np.broadcast_to(np.asarray(start).astype(np.uint64) & np.uint64(_MASK), (m,))
    rows = ((st * np.uint64(GOLDEN)) & np.uint64(_MASK)).astype(np.uint32)  # < 2**64: no wrap
    cols = _column_keys(w)
    rstep = max(1, HOST_TILE_WORDS // w)
    cstep = min(w, HOST_TILE_WORDS)
    h = np.empty((min(rstep, m), cstep), np.uint32)
    t = np.empty_like(h)
    for r0 in range(0, m, rstep):
        r1 = min(m, r0 + rstep)
        for c0 in range(0, w, cstep):
            c1 = min(w, c0 + cstep)
            hh, tt = h[: r1 - r0, : c1 - c0], t[: r1 - r0, : c1 - c0]
            np.add(rows[r0:r1, None], cols[None, c0:c1], out=hh)  # the position keys
            np.bitwise_xor(hh, x[r0:r1, c0:c1], out=hh)
            _fmix_inplace(hh, tt)
            out[r0:r1] += hh.sum(axis=1, dtype=np.uint64)
    return (out & np.uint64(_MASK)).astype(np.uint32)


def _fmix_inplace(h: np.ndarray, t: np.ndarray) -> None:
    """MurmurHash3's fmix32 on uint32 ``h`` in place (``t`` scratch of its shape)."""
    for shift, mul in ((16, M1), (13, M2), (16, None)):
        np.right_shift(h, np.uint32(shift), out=t)
        np.bitwise_xor(h, t, out=h)
        if mul is not None:
            np.multiply(h, np.uint32(mul), out=h)
