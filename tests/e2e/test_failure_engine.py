"""The gateway killed between and during requests: same tokens, one log line, engine serves on.

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
