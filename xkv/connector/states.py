"""Recurrent-state groups (Mamba2, gated delta net) on the scheduler side: where a state lives.

vLLM's ``align`` Mamba cache mode (prefix caching on) keeps, for a request, a position-indexed
block list per state group: index ``i`` holds the state after ``(i + 1) * block_size`` tokens
(null block 0 where no state was kept), and the *running* state of a step that ends at ``E``
tokens is written to index ``cdiv(E, block_size) - 1``. So:

* the state after a chunk boundary ``E = (c + 1) * chunk_size`` exists only if a scheduled step
  ended exactly at ``E`` (vLLM's block-aligned prefill split ends steps at the last full block of
  the prompt and at chunked-prefill boundaries); it is saved from block ``E / block_size - 1``
  right after that step's forward. Chunk boundaries crossed inside a step have no state.
* a restore at ``H`` tokens writes the stored state into block ``H / block_size - 1`` (the
  boundary block, which vLLM's own prefix cache may reuse later) AND into the running block of
  the step (``cdiv(H + scheduled, block_size) - 1``): on the V1 runner ``preprocess_mamba``
  copies boundary -> running before ``start_load_kv`` runs, so the boundary write alone would
  be read too late (docs/architecture.md, "Hybrid models").

No vLLM types; only :func:`probe_states` talks to the gateway.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from xkv.connector.metadata import ChunkRef, GroupTransfer, TransferJob

#: At most this many LOOKUPs to find the longest prefix whose boundary state is stored: the
#: state of the last chunk of the attention prefix is tried first, then earlier boundaries.
MAX_STATE_PROBES = 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def boundary_index(tokens: int, block_size: int) -> int:
    """Index in a state group's block list of the state after ``tokens`` (block aligned)."""
    if tokens <= 0 or tokens % block_size:
        raise ValueError(
            f"state boundary at {tokens} tokens: expected a positive multiple of the block size "
            f"{block_size}"
        )
    return tokens // block_size - 1


def running_index(computed: int, scheduled: int, block_size: int) -> int:
    """Index of the block the step's running state is read from and written to."""
    return cdiv(computed + scheduled, block_size) - 1


def state_load(g: int, ids: list[int], tokens: int, block_size: int, ref: ChunkRef,
               req_id: str) -> GroupTransfer:
    """Load of the state after ``tokens`` into its boundary block (the running block is added
    by :func:`with_running_block` once the step's scheduled tokens are known)."""
    i = boundary_index(tokens, block_size)
    if i >= len(ids) or ids[i] == 0:
        # vLLM allocates a real block there for every promised hit; anything else is a contract
        # change we must not paper over by writing into the null block.
        raise RuntimeError(
            f"xkv: request {req_id} state group {g}: no block at index {i} for the state after "
            f"{tokens} tokens (block list {ids[: i + 2]}...)"
        )
    return GroupTransfer(group=g, block_ids=(ids[i],), chunk_of=(0,), block_in_chunk=(0,),
                         chunks=(ref,))


def with_running_block(gt: GroupTransfer, ids: list[int], computed: int, scheduled: int,
                       block_size: int) -> GroupTransfer:
    """``gt`` plus the running block of this step (same state object)."""
    r = running_index(computed, scheduled, block_size)
    if r >= len(ids) or ids[r] == 0 or ids[r] in gt.block_ids:
        return gt
    return GroupTransfer(group=gt.group, block_ids=gt.block_ids + (ids[r],),
                         chunk_of=gt.chunk_of + (0,), block_in_chunk=gt.block_in_chunk + (0,),
                         chunks=gt.chunks)


def saved_boundary(computed: int, scheduled: int, num_prompt_tokens: int, chunk_size: int,
                   num_chunks_hashed: int) -> int | None:
    """Chunk whose end-of-chunk state this step materialises, or None.

    A step computing ``[computed, computed + scheduled)`` leaves the state after its last token
    in the running block; that is a storable boundary state when the step ends on a chunk
    boundary inside the prompt whose chunk has a key (all its block hashes are known).
    """
    end = computed + scheduled
    if scheduled <= 0 or end > num_prompt_tokens or end % chunk_size:
        return None
    c = end // chunk_size - 1
    return c if c < num_chunks_hashed else None


def add_running_blocks(job: TransferJob, registry: Any, block_ids: list[list[int]],
                       computed: int | None, scheduled: int) -> TransferJob:
    """``job`` with every state load also writing the step's running block. ``block_ids``: the
    request's lists by vLLM group index; ``computed``: its tokens before this step (None: not
    scheduled in this step, nothing to add)."""
    if computed is None or not scheduled:
        return job
    groups = []
    for gt in job.groups:
        plan = registry.groups[gt.group]
        if plan.is_state:
            gt = with_running_block(gt, block_ids[plan.group.index], computed, scheduled,
                                    plan.group.block_size)
        groups.append(gt)
    return replace(job, groups=tuple(groups))


def probe_states(gw: Any, layout_ids: list[int], groups: list[int], keys: list[bytes],
                 hits: int, timeout_s: float) -> tuple[int, int | None, dict[int, Any]]:
    """Longest ``n <= hits`` whose boundary state (``keys[n - 1]``) is stored in every state
    group (``groups``, their ``layout_ids``): ``(n, lease id, {group: ChunkSlots})``, or
    ``(0, None, {})`` when none of the last ``MAX_STATE_PROBES`` boundaries has one. States
    exist only where vLLM ended a step, so an attention prefix alone is not a hit. Misses hold
    no lease; a gateway error propagates (no lease is left behind)."""
    for n in range(hits, max(0, hits - MAX_STATE_PROBES), -1):
        res = gw.lookup([(lid, [keys[n - 1]]) for lid in layout_ids], lease=True,
                        timeout_s=timeout_s)
        if res.num_chunks >= 1:
            return n, res.lease_id or None, {g: res.slots[i][0] for i, g in enumerate(groups)}
        if res.lease_id:  # the gateway takes no lease without a hit; never keep one anyway
            gw.release(res.lease_id)
    return 0, None, {}
