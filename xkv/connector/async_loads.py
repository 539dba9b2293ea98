"""Asynchronous restores (``load_mode: "async"`` or ``"auto"``): the request waits, the batch runs.

The default restore (``load_mode: "sync"``) runs inside the step that computes the rest of the
prompt, each layer fenced on its own pages: the whole batch of that step waits for the copies
that attention is not yet hiding. In the asynchronous mode the scheduler answers vLLM's
``get_num_new_matched_tokens`` with ``(n, True)``; vLLM then allocates the request's blocks,
parks it in ``WAITING_FOR_REMOTE_KVS`` (schedules none of its tokens, does not zero the blocks
the load will write) and keeps stepping the other requests. The workers issue the whole restore
of the request (every layer of every group) at ``start_load_kv``, with no per-layer fence, poll
its completion at every ``get_finished`` (a CUDA event's ``query()``; on the CPU the copies ran
inline), check the slot generations as the synchronous path does (a reused slot is a load error,
never wrong bytes) and report the request in ``finished_recving`` once per rank. vLLM schedules
it on the following step with the restored tokens computed.

Contract points (checked in the 0.26/0.28/0.29/0.33 wheels, ``v1/core/sched/scheduler.py``):

* ``(n, True)`` only for ``n > 0`` (vLLM asserts it). vLLM may ask again for a request it could
  not admit; the answer (tokens and mode) is cached per lookup, so it does not change.
* ``update_state_after_alloc`` is called a second time when the parked request is scheduled
  after its load (with 0 external tokens): the request ledger (``ledger.RequestLedger.admit``,
  ``resumed``) keeps the request's state rather than treat it as re-admitted.
* A parked request that is aborted: vLLM itself keeps its blocks until the request id arrives in
  ``finished_recving`` (``finish_requests``: ``delay_free_blocks`` while not received), so
  ``request_finished`` still answers ``False``, every rank still reports the id once, and the
  lease of its data is released only when every rank finished the copy (the ledger's
  ``load_done``), never while a copy may still read the slots.
* Load errors are reported through ``get_block_ids_with_load_errors`` in the step whose
  ``finished_recving`` carries the request (vLLM truncates the request to its valid prefix).

Where it is not used: models with recurrent-state groups (Mamba, linear attention) keep
synchronous restores in every mode. Their restore writes the boundary state and the step's
running state block (``states.py``), and vLLM's ``align`` mode moves state blocks between steps
(``MambaManager.remove_skipped_blocks`` frees the block of two steps ago; the runner copies
boundary -> running before ``start_load_kv``); which blocks a parked request still holds when it
is scheduled has not been verified on a real hybrid engine, and a multi-group model cannot take
a block load error on vLLM <= 0.29 (a wrong guess would crash the engine or leave a zero state).
NVLink fan-out is not used for asynchronous loads (its all-gather runs in
``wait_for_layer_load``, which vLLM never calls for a parked request): each rank copies its
whole share from the card.

No vLLM types. Scheduler half: :class:`AsyncLoadPlanner` (the policy; which jobs are parked and
in flight is the request ledger's); worker half: :class:`AsyncLoadWorker`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from xkv.connector.checksums import session_words
from xkv.connector.config import LOAD_MODES
from xkv.connector.loads import LoadOutcomes, by_group, issue
from xkv.connector.metadata import TransferJob
from xkv.connector.transfer import TransferHandler

log = logging.getLogger("xkv.connector")


# ---------------------------------------------------------------------------- scheduler half


class AsyncLoadPlanner:
    """Scheduler side: which restores are asynchronous (where each one stands: ``ledger.py``).

    ``mode``: ``"sync"`` (never), ``"async"`` (every hit), ``"auto"`` (a hit is asynchronous
    while another request is admitted: that is when a synchronous restore would stall a batch;
    a lone request restores synchronously, which costs it no extra step). ``sync_only``: why
    this model's restores must stay synchronous (it has recurrent-state or sliding-window
    groups: vLLM frees a window's blocks as a request advances, never checked against a parked
    restore), named in the log line; None when nothing forbids asynchronous restores.
    """

    def __init__(self, mode: str, *, sync_only: str | None = None):
        if mode not in LOAD_MODES:
            raise ValueError(f"load_mode={mode!r}: expected one of {LOAD_MODES}")
        self.mode = mode
        self.enabled = mode != "sync" and sync_only is None
        if mode != "sync" and sync_only is not None:
            log.info("xkv: load_mode=%s: this model has %s, its restores stay synchronous "
                     "(docs/architecture.md, Asynchronous restores)", mode, sync_only)
        elif self.enabled:
            log.info("XKV: restores: load_mode %r (%s)", mode, "every hit parked while it copies"
                     if mode == "async" else "parked while another request is admitted, inside "
                     "the step when the engine is idle")

    def choose(self, ext: int, *, busy: bool) -> bool:
        """Whether a hit of ``ext`` tokens is restored asynchronously (``busy``: another
        request is admitted in the engine)."""
        if not self.enabled or ext <= 0:
            return False
        return self.mode == "async" or busy


# ---------------------------------------------------------------------------- worker half


def load_fence(handler: TransferHandler) -> Any:
    """A marker after every load issued so far on ``handler`` (``TransferHandler.load_fence``:
    a CUDA event on its load stream, or None when its copies run inline: already done)."""
    return handler.load_fence()


@dataclass
class _Batch:
    """One step's async loads on one handler: done when ``fence`` is (None: done)."""

    handler: TransferHandler
    fence: Any
    jobs: tuple[TransferJob, ...]
    checks: list = field(default_factory=list)  # loads.PendingCheck of its verified groups


