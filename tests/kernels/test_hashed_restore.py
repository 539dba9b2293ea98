"""xkv.kernels.prepare_hashed_restore: a verified restore in two passes (copy unchecked, then hash
the pages in the cache; hash-only fragments hashed from the card into the same residuals).

Against the one-pass checked restore (``prepare_restore(checks=...)``) on the same inputs, for
both engines (torch, and Triton interpreted): the same bytes written (poisoned destinations,
hash-only blocks untouched), the same residuals, so the same objects flagged: none on clean
bytes, exactly the object of one flipped card bit, whether the bit lies in a written or in a
hash-only fragment; the same with the copy in layer groups and every layer hashed by one launch
after the last copy (``checksum_pass`` "end"). Bad arguments are refused before anything runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hash_pages import POISON, cases, make_pools, save_words

import xkv.kernels as K
from xkv.layout import PagePool

ENGINES = ["reference", "triton"]


def poisoned_like(c) -> list[PagePool]:
    return [PagePool(torch.full((c["nblocks"] * c["stride"],), POISON, dtype=torch.uint8),
                     c["nblocks"], c["bb"], c["stride"], c["runs"]) for _ in range(c["L"])]


def run_two_pass(c, card, checks, engine, groups=None):
    """Per layer: copy then hash each layer; ``groups`` (a partition of the layers into runs):
    the copy by those groups, then one hash launch over every layer."""
    dst = poisoned_like(c)
    whole = None if groups is None else [list(range(c["L"]))]
    prep = K.prepare_hashed_restore(card, c["offs"], dst, c["ids"], checks, engine=engine,
                                    max_programs=3, hash_programs=2, layer_groups=groups,
                                    hash_groups=whole)
    if groups is None:
        assert len(prep) == c["L"]
        for li in range(c["L"]):
            prep.launch(li)
            prep.launch_check(li)
    else:
        assert len(prep) == len(groups) and len(prep.check) == 1
        for g in range(len(groups)):
            prep.launch(g)
        prep.launch_checks()
    return dst, prep.checks


def partition(data, L):
    """Consecutive runs covering range(L), drawn."""
    cuts = sorted(data.draw(st.sets(st.integers(1, L - 1), max_size=L - 1))) if L > 1 else []
    bounds = [0, *cuts, L]
    return [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def run_one_pass(c, card, checks, engine):
    dst = poisoned_like(c)
    prep = K.prepare_restore(card, c["offs"], dst, c["ids"], engine=engine, checks=checks)
    for li in range(c["L"]):
        prep.launch(li)
    return dst, prep.checks


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=30, deadline=None)
@given(c=cases(), data=st.data())
def test_two_passes_write_and_flag_what_one_pass_does(engine, c, data):
    src_pools = make_pools(c)
    want, card = save_words(c, src_pools)
    ho = np.array(data.draw(st.lists(st.booleans(), min_size=c["n"], max_size=c["n"])),
                  dtype=bool)
    checks = K.Checks(c["obj"], c["page"], c["C"], expected=want, hash_only=ho)
    flip = c["n"] > 0 and data.draw(st.booleans())
    if flip:  # one bit of the card, in a written or a hash-only fragment
        i = data.draw(st.integers(0, c["n"] - 1))
        li = data.draw(st.integers(0, c["L"] - 1))
        at = int(c["offs"][li, i]) + data.draw(st.integers(0, c["bb"] - 1))
        card[at] ^= 1 << data.draw(st.integers(0, 7))
    groups = partition(data, c["L"]) if data.draw(st.booleans()) else None
    two, w2 = run_two_pass(c, card, checks, engine, groups)
    one, w1 = run_one_pass(c, card, checks, "reference")
    for a, b in zip(two, one, strict=True):
        assert torch.equal(a.base, b.base)  # same bytes written, hash-only blocks still poison
    np.testing.assert_array_equal(w2.words.numpy(), w1.words.numpy())
    flagged = np.zeros(c["C"], dtype=bool)
    if flip:
        flagged[c["obj"][i]] = True
    np.testing.assert_array_equal(w2.mismatched(), flagged)
    if not flip:  # the written pages equal their source pages
        for li in range(c["L"]):
            for i in np.flatnonzero(~ho):
                b = int(c["ids"][i])
                s = src_pools[li].base[b * c["stride"]:(b + 1) * c["stride"]]
                d = two[li].base[b * c["stride"]:(b + 1) * c["stride"]]
                for r0, rl in c["runs"]:
                    assert torch.equal(d[r0:r0 + rl], s[r0:r0 + rl])


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=30, deadline=None)
@given(c=cases(), data=st.data())
def test_page_hash_checks_pages_another_path_wrote(engine, c, data):
    """``prepare_page_hash`` (the fan-out's verification): the written fragments are put into the
    cache by a plain unchecked restore (as the all-gather does), hash-only ones stay on the card.
    Same residuals as the one-pass checked restore on clean bytes; one bit flipped in the cache
    after the copy (in a written page) or on the card (in a hash-only fragment) flags exactly
    its object; nothing is written."""
    src_pools = make_pools(c)
    want, card = save_words(c, src_pools)
    ho = np.array(data.draw(st.lists(st.booleans(), min_size=c["n"], max_size=c["n"])),
                  dtype=bool)
    checks = K.Checks(c["obj"], c["page"], c["C"], expected=want, hash_only=ho)
    dst = poisoned_like(c)
    w = np.flatnonzero(~ho)
    K.restore_layers(card, c["offs"][:, w], dst, c["ids"][w], engine="reference")
    flagged = np.zeros(c["C"], dtype=bool)
    if c["n"] and data.draw(st.booleans()):
        i = data.draw(st.integers(0, c["n"] - 1))
        li = data.draw(st.integers(0, c["L"] - 1))
        r0, rl = c["runs"][data.draw(st.integers(0, len(c["runs"]) - 1))]
        if ho[i]:  # on the card
            card[int(c["offs"][li, i]) + data.draw(st.integers(0, c["bb"] - 1))] ^= 1
        else:  # in the cache, after the copy landed
            at = int(c["ids"][i]) * c["stride"] + r0 + data.draw(st.integers(0, rl - 1))
            dst[li].base[at] ^= 1 << data.draw(st.integers(0, 7))
        flagged[c["obj"][i]] = True
    before = [p.base.clone() for p in dst]
    ph = K.prepare_page_hash(card, c["offs"], dst, c["ids"], checks, engine=engine,
                             hash_programs=2)
    for li in range(c["L"]):
        ph.launch(li)
    for a, b in zip(dst, before, strict=True):
        assert torch.equal(a.base, b)  # the hash writes nothing
    np.testing.assert_array_equal(ph.checks.mismatched(), flagged)
    if not flagged.any():
        _, w1 = run_one_pass(c, card, checks, "reference")
        np.testing.assert_array_equal(ph.checks.words.numpy(), w1.words.numpy())


@pytest.mark.parametrize("engine", ENGINES)
def test_only_hash_only_fragments_and_none_at_all(engine):
    L, k, bb, nb = 2, 2, 16, 5
    src = [PagePool(torch.arange(nb * bb, dtype=torch.uint8) + 7 * li, nb, bb, bb, ((0, bb),))
           for li in range(L)]
    ids = np.array([3, 1], dtype=np.int64)
    card = torch.full((L * k * bb,), POISON, dtype=torch.uint8)
    offs = np.array([[(li * k + j) * bb for j in range(k)] for li in range(L)], dtype=np.int64)
    obj, page = np.zeros(2, np.int64), np.arange(2, dtype=np.int64)
    want = K.save_layers(src, ids, card, offs, engine="reference",
                         checks=K.Checks(obj, page, 1)).host_words()
    dst = [PagePool(torch.full((nb * bb,), POISON, dtype=torch.uint8), nb, bb, bb, ((0, bb),))
           for _ in range(L)]
    for ho in (np.ones(2, bool), np.array([False, True])):
        prep = K.prepare_hashed_restore(card, offs, dst, np.where(ho, -1, ids),
                                        K.Checks(obj, page, 1, expected=want, hash_only=ho),
                                        engine=engine)
        for li in range(L):
            prep.launch(li)
            prep.launch_check(li)
        assert not prep.checks.mismatched().any()
    empty = K.prepare_hashed_restore(card, np.zeros((L, 0), np.int64), dst,
                                     np.zeros(0, np.int64),
                                     K.Checks(np.zeros(0, np.int64), np.zeros(0, np.int64), 1,
                                              expected=want), engine=engine)
    for li in range(L):
        empty.launch(li)
        empty.launch_check(li)
    assert empty.checks.mismatched().tolist() == [True]  # an object no page of which was read


def test_bad_arguments_refused_before_anything_runs():
    L, bb, nb = 1, 16, 4
    card = torch.zeros(64, dtype=torch.uint8)
    dst = [PagePool(torch.full((nb * bb,), POISON, dtype=torch.uint8), nb, bb, bb, ((0, bb),))]
    ids, offs = np.array([0, 1]), np.array([[0, 16]])
    obj, page = np.zeros(2, np.int64), np.arange(2, dtype=np.int64)
    exp = np.zeros((L, 1), np.uint32)
    with pytest.raises(ValueError, match="expected words"):
        K.prepare_hashed_restore(card, offs, dst, ids, K.Checks(obj, page, 1))
    with pytest.raises(ValueError, match="written and as hash-only"):
        K.prepare_hashed_restore(card, np.array([[0, 0]]), dst, np.array([0, -1]),
                                 K.Checks(obj, np.zeros(2, np.int64), 1, expected=exp,
                                          hash_only=np.array([False, True])))
    with pytest.raises(ValueError, match="src_offsets"):
        K.prepare_hashed_restore(card, np.array([0, 16]), dst, ids,
                                 K.Checks(obj, page, 1, expected=exp))
    with pytest.raises(ValueError, match="hash_only"):
        K.prepare_hashed_restore(card, offs, dst, ids,
                                 K.Checks(obj, page, 1, expected=exp, hash_only=np.ones(3, bool)))
    with pytest.raises(ValueError):
        K.prepare_hashed_restore(card, offs, dst, np.array([0, 9]),  # block 9 of 4
                                 K.Checks(obj, page, 1, expected=exp))
    assert bool((dst[0].base == POISON).all())


@pytest.mark.gpu
@settings(max_examples=10, deadline=None)
@given(c=cases(), data=st.data())
def test_two_passes_on_the_gpu_with_a_check_stream(c, data):
    """The compiled kernels, pools in HBM, the card pinned, each layer's hash on a second stream
    that waits for that layer's copy (as ``CudaTransferHandler`` runs them): the same bytes and
    residuals as the one-pass kernel; one flipped card bit flags exactly its object."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    src = [PagePool(p.base.cuda(), p.num_blocks, p.block_bytes, p.block_stride, p.runs)
           for p in make_pools(c)]
    want, card = save_words(c, src, "triton")  # the card pinned (pools on CUDA)
    ho = np.array(data.draw(st.lists(st.booleans(), min_size=c["n"], max_size=c["n"])), bool)
    flip = c["n"] > 0 and data.draw(st.booleans())
    if flip:
        i = data.draw(st.integers(0, c["n"] - 1))
        at = int(c["offs"][0, i]) + data.draw(st.integers(0, c["bb"] - 1))
        card[at] ^= 1
    checks = K.Checks(c["obj"], c["page"], c["C"], expected=want, hash_only=ho)

    def dst():
        return [PagePool(torch.full((c["nblocks"] * c["stride"],), POISON, dtype=torch.uint8,
                                    device="cuda"), c["nblocks"], c["bb"], c["stride"], c["runs"])
                for _ in range(c["L"])]

    load, check = torch.cuda.Stream(), torch.cuda.Stream()
    two = dst()
    with torch.cuda.stream(load):
        prep = K.prepare_hashed_restore(card, c["offs"], two, c["ids"], checks, engine="triton")
        for li in range(c["L"]):
            prep.launch(li)
            ev = torch.cuda.Event()
            ev.record(load)
            check.wait_event(ev)
            prep.launch_check(li, check)
    torch.cuda.synchronize()
    one = dst()
    p1 = K.prepare_restore(card, c["offs"], one, c["ids"], engine="triton", checks=checks)
    for li in range(c["L"]):
        p1.launch(li)
    torch.cuda.synchronize()
    for a, b in zip(two, one, strict=True):
        assert torch.equal(a.base, b.base)
    np.testing.assert_array_equal(prep.checks.words.cpu().numpy(), p1.checks.words.cpu().numpy())
    flagged = np.zeros(c["C"], dtype=bool)
    if flip:
        flagged[c["obj"][i]] = True
    np.testing.assert_array_equal(prep.checks.mismatched(), flagged)
