"""``XKV_PROFILE_ISSUE`` (xkv/connector/issue_profile.py): which steps run under cProfile, the
one summed profile logged after the last, and a clear error for a bad value."""

from __future__ import annotations

import logging

import pytest

from xkv.connector import issue_profile
from xkv.connector.issue_profile import IssueProfiler


def _planning_work():
    return sum(i * i for i in range(2000))


def test_off_by_default_and_for_zero():
    for env in ({}, {"XKV_PROFILE_ISSUE": "0"}, {"XKV_PROFILE_ISSUE": " 0 "}):
        p = issue_profile.from_env(env)
        assert not p.enabled
    p = issue_profile.from_env({"XKV_PROFILE_ISSUE": "20,3"})
    assert (p.steps, p.skip, p.enabled) == (20, 3, True)
    assert issue_profile.from_env({"XKV_PROFILE_ISSUE": "7"}).skip == issue_profile.SKIP


@pytest.mark.parametrize("bad", ["x", "1,2,3", "-1", "2,-1", "1.5", ""])
def test_a_bad_value_names_itself(bad):
    with pytest.raises(ValueError, match="XKV_PROFILE_ISSUE"):
        issue_profile.from_env({"XKV_PROFILE_ISSUE": bad})


def test_the_steps_after_skip_are_profiled_and_logged_once(caplog):
    p = IssueProfiler(steps=2, skip=1)
    calls = []

    def step():
        calls.append(1)
        _planning_work()

    with caplog.at_level(logging.INFO, logger="xkv.connector"):
        p.call(step, loads=False)  # no loads: neither counted nor profiled
        p.call(step, loads=True)  # skipped (warmup)
        assert not p._profs
        p.call(step, loads=True)  # profiled
        assert p._profs and not caplog.records
        p.call(step, loads=True)  # profiled, the last: the summed profile is logged
        lines = [r.getMessage() for r in caplog.records]
        p.call(step, loads=True)  # done: plain again, nothing more logged
    assert len(calls) == 5 and not p.enabled and not p._profs
    assert len(caplog.records) == len(lines)
    assert all(ln.startswith("XKV_PROFILE_ISSUE ") for ln in lines)
    heads = [ln for ln in lines if "restore steps' start_load_kv, by" in ln]
    assert heads == ["XKV_PROFILE_ISSUE 2 restore steps' start_load_kv, by tottime:",
                     "XKV_PROFILE_ISSUE 2 restore steps' start_load_kv, by cumulative:"]
    # the profiled function and its callee are named, with 2 calls each
    assert any("_planning_work" in ln for ln in lines)
    assert any("step)" in ln and ln.split()[1] == "2" for ln in lines)


def test_a_step_that_raises_still_counts_and_the_error_passes():
    p = IssueProfiler(steps=1, skip=0)

    def boom():
        raise RuntimeError("issue failed")

    with pytest.raises(RuntimeError, match="issue failed"):
        p.call(boom, loads=True)
    assert not p.enabled and not p._profs


def test_fewer_steps_than_asked_are_logged_by_flush(caplog):
    """An engine that ends before the N-th step (at exit: ``atexit`` calls ``flush``)."""
    p = IssueProfiler(steps=20, skip=0)
    with caplog.at_level(logging.INFO, logger="xkv.connector"):
        p.flush()  # nothing profiled: nothing logged
        assert not caplog.records
        p.call(_planning_work, loads=True)
        p.call(_planning_work, loads=True)
        assert not caplog.records and p.enabled
        p.flush()
        n = len(caplog.records)
        p.flush()  # once
    assert n > 4 and len(caplog.records) == n
    assert caplog.records[0].getMessage() == (
        "XKV_PROFILE_ISSUE 2 restore steps' start_load_kv, by tottime:")


def test_each_kind_gets_its_own_n_steps_and_profile(caplog):
    """Checked and unverified steps interleaved (an A/B run): N of each are profiled after the
    skipped ones, each kind's profile logged after its N-th, with its label."""
    from xkv.connector.metadata import ChunkRef, GroupTransfer, TransferJob

    def job(checks):
        gt = GroupTransfer(0, (1,), (0,), (0,), (ChunkRef(b"k", (0,), (0,)),), checks=checks)
        return TransferJob(1, "r", (gt,), 16)

    assert issue_profile.step_kind([job((b"w" * 8,))]) == "checked"
    assert issue_profile.step_kind([job((b"w" * 8,)), job(())]) == "unverified"
    p = IssueProfiler(steps=2, skip=1)

    def checked():
        _planning_work()

    def unverified():
        sum(range(3000))

    with caplog.at_level(logging.INFO, logger="xkv.connector"):
        for kind in ("checked", "unverified", "unverified", "checked", "checked", "unverified",
                     "unverified", "checked"):
            p.call(checked if kind == "checked" else unverified, loads=True, kind=kind)
    heads = [r.getMessage() for r in caplog.records if "start_load_kv, by" in r.getMessage()]
    # step 1 skipped (checked); then unverified x2 -> logged; checked x2 -> logged
    assert heads == [
        "XKV_PROFILE_ISSUE 2 unverified restore steps' start_load_kv, by tottime:",
        "XKV_PROFILE_ISSUE 2 unverified restore steps' start_load_kv, by cumulative:",
        "XKV_PROFILE_ISSUE 2 checked restore steps' start_load_kv, by tottime:",
        "XKV_PROFILE_ISSUE 2 checked restore steps' start_load_kv, by cumulative:"]
    assert not p.enabled and not p._profs
    text = "\n".join(r.getMessage() for r in caplog.records)
    first_checked = text.index("checked restore steps'")
    assert "_planning_work" in text[first_checked:] and "_planning_work" not in text[:first_checked]
