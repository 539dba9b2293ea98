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
  after its load (with 0 external tokens): :meth:`AsyncLoadPlanner.resumed` tells the scheduler
  side to keep the request's state rather than treat it as re-admitted.
* A parked request that is aborted: vLLM itself keeps its blocks until the request id arrives in
  ``finished_recving`` (``finish_requests``: ``delay_free_blocks`` while not received), so
  ``request_finished`` still answers ``False``, every rank still reports the id once, and the
  lease of its data is released only when every rank finished the copy
  (``AsyncLoadPlanner.in_flight``), never while a copy may still read the slots.
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

No vLLM types. Scheduler half: :class:`AsyncLoadPlanner`; worker half: :class:`AsyncLoadWorker`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from xkv.connector.config import LOAD_MODES
from xkv.connector.metadata import GroupTransfer, TransferJob
from xkv.connector.transfer import load_transfers

log = logging.getLogger("xkv.connector")


# ---------------------------------------------------------------------------- scheduler half


class AsyncLoadPlanner:
    """Scheduler side: which restores are asynchronous, and where each one stands.

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
        self.pending: list[TransferJob] = []  # planned in this step, not yet shipped
        self._parked: set[str] = set()  # requests waiting for their async load
        self._in_flight: dict[int, str] = {}  # job id -> request id, until every rank is done

    def choose(self, ext: int, *, busy: bool) -> bool:
        """Whether a hit of ``ext`` tokens is restored asynchronously (``busy``: another
        request is admitted in the engine)."""
        if not self.enabled or ext <= 0:
            return False
        return self.mode == "async" or busy

    def add(self, job: TransferJob) -> None:
        """A planned async load: shipped at the next ``take``; its request is parked."""
        self.pending.append(job)
        self._parked.add(job.req_id)
        self._in_flight[job.job_id] = job.req_id

    def take(self) -> tuple[TransferJob, ...]:
        jobs, self.pending = tuple(self.pending), []
        return jobs

    def resumed(self, req_id: str, has_lookup: bool) -> bool:
        """``update_state_after_alloc`` for ``req_id``: True when this is vLLM scheduling the
        parked request after its load (no new lookup), so its state is kept."""
        was = req_id in self._parked
        self._parked.discard(req_id)
        return was and not has_lookup

    def done(self, job_id: int) -> None:
        """Every rank finished the job's copies (its lease may go)."""
        self._in_flight.pop(job_id, None)

    def in_flight(self, req_id: str) -> set[int]:
        """Jobs of ``req_id`` whose copies may still run on some rank."""
        return {j for j, r in self._in_flight.items() if r == req_id}

    def finished(self, req_id: str) -> None:
        """The request finished (or was aborted); its in-flight jobs stay tracked until done."""
        self._parked.discard(req_id)

    def forget(self) -> None:
        """A re-attach to another gateway process: nothing old is waited for any more."""
        self._in_flight.clear()


# ---------------------------------------------------------------------------- worker half


def load_fence(handler: Any) -> Any:
    """A marker after every load issued so far on ``handler``: a CUDA event on its load stream
    (``CudaTransferHandler``), or None when its copies run inline (``SyncTransferHandler``:
    already done)."""
    stream = getattr(handler, "load_stream", None)
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


@dataclass
class _Batch:
    """One step's async loads on one handler: done when ``fence`` is (None: done)."""

    handler: Any
    fence: Any
    jobs: tuple[TransferJob, ...]


class AsyncLoadWorker:
    """Worker side (one per TP rank): issue a step's async loads, poll them, report them.

    Each step's batch runs on a handler of its own (``new_handler()``, kept in a pool), so a
    finished batch is synced and checked without waiting for a later one; on CUDA each handler
    has its own load stream, ordered after the compute stream at issue (``begin_loads``).
    ``fail(block_ids)`` records load errors; ``no_block_errors(why)`` raises where vLLM cannot
    take them (multi-group models); ``on_done(job_id)`` counts the job finished on this rank
    (for the scheduler's lease release). ``pools`` (layer -> ``PagePool``) is set at register.
    """

    def __init__(self, registry: Any, tp_rank: int, session: Any, stats: Any, *,
                 fail: Callable[[Iterable[int]], None], no_block_errors: Callable[[str], None],
                 on_done: Callable[[int], None]):
        self.registry, self.tp_rank, self.session, self.stats = registry, tp_rank, session, stats
        self._fail, self._no_block_errors, self._on_done = fail, no_block_errors, on_done
        self.pools: dict[str, Any] = {}
        self.new_handler: Callable[[], Any] | None = None
        self._idle: list[Any] = []
        self._batches: list[_Batch] = []
        self._finished: set[str] = set()

    @property
    def in_flight(self) -> bool:
        """Copies issued and not yet completed (the card must stay mapped)."""
        return bool(self._batches)

    def start(self, jobs: Iterable[TransferJob], card: Any, epoch_ok: bool) -> None:
        """Issue every layer of every job (``epoch_ok``: the step's offsets belong to the
        mapped card). Without a usable card the jobs fail at once (and are reported)."""
        jobs = tuple(jobs)
        if not jobs:
            return
        if card is None or not epoch_ok:
            self._no_block_errors("the card is not mapped on this rank, or its gateway changed")
            for job in jobs:
                self._fail(job.block_ids())
                self._complete(job)
            return
        t0 = time.perf_counter()
        h = self._idle.pop() if self._idle else self._make_handler()
        h.begin_loads()
        by_group: dict[int, list[GroupTransfer]] = {}
        for gt in (gt for job in jobs for gt in job.groups):
            by_group.setdefault(gt.group, []).append(gt)
        for g, gts in by_group.items():
            plan = self.registry.groups[g]
            n = load_transfers(h, plan, self.tp_rank, card, gts,
                               [self.pools[name] for name in plan.group.layer_names])
            self.stats.add("blocks_restored", n)
            self.stats.add("bytes_restored", n * plan.group.bytes_all_layers)
        self._batches.append(_Batch(h, load_fence(h), jobs))
        self.stats.add("seconds_restored", time.perf_counter() - t0)  # host time to issue

    def _make_handler(self) -> Any:
        if self.new_handler is None:
            raise RuntimeError("xkv: async load before register_kv_caches")
        return self.new_handler()

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
            for job in b.jobs:
                self._check(job)
                self._complete(job)
        self._batches = pending

    def _check(self, job: TransferJob) -> None:
        """Slot generations of every chunk read, after the copy: a slot reused meanwhile
        makes its blocks load errors."""
        for gt in job.groups:
            shard = self.registry.groups[gt.group].shard_of(self.tp_rank)
            stale = gt.stale_blocks(shard, self.session.slot_generation)
            if stale:
                self._no_block_errors(f"a slot read by request {job.req_id} was reused")
                self._fail(stale)

    def _complete(self, job: TransferJob) -> None:
        self._on_done(job.job_id)
        self._finished.add(job.req_id)

    def take_finished(self) -> set[str]:
        """Requests whose async load completed on this rank since the last call (each once)."""
        done, self._finished = self._finished, set()
        return done
