"""Checksums inside the copies (xkv.kernels.verify): the Triton kernel (TRITON_INTERPRET=1) and
the torch engine compute exactly the words of xkv.kernels.checksum (checked against the numpy
statement of the definition on the card bytes), restores flag exactly the objects whose bytes
changed and never a clean one, hash-only fragments are checked and not written, and bad
arguments are refused before anything moves."""

from __future__ import annotations

import checksum_cases
import numpy as np
import pytest
import torch
from checksum_cases import oracle_words
from hypothesis import given, settings
from hypothesis import strategies as st

import xkv.kernels as K
from xkv.kernels import checksum as C
from xkv.layout import PagePool

ENGINES = ["reference", "triton"]
POISON = 0xA5


def cases(max_layers=3):
    """Small pages (12 / 6 words at most), 1-4 objects, 16-byte padded slots."""
    return checksum_cases.cases(max_layers, max_r0=12, max_r1=6, objects=(1, 4), spare=(0, 3),
                                padded=True)


def make_pools(c, seed):
    g = torch.Generator().manual_seed(seed)
    pools, raws = [], []
    for _ in range(c["L"]):
        raw = torch.randint(0, 256, (c["nblocks"] * c["stride"] + 16,), dtype=torch.uint8,
                            generator=g)
        raws.append(raw)
        pools.append(PagePool(raw, c["nblocks"], c["bb"], c["stride"], c["runs"]))
    return pools, raws


def checks_for(c, expected=None, hash_only=None):
    return K.Checks(c["obj"], c["page"], c["C"], expected=expected, hash_only=hash_only)


def saved(c, engine):
    """Save every fragment with checks; returns (pools, raws, card, words)."""
    pools, raws = make_pools(c, c["seed"])
    card = torch.full((c["card_bytes"],), POISON, dtype=torch.uint8)
    w = K.save_layers(pools, c["ids"], card, c["offs"], engine=engine, max_programs=3,
                      checks=checks_for(c))
    return pools, raws, card, w.host_words()


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=40, deadline=None)
@given(c=cases())
def test_save_words_are_the_card_words(engine, c):
    pools, _, card, words = saved(c, engine)
    plain = torch.full_like(card, POISON)
    K.save_layers(pools, c["ids"], plain, c["offs"], engine="reference")
    assert torch.equal(card, plain)  # the verified variant moves the same bytes
    np.testing.assert_array_equal(words, oracle_words(card, c))


