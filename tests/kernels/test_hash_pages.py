"""xkv.kernels.hash_pages: the words of pages already in a paged cache, nothing written.

Both engines (the torch engine, and the Triton kernel with ``STORE=False`` under
TRITON_INTERPRET=1) return exactly the words a checked ``save_layers`` of the same pages
returns (and the numpy definition of the card bytes), for odd page sizes, several layers, 0 or 1
fragments and block ids in any order; residuals against expected words are 0 exactly where the
pages match, and one flipped bit changes exactly its (layer, object) word; neither the pools nor
the flat buffer the kernel is handed (poisoned) change; bad arguments are a ValueError before
anything runs."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from checksum_cases import cases, oracle_words
from hypothesis import given, settings
from hypothesis import strategies as st

import xkv.kernels as K
from xkv.kernels import _launch, _torch, hashing
from xkv.kernels import checksum as C
from xkv.layout import PagePool

ENGINES = ["reference", "triton"]
POISON = 0xA5


def make_pools(c, device="cpu"):
    g = torch.Generator().manual_seed(c["seed"])
    pools = []
    for _ in range(c["L"]):
        raw = torch.randint(0, 256, (c["nblocks"] * c["stride"],), dtype=torch.uint8, generator=g)
        pools.append(PagePool(raw.to(device), c["nblocks"], c["bb"], c["stride"], c["runs"]))
    return pools


def checks_for(c, expected=None):
    return K.Checks(c["obj"], c["page"], c["C"], expected=expected)


def save_words(c, pools, engine="reference") -> tuple[np.ndarray, torch.Tensor]:
    """A checked save_layers of the same pages: its words and the card."""
    card = torch.full((c["card_bytes"],), POISON, dtype=torch.uint8)
    if pools[0].device.type == "cuda":
        card = card.pin_memory()
    w = K.save_layers(pools, c["ids"], card, c["offs"], engine=engine, checks=checks_for(c))
    if card.is_pinned():
        torch.cuda.synchronize()
    return w.host_words(), card


@contextlib.contextmanager
def poisoned_flat():
    """Hands the kernel a poisoned 64-byte flat buffer (instead of null_flat's); yields the
    list of buffers handed out, to check afterwards."""
    given_out, real = [], hashing.null_flat

    def fake(device):
        t = torch.full((64,), POISON, dtype=torch.uint8, device=device)
        given_out.append(t)
        return t

    hashing.null_flat = fake
    try:
        yield given_out
    finally:
        hashing.null_flat = real


def untouched(pools, before) -> bool:
    return all(torch.equal(p.base, b) for p, b in zip(pools, before, strict=True))


def flip_bit(pool: PagePool, block: int, byte: int, bit: int) -> None:
    """Flip one bit of byte ``byte`` of block ``block`` (counted along its runs)."""
    for r, (_, ln) in enumerate(pool.runs):
        if byte < ln:
            pool.run_view(r)[block, byte] ^= 1 << bit
            return
        byte -= ln


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=30, deadline=None)
@given(c=cases())
def test_words_are_a_checked_saves_words_and_nothing_is_written(engine, c):
    pools = make_pools(c)
    want, card = save_words(c, pools)
    np.testing.assert_array_equal(want, oracle_words(card, c))
    same, card2 = save_words(c, pools, engine)  # this engine's checked save: same card, words
    np.testing.assert_array_equal(same, want)
    assert torch.equal(card2, card)
    before = [p.base.clone() for p in pools]
    with poisoned_flat() as flats:
        w = K.hash_pages(pools, c["ids"], checks_for(c), engine=engine, max_programs=3)
    assert w.shape == (c["L"], c["C"]) and w.save
    np.testing.assert_array_equal(w.host_words(), want)
    assert untouched(pools, before)
    assert flats and all(bool((f == POISON).all()) for f in flats)


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=30, deadline=None)
@given(c=cases(), data=st.data())
def test_a_flipped_bit_changes_exactly_its_word_and_residual(engine, c, data):
    pools = make_pools(c)
    want, _ = save_words(c, pools)
    res = K.hash_pages(pools, c["ids"], checks_for(c, want), engine=engine, max_programs=2)
    assert not res.save and not res.mismatched().any()
    if c["n"] == 0:
        return
    li = data.draw(st.integers(0, c["L"] - 1))
    i = data.draw(st.integers(0, c["n"] - 1))
    flip_bit(pools[li], int(c["ids"][i]), data.draw(st.integers(0, c["bb"] - 1)),
             data.draw(st.integers(0, 7)))
    w = K.hash_pages(pools, c["ids"], checks_for(c), engine=engine).host_words()
    changed = np.argwhere(w != want).tolist()
    assert changed == [[li, int(c["obj"][i])]]
    res = K.hash_pages(pools, c["ids"], checks_for(c, want), engine=engine, max_programs=5)
    flagged = np.zeros(c["C"], bool)
    flagged[c["obj"][i]] = True
    np.testing.assert_array_equal(res.mismatched(), flagged)
    np.testing.assert_array_equal(res.words.numpy().view(np.uint32),
                                  (w.astype(np.int64) - want).astype(np.uint32))


@pytest.mark.parametrize("engine", ENGINES)
def test_one_fragment_and_zero_fragments(engine):
    raw = torch.arange(3 * 20, dtype=torch.int64).to(torch.uint8)
    pool = PagePool(raw, 3, 12, 20, ((0, 12),))
    w = K.hash_pages([pool], [2], K.Checks([0], [0], 1), engine=engine).host_words()
    assert w.tolist() == [[C.words_numpy(pool.block(2).numpy().tobytes())]]
    w = K.hash_pages([pool, pool], [], K.Checks([], [], 1), engine=engine).host_words()
    assert w.tolist() == [[0], [0]]


@pytest.mark.parametrize("engine", ENGINES)
def test_layers_of_different_geometries(engine):
    """Two launches (one per geometry), one word buffer: the words of a checked save."""
    g = torch.Generator().manual_seed(7)
    a = PagePool(torch.randint(0, 256, (5 * 24,), dtype=torch.uint8, generator=g), 5, 16, 24,
                 ((0, 16),))
    b = PagePool(torch.randint(0, 256, (5 * 40,), dtype=torch.uint8, generator=g), 5, 16, 40,
                 ((4, 8), (20, 8)))
    ids, checks = [4, 0, 2], K.Checks([1, 0, 1], [1, 0, 0], 2)
    card = torch.zeros(2 * 3 * 16, dtype=torch.uint8)
    offs = np.array([[48, 0, 32], [64, 16, 80]])  # no overlap; the save's own placement
    want = K.save_layers([a, b], ids, card, offs, engine="reference", checks=checks).host_words()
    with poisoned_flat() as flats:
        got = K.hash_pages([a, b], ids, checks, engine=engine).host_words()
    np.testing.assert_array_equal(got, want)
    assert all(bool((f == POISON).all()) for f in flats)


def _refusing(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("an engine ran")

    monkeypatch.setattr(_torch, "run", boom)
    monkeypatch.setattr(_launch, "run", boom)


@pytest.mark.parametrize("engine", ENGINES)
def test_bad_arguments_refused_before_anything_runs(engine, monkeypatch):
    _refusing(monkeypatch)
    raw = torch.randint(0, 256, (4 * 16,), dtype=torch.uint8)
    pool = PagePool(raw, 4, 12, 16, ((0, 12),))
    ok = K.Checks([0, 0], [0, 1], 1)
    bad = {
        "block_ids out of range": lambda: K.hash_pages([pool], [0, 4], ok, engine=engine),
        "negative block id": lambda: K.hash_pages([pool], [-1, 2], ok, engine=engine),
        "not a multiple of 4": lambda: K.hash_pages(
            [PagePool(raw, 4, 6, 16, ((0, 6),))], [0, 1], ok, engine=engine),
        "objects out of range": lambda: K.hash_pages(
            [pool], [0, 1], K.Checks([0, 1], [0, 1], 1), engine=engine),
        "checks shape": lambda: K.hash_pages([pool], [0, 1, 2], ok, engine=engine),
        "expected shape": lambda: K.hash_pages(
            [pool], [0, 1], K.Checks([0, 0], [0, 1], 1, expected=np.zeros((2, 1), np.uint32)),
            engine=engine),
        "hash_only": lambda: K.hash_pages(
            [pool], [0, 1], K.Checks([0, 0], [0, 1], 1, expected=np.zeros((1, 1), np.uint32),
                                     hash_only=np.array([True, False])), engine=engine),
        "not Checks": lambda: K.hash_pages([pool], [0, 1], None, engine=engine),
        "no pools": lambda: K.hash_pages([], [0, 1], ok, engine=engine),
        "max_programs": lambda: K.hash_pages([pool], [0, 1], ok, engine=engine, max_programs=0),
        "copy engine": lambda: K.hash_pages([pool], [0, 1], ok, engine="copy_engine"),
        "block_ids 2-D": lambda: K.hash_pages([pool], [[0, 1]], ok, engine=engine),
    }
    before = raw.clone()
    for what, call in bad.items():
        with pytest.raises(ValueError):
            call()
            pytest.fail(what)
        assert torch.equal(raw, before), what


def test_the_store_free_variant_only_for_hash_jobs():
    """Every other launch keeps its variant (no STORE key in its constexprs); a hash job's
    launch is the save-direction CHECK variant with STORE=False."""
    raw = torch.randint(0, 256, (4 * 16,), dtype=torch.uint8)
    pool = PagePool(raw, 4, 12, 16, ((0, 12),))
    job = hashing.build_hash_job([pool], [3, 1], K.Checks([0, 0], [0, 1], 1))
    (launch,) = _launch.launches(job, 4)
    assert launch.meta["STORE"] is False and launch.meta["SAVE"] and launch.meta["CHECK"]
    launch()  # a prepared launch (as the bench times it) of a residual job: restore semantics
    exp = np.array([[C.words_numpy(pool.block(3).numpy().tobytes() +
                                   pool.block(1).numpy().tobytes())]], np.uint32)
    res = hashing.build_hash_job([pool], [3, 1], K.Checks([0, 0], [0, 1], 1, expected=exp))
    for la in _launch.launches(res, 2):
        la()
    assert not res.checks.buf.save and res.checks.buf.mismatched().tolist() == [False]
    assert job.checks.buf.host_words().tolist() == exp.tolist()
    from xkv.kernels.jobs import build_job, offsets_arg

    card = torch.zeros(64, dtype=torch.uint8)
    for save, checks in ((True, None), (True, K.Checks([0, 0], [0, 1], 1)), (False, None)):
        job = build_job([pool], [3, 1], card, offsets_arg([0, 12], 1, "o"), save=save,
                        checks=checks)
        assert all("STORE" not in la.meta for la in _launch.launches(job, 4))


@pytest.mark.gpu
@settings(max_examples=10, deadline=None)
@given(c=cases(), data=st.data())
def test_compiled_kernel_on_the_gpu(c, data):
    """On CUDA (compiled, not interpreted): the words of a checked save (torch engine on CPU
    pools), nothing written (pools, poisoned flat), a flipped bit flags exactly its object."""
    cpu_pools = make_pools(c)
    want, _ = save_words(c, cpu_pools)
    pools = make_pools(c, "cuda")
    before = [p.base.clone() for p in pools]
    with poisoned_flat() as flats:
        w = K.hash_pages(pools, c["ids"], checks_for(c), engine="auto")
        res = K.hash_pages(pools, c["ids"], checks_for(c, want), max_programs=16)
    np.testing.assert_array_equal(w.host_words(), want)
    assert not res.mismatched().any()
    assert untouched(pools, before) and all(bool((f == POISON).all()) for f in flats)
    if c["n"]:
        li = data.draw(st.integers(0, c["L"] - 1))
        i = data.draw(st.integers(0, c["n"] - 1))
        flip_bit(pools[li], int(c["ids"][i]), data.draw(st.integers(0, c["bb"] - 1)), 0)
        res = K.hash_pages(pools, c["ids"], checks_for(c, want), engine="triton")
        flagged = np.zeros(c["C"], bool)
        flagged[c["obj"][i]] = True
        np.testing.assert_array_equal(res.mismatched(), flagged)
