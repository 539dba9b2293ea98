"""The checksum definition (xkv.kernels.checksum): the torch reference against an independent
per-word statement, and the properties the restore check relies on (bit flips always change the
word; swapped words / pages / layers change it; empty ranges; odd sizes refused)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xkv.kernels import checksum as C


def _loop_word(data: bytes, start: int = 0) -> int:
    """Word by word in plain Python ints: the definition, nothing shared with the module."""
    def fmix(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    total = 0
    for w in range(len(data) // 4):
        x = int.from_bytes(data[4 * w:4 * w + 4], "little")
        key = ((start + w + 1) * 0x9E3779B9) & 0xFFFFFFFF
        total = (total + fmix(x ^ key)) & 0xFFFFFFFF
    return total


words4 = st.integers(0, 64).map(lambda n: 4 * n)


@given(n=words4, start=st.integers(0, 2**32), seed=st.integers(0, 2**32 - 1))
def test_numpy_and_torch_match_the_definition(n, start, seed):
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    want = _loop_word(data, start)
    assert C.words_numpy(data, start) == want
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(1, n) if n else \
        torch.zeros(1, 0, dtype=torch.uint8)
    assert int(C.words_torch(t, start)[0]) == want
    assert int(C.words_device(t, start)[0]) == want
    assert int(C.words_host(np.frombuffer(data, np.uint8).reshape(1, n), start)[0]) == want


@given(rows=st.integers(0, 6), n=words4, seed=st.integers(0, 2**32 - 1))
def test_torch_rows_with_starts(rows, n, seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (rows, n), dtype=np.uint8)
    starts = rng.integers(0, 2**31, rows)
    want = [_loop_word(a[i].tobytes(), int(starts[i])) for i in range(rows)]
    for words in (C.words_torch, C.words_device):
        got = words(torch.from_numpy(a), torch.from_numpy(starts))
        assert got.shape == (rows,) and got.dtype == torch.int64
        assert got.tolist() == want
    host = C.words_host(a, starts)
    assert host.dtype == np.uint32 and host.tolist() == want


@settings(max_examples=60)
@given(rows=st.integers(0, 40), w=st.integers(0, 70), tile=st.integers(1, 50),
       seed=st.integers(0, 2**32 - 1), data=st.data())
def test_host_tiles_cover_every_word_once(rows, w, tile, seed, data):
    """words_host's tiles (whole rows, or a row's columns in parts when a row is longer than a
    tile) at drawn tile sizes, odd rows and columns, a strided view and a scalar or 2**40-sized
    start: the same words as the torch ops, word for word."""
    rng = np.random.default_rng(seed)
    big = rng.integers(0, 256, (rows, 4 * w + 12), dtype=np.uint8)
    a = big[:, 8:8 + 4 * w]  # not C-contiguous, not at its buffer's start
    starts = rng.integers(0, 2**40, rows) if data.draw(st.booleans()) else int(rng.integers(0, 2**40))
    want = C.words_device(torch.from_numpy(np.ascontiguousarray(a)),
                          torch.from_numpy(starts) if isinstance(starts, np.ndarray) else starts)
    old = C.HOST_TILE_WORDS
    C.HOST_TILE_WORDS = tile
    try:
        got = C.words_host(a, starts)
    finally:
        C.HOST_TILE_WORDS = old
    assert got.astype(np.int64).tolist() == want.tolist()


def test_empty_is_zero_and_zero_pages_are_not():
    assert C.words_numpy(b"") == 0
    assert C.words_torch(torch.zeros(3, 0, dtype=torch.uint8)).tolist() == [0, 0, 0]
    assert C.words_torch(torch.zeros(0, 8, dtype=torch.uint8)).shape == (0,)
    assert C.words_host(np.zeros((3, 0), np.uint8)).tolist() == [0, 0, 0]
    assert C.words_host(np.zeros((0, 8), np.uint8)).shape == (0,)
    assert C.words_numpy(bytes(16)) != 0  # an unwritten (zero) page is not "empty"


@pytest.mark.parametrize("nbytes", [1, 2, 3, 5, 6, 7, 4097])
def test_sizes_not_multiple_of_4_are_refused(nbytes):
    with pytest.raises(ValueError, match=f"{nbytes} bytes is not a multiple of 4"):
        C.check_page_bytes(nbytes)
    for words in (C.words_torch, C.words_device):
        with pytest.raises(ValueError, match="not a multiple of 4"):
            words(torch.zeros(2, nbytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not a multiple of 4"):
        C.words_host(np.zeros((2, nbytes), np.uint8))


@settings(max_examples=300)
@given(n=st.integers(1, 64).map(lambda n: 4 * n), seed=st.integers(0, 2**32 - 1),
       bit=st.integers(0, 10**9), start=st.integers(0, 2**32))
def test_every_single_bit_flip_changes_the_word(n, seed, bit, start):
    data = bytearray(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes())
    before = C.words_numpy(data, start)
    b = bit % (8 * n)
    data[b // 8] ^= 1 << (b % 8)
    assert C.words_numpy(data, start) != before


def test_every_bit_of_a_page_exhaustively():
    """All 8 * 256 single-bit flips of one random page, and every byte value of one word."""
    data = np.random.default_rng(1).integers(0, 256, 256, dtype=np.uint8)
    t = torch.from_numpy(np.repeat(data[None], 8 * 256, 0))
    idx = np.arange(8 * 256)
    t[idx, idx // 8] ^= torch.from_numpy((1 << (idx % 8)).astype(np.uint8))
    base = C.words_numpy(data.tobytes())
    assert (C.words_torch(t) != base).all()
    x = np.arange(2**16, dtype=np.uint32)  # mix(., p) is injective on a sample of words
    assert np.unique(C.mix_numpy(x, np.full(x.size, 7))).size == x.size


@given(n=st.integers(2, 64), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_swapped_words_change_it(n, seed, data):
    a = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint32)
    i = data.draw(st.integers(0, n - 1))
    j = data.draw(st.integers(0, n - 1).filter(lambda j: a[j] != a[i]))
    b = a.copy()
    b[[i, j]] = b[[j, i]]
    assert C.words_numpy(a.tobytes()) != C.words_numpy(b.tobytes())


def test_swapped_pages_and_layers_change_it():
    """k pages of a layer in one word: reordering pages changes it; a page moved into another
    layer's word changes both words (random bytes, many trials)."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        k, pb = int(rng.integers(2, 6)), 4 * int(rng.integers(1, 40))
        pages = rng.integers(0, 256, (k, pb), dtype=np.uint8)
        w = C.words_numpy(pages.tobytes())
        perm = rng.permutation(k)
        if (perm != np.arange(k)).any():
            assert C.words_numpy(pages[perm].tobytes()) != w
        other = rng.integers(0, 256, (k, pb), dtype=np.uint8)
        swapped = pages.copy()
        swapped[0] = other[0]
        assert C.words_numpy(swapped.tobytes()) != w


def test_sum_is_order_free():
    """Programs may add their tiles' terms in any order: the word of a range is the sum of the
    words of its parts at their positions."""
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 4 * 100, dtype=np.uint8).tobytes()
    parts = [(0, 40), (40, 44), (44, 400)]
    s = sum(C.words_numpy(data[a:b], a // 4) for a, b in parts) & 0xFFFFFFFF
    assert s == C.words_numpy(data)
