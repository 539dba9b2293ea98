"""group_copies: a light step's verified restore takes the light step's SM budget
(``kernels.light_restore_programs``), every other restore the kernels' default."""

from __future__ import annotations

import pytest

import xkv.kernels as K
from xkv.connector import group_copies


def _captured(monkeypatch) -> list[dict]:
    calls: list[dict] = []
    monkeypatch.setattr(group_copies.kernels, "prepare_restore",
                        lambda *a, **kw: calls.append(kw) or "prepared")
    return calls


@pytest.mark.parametrize("env,want", [(None, K._launch.LIGHT_VERIFIED_RESTORE_PROGRAMS),
                                      ("9", 9)])
def test_light_step_verified_restore_takes_the_light_budget(env, want, monkeypatch):
    if env is None:
        monkeypatch.delenv("XKV_LIGHT_PROGRAMS", raising=False)
    else:
        monkeypatch.setenv("XKV_LIGHT_PROGRAMS", env)
    calls = _captured(monkeypatch)
    out = group_copies.prepare_group_restore("card", "offs", ["p0", "p1"], "ids", checks="ck",
                                             layer_groups=[[0], [1]])
    assert out == "prepared"
    assert calls == [dict(engine="auto", layer_groups=[[0], [1]], checks="ck",
                          max_programs=want)]


def test_unverified_light_step_keeps_the_default_budget(monkeypatch):
    calls = _captured(monkeypatch)
    group_copies.prepare_group_restore("card", "offs", ["p0"], "ids", layer_groups=[[0]])
    assert calls[0]["max_programs"] is None and calls[0]["checks"] is None


@pytest.mark.parametrize("bad", ["0", "-3", "many"])
def test_light_budget_refuses_a_bad_setting(bad, monkeypatch):
    monkeypatch.setenv("XKV_LIGHT_PROGRAMS", bad)
    with pytest.raises(ValueError, match="XKV_LIGHT_PROGRAMS must be an integer >= 1"):
        K.light_restore_programs()
