"""A worker rank's restore path, shared by synchronous (``worker.py``) and asynchronous
(``async_loads.py``) restores: which card a batch may read, the issue of every group's copies (a
sync restore's blocks that the step's forward also writes go first and land before the forward:
:func:`load_transfers`), the one slot-generation check after them, and the load errors and per-job completions that go back
to vLLM and to the scheduler side.

Verified restores (``verify_checksums``, ``checksums.py``): every group whose chunks came with
checksum words is restored with them (:func:`load_transfers`); once the step's copies landed,
:meth:`LoadOutcomes.check_sums` reads each group's mismatch flags once, fails the blocks of every
object that did not match, reports the objects to the gateway (``CORRUPT``, on a background
thread) and logs one warning per object naming its key.

Never a wrong token: a batch whose offsets do not belong to the mapped card (no card, or another
gateway epoch) is failed whole (:meth:`LoadOutcomes.fail_unusable`); a chunk whose slot
generation moved while it was read is failed block by block (:meth:`LoadOutcomes.check_stale`).
Where vLLM cannot take block load errors (models with several KV cache groups, vLLM <= 0.29
crashes, 0.33 refuses) either is a broken invariant and stops with a clear error instead. No vLLM
types.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from xkv.connector.checksums import restore_checks
from xkv.connector.metadata import GroupTransfer, TransferJob, WorkerReport
from xkv.connector.registry import Registry
from xkv.connector.stats import ConnectorStats
from xkv.connector.transfer import TransferHandler, copy_table

log = logging.getLogger("xkv.connector")

UNUSABLE = "the card is not mapped on this rank, or its gateway changed"
CORRUPT_LINE = "xkv: restored bytes did not match their checksum"


@dataclass(frozen=True)
class PendingCheck:
    """One group's verified restore of a step: ``flags.get()`` (bool per column, once the
    copies landed), ``cols[i]`` = (index into ``transfers``, chunk) of column ``i``."""

    group: int
    shard: int
    transfers: tuple[GroupTransfer, ...]
    cols: list[tuple[int, int]]
    flags: Any  # transfer.WordsReadback


def by_group(jobs: Iterable[TransferJob]) -> dict[int, list[GroupTransfer]]:
    """The jobs' transfers per cache group (every job of a step is issued together)."""
    out: dict[int, list[GroupTransfer]] = {}
    for job in jobs:
        for gt in job.groups:
            out.setdefault(gt.group, []).append(gt)
    return out


def load_transfers(handler: TransferHandler, plan, tp_rank: int, card, transfers, pools, *,
                   fence_tail: bool = False, check_words: int = 0,
                   on_checks: Callable[[PendingCheck], None] | None = None) -> int:
    """Issue one group's restore of ``transfers`` (its ``GroupTransfer`` of one step, any
    number of requests) on ``handler``: every layer of ``plan`` (a registry ``GroupPlan``), card
    offsets of this rank's shard, ``pools`` the layers' ``PagePool``. Returns the blocks issued.
    The one home of the sync (worker) and async (``async_loads``) issue.

    ``fence_tail`` (sync restores): the blocks the step also writes (``GroupTransfer.tail``) go
    first, through ``handler.load_before_forward`` (complete before the forward); the rest get
    per-layer fences as usual. Async restores finish before their request computes: no need.

    ``check_words`` (the group's, 0: off): when every chunk came with its words, the restore is
    verified (hash-only fragments for the pages it does not write, the tail's blocks among
    them: the main copy hashes them, the tail copy writes them) and ``on_checks`` gets its
    :class:`PendingCheck`; else its blocks count as ``blocks_unverified`` (by :func:`issue`)."""
    rc = restore_checks(plan, tp_rank, transfers, check_words) if check_words else None
    blocks, offsets = copy_table(plan, tp_rank, rc.transfers if rc is not None else transfers)
    names = plan.group.layer_names
    n = sum(len(gt.block_ids) for gt in transfers)
    tail_copy = None  # (offsets, blocks) of the blocks the forward also writes
    if fence_tail and any(gt.tail for gt in transfers):
        tail = torch.zeros(int(blocks.numel()), dtype=torch.bool)
        at = 0
        for gt in transfers:
            at += len(gt.block_ids)
            tail[at - gt.tail:at] = True
        tail_copy = (offsets[:, tail], blocks[tail])
        if rc is None:  # the group's copy leaves them out; a verified one only hashes them
            blocks, offsets = blocks[~tail], offsets[:, ~tail]
        else:
            rc = rc.with_hash_only(tail.numpy())
    if tail_copy is not None and not handler.tail_last:
        handler.load_before_forward(names, card, tail_copy[0], pools, tail_copy[1])
    if tail_copy is None or rc is not None or blocks.numel():
        flags = handler.load_group(names, card, offsets, pools, blocks,
                                   checks=None if rc is None else rc.checks)
        if rc is not None and on_checks is not None and flags is not None:
            on_checks(PendingCheck(plan.group.index, plan.shard_of(tp_rank), tuple(transfers),
                                   rc.cols, flags))
    if tail_copy is not None and handler.tail_last:  # the group's copy is under way already
        handler.load_before_forward(names, card, tail_copy[0], pools, tail_copy[1])
    return n


