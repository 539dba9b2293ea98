"""The scheduler side's request ledger: every request's leases, save progress and load jobs.

A pure state machine (no gateway, no vLLM, no tensors; the model is the gateway's ``Index``):
each method applies one event of a request's life and returns the lease ids that nothing holds
any more, which the caller releases on the gateway (exactly once: a lease id leaves the ledger
the moment it is handed back). Every lease lives in exactly one place at a time:

* a cached LOOKUP answer (:class:`Lookup`, ``lookups[req]``) holds its leases while vLLM may
  ask the same question again;
* an admitted request (:class:`Admitted`) holds its lookup's leases from ``admit`` until the load
  job that reads them is added (``add_load``), a moment later in the same call of vLLM;
* a load job (:class:`LoadJob`) holds them until every rank reported it done; a synchronous job
  also until its request finishes or is re-admitted (its copies ran inside the step that was
  scheduled with it), an asynchronous one never before every rank finished copying (its request
  may be aborted while a rank still reads the slots: vLLM keeps the blocks until then).

Events: ``set_lookup`` / ``drop_lookup`` (an answer cached, replaced or dropped), ``admit``
(blocks allocated: a new admission, a re-admission after preemption, or a parked request
scheduled after its asynchronous load), ``add_load`` (the load job planned for the admission),
``take_loads`` (the step ships the queued jobs), ``load_done`` (ranks finished a job),
``finished`` (the request finished or was aborted), ``forget`` (a re-attach to another gateway
process: the old one's leases died with it and are never released on the new one), ``close``
(shutdown: everything still held). ``tests/connector/test_ledger.py`` drives it through every
order of these with hypothesis' state machine: no lease is leaked, none released twice, none
released while an asynchronous copy may still read it.

Saves are reserved by the scheduler and committed (or aborted) by the workers, so the ledger
keeps only which chunks a request still may save (``next_save_chunk``) and which the gateway
already reported stored (``present``); the gateway's write TTL is the backstop for a reservation
whose worker never answered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Lookup:
    """A LOOKUP answer, reused while vLLM asks the same question again (``local``,
    ``num_hashes``). ``slots``/``state_slots``/``keys`` are the scheduler's (opaque here)."""

    local: int  # tokens vLLM already had (block aligned)
    num_hashes: int
    start: int  # first chunk looked up
    hits: int  # chunks present from `start`
    ext: int  # tokens promised
    lease_id: int | None
    slots: dict[int, list[Any]] = field(default_factory=dict)  # {group: [chunk - start] -> ref}
    keys: list[bytes] = field(default_factory=list)
    state_lease_id: int | None = None  # boundary groups: the lease of the hit boundary's object
    state_slots: dict[int, Any] = field(default_factory=dict)  # {boundary group: ref}
    load_async: bool = False  # restored asynchronously (async_loads.py)
    #: verify_checksums: {group: {chunk key: its words, all shards}} as the LOOKUPs returned them
    checks: dict[int, dict[bytes, bytes]] = field(default_factory=dict)

    def leases(self) -> list[int]:
        return [x for x in (self.lease_id, self.state_lease_id) if x is not None]


@dataclass
class Admitted:
    """What the scheduler side keeps per admitted request."""

    request: Any
    block_ids: list[list[int]]  # per vLLM KV cache group index
    next_save_chunk: int = 0
    present: set[int] = field(default_factory=set)  # chunks the gateway reported stored
    leases: list[int] = field(default_factory=list)  # its lookup's, until add_load takes them


@dataclass
class LoadJob:
    """A load job the scheduler planned: its request, the leases its copies read under, and
    how many ranks reported it done."""

    req_id: str
    leases: list[int]
    is_async: bool
    done: int = 0


@dataclass(frozen=True)
class Admission:
    """``admit``'s answer: ``resumed`` (a parked request scheduled after its asynchronous load:
    same request, new blocks, nothing else changes), the request's cached ``lookup`` (popped),
    and ``release``: leases nothing holds any more."""

    resumed: bool
    lookup: Lookup | None
    release: list[int]


