"""Pure planning of a fanned-out restore: which bytes each rank copies, round by round.

A *segment* is the restore of one cache of one layer: ``n_blocks`` blocks of ``block_bytes`` bytes
each, laid out back to back in a staging slot (block ``i`` of a round at ``i * block_bytes``).
A segment larger than a staging slot is cut into *rounds* of whole blocks (balanced, never more
than a slot holds). Inside a round the ``nbytes = (b1 - b0) * block_bytes`` bytes are split into
``n_ranks`` equal shares of ``share`` bytes (a multiple of ``align``); rank ``r`` copies
``[r * share, min((r + 1) * share, nbytes))`` and the padding sits at the end, so a plain in-place
all-gather of ``n_ranks * share`` bytes leaves the round's bytes in order at the slot's start.

Everything here depends only on its arguments (no torch, no device), so every rank computes the
identical plan from the identical scheduler metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Share granularity in bytes: keeps every rank's share and the gathered buffer 256-byte aligned
#: (NCCL and the vectorised copy kernels are fastest on aligned buffers).
ALIGN = 256


class PlanError(ValueError):
    """The restore cannot be planned with these sizes."""


@dataclass(frozen=True)
class Round:
    """One staging round: blocks ``[b0, b1)`` of segment ``seg``, split over ``n_ranks`` ranks."""

    seg: int
    b0: int
    b1: int
    block_bytes: int
    n_ranks: int
    share: int

    @property
    def n_blocks(self) -> int:
        return self.b1 - self.b0

    @property
    def nbytes(self) -> int:
        """Payload bytes of the round (without padding)."""
        return self.n_blocks * self.block_bytes

    @property
    def gathered(self) -> int:
        """Bytes the all-gather moves into the slot (payload + padding)."""
        return self.share * self.n_ranks

    def share_range(self, rank: int) -> tuple[int, int]:
        """Payload bytes ``[lo, hi)`` rank ``rank`` copies (``lo == hi``: nothing, padding only)."""
        if not 0 <= rank < self.n_ranks:
            raise PlanError(f"rank {rank} is outside the group of {self.n_ranks}")
        lo = min(rank * self.share, self.nbytes)
        hi = min(lo + self.share, self.nbytes)
        return lo, hi


def share_bytes(nbytes: int, n_ranks: int, align: int = ALIGN) -> int:
    """Equal per-rank share (bytes, a multiple of ``align``) covering ``nbytes``."""
    per = -(-nbytes // n_ranks)
    return -(-per // align) * align


def max_blocks_per_round(block_bytes: int, n_ranks: int, slot_bytes: int, align: int = ALIGN) -> int:
    """Most blocks one round can hold so that ``n_ranks * share <= slot_bytes``."""
    _check_pos("block_bytes", block_bytes)
    _check_pos("n_ranks", n_ranks)
    _check_pos("slot_bytes", slot_bytes)
    _check_pos("align", align)
    max_share = slot_bytes // (n_ranks * align) * align
    return max_share * n_ranks // block_bytes


def plan_segment(seg: int, n_blocks: int, block_bytes: int, n_ranks: int, slot_bytes: int,
                 align: int = ALIGN) -> list[Round]:
    """Rounds of one segment: balanced runs of whole blocks, each fitting one slot."""
    if n_blocks < 0:
        raise PlanError(f"n_blocks={n_blocks}: expected >= 0")
    if n_blocks == 0:
        return []
    cap = max_blocks_per_round(block_bytes, n_ranks, slot_bytes, align)
    if cap == 0:
        raise PlanError(
            f"a staging slot of {slot_bytes} bytes cannot hold one block of {block_bytes} bytes "
            f"split over {n_ranks} ranks; raise nvlink_fanout_staging_bytes"
        )
    n_rounds = -(-n_blocks // cap)
    bounds = [k * n_blocks // n_rounds for k in range(n_rounds + 1)]
    return [
        Round(seg, b0, b1, block_bytes, n_ranks, share_bytes((b1 - b0) * block_bytes, n_ranks, align))
        for b0, b1 in zip(bounds[:-1], bounds[1:], strict=True)
    ]


def plan_batch(segments: Sequence[tuple[int, int]], n_ranks: int, slot_bytes: int,
               align: int = ALIGN) -> list[Round]:
    """Rounds of a batch, in segment order. ``segments[i] = (n_blocks, block_bytes)``."""
    rounds: list[Round] = []
    for i, (n_blocks, block_bytes) in enumerate(segments):
        rounds.extend(plan_segment(i, n_blocks, block_bytes, n_ranks, slot_bytes, align))
    return rounds


def _check_pos(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"{name}={value!r}: expected a positive integer")
