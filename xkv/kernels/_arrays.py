"""Index-array checks of the restore path that cost the same on the first call as on every other.

``np.unique`` imports ``numpy.ma`` the first time it runs (numpy 2.x: 8-9 ms on the 2-core dev box),
and vLLM does not import it: the first restore of a process paid that inside its step (found by a
cProfile of the first vs a later restore on vLLM's CPU engine, 2026-12-05). A sort does the same
job here and imports nothing.
"""

from __future__ import annotations

import numpy as np


def has_duplicates(a: np.ndarray) -> bool:
    """Whether the 1-D integer array ``a`` holds some value twice."""
    if a.size < 2:
        return False
    s = np.sort(a, kind="stable")
    return bool((s[1:] == s[:-1]).any())


def first_occurrences(a: np.ndarray) -> np.ndarray:
    """Indices (int64) of the first occurrence of each distinct value of the 1-D array ``a``, in
    ascending order of the values: ``np.unique(a, return_index=True)[1]``."""
    if not a.size:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(a, kind="stable")
    s = a[order]
    keep = np.ones(a.size, dtype=bool)
    keep[1:] = s[1:] != s[:-1]
    return order[keep].astype(np.int64, copy=False)
