"""``XKV_PROFILE_ISSUE=N[,SKIP]``: where the engine thread's time goes when it issues a restore.

On the H100 of stop 42 (bench/RESULTS.md) a restore step's issue (``start_load_kv``, from its
first load to its last launch) took 4-6 ms at every size, 35 MB to 4.3 GB, of which planning,
launches, the checksum readback and the tail's copy explain 3.7 ms; the same host path on the
2-core CPU box takes 0.56 ms (``bench/host_issue.py``). ``XKV_TIMING`` names the phases; this
names the functions: the ``N`` steps with loads after the first ``SKIP`` (default 4: the engine's
warmup restores) run ``start_load_kv`` under ``cProfile``, and once the ``N``-th is done their
summed profile is logged, as ``XKV_PROFILE_ISSUE`` lines (the top functions by own time, then by
cumulative time); a process that ends before the ``N``-th logs the steps it profiled at exit. The profiled steps are slower (cProfile's own cost): use it in a profiling
run (``bench/profile_steps.py``), not when measuring TTFT. Unset or ``0``: nothing is wrapped.
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


class IssueProfiler:
    """Runs ``call(fn, loads)``: ``fn()`` plain, or under cProfile for steps ``SKIP + 1`` ..
    ``SKIP + N`` of those with ``loads``; the summed profile is logged after the last one."""

    def __init__(self, steps: int, skip: int = SKIP):
        self.steps, self.skip = int(steps), int(skip)
        self._seen = 0
        self._prof: cProfile.Profile | None = None

    @property
    def enabled(self) -> bool:
        return self.steps > 0 and self._seen < self.skip + self.steps

    def call(self, fn: Callable[[], None], loads: bool) -> None:
        if not (loads and self.enabled):
            fn()
            return
        self._seen += 1
        if self._seen <= self.skip:
            fn()
            return
        if self._prof is None:
            self._prof = cProfile.Profile()
            atexit.register(self.flush)  # fewer steps than N before the process ends
        try:
            self._prof.runcall(fn)
        finally:
            if self._seen == self.skip + self.steps:
                self.flush()

    def flush(self) -> None:
        """Log the steps profiled so far (once; nothing when none was)."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        atexit.unregister(self.flush)
        done = self._seen - self.skip
        for order in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(order).print_stats(TOP)
            log.info("XKV_PROFILE_ISSUE %d restore steps' start_load_kv, by %s:", done, order)
            for line in buf.getvalue().splitlines():
                if line.strip():
                    log.info("XKV_PROFILE_ISSUE %s", line.rstrip())
