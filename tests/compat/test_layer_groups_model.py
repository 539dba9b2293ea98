"""bench/layer_groups_model.py: the light step's layer-group model that motivates
``XKV_LOAD_GROUPS=eighths`` (no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import layer_groups_model as M  # noqa: E402


def test_one_group_makes_the_forward_wait_for_the_whole_copy():
    # 4 layers of 1 ms copy each in one launch: the forward starts at 1 + 4 and runs 4 x 0.5
    assert M.step_end_ms([[0, 1, 2, 3]], 1.0, 0.5, issue_ms=1.0, launch_ms=0.0) == 7.0
    # one group per layer: layer i waits for its own copy; the forward (0.5) is faster than the
    # copy (1.0), so the last layer ends half a millisecond after the last copy
    assert M.step_end_ms([[0], [1], [2], [3]], 1.0, 0.5, issue_ms=1.0,
                         launch_ms=0.0) == pytest.approx(5.5)
    # the launches come before the forward's first kernel
    assert M.step_end_ms([[0], [1]], 0.0, 1.0, issue_ms=0.0, launch_ms=0.25) == 2.5


def test_eighths_beat_halves_where_copy_and_forward_per_layer_are_alike():
    t = M.table(32, 0.15, 1.0, 0.13)
    for r in (1.0, 1.15, 1.5):
        assert t[r]["auto"] - t[r]["eighths"] > 0.8, t[r]
    for r in (2.0, 4.0):  # copy-bound: both end one single-layer forward after the copy
        assert t[r]["eighths"] == pytest.approx(t[r]["auto"])
    # with the ring's costlier launches the extra launches lose
    ring = M.table(32, 0.15, 1.0, 0.4)
    assert ring[1.15]["eighths"] > ring[1.15]["auto"]
