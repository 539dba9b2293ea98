"""A hybrid model (attention + Mamba2) asking for ``save_mode`` step on vLLM's CPU engine with a
real gateway: it runs 'layer' (state pages are rewritten in place and vLLM zeroes new blocks
before the connector's bind, ``setup.save_mode``), says so at start, and stores and restores as
usual (every state page checked, greedy tokens equal the no-connector run)."""

import pytest
from hybrid_harness import block_size, run_hybrid

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def prompt(n, base=10):
    return [(base + 7 * i) % 1000 + 4 for i in range(n)]


def test_hybrid_asking_for_step_saves_runs_layer(hybrid_models, gateway):
    p1 = prompt(300)
    res, log = run_hybrid(hybrid_models, "nemotron_h", gateway, [
        {"op": "engine", "connector": False},
        {"op": "generate", "name": "ref", "prompts": [{"tokens": p1}]},
        {"op": "engine"},
        {"op": "generate", "name": "store", "prompts": [{"tokens": p1}]},
        {"op": "engine"},
        {"op": "generate", "name": "restore", "prompts": [{"tokens": p1}]},
    ], extra={"chunk_size": {"blocks": 1}, "save_mode": "step"})
    assert ("XKV: stores: save_mode 'step' requested, 'layer' used: recurrent-state groups "
            "(pages rewritten in place every step); vLLM zeroes new blocks before the "
            "connector's bind") in log
    bs = block_size(res)
    r = {x["name"]: x for x in res["runs"]}
    assert r["restore"]["cached"] == [(len(p1) - 1) // bs * bs]
    assert r["store"]["tokens"] == r["restore"]["tokens"] == r["ref"]["tokens"]
    assert "group_saves" not in res  # no save_group: the layer path ran
    assert res["state_saves_checked"] > 0 and res["state_saves_equal"] == res["state_saves_checked"]
    assert res["state_loads_match_saved"] == res["state_loads_checked"] > 0
    assert res["loads_equal"] == res["loads_checked"] and res["saves_equal"] == res["saves_checked"]
