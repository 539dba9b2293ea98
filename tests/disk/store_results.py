"""Waiting for a ``DiskStore``'s results (its ``done`` queue) in the disk tests."""

from __future__ import annotations

import os
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


def object_files(disk_dir: str) -> list[str]:
    """Paths of the files in the object directories (``<root>/<digest>/<prefix>/``) of the
    disk tier under ``disk_dir`` (the ``--disk`` directory), sorted: not the files at the
    root, such as the start-up measurement's temporary file (disk_depth.py)."""
    from xkv.gateway.disk_format import ROOT_NAME

    root = os.path.join(disk_dir, ROOT_NAME)
    return sorted(os.path.join(top, f) for top, _, fs in os.walk(root) for f in fs
                  if os.path.relpath(top, root).count(os.sep) == 1)
