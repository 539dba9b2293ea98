"""A worker's slow gateway work, off the engine thread: letting go of the card, attaching again.

Why: a worker that turns off (its gateway died) used to drain its commit thread, unregister the
card (``cudaHostUnregister``) and unmap it inside ``get_finished``, on vLLM's engine thread; the
first requests after a gateway SIGKILL took 1.0-5.6 s on the H200 (issue 27), growing with the
card. Attaching again (HELLO, map, ``cudaHostRegister`` of the whole card) cost the same in
``bind``. Measured on the H200 (``bench/cuda_register_lock.py``, 16 GiB memfd card, a thread
issuing CUDA work meanwhile): munmap takes 1.16 s and blocks nobody off the engine thread, but
``cudaHostUnregister`` (0.27 s) and ``cudaHostRegister`` (0.68 s) block *every* CUDA call of the
process for their whole duration, whichever thread makes them (a driver lock, not the GIL). So
a thread alone is not enough: the unregister must also run when the engine does not need the GPU.

:class:`OffPath` owns one daemon thread per worker rank:

* ``release(old, fences)``: the engine thread has already taken the card away from the session
  (``GatewaySession.detach``: no load or save issued from now on sees it) and recorded one CUDA
  event on every connector stream that may still read or write it (:func:`record_fences`: the
  load and save streams, the fan-out copy stream, the compute stream). The card is *retired*:
  still registered and mapped, touched by nobody. The thread lets go of it in steps, each
  taken only once the engine has been idle for ``idle_s`` (no step bound meanwhile,
  :meth:`note_step`): first it waits for those events and for the commit thread to send what it
  holds (bounded); then it unregisters the card one segment per step (the card is pinned in
  segments, ``card_pin``: one step holds the driver's lock for one segment, ~17 ms per GiB on
  the H200), at least ``step_gap_s`` and at least the last step's duration apart, so that
  engine CUDA calls queued on the lock get it and a step the engine binds meanwhile stops the
  release until the next idle gap; the last step closes the client, which unmaps the card (the
  unmap stalls nobody). A request that arrives during the release waits for one segment's
  unregister at most. Before an attach (which registers a card) the rest is let go without
  waiting for idleness (still one segment per step, with the gaps), and at :meth:`close` at
  once. A busy engine keeps the dead gateway's card (its RAM) until it idles.
* ``attach()``: let go of a retired card, then probe the gateway and connect afresh
  (``GatewaySession.connect_fresh``: HELLO, map, register). Its result is taken by the engine
  thread at a step boundary (:meth:`take_attached`, then ``GatewaySession.adopt``): the card and
  epoch that loads read change between steps only, never under a step.

Jobs run in submission order, so an old card is unregistered before a new one is registered.
The thread sets the CUDA device of the caches first (``torch.cuda.set_device``): the runtime
calls it makes act on that device's context. The engine thread never waits here except
(a) :meth:`take_attached` with a wait (bounded by the caller: one lookup deadline normally; a
multi-group model whose promised loads need the new card waits for it, since vLLM cannot take
their load errors), and (b) :meth:`close` at shutdown.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

log = logging.getLogger("xkv.connector")

#: Seconds without a step after which a retired card is let go (see the module docstring).
IDLE_S = 1.0
#: How long the release job waits for the commit thread before letting go anyway (seconds):
#: its batches wait on fences this job already waited for, then fail fast (the session is off).
DRAIN_S = 10.0
#: Least seconds between two release steps (also at least the last step's duration: the thread
#: holds the driver's lock half the time at most while the engine may want it).
STEP_GAP_S = 0.02


class _Retired:
    """A card being let go: ``old`` = ``[client, card]``, the CUDA events to wait for first,
    whether that wait (and the commit drain) is done, steps taken, seconds spent in them."""

    __slots__ = ("old", "fences", "drained", "steps", "busy_s")

    def __init__(self, old: list, fences: list):
        self.old, self.fences = old, fences
        self.drained, self.steps, self.busy_s = False, 0, 0.0


def record_fences(owners: Iterable[Any], device: Any) -> list:
    """One CUDA event recorded now on every stream of ``owners`` (any ``torch.cuda.Stream``
    attribute: a transfer handler's load/save streams, the fan-out copy stream) and on the
    device's current stream; ``[]`` off CUDA. Recording never waits for the GPU."""
    if device is None or getattr(device, "type", None) != "cuda":
        return []
    streams = [torch.cuda.current_stream(device)]
    for o in owners:
        for v in vars(o).values() if o is not None and hasattr(o, "__dict__") else ():
            if isinstance(v, torch.cuda.Stream) and all(v != s for s in streams):
                streams.append(v)
    return [s.record_event() for s in streams]


class OffPath:
    """The background jobs of one worker rank's gateway session (see the module docstring).

    ``session``: the worker's ``GatewaySession``; ``drain(timeout_s) -> bool``: waits for the
    commit thread (``Saver.wait_committed``); ``device``: the caches' device (set at
    ``register_kv_caches``; None = CPU, no device calls)."""

    def __init__(self, session: Any, drain: Callable[[float], bool], *, name: str = "xkv-offpath"):
        self.session = session
        self._drain = drain
        self.name = name
        self.device: Any = None
        self._cv = threading.Condition()
        self._jobs: deque[Callable[[], None]] = deque()
        self._busy = 0  # jobs queued or running
        self._thread: threading.Thread | None = None
        self._closed = False
        self._attaching = False
        self._attached: tuple | None = None  # connect_fresh's result, not yet taken
        self._retired: list[_Retired] = []  # cards to let go, oldest first
        self._last_step = time.monotonic()
        self._not_before = 0.0  # monotonic time before which no release step starts
        #: Seconds without a step after which the engine counts as idle (a retired card is let
        #: go then: its unregister stalls every CUDA call of the process).
        self.idle_s = IDLE_S
        #: Least seconds between two release steps (see :data:`STEP_GAP_S`).
        self.step_gap_s = STEP_GAP_S
        #: Seconds the release of the last card took on the thread (events, drain, every
        #: unregister step, unmap; not the waits between steps), and its number of steps.
        self.last_release_s = 0.0
        self.last_release_steps = 0

    # ------------------------------------------------------------------ engine thread

    @property
    def attaching(self) -> bool:
        """An attach was submitted and its result not taken yet."""
        with self._cv:
            return self._attaching

    def note_step(self) -> None:
        """The engine bound a step (its thread; one clock read): it is not idle."""
        self._last_step = time.monotonic()

    def release(self, old: list | None, fences: list) -> None:
        """Retire ``old`` (``GatewaySession.detach``'s ``[client, card]``): let go of it once
        ``fences`` completed, the commit thread drained, and the engine is idle (or an attach or
        close comes first); returns at once."""
        if old is None:
            return
        r = _Retired(old, fences)
        with self._cv:
            if not self._closed:
                self._retired.append(r)
                self._start()
                self._cv.notify_all()
                return
        self._release_all([r], gaps=False)  # shutting down: no thread would do it later

    def attach(self) -> None:
        """Probe and connect afresh in the background (no-op while one is under way)."""
        with self._cv:
            if self._attaching:
                return
            self._attaching = True
        self._submit(self._attach)

    def take_attached(self, wait_s: float | None = 0.0) -> tuple | None:
        """The finished attach's ``(client, infos, card)`` (for ``GatewaySession.adopt``), or
        None: none submitted, it failed, or it is still running after ``wait_s`` seconds
        (None: until it ends)."""
        with self._cv:
            if self._attaching and wait_s != 0:
                self._cv.wait_for(lambda: self._attached is not None or not self._attaching,
                                  timeout=wait_s)
            att, self._attached = self._attached, None
            if att is not None:
                self._attaching = False
            return att

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until every submitted job ran and every retired card was let go (which waits for an
        idle engine); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._busy == 0 and not self._retired,
                                     timeout=timeout_s)

    @property
    def retired(self) -> int:
        """Cards retired and not let go yet."""
        with self._cv:
            return len(self._retired)

    def close(self, timeout_s: float = 30.0) -> list | None:
        """Run what is queued and let go of retired cards now (up to ``timeout_s``), then let
        the thread end. Returns an attach result nobody took (its card is registered: the
        caller lets it go) or None."""
        with self._cv:
            self._closed = True  # retired cards go now; the thread ends once nothing is left
            self._cv.notify_all()
        if not self.wait(timeout_s):
            log.warning("xkv: %s still letting go of a card after %.0f s at shutdown",
                        self.name, timeout_s)
        with self._cv:
            att, self._attached, self._attaching = self._attached, None, False
        return None if att is None else [att[0], att[2]]

    def _submit(self, job: Callable[[], None]) -> None:
        with self._cv:
            if not self._closed:
                self._jobs.append(job)
                self._busy += 1
                self._start()
                self._cv.notify_all()
                return
        job()  # shutting down: no thread would run it later

    def _start(self) -> None:
        if self._thread is None:  # under self._cv
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the thread

    def _next(self) -> Callable[[], None] | None:
        """The next thing to do (under self._cv, waiting as needed); None: end the thread."""
        while True:
            if self._jobs:
                return self._jobs.popleft()
            now = time.monotonic()
            idle_for = now - self._last_step
            if self._retired and (self._closed or (idle_for >= self.idle_s
                                                   and now >= self._not_before)):
                r = self._retired[0]
                self._busy += 1
                return lambda: self._step(r, gap=not self._closed)
            if self._closed and not self._retired:
                return None
            wait = max(self.idle_s - idle_for, self._not_before - now)
            self._cv.wait(max(0.005, wait) if self._retired else None)

    def _run(self) -> None:
        if self.device is not None and getattr(self.device, "type", None) == "cuda":
            # the runtime calls below (event waits, cudaHostUnregister/Register) act on the
            # current device of this thread: the caches' one, as on the engine thread
            torch.cuda.set_device(self.device)
        while True:
            with self._cv:
                job = self._next()
            if job is None:
                return
            try:
                job()
            except Exception:
                log.exception("xkv: %s: a background gateway job failed", self.name)
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

    def _step(self, r: _Retired, gap: bool) -> bool:
        """One release step of ``r`` (the first of ``_retired``; only this thread pops it):
        the fences and the drain, or one segment's unregister, and after the last one the
        unmap. Sets the earliest start of the next step when ``gap``. True when ``r`` is gone."""
        t0 = time.perf_counter()
        done = False
        if not r.drained:
            for ev in r.fences:
                ev.synchronize()  # no copy or kernel issued before the detach still runs
            if not self._drain(DRAIN_S):
                log.warning("xkv: %s: save commits still pending after %.0f s; letting go of "
                            "the card anyway (their copies are done; the gateway's write TTL "
                            "frees their slots)", self.name, DRAIN_S)
            r.drained = True
        elif self.session.unpin_step(r.old) == 0:
            self.session.let_go(r.old)  # nothing registered left: unmap, close the client
            done = True
        dt = time.perf_counter() - t0
        r.steps, r.busy_s = r.steps + 1, r.busy_s + dt
        with self._cv:
            if gap:
                self._not_before = time.monotonic() + max(self.step_gap_s, dt)
            if done:
                if self._retired and self._retired[0] is r:
                    self._retired.pop(0)
                self.last_release_s, self.last_release_steps = r.busy_s, r.steps
        if done:
            log.debug("xkv: %s: card released in %d steps, %.2f s on this thread", self.name,
                      r.steps, r.busy_s)
        return done

    def _release_all(self, rs: list[_Retired], gaps: bool) -> None:
        """Let go of ``rs`` now, step by step (``gaps``: with the pauses between steps)."""
        for r in rs:
            while True:
                t0 = time.perf_counter()
                if self._step(r, gap=False):
                    break
                if gaps:
                    time.sleep(max(self.step_gap_s, time.perf_counter() - t0))

    def _attach(self) -> None:
        att = None
        try:
            with self._cv:  # a retired card goes first: never two registered at once
                retired, self._retired = self._retired, []
            self._release_all(retired, gaps=True)
            # commits of the old session go first (they fail fast while it is off); sent later,
            # to the new gateway, they would count as failures of the fresh session
            self._drain(DRAIN_S)
            att = self.session.connect_fresh()
        finally:
            with self._cv:
                self._attached = att
                if att is None:
                    self._attaching = False
                self._cv.notify_all()
