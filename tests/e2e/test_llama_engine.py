"""A Llama-like model on vLLM's CPU engine with FusIOnXConnector and a real xkv-gateway.

One child process, several engines (a fresh engine = empty local prefix cache), grouped so the
suite stays within minutes: store, restore in a fresh engine, a partial last chunk, a partly
stored prompt, two requests sharing a prefix in one batch, the per-request opt-out, the start
log lines and vLLM's external hit-rate line.
"""

import pytest
from e2e_harness import run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def prompt(n, base=10):
    return [(base + 7 * i) % 1000 + 4 for i in range(n)]


P1 = prompt(300)  # 4 full chunks of 64 + a partial one
P2 = P1[:130] + prompt(170, base=501)  # only its first 2 chunks are stored
Q1 = prompt(160, base=33) + prompt(90, base=77)  # Q1, Q2 share 160 tokens, run in one batch
Q2 = prompt(160, base=33) + prompt(90, base=901)
P4 = prompt(200, base=303)  # opted out
EXTRA = {"chunk_size": 64}


def test_store_restore_partial_batch_optout(models, gateway):
    opt_out = {"tokens": P4, "params": {"xkv_store": False}}
    res, log = run_engine(models, "llama", gateway, [
        {"op": "engine", "connector": False},
        {"op": "generate", "name": "ref", "prompts": [{"tokens": p} for p in (P1, P2, Q1, Q2, P4)]},
        {"op": "engine"},
        {"op": "generate", "name": "store1", "prompts": [{"tokens": P1}]},
        {"op": "generate", "name": "store_batch", "prompts": [{"tokens": Q1}, {"tokens": Q2}]},
        {"op": "generate", "name": "optout", "prompts": [opt_out]},
        {"op": "engine"},
        {"op": "generate", "name": "restore1", "prompts": [{"tokens": P1}]},
        {"op": "reset"},
        {"op": "generate", "name": "partly", "prompts": [{"tokens": P2}]},
        {"op": "reset"},
        {"op": "generate", "name": "batch", "prompts": [{"tokens": Q1}, {"tokens": Q2}]},
        {"op": "reset"},
        {"op": "generate", "name": "after_optout", "prompts": [{"tokens": P4}]},
        {"op": "log_stats"},
    ], extra=EXTRA)
    runs = {r["name"]: r for r in res["runs"]}
    ref = dict(zip(("P1", "P2", "Q1", "Q2", "P4"), runs["ref"]["tokens"], strict=True))

    # nothing restored on the first engine; its greedy tokens equal the no-connector run
    assert runs["store1"]["cached"] == [0] and runs["store1"]["tokens"] == [ref["P1"]]
    assert runs["store_batch"]["tokens"] == [ref["Q1"], ref["Q2"]]
    # the fresh engine restores the stored chunks (never the whole prompt) and decodes the same
    assert runs["restore1"]["cached"] == [256] and runs["restore1"]["tokens"] == [ref["P1"]]
    # the process's first restore imported nothing (np.unique imported numpy.ma: ~8 ms inside
    # the first restore's step, xkv.kernels._arrays)
    assert runs["restore1"]["imported"] == [], runs["restore1"]["imported"]
    assert runs["partly"]["cached"] == [128] and runs["partly"]["tokens"] == [ref["P2"]]
    assert runs["batch"]["cached"] == [192, 192]
    assert runs["batch"]["tokens"] == [ref["Q1"], ref["Q2"]]
    # the opted-out request sent no message at all and stored nothing
    o = runs["optout"]
    assert o["gw_before"] == o["gw_after"] and o["tokens"] == [ref["P4"]]
    assert runs["after_optout"]["cached"] == [0] and runs["after_optout"]["tokens"] == [ref["P4"]]
    # every restored page equals the card bytes, every saved slot equals the computed page
    assert res["loads_checked"] > 0 and res["loads_equal"] == res["loads_checked"]
    assert res["saves_checked"] > 0 and res["saves_equal"] == res["saves_checked"]
    # start-up lines (rank 0), vLLM's hit-rate line, the connector's own metrics
    assert log.count("XKV: 2 cache tensors registered for exchange") == 2
    assert "KV cache registry: 2 cache(s) in 1 group(s); writers: " in log
    assert "KV cache layout: 1 group(s)" in log
    assert "External prefix cache hit rate:" in log
    assert "KV Transfer metrics:" in log and "bytes_restored=" in log
    assert "turned off" not in log
    # Attention calls the per-layer hooks: per-layer fences, nothing saved in bulk
    assert "do not call vLLM's per-layer KV hooks" not in log
    assert "did not call wait_for_layer_load" not in log and "did not call save_kv_layer" not in log
    # every lease was released once the workers finished loading (or the request ended)
    assert all(r["gw_after"]["leases"] == 0 for r in res["runs"])
