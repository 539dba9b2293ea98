"""``XKV_PROFILE_ISSUE=N[,SKIP]``: where the engine thread's time goes when it issues a restore.

On the H100 of stop 42 (bench/RESULTS.md) a restore step's issue (``start_load_kv``, from its
first load to its last launch) took 4-6 ms at every size, 35 MB to 4.3 GB, of which planning,
launches, the checksum readback and the tail's copy explain 3.7 ms; the same host path on the
2-core CPU box takes 0.56 ms (``bench/host_issue.py``). ``XKV_TIMING`` names the phases; this
names the functions: the ``N`` steps with loads after the first ``SKIP`` (default 4: the engine's
warmup restores) run ``start_load_kv`` under ``cProfile``, and once the ``N``-th is done their
summed profile is logged, as ``XKV_PROFILE_ISSUE`` lines (the top functions by own time, then by
cumulative time); a process that ends before the ``N``-th logs the steps it profiled at exit.
Steps whose loads all carry checksum words and steps with some that do not (``"checked"`` /
``"unverified"``, e.g. ``allow_unverified_requests``) are profiled apart, ``N`` of each: on stop
43's H100 the unverified requests of a verifying engine spent 3-10 ms more before their first
copy (``XKV_TIMING`` ``pre_ms``), which no phase names. The profiled steps are slower
(cProfile's own cost): use it in a profiling run (``bench/profile_steps.py``), not when
measuring TTFT. Unset or ``0``: nothing is wrapped.
"""

from __future__ import annotations

import atexit
import cProfile
import io
import logging
import os
import pstats
from collections.abc import Callable

log = logging.getLogger("xkv.connector")

SKIP = 4  # steps with loads not profiled first (warmup restores)
TOP = 30  # functions listed per ordering


def from_env(env: dict | None = None) -> IssueProfiler:
    """The profiler ``XKV_PROFILE_ISSUE`` asks for (off when unset or ``0``)."""
    v = (os.environ if env is None else env).get("XKV_PROFILE_ISSUE", "0").strip()
    try:
        parts = [int(x) for x in v.split(",")]
        if len(parts) > 2 or min(parts) < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"XKV_PROFILE_ISSUE={v!r}: expected N or N,SKIP (steps, non-negative "
                         "integers), e.g. 20 or 20,4") from None
    return IssueProfiler(parts[0], parts[1] if len(parts) == 2 else SKIP)


def step_kind(loads) -> str:
    """``"checked"`` when every group transfer of the step's ``loads`` (``TransferJob``) came with
    checksum words, else ``"unverified"``."""
    ok = all(gt.checks for job in loads for gt in job.groups)
    return "checked" if ok else "unverified"


class IssueProfiler:
    """Runs ``call(fn, loads, kind)``: ``fn()`` plain, or under cProfile for the first ``N``
    steps of each ``kind`` among those with ``loads`` after the first ``SKIP`` of them; each
    kind's summed profile is logged after its last one. ``kind``: a label the caller gives the
    step (the connector: ``"checked"`` or ``"unverified"``, so a run that restores both ways,
    ``bench/e2e_ttft.py --ab-unverified``, gets one profile of each)."""

    def __init__(self, steps: int, skip: int = SKIP):
        self.steps, self.skip = int(steps), int(skip)
        self._seen = 0
        self._profs: dict[str, cProfile.Profile] = {}  # kinds being profiled
        self._done: dict[str, int] = {}  # steps profiled per kind met

    @property
    def enabled(self) -> bool:
        """Whether a step may still be profiled (every kind met so far done: no)."""
        return self.steps > 0 and (self._seen < self.skip or not self._done
                                   or any(n < self.steps for n in self._done.values()))

    def call(self, fn: Callable[[], None], loads: bool, kind: str = "") -> None:
        if not (loads and self.enabled):
            fn()
            return
        self._seen += 1
        done = self._done.setdefault(kind, 0)  # met: enabled until its N steps are profiled
        if self._seen <= self.skip or done >= self.steps:
            fn()
            return
        prof = self._profs.get(kind)
        if prof is None:
            if not self._profs:
                atexit.register(self.flush)  # fewer steps than N before the process ends
            prof = self._profs[kind] = cProfile.Profile()
        try:
            prof.runcall(fn)
        finally:
            self._done[kind] = done + 1
            if done + 1 == self.steps:
                self._log(kind)

    def flush(self) -> None:
        """Log every kind's steps profiled so far (once each; nothing when none was)."""
        for kind in list(self._profs):
            self._log(kind)

    def _log(self, kind: str) -> None:
        prof = self._profs.pop(kind, None)
        if prof is None:
            return
        if not self._profs:
            atexit.unregister(self.flush)
        label = f"{kind} " if kind else ""
        for order in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(order).print_stats(TOP)
            log.info("XKV_PROFILE_ISSUE %d %srestore steps' start_load_kv, by %s:",
                     self._done.get(kind, 0), label, order)
            for line in buf.getvalue().splitlines():
                if line.strip():
                    log.info("XKV_PROFILE_ISSUE %s", line.rstrip())
