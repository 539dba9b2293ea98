"""Prepared staged restores (xkv.kernels.staged_restore): chunking, slot assignment, and the bytes.

On CPU the copy engine is a byte copy (``dma``) and the unpack the interpreted Triton kernel over
the ring: every chunk's tables come from one upload. Bytes are compared with the oracle on
poisoned pages, layer groups and chunk sizes drawn so that chunks split layers, span several
whole layers and wrap the ring many times; verified restores flag exactly the corrupted object.
The ``gpu`` test runs hundreds of chunks through the real copy stream and events.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_buffers import gpu_and_cpu
from hypothesis import given, settings
from hypothesis import strategies as st
from pools import (
    POISON,
    Geometry,
    layer_jobs,
    layers_buffer_size,
    oracle,
    pools_over,
    random_bytes,
)
from test_verify import cases, checks_for, make_pools, saved

import xkv.kernels as K
from xkv.kernels import staged_restore
from xkv.kernels.jobs import build_job, offsets_arg
from xkv.kernels.ring import Ring


def _dma(flat, f, ring_buf, o, z):
    ring_buf[o : o + z] = flat[f : f + z]


def _groups(draw, L):
    """Runs of consecutive layers covering range(L) (or None: one per layer)."""
    if draw(st.booleans()):
        return None
    cuts = sorted(draw(st.sets(st.integers(1, max(1, L - 1)), max_size=L - 1))) if L > 1 else []
    edges = [0, *[c for c in cuts if c < L], L]
    return [list(range(a, b)) for a, b in zip(edges, edges[1:], strict=False) if b > a]


def test_chunks_split_layers_or_take_several():
    assert staged_restore.chunks([0, 1, 2], 8, 100, 300) == [
        ([0], 0, 3), ([0], 3, 6), ([0], 6, 8), ([1], 0, 3), ([1], 3, 6), ([1], 6, 8),
        ([2], 0, 3), ([2], 3, 6), ([2], 6, 8)]
    assert staged_restore.chunks([4, 5, 6], 8, 100, 1700) == [([4, 5], 0, 8), ([6], 0, 8)]
    assert staged_restore.chunks([0], 8, 100, 50) == [([0], i, i + 1) for i in range(8)]
    assert staged_restore.chunks([], 8, 100, 300) == []
    assert staged_restore.chunks([0, 1], 0, 100, 300) == []


@settings(max_examples=60, deadline=None)
@given(job=layer_jobs(save=False), seed=st.integers(0, 2**16), chunk=st.integers(1, 3000),
       slots=st.integers(1, 4), data=st.data())
def test_prepared_staged_restore_moves_the_bytes(job, seed, chunk, slots, data):
    geoms, offsets, ids, offs, flat_size = job
    size = layers_buffer_size(geoms, offsets)
    raw = torch.full((size,), POISON, dtype=torch.uint8)
    flat = random_bytes(flat_size, seed)
    pools = pools_over(raw, geoms, offsets)
    expect = raw.clone()
    oracle(expect, pools_over(expect, geoms, offsets), flat.clone(), offs, ids, save=False)
    bb = pools[0].block_bytes
    ring = Ring(torch.device("cpu"), max(bb, chunk) + data.draw(st.integers(0, 64)), slots)
    ring.buf.fill_(0x5A)
    groups = _groups(data.draw, len(pools))
    j = build_job(pools, ids, flat, offsets_arg(offs, len(pools), "offsets"), save=False)
    calls = staged_restore.prepare(j, 2, groups, dma=_dma, chunk_bytes=chunk, the_ring=ring)
    assert len(calls) == (len(pools) if groups is None else len(groups))
    if data.draw(st.booleans()):  # a group may be launched again: the same bytes
        calls[0]()
    for call in calls:
        call()
    assert torch.equal(raw, expect)


def test_slots_are_taken_in_turn_and_pages_must_fit():
    g = Geometry(8, 100, ((0, 100),))
    raw = torch.full((3 * 800 + 11,), POISON, dtype=torch.uint8)
    pools = pools_over(raw, [g] * 3, [0, 800, 1600])
    flat = random_bytes(2400, 3)
    offs = (np.arange(24, dtype=np.int64) * 100).reshape(3, 8)
    j = build_job(pools, np.arange(8), flat, offsets_arg(offs, 3, "o"), save=False)
    seen = []

    def dma(flat, f, ring_buf, o, z):
        seen.append(o // ring.slot_bytes)
        _dma(flat, f, ring_buf, o, z)

    ring = Ring(torch.device("cpu"), 300, 2)
    for c in staged_restore.prepare(j, 2, [[0, 1, 2]], dma=dma, chunk_bytes=300, the_ring=ring):
        c()
    # 9 chunks of at most 3 pages, contiguous in the card: one copy each, slots 0, 1, 0, 1, ...
    assert seen == [k % 2 for k in range(9)]
    expect = raw.clone()
    oracle(expect, pools_over(expect, [g] * 3, [0, 800, 1600]), flat, offs, np.arange(8),
           save=False)
    assert torch.equal(raw, expect)
    with pytest.raises(ValueError, match="does not fit"):
        staged_restore.prepare(j, 2, None, dma=dma, the_ring=Ring(torch.device("cpu"), 48, 2))
    with pytest.raises(ValueError, match="consecutive"):
        staged_restore.prepare(j, 2, [[0, 2], [1]], dma=dma, the_ring=ring)
    with pytest.raises(ValueError, match="consecutive"):
        staged_restore.prepare(j, 2, [[0, 1]], dma=dma, the_ring=ring)
    sj = build_job(pools, np.arange(8), flat, offsets_arg(offs, 3, "o"), save=True)
    with pytest.raises(ValueError, match="whole restores"):
        staged_restore.prepare(sj, 2, None, dma=dma, the_ring=ring)


def test_the_unpack_tables_are_built_once_after_the_first_copy(monkeypatch):
    """``prepare`` builds no unpack table; issuing builds them all once, right after the first
    chunk's copy was queued (the copy engine moves it meanwhile), before the second's."""
    g = Geometry(8, 100, ((0, 100),))
    raw = torch.full((3 * 800 + 11,), POISON, dtype=torch.uint8)
    pools = pools_over(raw, [g] * 3, [0, 800, 1600])
    flat = random_bytes(2400, 5)
    offs = (np.arange(24, dtype=np.int64) * 100).reshape(3, 8)[:, ::-1].copy()
    j = build_job(pools, np.arange(8), flat, offsets_arg(offs, 3, "o"), save=False)
    events = []
    build = staged_restore._unpacks

    def unpacks(*a, **k):
        events.append("tables")
        return build(*a, **k)

    monkeypatch.setattr(staged_restore, "_unpacks", unpacks)

    def dma(flat_, f, ring_buf, o, z):
        events.append(("copy", o // ring.slot_bytes))
        _dma(flat_, f, ring_buf, o, z)

    ring = Ring(torch.device("cpu"), 300, 2)
    calls = staged_restore.prepare(j, 2, [[0], [1, 2]], dma=dma, chunk_bytes=300, the_ring=ring)
    assert events == []
    for c in calls:
        c()
    assert events.count("tables") == 1
    assert events.index("tables") == 1 and events[0] == ("copy", 0) and events[2] == ("copy", 1)
    expect = raw.clone()
    oracle(expect, pools_over(expect, [g] * 3, [0, 800, 1600]), flat, offs, np.arange(8),
           save=False)
    assert torch.equal(raw, expect)


def test_empty_restores_issue_nothing():
    g = Geometry(8, 100, ((0, 100),))
    raw = torch.full((811,), POISON, dtype=torch.uint8)
    j = build_job(pools_over(raw, [g], [0]), np.zeros(0, np.int64),
                  torch.zeros(10, dtype=torch.uint8), offsets_arg(np.zeros((1, 0), np.int64), 1,
                                                                  "o"), save=False)
    calls = staged_restore.prepare(j, 2, None, dma=None, the_ring=Ring(torch.device("cpu"), 64))
    assert len(calls) == 1
    calls[0]()
    assert (raw == POISON).all()


def test_group_chunks_take_every_layer_of_whole_objects():
    # 4 layers x 40 fragments of 100 bytes, chunks of 1000 bytes (10 pages), objects of 2 pages
    assert staged_restore.group_chunks([0, 1, 2, 3], 40, 100, 1000, 2) == [
        ([0, 1, 2, 3], i, i + 2) for i in range(0, 40, 2)]
    # an object's 3 pages of all 4 layers exceed a chunk of 8 pages: runs of 8 // 3 = 2 layers,
    # each chunk one whole object of each (the old rule cut 2 pages of every layer: 4 ranges)
    assert staged_restore.group_chunks([5, 6, 7, 8], 9, 100, 800, 3) == [
        ([5, 6], i, i + 3) for i in (0, 3, 6)] + [([7, 8], i, i + 3) for i in (0, 3, 6)]
    # every fragment of a layer fits a chunk but the group does not (the MLA model's 4k restore,
    # 8 layers of 256 pages of 18 KiB, 9 MiB chunks): slices of whole objects of every layer,
    # not chunks of 2 whole layers that cut each object at every second layer
    got = staged_restore.group_chunks(list(range(8)), 256, 18432, 9437184, 16)
    assert got == [(list(range(8)), i, i + 64) for i in range(0, 256, 64)]
    # a 32k-token Llama-3-8B restore as one group (XKV_LOAD_GROUPS=whole): 32 layers of 64 KiB
    # pages, objects of 16 pages, 16 MiB slots: runs of 16 layers, one object per chunk
    got = staged_restore.group_chunks(list(range(32)), 2048, 65536, 16 << 20, 16)
    assert got == [(list(range(a, a + 16)), i, i + 16) for a in (0, 16) for i in range(0, 2048, 16)]
    # a layer's pages contiguous beyond a chunk (align >= a chunk's pages), one layer, a whole
    # group in one chunk, a page per layer not fitting: the per-layer rule
    for args in (([0, 1, 2], 8, 100, 300, 8), ([0], 40, 100, 1000, 2),
                 ([0, 1], 4, 100, 1000, 2), ([0, 1, 2, 3], 40, 100, 300, 2)):
        assert staged_restore.group_chunks(*args) == staged_restore.chunks(*args[:4])
    assert staged_restore.group_chunks([0, 1], 0, 100, 300, 1) == []


def test_object_run_and_card_order():
    assert staged_restore.object_run(np.array([0, 100, 200, 900, 1000, 5000], np.int64), 100) == 3
    assert staged_restore.object_run(np.array([7], np.int64), 100) == 1
    assert staged_restore.object_run(np.array([500, 0], np.int64), 100) == 1
    flat = np.array([30, 10, 20, 5, 0, 40], np.int64)
    chunk = np.array([1, 1, 0, 0, 1, 0], np.int64)
    np.testing.assert_array_equal(staged_restore.card_order(flat, chunk), [3, 2, 5, 4, 1, 0])
    big = np.array([1 << 61, 3, 1 << 61], np.int64)  # keys would overflow int64: lexsort
    np.testing.assert_array_equal(staged_restore.card_order(big, np.array([2, 2, 1])), [2, 1, 0])


@settings(max_examples=40, deadline=None)
@given(L=st.integers(2, 6), k=st.integers(1, 5), objs=st.integers(1, 7), first=st.integers(0, 4),
       pages=st.integers(1, 40), grouped=st.booleans(), seed=st.integers(0, 2**16),
       data=st.data())
def test_a_card_of_layer_major_objects_restores_in_one_range_per_object(
        L, k, objs, first, pages, grouped, seed, data):
    """The layout stored objects have (an object holds its layers one after another, objects
    anywhere in the card), restored in a light step's layer group (all layers, or one group per
    layer): bytes equal the oracle's on poisoned pages, and a chunk of every layer of whole
    objects is ONE copy-engine range per object (card order in the slot) where a ring laid out
    layer by layer needed one per layer and object."""
    bb, first = 100, first % k
    n = objs * k - first  # the first object restored from page ``first`` (a partial first one)
    g = Geometry(n + 3, bb + 20, ((0, 60), (80, 40)))  # two runs per page, gaps between pages
    offsets = [i * (g.extent + 13) for i in range(L)]
    raw = torch.full((layers_buffer_size([g] * L, offsets),), POISON, dtype=torch.uint8)
    pools = pools_over(raw, [g] * L, offsets)
    rng = np.random.default_rng(seed)
    # objects scattered in the card, never adjacent (a gap of one page after each)
    obj_at = rng.permutation(objs + 2)[:objs] * ((L * k + 1) * bb)
    j = np.arange(n) + first
    offs = np.stack([obj_at[j // k] + layer * k * bb + (j % k) * bb for layer in range(L)])
    flat = random_bytes(int((objs + 2) * (L * k + 1) * bb), seed)
    ids = rng.permutation(n + 3)[:n]
    expect = raw.clone()
    oracle(expect, pools_over(expect, [g] * L, offsets), flat.clone(), offs, ids, save=False)
    copies = []

    def dma(flat_, f, ring_buf, o, z):
        copies.append(z)
        _dma(flat_, f, ring_buf, o, z)

    chunk = pages * bb
    ring = Ring(torch.device("cpu"), max(bb, chunk), data.draw(st.integers(1, 3)))
    job = build_job(pools, ids, flat, offsets_arg(offs, L, "o"), save=False)
    groups = [list(range(L))] if grouped else None
    for call in staged_restore.prepare(job, 2, groups, dma=dma, chunk_bytes=chunk, the_ring=ring):
        call()
    assert torch.equal(raw, expect)
    assert sum(copies) == L * n * bb
    # per chunk and object: its layers' pages of a whole object are one range, of part of an
    # object one range per layer (the layers' pages are not adjacent then)
    run = staged_restore.object_run(offs[0], bb)
    todo = ([c for layer in range(L) for c in staged_restore.group_chunks([layer], n, bb, chunk, run)]
            if not grouped else staged_restore.group_chunks(list(range(L)), n, bb, chunk, run))
    want = 0
    for ls, i0, i1 in todo:
        per_obj: dict[int, int] = {}
        for i in range(i0, i1):
            per_obj[(i + first) // k] = per_obj.get((i + first) // k, 0) + 1
        want += sum(1 if p == k else len(ls) for p in per_obj.values())
    assert len(copies) == want


@settings(max_examples=20, deadline=None)
@given(c=cases(), chunk=st.integers(1, 400), data=st.data())
def test_verified_staged_restore_hashes_the_slot(c, chunk, data):
    """The unpack hashes what the copy brought into the slot: clean never flags, a flipped card
    byte flags exactly its object; written pages equal the card's."""
    pools, _, card, words = saved(c, "reference")
    li = data.draw(st.integers(0, c["L"] - 1))
    i = data.draw(st.integers(0, c["n"] - 1))
    bad = card.clone()
    bad[int(c["offs"][li, i]) + data.draw(st.integers(0, c["bb"] - 1))] ^= 0x40
    groups = _groups(data.draw, c["L"])
    for src, flagged in ((card, None), (bad, c["obj"][i])):
        dst, _ = make_pools(c, 9)
        job = build_job(dst, c["ids"], src, offsets_arg(c["offs"], c["L"], "o"), save=False,
                        checks=checks_for(c, words))
        ring = Ring(torch.device("cpu"), max(c["bb"], chunk) + 16, 2)
        for call in staged_restore.prepare(job, 2, groups, dma=_dma, chunk_bytes=chunk,
                                           the_ring=ring):
            call()
        want = np.zeros(c["C"], bool)
        if flagged is not None:
            want[flagged] = True
        np.testing.assert_array_equal(job.checks.buf.mismatched(), want)
        if flagged is None:
            ref, _ = make_pools(c, 9)
            K.restore_layers(card, c["offs"], ref, c["ids"], engine="reference")
            for a, b in zip(dst, ref, strict=True):
                assert torch.equal(a.base, b.base)


