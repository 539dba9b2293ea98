"""The default multi-process engine (engine core and worker in their own processes)."""

import pytest
from e2e_harness import run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_multiprocess_store_restore(models, gateway):
    p = [(5 + 19 * i) % 1000 + 4 for i in range(290)]
    res, log = run_engine(models, "llama", gateway, [
        {"op": "engine"},
        {"op": "generate", "name": "store", "prompts": [{"tokens": p}]},
        {"op": "engine"},
        {"op": "generate", "name": "restore", "prompts": [{"tokens": p}]},
    ], extra={"chunk_size": 64}, multiprocess=True)
    r = {x["name"]: x for x in res["runs"]}
    assert r["store"]["cached"] == [0] and r["restore"]["cached"] == [256]
    assert r["restore"]["tokens"] == r["store"]["tokens"]
    assert r["restore"]["gw_after"]["hit_chunks"] - r["restore"]["gw_before"]["hit_chunks"] == 4
    assert "XKV: 2 cache tensors registered for exchange" in log
