"""GroupTransfer.stale_blocks: the one slot-generation check of sync and async restores."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from xkv.connector.metadata import ChunkRef, GroupTransfer


@given(st.data())
def test_only_the_blocks_of_reused_slots_are_stale(data):
    n_chunks = data.draw(st.integers(1, 6))
    shards = data.draw(st.integers(1, 3))
    shard = data.draw(st.integers(0, shards - 1))
    chunks = tuple(ChunkRef(bytes([c]) * 8, tuple(4096 * (c * shards + s) for s in range(shards)),
                            tuple(data.draw(st.integers(1, 9)) for _ in range(shards)))
                   for c in range(n_chunks))
    chunk_of = tuple(data.draw(st.lists(st.integers(0, n_chunks - 1), max_size=20)))
    gt = GroupTransfer(0, tuple(range(100, 100 + len(chunk_of))), chunk_of, (0,) * len(chunk_of),
                       chunks)
    reused = data.draw(st.sets(st.integers(0, n_chunks - 1)))
    current = {ref.offsets[shard]: ref.generations[shard] + (c in reused)
               for c, ref in enumerate(chunks)}
    # other shards' slots change too: only this shard's generation counts
    current.update({ref.offsets[s]: -1 for ref in chunks for s in range(shards) if s != shard})
    want = [b for b, c in zip(gt.block_ids, chunk_of, strict=True) if c in reused]
    assert gt.stale_blocks(shard, current.__getitem__) == want
