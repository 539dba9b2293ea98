"""A step's copy table of one cache group: block ids and the card offset of every layer's
fragment (moved out of ``transfer``, which re-exports both names). Host int64 tensors only."""

from __future__ import annotations

import torch


def layer_offsets(plan, base: torch.Tensor, transfers=()) -> torch.Tensor:
    """int64 ``[L, n]``: card offsets of every layer of ``plan``'s group, from ``base`` (int64
    ``[n]``, layer 0; see ``GroupPlan.card_offsets``); objects are layer-major, so row ``l`` is
    ``base + plan.object_offset(l, 0)``, plus, for a group of mixed page sizes whose objects hold
    several blocks, ``j * (bytes_of(l) - bytes_of(0))`` for the block at object position ``j``
    (read from ``transfers``, the ``GroupTransfer``s ``base`` was made from, in order; only
    then). One host op for the group."""
    g = plan.group
    starts = torch.tensor([plan.object_offset(i, 0) for i in range(len(g.layer_names))],
                          dtype=torch.int64)
    out = base.reshape(1, -1) + starts.reshape(-1, 1)
    lb = g.layer_bytes
    if lb and plan.blocks_per_object > 1:
        pos = torch.tensor([j for gt in transfers for j in gt.block_in_chunk], dtype=torch.int64)
        if pos.numel() != base.numel():
            raise ValueError(f"group {g.index}: mixed page sizes need each block's transfer")
        step = torch.tensor([b - lb[0] for b in lb], dtype=torch.int64)
        out = out + step.reshape(-1, 1) * pos.reshape(1, -1)
    return out


def copy_table(plan, tp_rank: int, transfers) -> tuple[torch.Tensor, torch.Tensor]:
    """One group's copy table for a step: ``(block_ids, offsets)``, host int64 tensors, block
    ids ``[n]`` of every ``GroupTransfer`` in ``transfers`` (in order) and their card offsets
    ``[L, n]`` in this rank's shard (:func:`layer_offsets`). The one builder of restores
    (sync, async, fan-out) and saves."""
    blocks = torch.tensor([b for gt in transfers for b in gt.block_ids], dtype=torch.int64)
    base = torch.from_numpy(plan.card_offsets_array(tp_rank, transfers))
    return blocks, layer_offsets(plan, base, transfers)
