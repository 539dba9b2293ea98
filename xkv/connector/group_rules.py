"""One rule per kind of cache group, for the scheduler side: what a hit restores into a group and
which of a step's chunks a group saves. The scheduler (loads) and the save planner call
``rule_of(plan)`` instead of testing the group's kind at each step.

* prefix groups (attention, MLA, compressed MLA): every chunk of a hit is read (a hit ending
  inside a block reads that block too, as the transfer's ``tail``); every chunk the
  step completed (and the lookup did not find stored) is saved, all ``k`` blocks;
* window groups (``windows.py``): only the hit's last chunk's object is read, into the blocks vLLM
  keeps real; the window's tail is saved at each chunk end whose tail blocks are all held;
* state groups (``states.py``): only the hit's last chunk's state is read, into its boundary
  block; the states vLLM left at chunk boundaries in the step are saved (one block each).

Save order is prefix, window, then state groups (the order RESERVEs are sent in). No vLLM
types, no gateway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from xkv.connector.metadata import ChunkRef, GroupTransfer, load_transfer
from xkv.connector.registry import GroupPlan
from xkv.connector.states import saved_boundaries, state_load
from xkv.connector.windows import saved_tail, window_load

#: (chunks to reserve, their blocks ``blocks_of(c)``, object positions ``positions_of(c)`` or None
#: for ``0, 1, ...``)
SavePlan = tuple[list[int], Callable[[int], Sequence[int]], Callable[[int], Sequence[int]] | None]


class _Prefix:
    save_order = 0

    def load(self, g: int, plan: GroupPlan, ids: Sequence[int], lk: Any, ext: int,
             req_id: str) -> GroupTransfer | None:
        """The blocks holding tokens ``[local, local + ext)`` of the hit, chunk by chunk; a hit
        that ends inside a block (a full hit of a single attention group, restored up to the
        last prompt token) includes that block as the transfer's ``tail``."""
        bs, k = plan.group.block_size, plan.blocks_per_chunk
        end = lk.local + ext
        first, last = lk.local // bs, -(-end // bs)  # a partly restored last block included
        if last > len(ids):
            raise RuntimeError(
                f"xkv: request {req_id} group {g}: {len(ids)} blocks allocated, "
                f"{last} needed for {end} tokens"
            )
        return load_transfer(
            g, ids, first, last, k,
            lambda c: ChunkRef.at(lk.keys[c - lk.start], lk.slots[g][c - lk.start]),
            tail=int(end % bs != 0))

    def saves(self, plan: GroupPlan, ids: Sequence[int], new: range, cands: list[int],
              computed: int, n_sched: int, prompt: int, hashed: int) -> SavePlan:
        k = plan.blocks_per_chunk
        todo = [c for c in cands if (c + 1) * k <= len(ids)]
        return todo, lambda c: ids[c * k:(c + 1) * k], None


class _AtBoundary:
    """Window and state groups: a hit reads only its last chunk's object."""

    def load(self, g: int, plan: GroupPlan, ids: Sequence[int], lk: Any, ext: int,
             req_id: str) -> GroupTransfer | None:
        ref = ChunkRef.at(lk.keys[lk.hits - 1], lk.state_slots[g])
        gt = self._load(g, plan, list(ids), lk.local, lk.local + ext, ref, req_id)
        return gt if gt.block_ids else None


class _Window(_AtBoundary):
    save_order = 1

    def _load(self, g, plan, ids, local, end, ref, req_id) -> GroupTransfer:
        return window_load(g, plan, ids, local, end, ref, req_id)

    def saves(self, plan: GroupPlan, ids: Sequence[int], new: range, cands: list[int],
              computed: int, n_sched: int, prompt: int, hashed: int) -> SavePlan:
        # the window's tail at each chunk end, where no tail block may be gone (windows.py);
        # also chunks the lookup found: their window object may be the one missing
        tails = {c: t for c in new if (t := saved_tail(plan, ids, c, computed)) is not None}
        return sorted(tails), lambda c: tails[c][0], lambda c: tails[c][1]


class _State(_AtBoundary):
    save_order = 2

    def _load(self, g, plan, ids, local, end, ref, req_id) -> GroupTransfer:
        return state_load(g, ids, end, plan.group.block_size, ref, req_id)

    def saves(self, plan: GroupPlan, ids: Sequence[int], new: range, cands: list[int],
              computed: int, n_sched: int, prompt: int, hashed: int) -> SavePlan:
        k = plan.blocks_per_chunk
        # the state after chunk c is in block (c + 1) * k - 1 (align: the step's running block;
        # all: also every boundary the step crossed); a null block holds none
        todo = [c for c in saved_boundaries(plan.group.state_mode or "align", computed, n_sched,
                                            prompt, plan.chunk_size, hashed)
                if (c + 1) * k <= len(ids) and ids[(c + 1) * k - 1] != 0]
        return todo, lambda c: [ids[(c + 1) * k - 1]], None


PREFIX, WINDOW, STATE = _Prefix(), _Window(), _State()


def rule_of(plan: GroupPlan) -> _Prefix | _Window | _State:
    """The rule of ``plan``'s kind of group."""
    return STATE if plan.is_state else WINDOW if plan.is_window else PREFIX