@settings(max_examples=25, deadline=None)
@given(c=cases())
def test_triton_and_reference_words_are_identical(c):
    a = saved(c, "triton")[3]
    b = saved(c, "reference")[3]
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=40, deadline=None)
@given(c=cases(), data=st.data())
def test_restore_clean_never_flags_and_corruption_flags_exactly(engine, c, data):
    pools, raws, card, words = saved(c, engine="reference")
    hash_only = np.array(data.draw(st.lists(st.booleans(), min_size=c["n"], max_size=c["n"])))
    dst, draws = make_pools(c, c["seed"] + 1)
    for r in draws:
        r.fill_(POISON)
    before = [r.clone() for r in draws]
    res = K.restore_layers(card, c["offs"], dst, c["ids"], engine=engine, max_programs=2,
                           checks=checks_for(c, words, hash_only))
    assert not res.mismatched().any()
    for li in range(c["L"]):
        for i in range(c["n"]):
            got = dst[li].block(int(c["ids"][i]))
            if hash_only[i]:  # read and hashed, never written
                assert torch.equal(got, torch.full_like(got, POISON))
            else:
                assert torch.equal(got, pools[li].block(int(c["ids"][i])))
    # one bit of one fragment of one layer: exactly that object is flagged
    li = data.draw(st.integers(0, c["L"] - 1))
    i = data.draw(st.integers(0, c["n"] - 1))
    b = data.draw(st.integers(0, 8 * c["bb"] - 1))
    bad = card.clone()
    bad[int(c["offs"][li, i]) + b // 8] ^= 1 << (b % 8)
    for r, r0 in zip(draws, before, strict=True):
        r.copy_(r0)
    res = K.restore_layers(bad, c["offs"], dst, c["ids"], engine=engine, max_programs=2,
                           checks=checks_for(c, words, hash_only))
    want = np.zeros(c["C"], bool)
    want[c["obj"][i]] = True
    np.testing.assert_array_equal(res.mismatched(), want)


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=20, deadline=None)
@given(c=cases(), data=st.data())
def test_prepared_restores_verify_per_layer_and_grouped(engine, c, data):
    _, _, card, words = saved(c, engine="reference")
    li = data.draw(st.integers(0, c["L"] - 1))
    i = data.draw(st.integers(0, c["n"] - 1))
    bad = card.clone()
    bad[int(c["offs"][li, i]) + data.draw(st.integers(0, c["bb"] - 1))] ^= 0x10
    grouped = data.draw(st.booleans())
    groups = [list(range(c["L"]))] if grouped else None
    for src, flagged in ((card, None), (bad, c["obj"][i])):
        dst, _ = make_pools(c, 5)
        prep = K.prepare_restore(src, c["offs"], dst, c["ids"], engine=engine,
                                 layer_groups=groups, checks=checks_for(c, words))
        for g in range(len(prep)):
            prep.launch(g)
        want = np.zeros(c["C"], bool)
        if flagged is not None:
            want[flagged] = True
        resid = prep.checks.readback()  # [L, C] residuals; the flags are reduced on the host
        assert tuple(resid.shape) == (c["L"], c["C"])
        np.testing.assert_array_equal(K.mismatch_flags(resid.numpy()), want)
        np.testing.assert_array_equal(prep.checks.mismatched(), want)


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=20, deadline=None)
@pytest.mark.parametrize("whole", [False, True], ids=["per_layer", "one_group"])
@given(c=cases())
def test_prepared_saves_give_the_same_words(engine, whole, c):
    """Prepared saves, one launch per layer or every layer in one group (``save_mode`` step's
    verified saves), move the reference save's bytes and give its words."""
    pools, _, card, words = saved(c, engine="reference")
    card2 = torch.full_like(card, POISON)
    prep = K.prepare_save(pools, c["ids"], card2, c["offs"], engine=engine, checks=checks_for(c),
                          layer_groups=[list(range(c["L"]))] if whole else None)
    for li in range(len(prep)):
        prep.launch(li)
    assert torch.equal(card2, card)
    np.testing.assert_array_equal(prep.checks.host_words(), words)
    np.testing.assert_array_equal(prep.checks.readback().numpy().view(np.uint32), words)


def _one():
    raw = torch.zeros(4096, dtype=torch.uint8)
    pool = PagePool(raw, 8, 64, 128, ((0, 32), (64, 32)))
    card = torch.zeros(4096, dtype=torch.uint8)
    return pool, card


def test_refusals_name_the_problem():
    pool, card = _one()
    ok = K.Checks([0, 0], [0, 1], 1, expected=np.zeros((1, 1), np.uint32))
    with pytest.raises(ValueError, match="slices"):
        K.restore_slice(card, [0, 64], pool, [0, 1], 0, 10, checks=ok)
    with pytest.raises(ValueError, match="needs checks.expected"):
        K.restore(card, [0, 64], pool, [0, 1], checks=K.Checks([0, 0], [0, 1], 1))
    with pytest.raises(ValueError, match=r"expected must be integer \[1, 1\]"):
        K.restore(card, [0, 64], pool, [0, 1],
                  checks=K.Checks([0, 0], [0, 1], 1, expected=np.zeros((2, 1), np.uint32)))
    with pytest.raises(ValueError, match="objects out of range"):
        K.save(pool, [0, 1], card, [0, 64], checks=K.Checks([0, 1], [0, 1], 1))
    with pytest.raises(ValueError, match=r"objects must have shape \(2,\)"):
        K.save(pool, [0, 1], card, [0, 64], checks=K.Checks([0], [0], 1))
    with pytest.raises(ValueError, match="for restores"):
        K.save(pool, [0, 1], card, [0, 64], checks=ok)
    odd = PagePool(torch.zeros(64, dtype=torch.uint8), 4, 6, 8, ((0, 6),))
    with pytest.raises(ValueError, match="6 bytes is not a multiple of 4"):
        K.save(odd, [0], card, [0], checks=K.Checks([0], [0], 1))
    # nothing moved by any refused call
    assert not card.any() and not pool.base.any()


