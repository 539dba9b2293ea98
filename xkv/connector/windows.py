"""Sliding-window groups on the scheduler side: which blocks a chunk's object holds, when they
may be saved, and which blocks a restore fills. No vLLM types, no tensors.

What vLLM does with a sliding-window group under its hybrid allocator (0.29 and 0.33,
``SlidingWindowManager``; docs/architecture.md, "Sliding-window groups"):

* for a request with ``n`` computed tokens it keeps real blocks only from index
  ``skipped(n) // block_size`` on, ``skipped(n) = max(0, n - sliding_window + 1 -
  extra_retained_tokens)``; blocks before are the null block (id 0), and the freed ones go back
  to the pool, where another request may take and overwrite them;
* a hit (local or external) of ``T`` tokens gets real blocks only for indices
  ``[skipped(T) // block_size, T / block_size)``: the ``window_blocks`` blocks that end at
  ``T`` (``CacheGroup.window_blocks``); a restore must fill exactly those;
* blocks are freed in ``allocate_slots`` before a step's allocation, on the processed-token
  basis (at most the tokens computed before the step): a block is never freed during the
  forward of a step that reads it, but a chunk computed across two steps can have lost its
  first blocks by the time its last token is computed.

So the object of chunk ``c`` of a window group holds the ``window_blocks`` blocks that end at
the chunk's end (``tail``): block ``i`` of the request at position ``i - (end_block -
window_blocks)``. When the chunk's end lies in the step, every tail block outlives the step's
forward (``saved_tail`` checks it anyway, from the tokens computed before the step, and from
null ids); a chunk whose tail was freed (a chunk inside vLLM's local hit) is not saved, and
the lookup, which asks for the window object at the hit's last chunk, ends the hit before it.
"""

from __future__ import annotations

from collections.abc import Sequence

from xkv.connector.metadata import ChunkRef, GroupTransfer
from xkv.connector.registry import CacheGroup, GroupPlan


def skipped_tokens(g: CacheGroup, computed: int) -> int:
    """Tokens vLLM no longer keeps for a request with ``computed`` tokens (its window's trailing
    edge, ``SlidingWindowManager.get_num_skipped_tokens``)."""
    return max(0, computed - g.sliding_window + 1 - g.extra_retained)


def tail(plan: GroupPlan, c: int) -> list[tuple[int, int]]:
    """``(block index in the request, position in the object)`` of chunk ``c``'s object: the
    ``window_blocks`` blocks that end at the chunk's end (indices below 0 do not exist: their
    positions stay unused)."""
    end = (c + 1) * plan.blocks_per_chunk
    first = end - plan.blocks_per_object
    return [(i, i - first) for i in range(max(0, first), end)]


def saved_tail(plan: GroupPlan, ids: Sequence[int], c: int,
               computed: int) -> tuple[list[int], list[int]] | None:
    """Block ids and object positions to save chunk ``c``'s object from, in a step that starts
    with ``computed`` tokens; None when a tail block may be gone: not allocated, the null block,
    or below the window of ``computed`` tokens (vLLM may have freed it before this step)."""
    freed_below = skipped_tokens(plan.group, computed) // plan.group.block_size
    blocks, pos = [], []
    for i, j in tail(plan, c):
        if i >= len(ids) or ids[i] == 0 or i < freed_below:
            return None
        blocks.append(ids[i])
        pos.append(j)
    return blocks, pos


def window_load(g: int, plan: GroupPlan, ids: Sequence[int], local: int, tokens: int,
                ref: ChunkRef, req_id: str) -> GroupTransfer:
    """Restore of a hit ending at ``tokens`` (a chunk end) past ``local`` tokens vLLM already
    had: every real block of ``[local, tokens)`` that vLLM allocated, from the object of the
    hit's last chunk ``ref``; null blocks (outside the window) are left alone."""
    bs, k = plan.group.block_size, plan.blocks_per_chunk
    if tokens % plan.chunk_size or local % bs:
        raise ValueError(
            f"xkv: request {req_id} window group {g}: a hit of {tokens} tokens past {local}: "
            f"expected a chunk end (chunk {plan.chunk_size}) past a block boundary ({bs})")
    c = tokens // plan.chunk_size - 1
    held = dict(tail(plan, c))
    blocks, pos = [], []
    for i in range(local // bs, tokens // bs):
        if i >= len(ids):
            raise RuntimeError(
                f"xkv: request {req_id} window group {g}: {len(ids)} blocks allocated, "
                f"{tokens // bs} needed for {tokens} tokens")
        if ids[i] == 0:
            continue
        if i not in held:
            # vLLM keeps a block the object does not hold: its window rule changed; writing
            # nothing there would leave garbage in a block vLLM trusts.
            raise RuntimeError(
                f"xkv: request {req_id} window group {g}: vLLM allocated block index {i} for a "
                f"hit of {tokens} tokens, outside the stored window tail "
                f"({plan.blocks_per_object} blocks ending at index {(c + 1) * k - 1})")
        blocks.append(ids[i])
        pos.append(held[i])
    return GroupTransfer(group=g, block_ids=tuple(blocks), chunk_of=(0,) * len(blocks),
                         block_in_chunk=tuple(pos), chunks=(ref,),
                         first_page=min(held.values(), default=0))
