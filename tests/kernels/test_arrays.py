"""``xkv.kernels._arrays``: the restore path's duplicate and first-occurrence checks agree with
``np.unique`` on any input, and import nothing on their first call (``np.unique`` imports
``numpy.ma`` then: a cost the first restore of a process paid inside its step)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from xkv.kernels._arrays import first_occurrences, has_duplicates

ROOT = Path(__file__).resolve().parents[2]
ints = st.lists(st.integers(-(2**62), 2**62) | st.integers(0, 6), max_size=300)


@settings(max_examples=300, deadline=None)
@given(ints)
def test_agree_with_np_unique(values):
    a = np.array(values, dtype=np.int64)
    assert has_duplicates(a) == (np.unique(a).size != a.size)
    got = first_occurrences(a)
    assert got.dtype == np.int64
    assert np.array_equal(got, np.unique(a, return_index=True)[1])


def test_edges():
    assert not has_duplicates(np.zeros(0, np.int64)) and not has_duplicates(np.array([7]))
    assert has_duplicates(np.array([3, 1, 3])) and not has_duplicates(np.array([3, 1, 2]))
    assert first_occurrences(np.zeros(0, np.int64)).tolist() == []
    assert first_occurrences(np.array([5, 2, 5, 2, 9])).tolist() == [1, 0, 4]


def test_first_call_imports_nothing():
    code = ("import sys, numpy as np; from xkv.kernels import _arrays as A; m = set(sys.modules); "
            "A.has_duplicates(np.array([3, 1, 3])); A.first_occurrences(np.array([2, 2, 1])); "
            "print(sorted(set(sys.modules) - m))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"