def test_empty_copies_and_hash_only_ids_are_ignored():
    pool, card = _one()
    w = K.save(pool, [], card, [], checks=K.Checks([], [], 0))
    assert w.host_words().shape == (1, 0)
    card[:128] = torch.arange(128, dtype=torch.uint8)
    words = K.save(pool, [0, 1], torch.zeros(4096, dtype=torch.uint8), [0, 64],
                   checks=K.Checks([0, 0], [0, 1], 1)).host_words()
    before = pool.base.clone()
    # block id 99 does not exist: a hash-only fragment's id is never used
    res = K.restore(card, [0, 64], pool, [99, 3],
                    checks=K.Checks([0, 0], [0, 1], 1, expected=np.array([[C.words_numpy(
                        card[:128].numpy().tobytes())]], np.uint32),
                        hash_only=np.array([True, False])))
    assert not res.mismatched().any()
    assert torch.equal(pool.block(3), card[64:128])
    assert torch.equal(pool.base[:3 * 128], before[:3 * 128])
    with pytest.raises(ValueError, match="block_ids out of range"):
        K.restore(card, [0, 64], pool, [99, 3], checks=K.Checks(
            [0, 0], [0, 1], 1, expected=np.zeros((1, 1), np.uint32)))
    assert words.shape == (1, 1)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_page_read_into_two_blocks_is_hashed_once(engine):
    """A state read into its boundary and its running block: one object, page 0 twice."""
    raw = torch.randint(0, 256, (8 * 64,), dtype=torch.uint8, generator=torch.Generator()
                        .manual_seed(3))
    pool = PagePool(raw, 8, 64, 64, ((0, 64),))
    card = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    exp = np.array([[C.words_numpy(card[128:192].numpy().tobytes())]], np.uint32)
    res = K.restore(card, [128, 128], pool, [2, 5], engine=engine,
                    checks=K.Checks([0, 0], [0, 0], 1, expected=exp))
    assert not res.mismatched().any()
    assert torch.equal(pool.block(2), card[128:192]) and torch.equal(pool.block(5), card[128:192])
    card[130] ^= 1
    res = K.restore(card, [128, 128], pool, [2, 5], engine=engine,
                    checks=K.Checks([0, 0], [0, 0], 1, expected=exp))
    assert res.mismatched().all()


def _dma(flat, f, slot, o, z, to_slot):
    if to_slot:
        slot[o : o + z] = flat[f : f + z]
    else:
        flat[f : f + z] = slot[o : o + z]


@settings(max_examples=20, deadline=None)
@given(c=cases(), chunk=st.integers(1, 400), data=st.data())
def test_staged_engine_hashes_its_slot(c, chunk, data):
    """The staged pipeline (copy engine replaced by plain copies on CPU, kernel interpreted),
    in chunks that split layers: the same words as the reference save, and restores flag
    exactly the corrupted object."""
    from xkv.kernels import staged
    from xkv.kernels.jobs import build_job, offsets_arg

    pools, _, card, words = saved(c, "reference")
    mp = pytest.MonkeyPatch()
    mp.setattr(staged, "STAGED_MIN_CHUNK", chunk)
    mp.setattr(staged, "STAGED_MAX_CHUNK", chunk)
    try:
        card2 = torch.full_like(card, POISON)
        job = build_job(pools, c["ids"], card2, offsets_arg(c["offs"], c["L"], "o"), save=True,
                        checks=checks_for(c))
        staged.run(job, 2, dma=_dma)
        assert torch.equal(card2, card)
        np.testing.assert_array_equal(job.checks.buf.host_words(), words)
        li = data.draw(st.integers(0, c["L"] - 1))
        i = data.draw(st.integers(0, c["n"] - 1))
        bad = card.clone()
        bad[int(c["offs"][li, i]) + data.draw(st.integers(0, c["bb"] - 1))] ^= 0x40
        for src, flagged in ((card, None), (bad, c["obj"][i])):
            dst, _ = make_pools(c, 9)
            job = build_job(dst, c["ids"], src, offsets_arg(c["offs"], c["L"], "o"),
                            save=False, checks=checks_for(c, words))
            staged.run(job, 2, dma=_dma)
            want = np.zeros(c["C"], bool)
            if flagged is not None:
                want[flagged] = True
            np.testing.assert_array_equal(job.checks.buf.mismatched(), want)
    finally:
        mp.undo()


