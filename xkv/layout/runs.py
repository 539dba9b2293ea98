"""Runs of back-to-back blocks in a list of byte offsets: one copy per run instead of one per
block (the fan-out's share copies, the restore verifier)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def contiguous_runs(offsets: torch.Tensor | Sequence[int], step: int) -> list[tuple[int, int, int]]:
    """Maximal runs of ``offsets`` (int64 [n]: tensor, array or list) in which each entry is the
    previous one plus ``step`` (bytes of one block): ``(first index, count, first offset)``.
    One copy per run moves back-to-back blocks; ``[]`` for no offsets."""
    t = torch.as_tensor(offsets, dtype=torch.int64).reshape(-1).cpu()
    n = t.numel()
    if n == 0:
        return []
    breaks = ((t[1:] - t[:-1]) != step).nonzero().flatten().add(1).tolist()
    starts, ends = [0, *breaks], [*breaks, n]
    firsts = t[starts].tolist()
    return [(a, b - a, o) for a, b, o in zip(starts, ends, firsts, strict=True)]
