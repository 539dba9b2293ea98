"""A worker rank's restore path, shared by synchronous (``worker.py``) and asynchronous
(``async_loads.py``) restores: which card a batch may read, the issue of every group's copies (a
sync restore's blocks that the step's forward also writes go first and land before the forward:
:func:`load_transfers`), the one slot-generation check after them, and the load errors and per-job completions that go back
to vLLM and to the scheduler side.

Never a wrong token: a batch whose offsets do not belong to the mapped card (no card, or another
gateway epoch) is failed whole (:meth:`LoadOutcomes.fail_unusable`); a chunk whose slot
generation moved while it was read is failed block by block (:meth:`LoadOutcomes.check_stale`).
Where vLLM cannot take block load errors (models with several KV cache groups, vLLM <= 0.29
crashes, 0.33 refuses) either is a broken invariant and stops with a clear error instead. No vLLM
types.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from xkv.connector.metadata import GroupTransfer, TransferJob, WorkerReport
from xkv.connector.registry import Registry
from xkv.connector.stats import ConnectorStats
from xkv.connector.transfer import TransferHandler, copy_table

UNUSABLE = "the card is not mapped on this rank, or its gateway changed"


def by_group(jobs: Iterable[TransferJob]) -> dict[int, list[GroupTransfer]]:
    """The jobs' transfers per cache group (every job of a step is issued together)."""
    out: dict[int, list[GroupTransfer]] = {}
    for job in jobs:
        for gt in job.groups:
            out.setdefault(gt.group, []).append(gt)
    return out


def load_transfers(handler: TransferHandler, plan, tp_rank: int, card, transfers, pools, *,
                   fence_tail: bool = False) -> int:
    """Issue one group's restore of ``transfers`` (its ``GroupTransfer`` of one step, any
    number of requests) on ``handler``: every layer of ``plan`` (a registry ``GroupPlan``), card
    offsets of this rank's shard, ``pools`` the layers' ``PagePool``. Returns the blocks issued.
    The one home of the sync (worker) and async (``async_loads``) issue.

    ``fence_tail`` (sync restores): the blocks the step also writes (``GroupTransfer.tail``) go
    first, through ``handler.load_before_forward`` (complete before the forward); the rest get
    per-layer fences as usual. Async restores finish before their request computes: no need."""
    blocks, offsets = copy_table(plan, tp_rank, transfers)
    names, n = plan.group.layer_names, int(blocks.numel())
    if fence_tail and any(gt.tail for gt in transfers):
        tail = torch.zeros(n, dtype=torch.bool)
        at = 0
        for gt in transfers:
            at += len(gt.block_ids)
            tail[at - gt.tail:at] = True
        handler.load_before_forward(names, card, offsets[:, tail], pools, blocks[tail])
        blocks, offsets = blocks[~tail], offsets[:, ~tail]
        if not blocks.numel():
            return n
    handler.load_group(names, card, offsets, pools, blocks)
    return n


def issue(handler: TransferHandler, registry: Registry, tp_rank: int, card: Any,
          groups: Mapping[int, list[GroupTransfer]], pools: Mapping[str, Any],
          stats: ConnectorStats, skip: Iterable[int] = (), *, fence_tail: bool = False) -> None:
    """Issue every group's restore of ``groups`` on ``handler`` (after its ``begin_loads``),
    except the groups in ``skip`` (restored by NVLink fan-out); counts them all.
    ``fence_tail``: sync restores copy the blocks the step also writes before the forward
    (:func:`load_transfers`)."""
    skip = set(skip)
    for g, transfers in groups.items():
        plan = registry.groups[g]
        if g in skip:
            n = sum(len(gt.block_ids) for gt in transfers)
        else:
            n = load_transfers(handler, plan, tp_rank, card, transfers,
                               [pools[name] for name in plan.group.layer_names],
                               fence_tail=fence_tail)
        stats.add("blocks_restored", n)
        stats.add("bytes_restored", n * plan.group.bytes_all_layers)


class LoadOutcomes:
    """Load errors and finished jobs of one worker rank (``session``: its ``card``, ``epoch``
    and ``slot_generation``)."""

    def __init__(self, registry: Registry, tp_rank: int, session: Any, stats: ConnectorStats):
        self.registry, self.tp_rank, self.session, self.stats = registry, tp_rank, session, stats
        self._errors: set[int] = set()
        self._done: Counter = Counter()  # job id -> 1 once finished on this rank

    def usable_card(self, epoch: int) -> Any:
        """The mapped card when the step's offsets (of gateway ``epoch``) belong to it, else
        None (the batch fails whole: :meth:`fail_unusable`)."""
        card = self.session.card
        return card if card is not None and epoch == self.session.epoch else None

    def fail_unusable(self, jobs: Iterable[TransferJob]) -> None:
        """The one 'card unusable' branch: every block of ``jobs`` is a load error."""
        jobs = tuple(jobs)
        if not jobs:
            return
        self.no_block_errors(UNUSABLE)
        for job in jobs:
            self.fail(job.block_ids())
            self.finished(job)

    def check_stale(self, jobs: Iterable[TransferJob]) -> None:
        """The one slot-generation check, after the copies landed: blocks read from a slot
        that was evicted and reused meanwhile are load errors, never wrong bytes."""
        for job in jobs:
            for gt in job.groups:
                shard = self.registry.groups[gt.group].shard_of(self.tp_rank)
                stale = gt.stale_blocks(shard, self.session.slot_generation)
                if stale:
                    self.no_block_errors(
                        f"a slot read by request {job.req_id} (group {gt.group}) was reused")
                    self.fail(stale)

    def no_block_errors(self, why: str) -> None:
        """vLLM <= 0.29 crashes its scheduler on block load errors of multi-group (hybrid)
        models, and 0.33 refuses them; the scheduler side only promises leased data there, so
        this is a broken invariant: stop with a clear message rather than hand vLLM errors it
        cannot take (or restore bytes that are not the request's)."""
        if self.registry.multi_group:
            raise RuntimeError(
                f"xkv: a promised load cannot be completed on tp rank {self.tp_rank} ({why}); "
                "vLLM cannot recompute blocks of a model with several KV cache groups"
            )

    def fail(self, block_ids: Iterable[int]) -> None:
        before = len(self._errors)
        self._errors.update(block_ids)
        self.stats.add("load_errors", len(self._errors) - before)

    def finished(self, job: TransferJob) -> None:
        """This rank is done with ``job`` (the scheduler releases its lease once every rank is)."""
        self._done[job.job_id] += 1

    def take_errors(self) -> set[int]:
        errs, self._errors = self._errors, set()
        return errs

    def take_report(self) -> WorkerReport | None:
        if not self._done:
            return None
        done, self._done = self._done, Counter()
        return WorkerReport(loads_done=done)