@pytest.mark.gpu
@settings(max_examples=30, deadline=None)
@given(c=cases(), data=st.data())
def test_compiled_kernel_on_the_gpu(c, data):
    """The compiled CHECK variant (pools in HBM, the card in pinned host memory): the words of
    the reference engine on CPU copies, and exact flags."""
    pools, _, card_ref, words = saved(c, "reference")
    gpools = [PagePool(p.base.cuda(), p.num_blocks, p.block_bytes, p.block_stride, p.runs)
              for p in pools]
    card = torch.full((c["card_bytes"],), POISON, dtype=torch.uint8).pin_memory()
    w = K.save_layers(gpools, c["ids"], card, c["offs"], engine="triton", checks=checks_for(c))
    torch.cuda.synchronize()
    assert torch.equal(card, card_ref)
    np.testing.assert_array_equal(w.host_words(), words)
    li = data.draw(st.integers(0, c["L"] - 1))
    i = data.draw(st.integers(0, c["n"] - 1))
    for flip in (False, True):
        if flip:
            card[int(c["offs"][li, i]) + data.draw(st.integers(0, c["bb"] - 1))] ^= 0x02
        dst = [PagePool(torch.full_like(p.base, POISON), p.num_blocks, p.block_bytes,
                        p.block_stride, p.runs) for p in gpools]
        prep = K.prepare_restore(card, c["offs"], dst, c["ids"], engine="triton",
                                 checks=checks_for(c, words))
        for g in range(len(prep)):
            prep.launch(g)
        want = np.zeros(c["C"], bool)
        if flip:
            want[c["obj"][i]] = True
        np.testing.assert_array_equal(prep.checks.mismatched(), want)