class AsyncLoadWorker:
    """Worker side (one per TP rank): issue a step's async loads, poll them, report them.

    Each step's batch runs on a handler of its own (``new_handler()``, kept in a pool), so a
    finished batch is synced and checked without waiting for a later one; on CUDA each handler
    has its own load stream, ordered after the compute stream at issue (``begin_loads``).
    Load errors, completions and the slot-generation check are the sync path's
    (``loads.LoadOutcomes``); ``pools``: layer -> ``PagePool``.
    """

    def __init__(self, registry: Any, tp_rank: int, outcomes: LoadOutcomes, stats: Any, *,
                 pools: Mapping[str, Any], new_handler: Callable[[], TransferHandler]):
        self.registry, self.tp_rank, self.outcomes, self.stats = registry, tp_rank, outcomes, stats
        self.pools, self.new_handler = pools, new_handler
        self._idle: list[TransferHandler] = []
        self._batches: list[_Batch] = []
        self._finished: set[str] = set()

    @property
    def in_flight(self) -> bool:
        """Copies issued and not yet completed (the card must stay mapped)."""
        return bool(self._batches)

    def start(self, jobs: Iterable[TransferJob], card: Any) -> None:
        """Issue every layer of every job from ``card`` (``LoadOutcomes.usable_card``: None
        when the step's offsets do not belong to a mapped card; the jobs then fail at once and
        are reported)."""
        jobs = tuple(jobs)
        if not jobs:
            return
        if card is None:
            self.outcomes.fail_unusable(jobs)
            self._finished.update(job.req_id for job in jobs)
            return
        t0 = time.perf_counter()
        h = self._idle.pop() if self._idle else self.new_handler()
        h.begin_loads()
        checks: list = []
        issue(h, self.registry, self.tp_rank, card, by_group(jobs), self.pools, self.stats,
              check_words=session_words(self.outcomes.session),
              on_checks=checks.append)
        self._batches.append(_Batch(h, load_fence(h), jobs, checks))
        self.stats.add("seconds_restored", time.perf_counter() - t0)  # host time to issue

    def poll(self, wait: bool = False) -> None:
        """Complete every batch whose copies finished (``wait``: all of them, blocking: before
        the card is let go). Never blocks otherwise."""
        pending = []
        for b in self._batches:
            if wait and b.fence is not None:
                b.fence.synchronize()
            if b.fence is not None and not b.fence.query():
                pending.append(b)
                continue
            b.handler.sync_loads()  # returns at once: its stream is idle (runs the verifier)
            self._idle.append(b.handler)
            self.outcomes.check_stale(b.jobs)
            self.outcomes.check_sums(b.checks)  # its copies landed: read its flags
            for job in b.jobs:
                self.outcomes.finished(job)
                self._finished.add(job.req_id)
        self._batches = pending

    def take_finished(self) -> set[str]:
        """Requests whose async load completed on this rank since the last call (each once)."""
        done, self._finished = self._finished, set()
        return done
