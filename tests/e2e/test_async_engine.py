"""Asynchronous restores (``load_mode: "async"``) on vLLM's CPU engine with a real xkv-gateway.

A first engine (default synchronous mode) stores the prompts; a fresh engine in async mode
restores them through vLLM's WAITING_FOR_REMOTE_KVS path: alone, then in one batch beside
requests that have no stored prefix (computed and decoding while the others restore); an engine
in ``auto`` mode restores the same batch, synchronously for the request that finds it idle. Greedy
tokens must equal the no-connector run, every restored page the card bytes it came from, the
cached-token counts what was stored, and every lease must be released.
"""

import pytest
from e2e_harness import run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def prompt(n, base=10):
    return [(base + 7 * i) % 1000 + 4 for i in range(n)]


P1 = prompt(300)  # 4 full chunks of 64 stored: 256 restored
P2 = prompt(200, base=401)  # 3 chunks: 192 restored
F1 = prompt(150, base=777)  # never stored: computed while P1/P2 restore
F2 = prompt(90, base=901)


def test_async_restore_alone_and_in_a_batch(models, gateway):
    batch = [{"tokens": p} for p in (P1, F1, P2, F2)]
    res, log = run_engine(models, "llama", gateway, [
        {"op": "engine", "connector": False},
        {"op": "generate", "name": "ref", "prompts": batch, "max_tokens": 12},
        {"op": "engine"},
        {"op": "generate", "name": "store", "prompts": [{"tokens": P1}, {"tokens": P2}],
         "max_tokens": 12},
        {"op": "engine", "extra": {"load_mode": "async"}},
        {"op": "generate", "name": "alone", "prompts": [{"tokens": P1}], "max_tokens": 12},
        {"op": "reset"},
        {"op": "generate", "name": "batch", "prompts": batch, "max_tokens": 12},
        {"op": "engine", "extra": {"load_mode": "auto"}},
        {"op": "generate", "name": "auto", "prompts": batch, "max_tokens": 12},
    ], extra={"chunk_size": 64})
    runs = {r["name"]: r for r in res["runs"]}
    ref = runs["ref"]["tokens"]
    assert runs["store"]["cached"] == [0, 0]
    assert runs["alone"]["cached"] == [256] and runs["alone"]["tokens"] == [ref[0]]
    # restoring requests beside computed ones: same tokens as without the connector
    assert runs["batch"]["cached"] == [256, 0, 192, 0]
    assert runs["batch"]["tokens"] == ref
    # async: every restore took the asynchronous path (3 requests, none synchronously). auto
    # (F1, F2 were stored by the async engine): P1 came first into an idle engine and restored
    # synchronously, F1, P2, F2 beside it asynchronously
    assert (res["async_load_jobs"], res["load_jobs"]) == (3 + 3, 1)
    assert runs["auto"]["cached"] == [256, 128, 192, 64] and runs["auto"]["tokens"] == ref
    # every copy was checked against the card: 2 layers x (8 + 8 + 6 + 8 + 4 + 6 + 2) blocks
    assert res["loads_checked"] == 2 * (8 + 8 + 6 + 8 + 4 + 6 + 2) and res["loads_equal"] == res["loads_checked"]
    assert all(r["gw_after"]["leases"] == 0 for r in res["runs"])
    assert "turned off" not in log