def verified(plan, transfers, check_words: int) -> bool:
    """Whether :func:`load_transfers` verifies this group's restore (every chunk has words)."""
    return bool(check_words) and all(
        gt.checks and len(gt.checks) == len(gt.chunks) and all(gt.checks) for gt in transfers)


def issue(handler: TransferHandler, registry: Registry, tp_rank: int, card: Any,
          groups: Mapping[int, list[GroupTransfer]], pools: Mapping[str, Any],
          stats: ConnectorStats, skip: Iterable[int] = (), *, fence_tail: bool = False,
          check_words: Mapping[int, int] | None = None,
          on_checks: Callable[[PendingCheck], None] | None = None,
          checked: Iterable[int] = ()) -> None:
    """Issue every group's restore of ``groups`` on ``handler`` (after its ``begin_loads``),
    except the groups in ``skip`` (restored by NVLink fan-out; verified there where listed in
    ``checked``, ``fanout_loads``); counts them all.
    ``fence_tail``: sync restores copy the blocks the step also writes before the forward
    (:func:`load_transfers`). ``check_words[g]``: group ``g``'s words per object (verified
    restores, their flags to ``on_checks``)."""
    skip, checked = set(skip), set(checked)
    check_words = check_words or {}
    for g, transfers in groups.items():
        plan = registry.groups[g]
        cw = check_words.get(g, 0)
        if g in skip:
            n = sum(len(gt.block_ids) for gt in transfers)
        else:
            n = load_transfers(handler, plan, tp_rank, card, transfers,
                               [pools[name] for name in plan.group.layer_names],
                               fence_tail=fence_tail, check_words=cw, on_checks=on_checks)
        unverified = g not in checked if g in skip else not verified(plan, transfers, cw)
        if unverified:
            stats.add("blocks_unverified", n)
        stats.add("blocks_restored", n)
        stats.add("bytes_restored", n * plan.group.bytes_all_layers)


class LoadOutcomes:
    """Load errors and finished jobs of one worker rank (``session``: its ``card``, ``epoch``
    and ``slot_generation``)."""

    def __init__(self, registry: Registry, tp_rank: int, session: Any, stats: ConnectorStats):
        self.registry, self.tp_rank, self.session, self.stats = registry, tp_rank, session, stats
        self._errors: set[int] = set()
        self._done: Counter = Counter()  # job id -> 1 once finished on this rank
        self._checks: list[PendingCheck] = []  # verified restores whose flags are not read yet
        self._reporters: list[threading.Thread] = []  # CORRUPT reports being sent

    def add_check(self, pending: PendingCheck) -> None:
        """A verified group restore of this step (its flags read by :meth:`check_sums`)."""
        self._checks.append(pending)

    def check_sums(self, pending: Iterable[PendingCheck] | None = None) -> int:
        """After the copies landed: read each verified restore's flags (once per group and
        step); the blocks of every object that did not match are load errors, the objects are
        reported to the gateway (background) and each is named in one warning. ``pending``:
        these (async batches), else every one added by :meth:`add_check`. Returns the number of
        objects that did not match."""
        if pending is None:
            pending, self._checks = self._checks, []
        bad_refs: dict[tuple[int, int], list] = {}
        n_bad = 0
        for pc in pending:
            flags = pc.flags.get()
            for col in flags.nonzero()[0].tolist():
                t, c = pc.cols[col]
                gt = pc.transfers[t]
                ref = gt.chunks[c]
                self.no_block_errors(f"stored object {ref.key[:16].hex()} (group {pc.group}) did "
                                     "not match its checksum")
                self.fail([b for b, cc in zip(gt.block_ids, gt.chunk_of, strict=True) if cc == c])
                log.warning("%s: key %s group %d shard %d (slot offset %d, generation %d); its "
                            "blocks are recomputed and the object is reported to the gateway",
                            CORRUPT_LINE, ref.key[:16].hex(), pc.group, pc.shard,
                            ref.offsets[pc.shard], ref.generations[pc.shard])
                bad_refs.setdefault((pc.group, pc.shard), []).append(ref)
                n_bad += 1
        if n_bad:
            self.stats.add("checksum_mismatches", n_bad)
            self._report(bad_refs)
        return n_bad

    def _report(self, bad: dict[tuple[int, int], list]) -> None:
        """CORRUPT for every object, off the engine thread (one thread per step with a
        mismatch: rare). A failure is logged, never raised: the blocks already failed."""
        session = self.session

        def send() -> None:
            for (g, shard), refs in bad.items():
                try:
                    lid = session.layout_ids[g]
                    session.call(f"CORRUPT report of {len(refs)} object(s)",
                                 lambda c, lid=lid, shard=shard, refs=refs:
                                 c.report_corrupt(lid, shard, refs))
                except Exception as e:  # noqa: BLE001 - a report is best effort
                    log.warning("xkv: reporting %d corrupt object(s) to the gateway failed: %s",
                                len(refs), e)

        self._reporters = [t for t in self._reporters if t.is_alive()]
        t = threading.Thread(target=send, name="xkv-corrupt-report", daemon=True)
        t.start()
        self._reporters.append(t)

    def wait_reports(self, timeout_s: float | None = None) -> None:
        """Wait for the CORRUPT reports sent so far (tests, shutdown)."""
        for t in self._reporters:
            t.join(timeout_s)
        self._reporters = [t for t in self._reporters if t.is_alive()]

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