@pytest.mark.parametrize("engine", ENGINES)
def test_unaligned_verified_copies_run_the_torch_engine(engine):
    """A page whose runs, address or card offset are not 4-byte aligned (its size is a multiple
    of 4): the kernel cannot hash it, the torch engine does, with the words of the definition
    (runs of 2 and 6 bytes hashed as one page)."""
    raw = torch.randint(0, 256, (2 + 5 * 12,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(4))
    pool = PagePool(raw[2:], 5, 8, 12, ((0, 2), (4, 6)))  # address 2 mod 4, odd runs
    card = torch.full((64,), POISON, dtype=torch.uint8)
    w = K.save(pool, [3, 1], card, [6, 14], engine=engine, checks=K.Checks([0, 0], [0, 1], 1))
    assert torch.equal(card[6:14], pool.block(3)) and torch.equal(card[14:22], pool.block(1))
    want = C.words_numpy(card[6:22].numpy().tobytes())
    assert w.host_words().tolist() == [[want]]
    dst = PagePool(torch.zeros(62, dtype=torch.uint8)[2:], 5, 8, 12, ((0, 2), (4, 6)))
    card[9] ^= 4
    res = K.restore(card, [6, 14], dst, [0, 2], engine=engine,
                    checks=K.Checks([0, 0], [0, 1], 1, expected=np.array([[want]], np.uint32)))
    assert res.mismatched().tolist() == [True]


@pytest.mark.parametrize("whole_first", [True, False])
def test_layer_checks_taken_before_the_bind_share_its_buffer(whole_first):
    """A layer's (or a chunk's) checks taken from a job before its word buffer is bound add
    their terms into the job's one buffer, whichever binds first: a copy built before the bind
    is still verified (a part with a buffer of its own would leave the job's at -expected, or
    its terms nowhere)."""
    from xkv.kernels.jobs import build_job, offsets_arg

    pools = [PagePool(torch.zeros(4 * 64, dtype=torch.uint8), 4, 64, 64, ((0, 64),))
             for _ in range(2)]
    card = torch.zeros(1024, dtype=torch.uint8)
    checks = K.Checks(np.array([0, 1]), np.array([0, 0]), 2,
                      expected=np.zeros((2, 2), np.uint32))
    job = build_job(pools, np.array([0, 1]), card,
                    offsets_arg(np.array([[0, 64], [128, 192]]), 2, "o"), save=False,
                    checks=checks)
    parts = [job.layer(1).checks, job.checks.select([0], 0, 1)]
    if whole_first:
        whole = job.checks.bind(torch.device("cpu"), False)
        assert all(p.bind(torch.device("cpu"), False) is whole for p in parts)
    else:
        first = parts[0].bind(torch.device("cpu"), False)
        assert job.checks.bind(torch.device("cpu"), False) is first
        assert parts[1].bind(torch.device("cpu"), False) is first


def test_mismatch_flags_reduce_layers_on_the_host():
    w = np.array([[0, 5, 0, 0], [0, 0, 0, 7], [0, 0, 0, 0]], dtype=np.int32)
    assert K.mismatch_flags(w).tolist() == [False, True, False, True]
    assert K.mismatch_flags(np.zeros((0, 3), np.int32)).tolist() == [False] * 3
    with pytest.raises(ValueError, match=r"expected \[L, C\] words, got shape \(4,\)"):
        K.mismatch_flags(np.zeros(4, np.int32))


def test_readback_runs_no_kernel_on_the_words(monkeypatch):
    """A restore's readback is the words themselves (a copy, no torch reduction whose CUDA
    kernel would load on first use mid-step): on CPU, the same tensor values, not a reduction."""
    from xkv.kernels.verify import CheckWords

    cw = CheckWords(np.array([[1, 0], [0, 0]], np.uint32), torch.device("cpu"), save=False)
    monkeypatch.setattr(torch.Tensor, "any", lambda *a, **k: pytest.fail("reduced on device"))
    out = cw.readback()
    assert out.shape == (2, 2) and K.mismatch_flags(out.numpy()).tolist() == [True, False]


@pytest.mark.parametrize("split", [2, 8, 64])
@settings(max_examples=15, deadline=None)
@given(c=cases(), data=st.data())
def test_split_partial_sums_give_the_same_words_and_flags(split, c, data):
    """``XKV_CHECK_SPLIT`` (the kernel's SPLIT partial sums per row, each added atomically):
    the saved words equal the oracle's, a clean restore flags nothing and a flipped bit flags
    exactly its object, as with one whole-row sum (split capped at the tile's columns)."""
    from xkv.kernels import _launch

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_launch, "CHECK_SPLIT", split)
        pools, _, card, words = saved(c, "triton")
        np.testing.assert_array_equal(words, oracle_words(card, c))
        keep = np.zeros(c["n"], bool)
        dst, _ = make_pools(c, c["seed"] + 1)
        res = K.restore_layers(card, c["offs"], dst, c["ids"], engine="triton", max_programs=2,
                               checks=checks_for(c, words, keep))
        assert not res.mismatched().any()
        li = data.draw(st.integers(0, c["L"] - 1))
        i = data.draw(st.integers(0, c["n"] - 1))
        b = data.draw(st.integers(0, 8 * c["bb"] - 1))
        bad = card.clone()
        bad[int(c["offs"][li, i]) + b // 8] ^= 1 << (b % 8)
        res = K.restore_layers(bad, c["offs"], dst, c["ids"], engine="triton", max_programs=2,
                               checks=checks_for(c, words, keep))
        want = np.zeros(c["C"], bool)
        want[c["obj"][i]] = True
        np.testing.assert_array_equal(res.mismatched(), want)
