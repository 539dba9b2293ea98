"""``XKV_EARLY_ISSUE=1`` on vLLM's CPU engine with a real gateway (xkv/connector/early_issue.py):
the scheduler side hands each step with restores to its engine's worker when it builds it, the
worker binds it and issues the copies then, and the step's own hooks do not issue them again.
The same scenario with the default (``auto``, off on the CPU engine: no CUDA graphs) is the oracle:
the same restored tokens and pages (every restored page checked against its card bytes when its
layer is waited for, ``verify``), the same number of restored block-layers (a step issued twice
would count twice), greedy tokens equal to the no-connector run."""

import json

import pytest
from e2e_harness import run_engine
from early_marks import MARK

from xkv.connector import early_issue

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def prompt(n, base=10):
    return [(base + 7 * i) % 1000 + 4 for i in range(n)]


P1 = prompt(300)  # 4 chunks of 64 restored, the rest computed
Q1 = prompt(160, base=33) + prompt(90, base=77)  # two restores in one step
Q2 = prompt(200, base=401)


def _scenario(models, gateway, env, namespace):
    """Store with one engine, restore with a fresh one; each run stores under its own key
    namespace on the shared gateway (the second run would otherwise restore its stores)."""
    return run_engine(models, "llama", gateway, [
        {"op": "engine", "connector": False},
        {"op": "generate", "name": "ref", "prompts": [{"tokens": p} for p in (P1, Q1, Q2)]},
        {"op": "engine"},
        {"op": "generate", "name": "store", "prompts": [{"tokens": p} for p in (P1, Q1, Q2)]},
        {"op": "engine"},
        {"op": "generate", "name": "restore1", "prompts": [{"tokens": P1}]},
        {"op": "reset"},
        {"op": "generate", "name": "batch", "prompts": [{"tokens": Q1}, {"tokens": Q2}]},
    ], extra={"chunk_size": 64, "key_namespace": namespace}, env=env, imports=["early_marks"])


def test_early_issue_restores_the_same_pages_once(models, gateway):
    # the default (auto) on the CPU engine, which replays no CUDA graphs: not early
    plain, plain_log = _scenario(models, gateway, {}, "plain")
    early, early_log = _scenario(models, gateway, {"XKV_EARLY_ISSUE": "1"}, "early")
    assert early_issue.LINE in early_log and early_issue.LINE not in plain_log
    assert early_issue.OFF_LINE.format(
        why="auto: no full CUDA graphs with per-layer restore waits") in plain_log
    # both restore steps went early (P1 alone: one load job; Q1 and Q2 together: two), every
    # load job once; none without the switch
    marks = [json.loads(ln.split(MARK, 1)[1]) for ln in early_log.splitlines() if MARK in ln]
    assert [len(m) for m in marks] == [1, 2], marks
    assert len({j for m in marks for j in m}) == early["load_jobs"]
    assert MARK not in plain_log
    for res in (plain, early):
        runs = {r["name"]: r for r in res["runs"]}
        ref = runs["ref"]["tokens"]
        assert runs["store"]["cached"] == [0, 0, 0]
        assert runs["restore1"]["cached"] == [256] and runs["restore1"]["tokens"] == [ref[0]]
        assert runs["batch"]["cached"] == [192, 192]
        assert runs["batch"]["tokens"] == ref[1:]
        assert res["loads_checked"] > 0 and res["loads_equal"] == res["loads_checked"]
    # the same restores, each issued once: the two steps with loads were both issued early
    assert early["load_jobs"] == plain["load_jobs"] == 3
    assert early["loads_checked"] == plain["loads_checked"]
    assert "Traceback" not in early_log