@pytest.mark.gpu
@pytest.mark.parametrize("pages,shuffled", [(3, False), (12, True)])
def test_prepared_staged_restore_on_the_gpu(pages, shuffled):
    """Hundreds of chunks through a small ring with the real copy stream (a few plain copies
    per chunk, or one batch of 12 scattered pages), across a break in the card's contiguity and
    in layer groups: slot reuse waits for the unpack on the GPU."""
    g = Geometry(4000, 4096, ((0, 4096),))
    rng = np.random.default_rng(1)
    ids = rng.permutation(g.num_blocks)[:3000]
    offs = np.arange(3000, dtype=np.int64) * 4096
    if shuffled:
        offs = rng.permutation(offs)
    offs[1000:] += 64  # a break in the contiguous run
    data = random_bytes(int(offs.max()) + 4096, 10)
    raw_cpu, pool_cpu, raw_gpu, pool_gpu = gpu_and_cpu(g, 11, fill=POISON)
    oracle(raw_cpu, [pool_cpu], data, offs[None], ids, save=False)
    job = build_job([pool_gpu], ids, data.pin_memory(), offsets_arg(offs, 1, "o"), save=False)
    ring = Ring(pool_gpu.device, pages * 4096, 3)
    for call in staged_restore.prepare(job, 4, None, chunk_bytes=pages * 4096, the_ring=ring):
        call()
    torch.cuda.synchronize()
    assert torch.equal(raw_gpu.cpu(), raw_cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("page,k,first", [(18432, 16, 5), (65536, 16, 0), (4096, 3, 2)])
def test_layer_major_objects_through_the_ring_on_the_gpu(page, k, first):
    """A light step's layer groups (16 layers: 8, 4, 2, 1, 1) restored through the real copy
    engine and ring from a pinned card laid out as stored objects are (layer-major, scattered, a
    partial first object): chunks of every layer of whole objects, one range each, equal the
    oracle's bytes on poisoned pages (MLA's 18 KiB pages, the Llama shape's 64 KiB, small ones)."""
    from xkv.connector.light_steps import load_layer_groups

    L, objs = 16, 40
    n = objs * k - first
    g = Geometry(n + 5, page, ((0, page),))
    offsets = [i * (g.extent + 256) for i in range(L)]
    size = layers_buffer_size([g] * L, offsets)
    rng = np.random.default_rng(3)
    obj_at = rng.permutation(objs + 3)[:objs] * ((L * k + 1) * page)
    j = np.arange(n) + first
    offs = np.stack([obj_at[j // k] + layer * k * page + (j % k) * page for layer in range(L)])
    flat = random_bytes(int((objs + 3) * (L * k + 1) * page), 12)
    ids = rng.permutation(n + 5)[:n]
    raw_cpu = torch.full((size,), POISON, dtype=torch.uint8)
    oracle(raw_cpu, pools_over(raw_cpu, [g] * L, offsets), flat, offs, ids, save=False)
    raw_gpu = torch.full((size,), POISON, dtype=torch.uint8, device="cuda")
    job = build_job(pools_over(raw_gpu, [g] * L, offsets), ids, flat.pin_memory(),
                    offsets_arg(offs, L, "o"), save=False)
    ring = Ring(raw_gpu.device, 16 << 20, 3)
    for call in staged_restore.prepare(job, 32, load_layer_groups(L), the_ring=ring):
        call()
    torch.cuda.synchronize()
    assert torch.equal(raw_gpu.cpu(), raw_cpu)


@settings(max_examples=30, deadline=None)
@given(c=cases(max_layers=4), chunk=st.integers(1, 400), checked=st.booleans(), data=st.data())
def test_every_table_slice_a_launch_gets_is_16_byte_aligned(c, chunk, checked, data):
    """The kernel's variants assume 16-byte aligned tables (``_launch.variant_key``): a chunk's
    slice of the shared upload at an odd int64 index would be another Triton variant, compiled
    mid-serving (the H100 of stop 40: 290 ms in a first restore, a checked layer's word rows
    sliced at an odd layer). Odd layer counts, fragment counts and chunk sizes."""
    from xkv.kernels import _launch

    pools, _, card, words = saved(c, "reference")
    seen = []
    real = _launch.Launch.__call__

    def check(self):
        seen.append([a.data_ptr() % 16 for a in self.args[2:9]])
        real(self)

    dst, _ = make_pools(c, 9)
    job = build_job(dst, c["ids"], card, offsets_arg(c["offs"], c["L"], "o"), save=False,
                    checks=checks_for(c, words) if checked else None)
    ring = Ring(torch.device("cpu"), max(c["bb"], chunk) + 16, 3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_launch.Launch, "__call__", check)
        for call in staged_restore.prepare(job, 2, _groups(data.draw, c["L"]), dma=_dma,
                                           chunk_bytes=chunk, the_ring=ring):
            call()
    assert seen and all(r == [0] * 7 for r in seen), seen


def test_reserve_needs_cuda():
    from xkv.kernels import ring

    assert ring.reserve(torch.device("cpu")) is None


@pytest.mark.gpu
def test_auto_restores_large_copies_through_the_reserved_ring():
    """``engine="auto"`` takes the staged path for a restore of >= 8 MiB from pinned memory (and
    the Triton kernel below that); the worker's ``reserve_staging`` ring is the one it uses, so
    the first restore allocates no ring."""
    from xkv.kernels import ring, ring_choice

    ring_choice.set_choice(None, "cuda")  # unprobed: the ring (test_ring_choice.py: a probe's verdict)
    r = K.reserve_staging(torch.device("cuda"))
    g = Geometry(300, 65536, ((0, 32768), (32768, 32768)))
    ids = np.random.default_rng(2).permutation(g.num_blocks)[:200]
    offs = (np.arange(2 * 200, dtype=np.int64) * 65536).reshape(2, 200)
    data = random_bytes(2 * 200 * 65536, 12).pin_memory()
    pools, expect = [], []
    for k in range(2):
        raw_cpu, pool_cpu, raw_gpu, pool_gpu = gpu_and_cpu(g, 20 + k, fill=POISON)
        oracle(raw_cpu, [pool_cpu], data, offs[k : k + 1], ids, save=False)
        pools.append((raw_gpu, pool_gpu))
        expect.append(raw_cpu)
    prep = K.prepare_restore(data, offs, [p for _, p in pools], ids)
    assert prep.engines == ("staged", "staged")
    for k in range(len(prep)):
        prep.launch(k)
    torch.cuda.synchronize()
    assert ring.ring(torch.device("cuda")) is r
    for (raw_gpu, _), want in zip(pools, expect, strict=True):
        assert torch.equal(raw_gpu.cpu(), want)
    small = K.prepare_restore(data, offs[:, :8], [p for _, p in pools], ids[:8])
    assert small.engines == ("triton", "triton")


def test_auto_prefers_the_ring_for_large_restores_from_host_memory(monkeypatch):
    """``staged_restore.preferred`` (``engine="auto"``): CUDA pages, a host card, a whole
    restore of >= 8 MiB of pages up to a slot, the batch copy available, no calibration; any one
    condition missing keeps the Triton kernel. The job is a stand-in (no GPU here)."""
    from types import SimpleNamespace as NS

    from xkv.kernels import copy_engine, staged

    monkeypatch.setattr(copy_engine, "available", lambda: True)
    monkeypatch.setattr(staged_restore, "calibration", lambda dev: None)
    monkeypatch.setattr(staged_restore, "takes_ring", lambda dev, nbytes: True)  # test_ring_choice.py
    cuda, cpu = NS(type="cuda"), NS(type="cpu")

    def job(L=32, n=128, bb=65536, dev=cuda, flat=cpu, save=False, sliced=False):
        return NS(save=save, sliced=sliced, pools=[NS(device=dev)] * L, n=n, block_bytes=bb,
                  flat=NS(device=flat))

    assert staged_restore.preferred(job())
    assert staged_restore.preferred(job(L=1, n=staged.STAGED_MIN_BYTES // 65536))
    assert not staged_restore.preferred(job(L=1, n=staged.STAGED_MIN_BYTES // 65536 - 1))
    assert staged_restore.preferred(job(L=1, n=1, bb=staged_restore.MAX_PAGE_BYTES))
    assert not staged_restore.preferred(job(L=1, n=1, bb=staged_restore.MAX_PAGE_BYTES + 16))
    for bad in (dict(dev=cpu), dict(flat=cuda), dict(save=True), dict(sliced=True), dict(n=0),
                dict(L=0)):
        assert not staged_restore.preferred(job(**bad)), bad
    monkeypatch.setattr(staged_restore, "calibration", lambda dev: object())
    assert not staged_restore.preferred(job())
    monkeypatch.setattr(staged_restore, "calibration", lambda dev: None)
    monkeypatch.setattr(copy_engine, "available", lambda: False)
    assert not staged_restore.preferred(job())


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_absolute_ranges_equal_a_split_per_chunk(data):
    """The plan's one vectorised pass (``absolute_ranges``) gives every chunk exactly what the
    per-chunk conversion and ``host.split_at`` gave before it (the copy engine's input on CUDA):
    chunks of 1-6 ranges, registration boundaries inside, at the edges of and outside the
    ranges, none at all."""
    from xkv.kernels import host

    n_chunks = data.draw(st.integers(0, 6))
    ranges = []
    for _ in range(n_chunks):
        m = data.draw(st.integers(1, 6))
        z = np.array(data.draw(st.lists(st.integers(1, 5000), min_size=m, max_size=m)), np.int64)
        f = np.array(data.draw(st.lists(st.integers(0, 40000), min_size=m, max_size=m)), np.int64)
        d = np.array(data.draw(st.lists(st.integers(0, 40000), min_size=m, max_size=m)), np.int64)
        ranges.append((d, f, z))
    ring_ptr = data.draw(st.integers(1 << 40, 1 << 41))
    flat_ptr = data.draw(st.integers(1 << 30, 1 << 31))
    rel = data.draw(st.lists(st.integers(0, 46000), max_size=5, unique=True))
    bounds = np.array(sorted(flat_ptr + x for x in rel), np.uint64)
    got = staged_restore.absolute_ranges(ranges, ring_ptr, flat_ptr, bounds)
    assert len(got) == n_chunks
    for (d, f, z), (gd, gf, gz) in zip(ranges, got, strict=True):
        wd, wf, wz = host.split_at((d + ring_ptr).astype(np.uint64),
                                   (f + flat_ptr).astype(np.uint64), z.astype(np.uint64), bounds)
        for w, g in ((wd, gd), (wf, gf), (wz, gz)):
            assert g.dtype == np.uint64 and g.flags.c_contiguous
            np.testing.assert_array_equal(g, w)
