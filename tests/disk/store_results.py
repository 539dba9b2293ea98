"""Waiting for a ``DiskStore``'s results (its ``done`` queue) in the disk tests."""

from __future__ import annotations

import time


def wait(store, kind, timeout_s=10.0):
    """The next ``kind`` message the store posts (others are skipped); fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not store.done.empty():
            msg = store.done.get_nowait()
            if msg[0] == kind:
                return msg
            continue
        time.sleep(0.001)
    raise AssertionError(f"no {kind} result")
