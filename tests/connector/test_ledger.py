"""The request ledger (xkv/connector/ledger.py) as a state machine: hypothesis drives it through
any order of lookup, allocation (admission, re-admission after preemption, a parked request
resumed), shipping, per-rank completion reports, abort/finish, gateway loss and shutdown, and
checks after every step that each lease issued is held exactly once, released, or died with its
gateway: none leaked, none released twice, none released while an asynchronous copy that reads
it may still run on some rank."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from xkv.connector.ledger import Lookup, RequestLedger

REQS = st.sampled_from(["a", "b"])


class LedgerMachine(RuleBasedStateMachine):
    @initialize(world=st.integers(1, 3))
    def start(self, world):
        self.world = world
        self.ledger = RequestLedger(world)
        self.next_lease = 1
        self.next_job = 1
        self.issued: set[int] = set()
        self.released: set[int] = set()
        self.dead: set[int] = set()  # held when the gateway was lost: never released
        self.queued: dict[int, tuple[list[int], bool]] = {}  # job -> (leases, async), unshipped
        self.ranks_left: dict[int, int] = {}  # shipped job -> ranks that did not report yet
        self.copying: dict[int, list[int]] = {}  # async job -> leases its copies read

    # ---------------------------------------------------------------- the gateway's side

    def _lease(self) -> int:
        self.next_lease += 1
        self.issued.add(self.next_lease)
        return self.next_lease

    def _release(self, leases):
        for x in leases:
            assert x in self.issued, f"lease {x} was never issued"
            assert x not in self.released, f"lease {x} released twice"
            assert x not in self.dead, f"lease {x} of a lost gateway released on the new one"
            reading = [j for j, ls in self.copying.items() if x in ls]
            assert not reading, f"lease {x} released while async job(s) {reading} still copy"
            self.released.add(x)

    # ---------------------------------------------------------------- events

    # sampled_from, first the common case: hypothesis leans to the first (simplest) value
    @rule(req=REQS, leases=st.sampled_from([1, 2, 0]), ext=st.sampled_from([16, 32, 0]))
    def lookup(self, req, leases, ext):
        ids = [self._lease() for _ in range(leases)] + [None, None]
        lk = Lookup(local=0, num_hashes=4, start=0, hits=ext // 16, ext=ext,
                    lease_id=ids[0], state_lease_id=ids[1])
        self._release(self.ledger.set_lookup(req, lk))

    @precondition(lambda self: self.ledger.lookups)
    @rule(req=REQS)
    def drop_lookup(self, req):
        self._release(self.ledger.drop_lookup(req))

    @rule(req=REQS, take=st.sampled_from([True, False]), is_async=st.sampled_from([True, False]),
          nblocks=st.integers(0, 3))
    def allocate(self, req, take, is_async, nblocks):
        """vLLM allocated blocks: it takes the offered tokens (``take``) or none."""
        lk = self.ledger.lookup(req)
        ext = lk.ext if lk is not None and take else 0
        adm = self.ledger.admit(req, NS(request_id=req), [list(range(nblocks))], ext)
        self._release(adm.release)
        if adm.resumed:
            assert self.ledger.admitted(req).block_ids == [list(range(nblocks))]
            return
        assert adm.lookup is lk
        if ext:
            job_id, self.next_job = self.next_job, self.next_job + 1
            self.ledger.add_load(job_id, NS(req_id=req, job_id=job_id), is_async=is_async)
            leases = self.ledger.jobs[job_id].leases
            assert sorted(leases) == sorted(lk.leases())
            self.queued[job_id] = (leases, is_async)

    @precondition(lambda self: self.ledger.lookups)
    @rule(data=st.data(), is_async=st.sampled_from([True, False]))
    def admit_offered(self, data, is_async):
        """The common case: a request with a cached answer is admitted with what it offered."""
        req = data.draw(st.sampled_from(sorted(self.ledger.lookups)))
        self.allocate(req, True, is_async, 2)

    @precondition(lambda self: self.queued)
    @rule()
    def ship(self):
        sync, async_ = self.ledger.take_loads()
        shipped = [j.job_id for j in sync] + [j.job_id for j in async_]
        assert sorted(shipped) == sorted(self.queued)
        assert all(not self.queued[j.job_id][1] for j in sync)
        assert all(self.queued[j.job_id][1] for j in async_)
        for job_id in shipped:
            leases, is_async = self.queued.pop(job_id)
            self.ranks_left[job_id] = self.world
            if is_async and job_id in self.ledger.jobs:
                self.copying[job_id] = leases

    @precondition(lambda self: self.ranks_left)
    @rule(data=st.data())
    def report(self, data):
        job_id = data.draw(st.sampled_from(sorted(self.ranks_left)))
        n = data.draw(st.integers(1, self.ranks_left[job_id]))
        self.ranks_left[job_id] -= n
        if not self.ranks_left[job_id]:
            del self.ranks_left[job_id]
            self.copying.pop(job_id, None)  # every rank finished copying
        self._release(self.ledger.load_done(job_id, n))

    @precondition(lambda self: self.ledger.requests or self.ledger.lookups)
    @rule(data=st.data())
    def finish(self, data):
        """Finished, or aborted at any point (also while parked, or before shipping)."""
        req = data.draw(st.sampled_from(sorted({*self.ledger.requests, *self.ledger.lookups})))
        self._release(self.ledger.finished(req))

    @rule(req=REQS)
    def finish_unknown(self, req):
        """vLLM finishes requests the connector never saw or already forgot."""
        if req not in self.ledger.requests and req not in self.ledger.lookups:
            self._release(self.ledger.finished(req))

    @precondition(lambda self: self.ledger.held())  # (a no-op step otherwise)
    @rule()
    def gateway_lost(self):
        """A re-attach to another gateway process: what was held died with the old one."""
        self.dead.update(self.ledger.held())
        self.ledger.forget()
        self.copying.clear()  # those copies' leases can never be released, so never early

    # ---------------------------------------------------------------- invariants

    @invariant()
    def every_lease_held_once_released_or_dead(self):
        if not hasattr(self, "ledger"):
            return
        held = self.ledger.held()
        assert len(held) == len(set(held)), f"a lease held twice: {sorted(held)}"
        assert set(held) == self.issued - self.released - self.dead, "a lease leaked"

    @invariant()
    def async_copies_keep_their_leases(self):
        if not hasattr(self, "ledger"):
            return
        held = set(self.ledger.held())
        for job_id, leases in self.copying.items():
            assert set(leases) <= held, f"async job {job_id} copies without its leases"

    def teardown(self):
        if not hasattr(self, "ledger"):
            return
        self.copying.clear()  # shutdown: the worker waited for its copies first
        self._release(self.ledger.close())
        assert self.issued == self.released | self.dead
        assert not self.ledger.held()


TestLedgerMachine = LedgerMachine.TestCase
# pure Python, milliseconds per run: more orders than the profile's default, on every profile
TestLedgerMachine.settings = settings(settings(), max_examples=max(settings().max_examples, 300),
                                      stateful_step_count=40)


def _lk(ext=16, lease=7, state=None):
    return Lookup(local=0, num_hashes=4, start=0, hits=1, ext=ext, lease_id=lease,
                  state_lease_id=state)


def test_async_load_of_aborted_request_keeps_lease_until_every_rank():
    led = RequestLedger(2)
    led.set_lookup("r", _lk(state=8))
    assert led.admit("r", NS(request_id="r"), [[1, 2]], 16).release == []
    led.add_load(1, NS(req_id="r"), is_async=True)
    assert led.take_loads()[1][0].req_id == "r"
    assert led.finished("r") == []  # aborted while both ranks copy
    assert led.load_done(1, 1) == []
    assert sorted(led.load_done(1, 1)) == [7, 8]
    assert led.load_done(1, 1) == []  # a late report: nothing twice
    assert led.held() == []


def test_sync_load_released_at_finish_and_late_report_ignored():
    led = RequestLedger(1)
    led.set_lookup("r", _lk())
    led.admit("r", NS(request_id="r"), [[1]], 16)
    led.add_load(1, NS(req_id="r"), is_async=False)
    assert led.finished("r") == [7]
    assert led.load_done(1, 1) == []


def test_readmission_after_preemption_releases_old_leases_once():
    led = RequestLedger(1)
    led.set_lookup("r", _lk())
    led.admit("r", NS(request_id="r"), [[1]], 16)
    led.add_load(1, NS(req_id="r"), is_async=False)
    led.take_loads()
    led.set_lookup("r", _lk(lease=9))
    adm = led.admit("r", NS(request_id="r"), [[3]], 0)  # preempted, re-admitted, took none
    assert sorted(adm.release) == [7, 9] and not adm.resumed
    assert led.load_done(1, 1) == []  # the old job's report comes late: not released again


def test_parked_request_resumes_with_new_blocks():
    led = RequestLedger(1)
    led.set_lookup("r", _lk())
    led.admit("r", NS(request_id="r"), [[1]], 16)
    led.add_load(1, NS(req_id="r"), is_async=True)
    adm = led.admit("r", NS(request_id="r"), [[1, 2]], 0)
    assert adm.resumed and adm.release == [] and led.admitted("r").block_ids == [[1, 2]]
    assert led.held() == [7]  # still the job's, until every rank reported it


def test_mismatched_admission_releases_the_lookup():
    led = RequestLedger(1)
    led.set_lookup("r", _lk(ext=32))
    adm = led.admit("r", NS(request_id="r"), [[1]], 16)
    assert adm.release == [7] and adm.lookup.ext == 32 and led.held() == []


def test_load_for_request_not_admitted_is_refused():
    led = RequestLedger(1)
    with pytest.raises(KeyError, match="'x'"):
        led.add_load(1, NS(req_id="x"), is_async=False)
    with pytest.raises(ValueError, match="world_size=0"):
        RequestLedger(0)


def test_claim_saves_skips_stored_chunks_and_advances():
    led = RequestLedger(1)
    led.set_lookup("r", Lookup(local=0, num_hashes=8, start=1, hits=2, ext=0, lease_id=None))
    led.admit("r", NS(request_id="r"), [[1]], 0)
    new, todo = led.claim_saves("r", 4)
    assert list(new) == [0, 1, 2, 3] and todo == [0, 3]
    assert led.claim_saves("r", 4) == (range(4, 4), [])
