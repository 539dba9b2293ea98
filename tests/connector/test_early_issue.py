"""The hand-over rules of ``XKV_EARLY_ISSUE`` (xkv/connector/early_issue.py), without vLLM: when a
step built by the scheduler side may be issued by the worker at once, and that the step bound
next must be the one issued."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from xkv.connector import early_issue


@dataclass
class Job:
    job_id: int


@dataclass
class Step:
    loads: tuple = ()


def test_the_switch_refuses_other_values(monkeypatch):
    monkeypatch.delenv(early_issue.ENV, raising=False)
    assert early_issue.mode() == "auto" and early_issue.enabled()  # the default
    monkeypatch.setenv(early_issue.ENV, "0")
    assert early_issue.mode() == "0" and not early_issue.enabled()
    monkeypatch.setenv(early_issue.ENV, "1")
    assert early_issue.mode() == "1" and early_issue.enabled()
    for bad in ("yes", "AUTO", ""):
        monkeypatch.setenv(early_issue.ENV, bad)
        with pytest.raises(ValueError, match=f"XKV_EARLY_ISSUE='{bad}': expected 0, 1 or auto"):
            early_issue.enabled()


def test_auto_is_on_only_where_measured_faster():
    why = early_issue.auto_off_reason
    assert why(full_graphs=True, copy_engine=False) == ""
    assert why(full_graphs=False, copy_engine=False) == (
        "no full CUDA graphs with per-layer restore waits")
    assert why(full_graphs=True, copy_engine=True) == "restores may take the copy engine"
    # every combination with a condition missing is off
    for fg in (False, True):
        for ce in (False, True):
            assert (why(full_graphs=fg, copy_engine=ce) == "") == (fg and not ce)


def test_auto_registers_only_an_engine_that_qualifies(monkeypatch, caplog):
    monkeypatch.delenv(early_issue.ENV, raising=False)

    class W:
        """A worker-role façade stand-in (weakly referenced, as the registry holds them)."""

    on, off = W(), W()
    with caplog.at_level("INFO", logger="xkv.connector"):
        early_issue.register("a1", on, world_size=1, fanout=False, auto_why="")
        early_issue.register("a2", off, world_size=1, fanout=False, auto_why="an MLA model")
    assert early_issue.peer("a1") is on and early_issue.peer("a2") is None
    assert early_issue.OFF_LINE.format(why="auto: an MLA model") in caplog.text
    # "1" ignores auto's reasons (an explicit choice), never the single-worker rule
    monkeypatch.setenv(early_issue.ENV, "1")
    forced = W()
    early_issue.register("a3", forced, world_size=1, fanout=False, auto_why="an MLA model")
    assert early_issue.peer("a3") is forced
    early_issue.register("a4", W(), world_size=2, fanout=False, auto_why="")
    assert early_issue.peer("a4") is None


def test_only_a_single_worker_without_fanout_registers(monkeypatch, caplog):
    monkeypatch.setenv(early_issue.ENV, "1")

    class W:
        """A worker-role façade stand-in (weakly referenced, as the registry holds them)."""

    w1, w2, w3 = W(), W(), W()
    early_issue.register("e1", w1, world_size=1, fanout=False)
    with caplog.at_level("INFO", logger="xkv.connector"):
        early_issue.register("e2", w2, world_size=2, fanout=False)
        early_issue.register("e3", w3, world_size=1, fanout=True)
    assert early_issue.peer("e1") is w1
    assert early_issue.peer("e2") is None and early_issue.peer("e3") is None
    assert "world size 2" in caplog.text and "fan-out" in caplog.text
    monkeypatch.setenv(early_issue.ENV, "0")
    early_issue.register("e4", W(), world_size=1, fanout=False)
    assert early_issue.peer("e4") is None  # off: never offered
    del w1
    assert early_issue.peer("e1") is None  # a weak reference: a dropped engine is not kept


def test_a_step_is_issued_early_only_between_steps_on_the_workers_thread():
    h = early_issue.Handover()
    step = Step(loads=(Job(3), Job(4)))
    assert not h.may_issue(step, between_steps=True)  # no step ran on any thread yet
    h.note_thread()
    assert not h.may_issue(Step(), between_steps=True)  # nothing to restore
    assert not h.may_issue(step, between_steps=False)  # the worker is inside a step
    seen = []
    t = threading.Thread(target=lambda: seen.append(h.may_issue(step, between_steps=True)))
    t.start()
    t.join()
    assert seen == [False]  # another thread: another CUDA stream, maybe a step running
    assert h.may_issue(step, between_steps=True)
    h.issued(step)
    assert not h.may_issue(Step(loads=(Job(5),)), between_steps=True)  # one at a time
    assert h.take(Step(loads=(Job(3), Job(4))))  # a copy of the metadata matches by job ids
    assert h.started()  # its start issues nothing
    assert not h.take(step) and not h.started()  # the next step binds and issues as usual


def test_binding_another_step_than_the_one_issued_stops():
    h = early_issue.Handover()
    h.note_thread()
    h.issued(Step(loads=(Job(7),)))
    with pytest.raises(RuntimeError, match=r"load jobs \[8\]\) is not the one .* \[7\]"):
        h.take(Step(loads=(Job(8),)))
