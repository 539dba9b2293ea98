"""The gateway killed between and during requests: same tokens, one log line, engine serves on;
restarted with ``reattach: true``: the engine uses the new gateway.

The scheduler side turns off at its first failed call and answers zero hits from then on;
every worker rank logs "External KV cache turned off on this rank" exactly once. Loads that were
already promised still come from the mapped card (or are reported as load errors and recomputed,
``kv_load_failure_policy: "recompute"``): no wrong token either way.
"""

import pytest
from e2e_harness import run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LINE = "External KV cache turned off on this rank"


def prompt(n, base=10):
    return [(base + 17 * i) % 1000 + 4 for i in range(n)]


PS = [prompt(200 + 10 * i, base=40 * i) for i in range(6)]


def test_gateway_killed_between_requests(models, gateway):
    res, log = run_engine(models, "llama", gateway, [
        {"op": "engine"},
        {"op": "generate", "name": "ref", "prompts": [{"tokens": p} for p in PS]},
        {"op": "engine"},
        {"op": "generate", "name": "warm", "prompts": [{"tokens": PS[0]}]},
        {"op": "kill_gateway"},
        {"op": "generate", "name": "after_kill", "prompts": [{"tokens": p} for p in PS[:3]]},
        {"op": "reset"},
        {"op": "generate", "name": "still_serving", "prompts": [{"tokens": p} for p in PS]},
    ], extra={"chunk_size": 64, "lookup_timeout_ms": 100})
    r = {x["name"]: x for x in res["runs"]}
    ref = r["ref"]["tokens"]
    assert r["warm"]["cached"] == [192]  # the fresh engine restored PS[0] before the kill
    assert r["warm"]["tokens"] == ref[:1]
    assert r["after_kill"]["tokens"] == ref[:3]
    assert r["still_serving"]["tokens"] == ref and r["still_serving"]["cached"] == [0] * 6
    assert log.count(LINE) == 1


def test_gateway_killed_during_requests(models, gateway):
    res, log = run_engine(models, "llama", gateway, [
        {"op": "engine"},
        {"op": "generate", "name": "store", "prompts": [{"tokens": p} for p in PS]},
        {"op": "reset"},
        {"op": "generate", "name": "during", "max_tokens": 48, "kill_after_s": 0.05,
         "prompts": [{"tokens": p} for p in PS] + [{"tokens": prompt(300, base=7)}]},
        {"op": "reset"},
        {"op": "generate", "name": "after", "prompts": [{"tokens": p} for p in PS]},
    ], extra={"chunk_size": 64, "lookup_timeout_ms": 100})
    r = {x["name"]: x for x in res["runs"]}
    ref = r["store"]["tokens"]
    assert r["during"]["seconds"] > 0.05  # the gateway died while the batch was running
    assert r["during"]["gw_after"] is None  # ... and was gone when it ended
    assert [t[:8] for t in r["during"]["tokens"][:6]] == ref
    assert r["after"]["tokens"] == ref
    assert r["after"]["cached"] == [0] * 6
    assert log.count(LINE) == 1


BACK = "External KV cache re-attached on this rank"


def test_gateway_restarted_reattach(models, gateway):
    """``reattach: true``: the gateway SIGKILLed and restarted (new epoch, empty card) while the
    engine runs: the same tokens throughout, "turned off" and "re-attached" each logged once
    per rank, and after the restart prompts are stored on the new gateway and restored."""
    res, log = run_engine(models, "llama", gateway, [
        {"op": "engine"},
        {"op": "generate", "name": "ref", "prompts": [{"tokens": p} for p in PS]},
        {"op": "restart_gateway"},
        {"op": "generate", "name": "restart", "prompts": [{"tokens": p} for p in PS[:3]]},
        {"op": "sleep", "s": 1.5},  # the first re-probe comes 1 s after turning off
        {"op": "reset"},
        {"op": "generate", "name": "store", "prompts": [{"tokens": p} for p in PS]},
        {"op": "reset"},
        {"op": "generate", "name": "back", "prompts": [{"tokens": p} for p in PS]},
    ], extra={"chunk_size": 64, "lookup_timeout_ms": 100, "reattach": True})
    r = {x["name"]: x for x in res["runs"]}
    ref = r["ref"]["tokens"]
    assert r["restart"]["tokens"] == ref[:3] and r["store"]["tokens"] == ref
    assert r["back"]["tokens"] == ref
    assert r["back"]["cached"] == [(len(p) - 1) // 64 * 64 for p in PS]  # hits again
    assert r["back"]["gw_before"]["committed"] > 0  # stored on the new gateway
    assert res["loads_checked"] > 0 and res["loads_equal"] == res["loads_checked"]
    assert log.count(LINE) == 1 and log.count(BACK) == 1
