"""The plan: every byte covered exactly once, equal shares, padding only at the end, one plan."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xkv.fanout.plan import (
    ALIGN,
    PlanError,
    Round,
    max_blocks_per_round,
    plan_batch,
    plan_segment,
    share_bytes,
)

segments_st = st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 200_000)), min_size=0, max_size=5)


@given(segments=segments_st, n_ranks=st.integers(1, 8), slot_bytes=st.integers(1, 64 << 20),
       align=st.sampled_from([1, 16, ALIGN]))
def test_plan_covers_every_byte_once(segments, n_ranks, slot_bytes, align):
    fits = all(max_blocks_per_round(bb, n_ranks, slot_bytes, align) > 0 for n, bb in segments if n)
    if not fits:
        with pytest.raises(PlanError, match="staging slot"):
            plan_batch(segments, n_ranks, slot_bytes, align)
        return
    rounds = plan_batch(segments, n_ranks, slot_bytes, align)
    assert rounds == plan_batch(list(segments), n_ranks, slot_bytes, align)  # deterministic
    for seg, (n, bb) in enumerate(segments):
        mine = [r for r in rounds if r.seg == seg]
        # rounds tile the blocks in order, balanced, each fitting a slot
        assert [r.b0 for r in mine] == ([0] + [r.b1 for r in mine[:-1]] if mine else [])
        assert (mine[-1].b1 if mine else 0) == n
        sizes = [r.n_blocks for r in mine]
        assert not sizes or max(sizes) - min(sizes) <= 1
        for r in mine:
            assert r.block_bytes == bb and r.n_ranks == n_ranks and r.n_blocks > 0
            assert r.share % align == 0 and r.gathered <= slot_bytes
            assert r.share == share_bytes(r.nbytes, n_ranks, align)
            assert r.gathered >= r.nbytes and r.gathered - r.nbytes < n_ranks * align + n_ranks
            # shares tile [0, nbytes) in rank order; empty ones (pure padding) only at the end
            pos, seen_empty = 0, False
            for rank in range(n_ranks):
                lo, hi = r.share_range(rank)
                assert lo == pos and hi - lo <= r.share
                if hi == lo:
                    seen_empty = True
                else:
                    assert not seen_empty
                    assert hi - lo == r.share or hi == r.nbytes  # equal shares, short one last
                pos = hi
            assert pos == r.nbytes


@given(n=st.integers(0, 64), bb=st.integers(1, 700), n_ranks=st.integers(1, 5),
       slot_bytes=st.integers(2000, 40_000))
def test_plan_bytes_exactly_once(n, bb, n_ranks, slot_bytes):
    """Byte-level check on small sizes: count how often each payload byte is copied."""
    rounds = plan_segment(0, n, bb, n_ranks, slot_bytes, 16)
    count = bytearray(n * bb)
    for r in rounds:
        for rank in range(n_ranks):
            lo, hi = r.share_range(rank)
            for p in range(r.b0 * bb + lo, r.b0 * bb + hi):
                count[p] += 1
    assert count == bytearray([1]) * (n * bb)


def test_plan_edges():
    assert plan_batch([], 4, 1 << 20) == []
    assert plan_segment(0, 0, 73728, 8, 1 << 20) == []
    # one block of 72 KiB over 8 ranks: shares of 9216 B, no padding
    (r,) = plan_segment(0, 1, 73728, 8, 1 << 20)
    assert (r.share, r.gathered) == (9216, 73728)
    # 3 blocks of 100 B over 4 ranks, align 256: rank 0 gets all 300 B? no: share = 256
    (r,) = plan_segment(0, 3, 100, 4, 4096)
    assert r.share == 256 and [r.share_range(k) for k in range(4)] == [(0, 256), (256, 300), (300, 300), (300, 300)]
    # a slot too small for one block split over the ranks
    with pytest.raises(PlanError, match="cannot hold one block"):
        plan_segment(0, 5, 73728, 8, 65536)
    with pytest.raises(PlanError, match="n_ranks=0"):
        plan_segment(0, 5, 100, 0, 65536)
    with pytest.raises(PlanError, match="n_blocks=-1"):
        plan_segment(0, -1, 100, 2, 65536)
    with pytest.raises(PlanError, match="outside the group"):
        Round(0, 0, 1, 10, 2, 256).share_range(2)


def test_plan_deepseek_128k_rounds():
    """128k bf16 tokens (151 MB/layer) in 64 MiB slots at TP 2: 3 balanced rounds."""
    rounds = plan_segment(0, 2048, 73728, 2, 64 << 20)
    assert len(rounds) == 3 and sum(r.n_blocks for r in rounds) == 2048
    assert all(r.gathered <= 64 << 20 for r in rounds)
