"""The registry's decisions (shards, writers, refusals) and the stored-object layout."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from xkv.connector.metadata import ChunkRef, GroupTransfer
from xkv.connector.registry import CacheGroup, RegistryError, build_registry, state_group


def _g(i=0, kind="attention", layers=("a", "b"), bs=32, bb=1024):
    return CacheGroup(i, kind, tuple(layers), bs, bb, "Spec")


def test_attention_sharded_mla_replicated():
    r = build_registry([_g(0, "attention"), _g(1, "mla", ("c",))], tp_size=4, pp_size=1,
                       chunk_size=64)
    a, m = r.groups
    assert (a.num_shards, a.writer_ranks, a.reader_ranks) == (4, (0, 1, 2, 3), (0, 1, 2, 3))
    assert [a.shard_of(r) for r in range(4)] == [0, 1, 2, 3]
    assert (m.num_shards, m.writer_ranks) == (1, (0,))
    assert [m.shard_of(r) for r in range(4)] == [0, 0, 0, 0] and not m.writes(1)
    assert a.blocks_per_chunk == 2 and a.shard_bytes == 2 * 2 * 1024
    lines = r.log_lines()
    assert lines[0].startswith("KV cache registry: 3 cache(s) in 2 group(s); writers: ")
    assert " ; readers: " in lines[0]
    assert lines[1] == "KV cache layout: 2 group(s)"


@pytest.mark.parametrize("kind", ["MambaSpec", "SlidingWindowSpec", "CrossAttentionSpec"])
def test_cache_nobody_writes_is_refused(kind):
    with pytest.raises(RegistryError, match="has no writer"):
        build_registry([_g(0), _g(1, kind)], tp_size=1, pp_size=1, chunk_size=64)


def test_registry_refusals():
    with pytest.raises(RegistryError, match="pipeline"):
        build_registry([_g()], tp_size=1, pp_size=2, chunk_size=64)
    with pytest.raises(RegistryError, match="multiple"):
        build_registry([_g()], tp_size=1, pp_size=1, chunk_size=48)
    with pytest.raises(RegistryError, match="no KV cache group"):
        build_registry([], tp_size=1, pp_size=1, chunk_size=64)


def test_slot_alignment_rounds_registered_size():
    r = build_registry([_g(bb=1000)], tp_size=1, pp_size=1, chunk_size=64, slot_alignment=4096)
    (p,) = r.groups
    assert p.shard_bytes == 2 * 2 * 1000 and p.registered_bytes == 4096


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.sampled_from([8, 96, 4096]),
       st.booleans(), st.integers(0, 3))
def test_card_offsets_tile_each_object_layer_major(layers, k, chunks, bb, state, rank):
    """Every (layer, block) of an object maps to its own ``block_bytes`` range inside the
    shard's slot, in layer-major order, and together they cover the object exactly."""
    g = _g(layers=[f"l{i}" for i in range(layers)], bs=16, bb=bb)
    if state:
        g = state_group(g, bb)
    plan = build_registry([g, _g(1, bs=16)] if state else [g], tp_size=4, pp_size=1,
                          chunk_size=16 * k, slot_alignment=4096).groups[0]
    per = plan.blocks_per_object
    slots = [((c * 7 + 3) * plan.registered_bytes, 4 * plan.registered_bytes) for c in range(chunks)]
    refs = tuple(ChunkRef(bytes([c]), tuple(s + r * plan.registered_bytes for r in range(4)),
                          (0,) * 4) for c, (s, _) in enumerate(slots))
    # the blocks of every chunk, in a shuffled order (a transfer need not be sorted)
    pairs = sorted(((c, j) for c in range(chunks) for j in range(per)), key=lambda p: (p[1], -p[0]))
    gt = GroupTransfer(0, tuple(range(len(pairs))), tuple(c for c, _ in pairs),
                       tuple(j for _, j in pairs), refs)
    shard = plan.shard_of(rank)
    seen = {}
    for layer in range(layers):
        for off, (c, j) in zip(plan.card_offsets(rank, [gt], layer=layer), pairs, strict=True):
            seen[(c, layer, j)] = off
    for c in range(chunks):
        start = refs[c].offsets[shard]
        ranges = sorted((seen[(c, li, j)], li, j) for li in range(layers) for j in range(per))
        assert [(li, j) for _, li, j in ranges] == [(li, j) for li in range(layers)
                                                     for j in range(per)]  # layer-major
        assert [o for o, _, _ in ranges] == [start + i * bb for i in range(layers * per)]
        assert ranges[-1][0] + bb - start == plan.shard_bytes <= plan.registered_bytes
    assert plan.object_offset(layers - 1, per - 1) == plan.shard_bytes - bb


@given(sizes=st.lists(st.sampled_from([576 * 32, 132 * 32, 1024, 4096]), min_size=1, max_size=5),
       k=st.integers(1, 6), rank=st.integers(0, 3), data=st.data())
def test_card_offsets_array_is_the_scalar_formula(sizes, k, rank, data):
    """The vectorised offsets (the restore's host path) equal ``chunk offset + object_offset``
    block by block, for every layer, uniform and mixed page sizes (an MLA latent and its
    indexer in one group), several transfers, empty ones included."""
    names = tuple(f"l{i}" for i in range(len(sizes)))
    mixed = len(set(sizes)) > 1
    g = CacheGroup(0, "mla" if mixed else "attention", names, 16, sizes[0],
                   layer_bytes=tuple(sizes) if mixed else ())
    plan = build_registry([g], tp_size=4, pp_size=1, chunk_size=16 * k).groups[0]
    transfers = []
    for _ in range(data.draw(st.integers(0, 3))):
        nc = data.draw(st.integers(1, 4))
        refs = tuple(ChunkRef(bytes([c]), tuple(data.draw(st.integers(0, 1 << 40))
                                                for _ in range(plan.num_shards)),
                              (0,) * plan.num_shards) for c in range(nc))
        n = data.draw(st.integers(0, 12))
        cs = data.draw(st.lists(st.integers(0, nc - 1), min_size=n, max_size=n))
        js = data.draw(st.lists(st.integers(0, plan.blocks_per_object - 1), min_size=n, max_size=n))
        transfers.append(GroupTransfer(0, tuple(range(n)), tuple(cs), tuple(js), refs))
    shard = plan.shard_of(rank)
    for layer in range(len(sizes)):
        want = [gt.chunks[c].offsets[shard] + plan.object_offset(layer, j)
                for gt in transfers for c, j in zip(gt.chunk_of, gt.block_in_chunk, strict=True)]
        got = plan.card_offsets_array(rank, transfers, layer)
        assert got.dtype == np.int64 and got.tolist() == want
        assert plan.card_offsets(rank, transfers, layer) == want

