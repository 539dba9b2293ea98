"""Recurrent-state groups (Mamba2, gated delta net) on the scheduler side: where a state lives.

vLLM keeps, for a request, a position-indexed block list per state group in both cache modes it
uses with prefix caching: index ``i`` holds the state after ``(i + 1) * block_size`` tokens (null
block 0 where nothing is kept), and a step computing ``[C, E)`` reads its initial state from
index ``cdiv(C, block_size) - 1`` and leaves its final state in index ``cdiv(E, block_size) - 1``.
The two modes differ in which other boundaries get a state and in what runs before the forward
(read from vLLM 0.26-0.29: ``MambaManager``, the Mamba attention metadata builders, the Mamba2
mixer; 0.33 has ``align`` only):

``align`` (``STATE_MODES``; vLLM's default with prefix caching on 0.28+, and on 0.26 for models
without ``SupportsMambaPrefixCaching``, e.g. Qwen3-Next):

* the state after a chunk boundary ``E = (c + 1) * chunk_size`` exists only if a scheduled step
  ended exactly at ``E`` (vLLM's block-aligned prefill split ends steps at the last full block of
  the prompt and at chunked-prefill boundaries); it is saved from block ``E / block_size - 1``
  right after that step's forward. Chunk boundaries crossed inside a step have no state.
* a restore at ``H`` tokens writes the stored state into block ``H / block_size - 1`` (the
  boundary block, which vLLM's own prefix cache may reuse later) AND into the running block of
  the step (``cdiv(H + scheduled, block_size) - 1``): on the V1 runner ``preprocess_mamba``
  copies boundary -> running before ``start_load_kv`` runs, so the boundary write alone would
  be read too late (docs/architecture.md, "Hybrid models").

``all`` (vLLM 0.26's default with prefix caching for Nemotron-H, Granite-4 hybrid, Falcon-H1,
Zamba2, Jamba; 0.28/0.29 with ``--mamba-cache-mode all``):

* every block gets a real block (no null padding past the request's first step); a prefill step
  writes the state at EVERY block boundary it crosses into that boundary's block (the SSD scan's
  intermediate states, the conv kernel's aligned writes) and its final, possibly mid-block, state
  into index ``cdiv(E, block_size) - 1``. So every chunk boundary a step crossed inside the
  prompt (``C < (c + 1) * chunk_size <= E``) has its state in block ``(c + 1) * blocks_per_chunk
  - 1`` after that step's forward: all of them are saved, not only the step end.
* no copy runs before the forward (``preprocess_mamba`` is ``align`` only): the step reads its
  initial state straight from block ``H / block_size - 1``, and writes only blocks from index
  ``H / block_size`` on. A restore at ``H`` writes the boundary block only.

In both modes a hit is promised only at a chunk boundary whose state object is stored (the
attention prefix alone resumes from a wrong state), at most ``num_tokens - 1`` tokens.

No vLLM types; only :func:`probe_states` talks to the gateway.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from xkv.connector.metadata import ChunkRef, GroupTransfer, TransferJob

#: At most this many LOOKUPs to find the longest prefix whose boundary state is stored: the
#: state of the last chunk of the attention prefix is tried first, then earlier boundaries.
MAX_STATE_PROBES = 4

#: vLLM's Mamba cache modes that keep states at block boundaries ("none" keeps none: refused).
STATE_MODES = ("align", "all")


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
    """``gt`` plus the running block of this step (same state object); ``align`` mode only."""
    r = running_index(computed, scheduled, block_size)
    if r >= len(ids) or ids[r] == 0 or ids[r] in gt.block_ids:
        return gt
    return GroupTransfer(group=gt.group, block_ids=gt.block_ids + (ids[r],),
                         chunk_of=gt.chunk_of + (0,), block_in_chunk=gt.block_in_chunk + (0,),
                         chunks=gt.chunks, checks=gt.checks)


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


def saved_boundaries(mode: str, computed: int, scheduled: int, num_prompt_tokens: int,
                     chunk_size: int, num_chunks_hashed: int) -> list[int]:
    """Chunks whose end-of-chunk state this step leaves in the request's state blocks.

    ``align``: the chunk the step ends on, if any (:func:`saved_boundary`). ``all``: every chunk
    ``c`` with ``computed < (c + 1) * chunk_size <= computed + scheduled``, inside the prompt,
    whose chunk has a key (``c < num_chunks_hashed``). The state of chunk ``c`` is in block index
    ``boundary_index((c + 1) * chunk_size, block_size)`` in both modes.
    """
    if mode == "align":
        c = saved_boundary(computed, scheduled, num_prompt_tokens, chunk_size, num_chunks_hashed)
        return [] if c is None else [c]
    if mode != "all":
        raise ValueError(f"Mamba cache mode {mode!r}: expected one of {STATE_MODES}")
    if scheduled <= 0:
        return []
    end = min(computed + scheduled, num_prompt_tokens)
    first = computed // chunk_size  # chunk whose end is the first boundary > computed
    return list(range(first, min(end // chunk_size, num_chunks_hashed)))


def add_running_blocks(job: TransferJob, registry: Any, block_ids: list[list[int]],
                       computed: int | None, scheduled: int) -> TransferJob:
    """``job`` with every ``align``-mode state load also writing the step's running block
    (``all`` mode reads the boundary block itself: nothing to add). ``block_ids``: the
    request's lists by vLLM group index; ``computed``: its tokens before this step (None: not
    scheduled in this step, nothing to add)."""
    if computed is None or not scheduled:
        return job
    groups = []
    for gt in job.groups:
        plan = registry.groups[gt.group]
        if plan.is_state and plan.group.state_mode != "all":
            gt = with_running_block(gt, block_ids[plan.group.index], computed, scheduled,
                                    plan.group.block_size)
        groups.append(gt)
    return replace(job, groups=tuple(groups))


def probe_states(gw: Any, layout_ids: list[int], groups: list[int], keys: list[bytes],
                 hits: int, timeout_s: float,
                 checks_out: dict[int, bytes] | None = None) -> tuple[int, int | None,
                                                                     dict[int, Any]]:
    """Longest ``n <= hits`` whose boundary state (``keys[n - 1]``) is stored in every state
    group (``groups``, their ``layout_ids``): ``(n, lease id, {group: ChunkSlots})``, or
    ``(0, None, {})`` when none of the last ``MAX_STATE_PROBES`` boundaries has one. States
    exist only where vLLM ended a step, so an attention prefix alone is not a hit. Misses hold
    no lease; a gateway error propagates (no lease is left behind). ``checks_out``: filled
    with each group's checksum words of the hit object (``verify_checksums``; b"" if none)."""
    for n in range(hits, max(0, hits - MAX_STATE_PROBES), -1):
        res = gw.lookup([(lid, [keys[n - 1]]) for lid in layout_ids], lease=True,
                        timeout_s=timeout_s)
        if res.num_chunks >= 1:
            if checks_out is not None:
                raw = list(getattr(res, "raw_checksums", None) or [])
                checks_out.update({g: bytes(raw[i]) if i < len(raw) else b""
                                   for i, g in enumerate(groups)})
            return n, res.lease_id or None, {g: res.slots[i][0] for i, g in enumerate(groups)}
        if res.lease_id:  # the gateway takes no lease without a hit; never keep one anyway
            gw.release(res.lease_id)
    return 0, None, {}