class RequestLedger:
    """See the module docstring. ``world_size``: ranks that report every load job."""

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: expected at least 1")
        self.world_size = world_size
        self.lookups: dict[str, Lookup] = {}
        self.requests: dict[str, Admitted] = {}
        self.jobs: dict[int, LoadJob] = {}
        self._parked: set[str] = set()  # requests waiting for their asynchronous load
        self._queued: list[tuple[Any, bool]] = []  # (job, async) planned, not yet shipped

    # ------------------------------------------------------------------ lookups

    def lookup(self, req_id: str) -> Lookup | None:
        return self.lookups.get(req_id)

    def set_lookup(self, req_id: str, lk: Lookup) -> list[int]:
        """Cache ``lk`` for ``req_id``; returns the replaced answer's leases."""
        release = self.drop_lookup(req_id)
        self.lookups[req_id] = lk
        return release

    def drop_lookup(self, req_id: str) -> list[int]:
        lk = self.lookups.pop(req_id, None)
        return lk.leases() if lk is not None else []

    # ------------------------------------------------------------------ admission

    def admit(self, req_id: str, request: Any, block_ids: Sequence[Sequence[int]],
              num_external_tokens: int) -> Admission:
        """vLLM allocated ``req_id``'s blocks (``update_state_after_alloc``). The lookup's
        leases go to the request when ``num_external_tokens`` matches what it offered (then
        :meth:`add_load` must follow), else they are released."""
        blocks = [list(b) for b in block_ids]
        lk = self.lookups.pop(req_id, None)
        was_parked = req_id in self._parked
        self._parked.discard(req_id)
        if was_parked and lk is None and req_id in self.requests:
            self.requests[req_id].block_ids = blocks
            return Admission(True, None, [])
        release = []
        if req_id in self.requests:  # re-admitted after preemption: its old leases are useless
            release += self._drop_request(req_id)
        st = Admitted(request=request, block_ids=blocks)
        self.requests[req_id] = st
        if lk is not None:
            st.present.update(range(lk.start, lk.start + lk.hits))
            if num_external_tokens and lk.ext == num_external_tokens:
                st.leases = lk.leases()
            else:
                release += lk.leases()
        return Admission(False, lk, release)

    def add_load(self, job_id: int, job: Any, *, is_async: bool) -> None:
        """The load job of the request just admitted (``job.req_id``): it takes the request's
        lookup leases and is shipped at the next :meth:`take_loads`; an asynchronous one parks
        its request until vLLM schedules it again."""
        st = self.requests.get(job.req_id)
        if st is None:
            raise KeyError(f"xkv: load job {job_id} for request {job.req_id!r}, not admitted")
        if job_id in self.jobs:
            raise ValueError(f"xkv: load job id {job_id} used twice")
        leases, st.leases = st.leases, []
        self.jobs[job_id] = LoadJob(job.req_id, leases, is_async)
        self._queued.append((job, is_async))
        if is_async:
            self._parked.add(job.req_id)

    def admitted(self, req_id: str) -> Admitted | None:
        """The admitted request's record (None when it is not admitted)."""
        return self.requests.get(req_id)

    def others_admitted(self, req_id: str) -> bool:
        """Another request than ``req_id`` is admitted (the engine is busy)."""
        return len(self.requests) > (req_id in self.requests)

    def claim_saves(self, req_id: str, c_end: int) -> tuple[range, list[int]]:
        """Chunks ``[next_save_chunk, c_end)`` become complete in this step: returns them and
        the ones not reported stored (to reserve); later steps start at ``c_end``."""
        st = self.requests[req_id]
        new = range(st.next_save_chunk, c_end)
        st.next_save_chunk = max(st.next_save_chunk, c_end)
        return new, [c for c in new if c not in st.present]

    # ------------------------------------------------------------------ per step

    @property
    def loads_queued(self) -> bool:
        return bool(self._queued)

    def take_loads(self) -> tuple[list[Any], list[Any]]:
        """The queued (synchronous, asynchronous) load jobs, in planning order."""
        q, self._queued = self._queued, []
        return [j for j, a in q if not a], [j for j, a in q if a]

    def load_done(self, job_id: int, ranks: int) -> list[int]:
        """``ranks`` more ranks finished job ``job_id``; its leases once every rank did. A job
        the ledger no longer knows (its request finished, a re-attach) is ignored."""
        job = self.jobs.get(job_id)
        if job is None:
            return []
        job.done += ranks
        if job.done < self.world_size:
            return []
        del self.jobs[job_id]
        return job.leases

    def finished(self, req_id: str) -> list[int]:
        """The request finished or was aborted: every lease it holds except an asynchronous
        copy's (released by :meth:`load_done` once every rank finished it)."""
        self._parked.discard(req_id)
        release = self.drop_lookup(req_id)
        if req_id in self.requests:
            release += self._drop_request(req_id)
        else:
            release += self._drop_jobs(req_id)
        return release

    def forget(self) -> None:
        """A re-attach to another gateway process: its leases, slots and 'stored' answers died
        with the old one (its lease ids may be someone else's on the new one: never released)."""
        for st in self.requests.values():
            st.leases = []
            st.present.clear()
        self.lookups.clear()
        self.jobs.clear()

    def close(self) -> list[int]:
        """Shutdown: every lease still held, once; the ledger is empty afterwards."""
        release = [x for lk in self.lookups.values() for x in lk.leases()]
        release += [x for st in self.requests.values() for x in st.leases]
        release += [x for job in self.jobs.values() for x in job.leases]
        self.lookups.clear()
        self.requests.clear()
        self.jobs.clear()
        self._parked.clear()
        return release

    def held(self) -> list[int]:
        """Every lease the ledger holds (tests: each exactly once)."""
        return ([x for lk in self.lookups.values() for x in lk.leases()]
                + [x for st in self.requests.values() for x in st.leases]
                + [x for job in self.jobs.values() for x in job.leases])

    # ------------------------------------------------------------------ helpers

    def _drop_request(self, req_id: str) -> list[int]:
        st = self.requests.pop(req_id)
        return st.leases + self._drop_jobs(req_id)

    def _drop_jobs(self, req_id: str) -> list[int]:
        """Release the request's synchronous jobs; asynchronous ones stay until done."""
        release = []
        for job_id in [j for j, job in self.jobs.items()
                       if job.req_id == req_id and not job.is_async]:
            release += self.jobs.pop(job_id).leases
        return release
