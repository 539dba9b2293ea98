"""Hypothesis strategies for page pools and copy jobs, and the independent byte-loop oracle.

Pools are built directly over one uint8 buffer (not through describe_cache) so that every geometry a
layout can produce shows up: odd run lengths from 1 byte to 256 KiB, gaps between runs, padded
strides, runs beyond the block stride (heads outside blocks, K/V-first), unaligned bases.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

from xkv.layout import PagePool

POISON = 0xA5


@dataclass(frozen=True)
class Geometry:
    num_blocks: int
    block_stride: int
    runs: tuple[tuple[int, int], ...]

    @property
    def block_bytes(self) -> int:
        return sum(n for _, n in self.runs)

    @property
    def extent(self) -> int:
        return (self.num_blocks - 1) * self.block_stride + max(o + n for o, n in self.runs)


def pool_over(raw: torch.Tensor, offset: int, g: Geometry) -> PagePool:
    return PagePool(
        base=raw[offset : offset + g.extent],
        num_blocks=g.num_blocks,
        block_bytes=g.block_bytes,
        block_stride=g.block_stride,
        runs=g.runs,
    )


_BIG = [65536, 65536 + 3, 100000, 262144 - 8, 262144, 67584]  # 67584: 33 rows of 2 KiB
_PAGE = [4096, 4104, 10496, 16384, 3000, 18432]  # 18432: the MLA page (576 bf16 x 16)


@st.composite
def geometries(
    draw, *, big: bool = True, max_blocks: int = 6, run_lens: tuple[int, ...] | None = None
) -> Geometry:
    """One layer's geometry. ``run_lens`` fixes the run lengths (layers that must share block_bytes)."""
    aligned = draw(st.booleans())
    q = 16 if aligned else 1
    if run_lens is None:
        kind = draw(st.sampled_from(["tiny", "small", "page", "heads"] + (["big"] if big else [])))
        if kind == "big":
            run_lens = (draw(st.sampled_from(_BIG)),)
            max_blocks = 2
        elif (
            kind == "heads"
        ):  # H runs of one page each, H*num_blocks pages apart (LHBNC, K/V-first)
            nb = draw(st.integers(1, max_blocks))
            page = draw(st.integers(1, 300)) * q
            heads = draw(st.integers(1, 3))
            return Geometry(nb, page, tuple((h * nb * page, page) for h in range(heads)))
        else:
            hi = {"tiny": 16, "small": 700, "page": None}[kind]
            R = draw(st.integers(1, 3))
            if hi is None:
                run_lens = tuple(draw(st.sampled_from(_PAGE)) for _ in range(R))
            else:
                run_lens = tuple(draw(st.integers(1, hi)) for _ in range(R))
            if aligned:
                run_lens = tuple(-(-n // q) * q for n in run_lens)
    runs, off = [], draw(st.integers(0, 40)) * q
    for n in run_lens:
        runs.append((off, n))
        off += n + draw(st.integers(0, 24)) * q
    span = max(o + n for o, n in runs)
    stride = span + draw(st.integers(0, 40)) * q
    nb = draw(st.integers(1, max_blocks))
    return Geometry(nb, stride, tuple(runs))


@st.composite
def fragment_offsets(
    draw, count: int, size: int, *, disjoint: bool, aligned: bool
) -> tuple[np.ndarray, int]:
    """``count`` offsets of ``size``-byte fragments in a flat buffer, shuffled; returns (offsets, buffer size)."""
    q = 16 if aligned else 1
    pos, slots = draw(st.integers(0, 20)) * q, []
    for _ in range(count):
        slots.append(pos)
        pos += size + draw(st.integers(0, 20)) * q
    order = draw(st.permutations(range(count))) if count else []
    offs = np.array([slots[k] for k in order], dtype=np.int64)
    if not disjoint and count > 1 and draw(st.booleans()):
        offs[-1] = offs[0]  # two fragments read the same source bytes: allowed for restores
    return offs, pos + draw(st.integers(0, 20))


def block_ids(draw, num_blocks: int, *, empty: bool = True) -> np.ndarray:
    n = draw(st.integers(0 if empty else 1, num_blocks))
    ends = draw(st.booleans())
    perm = list(draw(st.permutations(range(num_blocks))))
    if ends and num_blocks > 1:  # make sure both ends of the cache are in the list
        for b in (0, num_blocks - 1):
            perm.remove(b)
        perm = [num_blocks - 1, 0] + perm
        n = max(n, 2)
    return np.array(perm[:n], dtype=np.int64)


def random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def oracle(
    raw: torch.Tensor,
    pools: list[PagePool],
    flat: torch.Tensor,
    offs: np.ndarray,
    ids: np.ndarray,
    *,
    save: bool,
    lo: int = 0,
    hi: int | None = None,
) -> None:
    """The obvious loop: byte ranges, one run at a time (mutates ``raw`` or ``flat``).

    The oracle every engine is checked against (on CPU, and on GPU via CPU copies): plain slicing
    written here, sharing no code with ``xkv.kernels``. ``offs`` is ``[L, n]`` bytes."""
    n = ids.size
    bb = pools[0].block_bytes if pools else 0
    hi = len(pools) * n * bb if hi is None else hi
    for layer, pool in enumerate(pools):
        base = pool.data_ptr - raw.data_ptr()
        for i, b in enumerate(ids.tolist()):
            cum = 0
            for o, ln in pool.runs:
                pos = (layer * n + i) * bb + cum
                a, c = max(lo - pos, 0), min(hi - pos, ln)
                if a < c:
                    p = base + b * pool.block_stride + o + a
                    f = int(offs[layer][i]) + cum + a
                    if save:
                        flat[f : f + c - a] = raw[p : p + c - a]
                    else:
                        raw[p : p + c - a] = flat[f : f + c - a]
                cum += ln


# ---- whole jobs ---------------------------------------------------------------------------------


def setup_single(g: Geometry, base_off: int, flat_size: int, seed: int):
    """(cache buffer, flat buffer, pool over the cache buffer at ``base_off``), random bytes."""
    raw = random_bytes(base_off + g.extent + 13, seed)
    flat = random_bytes(flat_size, seed + 1)
    return raw, flat, pool_over(raw, base_off, g)


@st.composite
def single_jobs(draw, *, save: bool):
    """One layer: (geometry, ids, offsets, flat size, pool offset in its buffer)."""
    g = draw(geometries())
    ids = block_ids(draw, g.num_blocks)
    aligned = draw(st.booleans())
    offs, flat_size = draw(
        fragment_offsets(ids.size, g.block_bytes, disjoint=save, aligned=aligned)
    )
    base_off = draw(st.sampled_from([0, 16, 3, 8]))
    return g, ids, offs, flat_size, base_off


@st.composite
def layer_jobs(draw, *, save: bool):
    """L pools over one buffer: separate regions, interleaved (block-outermost), or two geometries.
    Returns (geometries, pool offsets in the buffer, ids, offsets [L, n], flat size)."""
    L = draw(st.integers(1, 4))
    arrangement = draw(st.sampled_from(["separate", "interleaved", "mixed"]))
    g0 = draw(geometries(big=False, max_blocks=5))
    lens = tuple(n for _, n in g0.runs)
    if arrangement == "interleaved":  # layer l's page at l * span inside a block of L * span
        span = max(o + n for o, n in g0.runs)
        stride = L * span + draw(st.integers(0, 9))
        geoms = [Geometry(g0.num_blocks, stride, g0.runs)] * L
        offsets = [k * span for k in range(L)]
    else:
        geoms = [g0] + [
            draw(geometries(run_lens=lens)) if arrangement == "mixed" else g0 for _ in range(L - 1)
        ]
        geoms = [Geometry(g0.num_blocks, g.block_stride, g.runs) for g in geoms]
        offsets, pos = [0] * L, draw(st.integers(0, 7))
        for k in draw(st.permutations(range(L))):  # layer order need not follow addresses
            offsets[k] = pos
            pos += geoms[k].extent + draw(st.integers(0, 9))
    ids = block_ids(draw, g0.num_blocks)
    offs, flat_size = draw(
        fragment_offsets(L * ids.size, g0.block_bytes, disjoint=save, aligned=draw(st.booleans()))
    )
    return geoms, offsets, ids, offs.reshape(L, ids.size), flat_size


def layers_buffer_size(geoms, offsets) -> int:
    return max(o + g.extent for o, g in zip(offsets, geoms, strict=True)) + 11


def pools_over(raw: torch.Tensor, geoms, offsets) -> list[PagePool]:
    return [pool_over(raw, o, g) for o, g in zip(offsets, geoms, strict=True)]


def slice_case(job, seed: int, data):
    """A drawn ``[lo, hi)`` restore slice of a ``single_jobs(save=False)`` job: (poisoned cache
    buffer, flat, pool, expected cache buffer, ids, offsets, lo, hi)."""
    g, ids, offs, flat_size, base_off = job
    total = ids.size * g.block_bytes
    lo = data.draw(st.integers(0, total))
    hi = data.draw(st.integers(lo, total))
    raw, flat, pool = setup_single(g, base_off, flat_size, seed)
    raw.fill_(POISON)
    expect = raw.clone()
    oracle(
        expect, [pool_over(expect, base_off, g)], flat, offs[None], ids, save=False, lo=lo, hi=hi
    )
    return raw, flat, pool, expect, ids, offs, lo, hi


def refused_and_untouched(call, setup, engine: str) -> bool:
    """``call(raw, flat, pool, engine)`` raises ValueError and changes neither buffer."""
    import pytest

    raw, flat, pool = setup()
    raw0, flat0 = raw.clone(), flat.clone()
    with pytest.raises(ValueError):
        call(raw, flat, pool, engine)
    return torch.equal(raw, raw0) and torch.equal(flat, flat0)
