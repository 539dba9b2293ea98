"""``load_mode: "async"`` on a hybrid model (attention + Mamba2) on vLLM's CPU engine: its
restores stay synchronous (docs/architecture.md, Asynchronous restores) and stay correct — the
same hit, every state page equal to the saved bytes, greedy tokens equal the reference.

``chunk_size`` is left out: the connector derives it from the block size vLLM chose on this CPU
(one block for a model with state groups; logged at start), and the hit follows."""

import pytest
from hybrid_harness import block_size, run_hybrid

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def prompt(n, base=10):
    return [(base + 7 * i) % 1000 + 4 for i in range(n)]


P1 = prompt(300)
P2 = prompt(250, base=77)


def test_hybrid_restores_stay_synchronous_in_async_mode(hybrid_models, gateway):
    kind = "nemotron_h"
    res, log = run_hybrid(hybrid_models, kind, gateway, [
        {"op": "engine", "connector": False},
        {"op": "generate", "name": "ref", "prompts": [{"tokens": P1}, {"tokens": P2}]},
        {"op": "engine"},
        {"op": "generate", "name": "store", "prompts": [{"tokens": P1}]},
        {"op": "engine", "extra": {"load_mode": "async"}},
        {"op": "generate", "name": "restore", "prompts": [{"tokens": P2}, {"tokens": P1}]},
    ])
    bs = block_size(res)
    chunk = bs  # the connector's default for a model with state groups: one block
    line = (f"XKV: chunk_size {chunk} tokens (default: one block, states are restorable at chunk "
            f"ends only; vLLM's KV cache block size {bs} tokens)")
    assert line in log
    r = {x["name"]: x for x in res["runs"]}
    ref = r["ref"]["tokens"]
    assert r["restore"]["cached"] == [0, (len(P1) - 1) // chunk * chunk]
    assert r["restore"]["tokens"] == ref[::-1]
    # P1 was admitted beside P2 and still restored in its own step, boundary + running block
    assert res["async_load_jobs"] == 0 and res["load_jobs"] == 1
    assert set(res["state_blocks_per_load"]) == {2}
    assert res["state_loads_checked"] > 0
    assert res["state_loads_match_saved"] == res["state_loads_checked"]
    assert res["loads_equal"] == res["loads_checked"]
    assert "has recurrent-state groups, its restores stay synchronous" in log
    assert r["restore"]["gw_after"]["leases"] == 0
