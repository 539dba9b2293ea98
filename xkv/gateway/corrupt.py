"""The gateway's warning about objects reported corrupt (CORRUPT), rate-limited.

A client whose restore found bytes that did not match their checksum words reports them; the
index removes each reported object whose token is live (removal.py). Each removed object gets one
warning naming its layout's namespace and its key (hex, first 16 bytes), at most
``per_window`` warnings per ``window_s`` seconds: a hostile or broken client that floods reports
cannot flood the log. What was not logged is counted and said in one line when the next window
opens (and always counted in ``corrupt_removed``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

log = logging.getLogger("xkv.gateway")


class CorruptWarnings:
    """``per_window`` warnings per ``window_s`` seconds (``clock``: monotonic seconds)."""

    def __init__(self, per_window: int = 10, window_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.per_window = per_window
        self.window_s = window_s
        self.clock = clock
        self._window_end = float("-inf")
        self._left = 0
        self.suppressed = 0  # not logged in the current window
        self.logged = 0

    def removed(self, objs: Iterable) -> None:
        """Warn about each removed object (index ``Obj``) within the budget; count the rest."""
        for obj in objs:
            now = self.clock()
            if now >= self._window_end:
                if self.suppressed:
                    log.warning("%d more objects were reported corrupt and removed in the last "
                                "%g s (warnings rate-limited; see corrupt_removed)",
                                self.suppressed, self.window_s)
                self._window_end, self._left, self.suppressed = now + self.window_s, \
                    self.per_window, 0
            if self._left <= 0:
                self.suppressed += 1
                continue
            self._left -= 1
            self.logged += 1
            log.warning("restored bytes did not match their checksums: removed namespace %r key "
                        "%s%s from the card (reported by a client; the next lookup misses and "
                        "vLLM recomputes)", obj.layout.namespace, obj.key[:16].hex(),
                        "..." if len(obj.key) > 16 else "")
