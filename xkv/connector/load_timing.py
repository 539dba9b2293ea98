"""``XKV_TIMING=1``: what one step's restores cost, as one ``XKV_TIMING restore`` log line per step
with loads (:class:`~xkv.connector.cuda_transfer.CudaTransferHandler`; bench/ reads the line).

Fields: ``bytes`` restored (the before-forward tail's included); ``copy_ms``, GPU time of the load
stream from :meth:`LoadTiming.begin` (after the compute stream's work queued before the loads) to
the end of the last group's copies (two timing events; with ``checksum_pass`` "hbm" or "end"
the hashes the load stream waits for are inside it); ``issue_ms``, host time from ``begin`` to
the last launch issued (``issue_cpu_ms``: the engine thread's CPU time in that window, so
``issue_ms - issue_cpu_ms`` is time it waited: for the GIL held by another thread, or off the CPU;
``pre_ms``: from ``begin`` to the first group's planning, the tail's copy and the tables' building
among it); of it ``plan_ms``, validating and uploading the copies, ``launch_ms``,
the launches and their events (``launch_max_ms``: the longest one; a staged restore's unpack
tables are built and uploaded inside its first launch, after its first copy was queued), ``readback_ms``, queueing
the checksum flags' readback; ``tail_ms``, host time of the before-forward (tail) launches;
``launches``, the step's load launches (the tail's aside); ``checked=a/b``, the step's group
restores verified by checksums of those issued; ``GBps`` = bytes / copy_ms;
``imported=a,b`` (only when any): modules first imported between the step's first load and its
end (xkv's or vLLM's, the forward included): a first-time cost inside the step (a first restore
once imported ``numpy.ma`` through ``np.unique``, ~8 ms; ``xkv.kernels._arrays``).

``alloc_retries`` (only when any, and only where the handler counts it: CUDA): how often
torch's caching allocator, inside the window ``begin`` .. ``report`` (the forward included),
found no free block, released its cached memory and retried ``cudaMalloc``; the release
(``cudaFree``) synchronises the device, so the host waits there for every copy queued before
it. stop 48's 8 x 16k step (two engines sharing one H100) spent ~350 ms of host time between
the issue and the first layer while its copy ran, outside every hook: this counted the
candidate, and stop 49's profile of that case (xkv's engine alone on an H100) found 0 retries
(bench/RESULTS.md "stop 49").

``device_allocs`` / ``pinned_allocs`` (only when any, CUDA, like ``alloc_retries``):
``cudaMalloc`` calls of torch's caching allocator (``num_device_alloc``) and page-locked
buffers that :mod:`xkv.kernels.pinned`'s pool allocated in the same window (the forward
included: a count does not say which phase allocated). Both are implicit synchronisations: the
host waits there for the work queued on the device, spinning under CUDA's default scheduling,
so as the engine thread's CPU time. Stop 54's same-engine A/B found unverified restores
spending 4.3-11.5 ms of CPU time before their first copy (``pre_ms``) in 26 of 40 steps,
against 0.8-3.6 for checked ones, with no xkv phase that differs enough to explain it
(bench/RESULTS.md "stop 54"): steps of one side that allocate where the other's do not would
point at such a wait.

``sync_ms`` (only where the handler times it: CUDA): host time the end of the step waited for
the step's loads (``sync_loads``, after the forward): a restore whose load stream ends after the
forward shows here. Stop 50's profile of the MLA model's 32k restore found vLLM's
``get_finished`` hook stalling 0.7-1.0 ms when checked against 0.0-0.15 unchecked (bench/RESULTS.md
"stop 50"); this field puts that wait on every step's line, so a same-engine A/B
(``bench/e2e_ab.py``) reads it without a profile.

``gc_ms`` (only when any): Python garbage collection inside the window ``begin`` .. ``report``
(``gc.callbacks``); and any collection of at least :data:`GC_LOG_MS` anywhere in the process logs
its own ``XKV_TIMING gc`` line (generation, ms, objects collected): vLLM's own steps vary by up to
17 ms with the same copy (bench/RESULTS.md "stop 33", "stop 41"), and a collection is one
candidate the step's other timings cannot name.

``XKV_TIMING=2`` (``watch=True``, :meth:`LoadTiming.watch`): also, when a step's launches take more than
:data:`WATCH_S`, ``faulthandler`` writes every thread's Python stack to stderr (the engine log)
while they still run: what the engine thread waits for, and what the other threads do then.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

WATCH_S = 0.1  # XKV_TIMING=2: launches slower than this dump every thread's stack
GC_LOG_MS = 2.0  # a collection at least this long logs its own line

log = logging.getLogger("xkv.connector")

_TIMINGS: weakref.WeakSet = weakref.WeakSet()  # enabled timings (the handlers')
_gc_t0 = [0.0]


def _on_gc(phase: str, info: dict) -> None:
    """``gc.callbacks``: a collection's time goes to every timing with a step open; a long one
    logs its own line."""
    if not _TIMINGS:  # no enabled timing alive (tests, shutdown): nothing to time or log
        return
    if phase == "start":
        _gc_t0[0] = time.perf_counter()
        return
    dt = time.perf_counter() - _gc_t0[0]
    inside = False
    for t in list(_TIMINGS):
        if t._open:
            t.gc_s += dt
            inside = True
    if dt * 1e3 >= GC_LOG_MS:
        log.info("XKV_TIMING gc generation=%s ms=%.2f collected=%s in_restore=%s",
                 info.get("generation"), dt * 1e3, info.get("collected"), inside)


def _watch_gc(timing: LoadTiming) -> None:
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)
    _TIMINGS.add(timing)


class LoadTiming:
    """One step's restore timing; every method does nothing when ``enabled`` is False or no
    :meth:`begin` opened the step. ``event``: makes a timing event with ``record(stream)`` and
    ``elapsed_time(other)`` in ms (``torch.cuda.Event(enable_timing=True)``)."""

    def __init__(self, enabled: bool, event: Callable[[], Any], watch: bool = False,
                 counters: Callable[[], Mapping[str, int]] | None = None) -> None:
        """``counters``: counts so far by field name (the CUDA handler's ``alloc_retries``,
        ``device_allocs`` and ``pinned_allocs``: one read of ``torch.cuda.memory_stats`` and
        the pinned pool's count), read at ``begin`` and ``report``; each one that grew in
        between is on the line as ``name=delta``, in the mapping's order. None: none counted."""
        self.enabled, self._event, self._watch = enabled, event, enabled and watch
        self._counters = counters if enabled else None
        self._counts0: Mapping[str, int] = {}
        self._open = False
        self.gc_s = 0.0
        if enabled:
            _watch_gc(self)

    def begin(self, stream) -> None:
        """A step's loads start on ``stream``."""
        if not self.enabled:
            return
        # the counts first: reading torch's memory stats takes host time, kept out of pre_ms
        if self._counters is not None:
            self._counts0 = dict(self._counters())
        self._start = self._event()
        self._start.record(stream)
        self._end = None
        self._host0 = self._host1 = time.perf_counter()
        self._cpu0 = self._cpu1 = time.thread_time()
        self._first_plan: float | None = None
        self.nbytes, self.launches, self.plan_s, self.tail_s = 0, 0, 0.0, 0.0
        self.launch_s = self.readback_s = self.launch_max_s = self.gc_s = 0.0
        self.sync_s: float | None = None
        self.groups = self.checked = 0
        # a count, not a copy: a set of the engine's ~5000 module names cost 0.75 ms of each
        # restore's issue (stop 43's profile); imports only add keys, in order
        self._mods = len(sys.modules)
        self._open = True

    def planned(self, seconds: float, started: float | None = None) -> None:
        """Host time spent validating and uploading a group's copies (from ``started``, a
        ``time.perf_counter()`` reading: the first group's gives ``pre_ms``)."""
        if self._open:
            self.plan_s += seconds
            if started is not None and self._first_plan is None:
                self._first_plan = started

    def watch(self) -> None:
        """``XKV_TIMING=2``: arm the stack dump for the launches about to be issued."""
        if self._open and self._watch:
            faulthandler.dump_traceback_later(WATCH_S, repeat=False, file=sys.stderr)

    def unwatch(self) -> None:
        if self._open and self._watch:
            faulthandler.cancel_dump_traceback_later()

    def launched(self, seconds: float, longest: float = 0.0) -> None:
        """Host time spent in a group's launches (and their events); ``longest``: of one."""
        if self._open:
            self.launch_s += seconds
            self.launch_max_s = max(self.launch_max_s, longest)

    def read_back(self, seconds: float) -> None:
        """Host time spent queueing a group's flags readback."""
        if self._open:
            self.readback_s += seconds

    def issued(self, nbytes: int, launches: int, stream, checked: bool = False) -> None:
        """A group's copies are issued on ``stream``: ``nbytes``, in ``launches`` launches,
        ``checked`` (verified by checksums) or not."""
        if not self._open:
            return
        self._host1 = time.perf_counter()
        self._cpu1 = time.thread_time()
        self.nbytes += nbytes
        self.launches += launches
        self.groups += 1
        self.checked += int(checked)
        self._end = self._event()
        self._end.record(stream)

    def tail(self, nbytes: int, seconds: float) -> None:
        """A before-forward (tail) copy of ``nbytes`` that took ``seconds`` of host time."""
        if self._open:
            self.nbytes += nbytes
            self.tail_s += seconds

    def synced(self, seconds: float) -> None:
        """The end of the step waited ``seconds`` for its loads (host time)."""
        if self._open:
            self.sync_s = seconds

    def report(self) -> str | None:
        """The step's line once its copies finished (the caller synchronised the stream), or
        None (off, or no group issued); closes the step."""
        if not self._open:
            return None
        self._open = False
        if self._end is None:
            return None
        ms = self._start.elapsed_time(self._end)
        pre = (self._first_plan if self._first_plan is not None else self._host1) - self._host0
        new = sorted(list(sys.modules)[self._mods:]) if len(sys.modules) > self._mods else []
        more = f" imported={','.join(new)[:400]}" if new else ""
        more += f" gc_ms={self.gc_s * 1e3:.2f}" if self.gc_s else ""
        if self._counters is not None:
            for name, n in self._counters().items():
                d = n - self._counts0.get(name, 0)
                more += f" {name}={d}" if d else ""
        more += f" sync_ms={self.sync_s * 1e3:.2f}" if self.sync_s is not None else ""
        return (f"XKV_TIMING restore bytes={self.nbytes} copy_ms={ms:.2f} "
                f"issue_ms={(self._host1 - self._host0) * 1e3:.2f} "
                f"issue_cpu_ms={(self._cpu1 - self._cpu0) * 1e3:.2f} pre_ms={pre * 1e3:.2f} "
                f"plan_ms={self.plan_s * 1e3:.2f} "
                f"launch_ms={self.launch_s * 1e3:.2f} launch_max_ms={self.launch_max_s * 1e3:.2f} "
                f"readback_ms={self.readback_s * 1e3:.2f} "
                f"tail_ms={self.tail_s * 1e3:.2f} launches={self.launches} "
                f"checked={self.checked}/{self.groups} "
                f"GBps={self.nbytes / ms / 1e6 if ms else 0.0:.1f}{more}")
