"""Sliding-window groups' plan (``xkv.connector.windows``, the registry's window fields) against
vLLM's own window rule (``SlidingWindowManager.get_num_skipped_tokens``), and the per-layer
offsets of objects of mixed page sizes."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from xkv.connector import windows
from xkv.connector.metadata import ChunkRef, GroupTransfer
from xkv.connector.registry import CacheGroup, RegistryError, build_registry, state_group
from xkv.connector.transfer import layer_offsets

REF = ChunkRef(b"k", (4096,), (1,))


def _win(bs=64, w=128, extra=0, replicated=True, i=1):
    return CacheGroup(i, "sliding_window", ("s0", "s1"), bs, 1024, "SlidingWindowMLASpec",
                      sliding_window=w, extra_retained=extra, replicated=replicated)


def _plan(g, chunk=256):
    full = CacheGroup(0, "mla_compressed", ("a",), 256, 4096, "MLAAttentionSpec")
    return build_registry([full, g], tp_size=2, pp_size=1, chunk_size=chunk).groups[1]


def _vllm_skipped(w, extra, n):
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    me = SimpleNamespace(sliding_window=w, extra_retained_tokens=extra)
    return SlidingWindowManager.get_num_skipped_tokens(me, n)


@given(bs=st.sampled_from([4, 8, 16, 64]), w=st.integers(2, 600), extra=st.integers(0, 40),
       t=st.integers(1, 200))
def test_window_blocks_are_the_blocks_vllm_keeps_real(bs, w, extra, t):
    pytest.importorskip("vllm")
    g = _win(bs, w, extra)
    tokens = t * bs
    assert windows.skipped_tokens(g, tokens) == _vllm_skipped(w, extra, tokens)
    real = tokens // bs - _vllm_skipped(w, extra, tokens) // bs  # vLLM's non-null blocks
    assert real == min(g.window_blocks, tokens // bs)


def test_registry_shards_windows_and_refuses_what_it_cannot_place():
    p = _plan(_win(replicated=True))
    assert (p.num_shards, p.writer_ranks, p.blocks_per_object, p.is_window) == (1, (0,), 2, True)
    assert p.at_boundary and not p.is_state
    s = _plan(_win(replicated=False))
    assert (s.num_shards, s.writer_ranks) == (2, (0, 1))  # heads split by TP
    assert _plan(_win(bs=8, w=128), chunk=512).blocks_per_object == 16
    with pytest.raises(RegistryError, match="sliding window whose window size is unknown"):
        _plan(_win(w=0))
    with pytest.raises(RegistryError, match="sliding-window layers only"):
        build_registry([_win(i=0)], tp_size=1, pp_size=1, chunk_size=256)
    m = state_group(CacheGroup(1, "mamba", ("m",), 64, 512, "MambaSpec"), 100)
    with pytest.raises(RegistryError, match="different block sizes"):
        build_registry([CacheGroup(0, "attention", ("a",), 32, 1024), m], tp_size=1,
                       pp_size=1, chunk_size=256)


def test_tail_and_saved_tail():
    p = _plan(_win(), chunk=256)  # k = 4 blocks of 64 per chunk, 2 blocks per object
    assert windows.tail(p, 0) == [(2, 0), (3, 1)]
    assert windows.tail(p, 2) == [(10, 0), (11, 1)]
    q = _plan(_win(bs=64, w=400), chunk=256)  # the window reaches into the chunk before
    assert q.blocks_per_object == 7 and windows.tail(q, 0) == [(i, i + 3) for i in range(4)]
    ids = list(range(100, 112))
    assert windows.saved_tail(p, ids, 2, computed=600) == ([110, 111], [0, 1])
    # a step starting at 700 tokens: vLLM may have freed every block below (700-127)//64 = 8
    assert windows.saved_tail(p, ids, 1, computed=700) is None
    assert windows.saved_tail(p, ids, 2, computed=700) == ([110, 111], [0, 1])
    assert windows.saved_tail(p, ids[:11], 2, computed=0) is None  # not allocated
    nulls = ids[:10] + [0, 111]
    assert windows.saved_tail(p, nulls, 2, computed=0) is None  # the null block holds nothing


def test_window_load_fills_only_the_real_blocks():
    p = _plan(_win(), chunk=256)
    ids = [0] * 10 + [210, 211]  # a hit of 768 tokens: vLLM keeps blocks 10 and 11
    gt = windows.window_load(1, p, ids, 0, 768, REF, "r")
    assert (gt.block_ids, gt.block_in_chunk, gt.chunk_of) == ((210, 211), (0, 1), (0, 0))
    gt = windows.window_load(1, p, [0] * 10 + [0, 211], 0, 768, REF, "r")
    assert gt.block_ids == (211,) and gt.block_in_chunk == (1,)
    gt = windows.window_load(1, p, ids, 704, 768, REF, "r")  # past a local hit of 11 blocks
    assert gt.block_ids == (211,) and gt.block_in_chunk == (1,)
    with pytest.raises(RuntimeError, match="outside the stored window tail"):
        windows.window_load(1, p, [0] * 9 + [209, 210, 211], 0, 768, REF, "r")
    with pytest.raises(ValueError, match="expected a chunk end"):
        windows.window_load(1, p, ids, 0, 700, REF, "r")


@given(data=st.data())
def test_mixed_page_offsets_follow_object_offset(data):
    """Several blocks per object in a group of mixed page sizes: every (layer, block) offset
    is ``GroupPlan.object_offset``, the one home of the layout (a DeepSeek-V4 compressor-state
    group: a 32 KiB and an 8 KiB state cache per layer)."""
    sizes = data.draw(st.lists(st.sampled_from([132, 2048, 8192, 32768]), min_size=2,
                               max_size=4))
    g = CacheGroup(1, "sliding_window", tuple(f"l{i}" for i in range(len(sizes))), 4,
                   max(sizes), "SlidingWindowMLASpec", layer_bytes=tuple(sizes),
                   sliding_window=data.draw(st.integers(2, 40)), replicated=True)
    p = _plan(g, chunk=256)
    k = p.blocks_per_object
    pos = data.draw(st.lists(st.integers(0, k - 1), max_size=8))
    gt = GroupTransfer(1, tuple(range(len(pos))), (0,) * len(pos), tuple(pos), (REF,))
    base = torch.tensor(p.card_offsets(0, [gt]), dtype=torch.int64)
    offs = layer_offsets(p, base, [gt])
    for layer in range(len(sizes)):
        assert offs[layer].tolist() == [4096 + p.object_offset(layer, j) for j in pos]
    ends = [p.object_offset(n, j) + sizes[n] for n in range(len(sizes)) for j in range(k)]
    starts = sorted((p.object_offset(n, j), n) for n in range(len(sizes)) for j in range(k))
    assert max(ends) == p.shard_bytes  # dense, no overlap:
    assert all(a + sizes[n] <= b for (a, n), (b, _) in zip(starts, starts[1:], strict=False))
