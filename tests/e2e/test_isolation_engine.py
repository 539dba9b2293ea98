"""Tenant isolation on a real engine: cache_salt, key_namespace, require_cache_salt.

Every negative assertion is paired with a positive one in the same run (caching must be shown
working, or "no hit" proves nothing).
"""

import pytest
from e2e_harness import run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def prompt(n, base=10):
    return [(base + 13 * i) % 1000 + 4 for i in range(n)]


S = prompt(220)  # 3 full chunks of 64
U = prompt(220, base=400)


def test_salts_namespaces_require_salt(models, gateway):
    A = {"tokens": S, "salt": "tenant-a-3f9c2e"}
    B = {"tokens": S, "salt": "tenant-b-81d0aa"}
    res, log = run_engine(models, "llama", gateway, [
        {"op": "engine", "extra": {"key_namespace": "prod"}},
        {"op": "generate", "name": "store_a", "prompts": [A]},
        {"op": "generate", "name": "store_unsalted", "prompts": [{"tokens": U}]},
        {"op": "engine", "extra": {"key_namespace": "prod"}},
        {"op": "generate", "name": "tenant_b", "prompts": [B]},
        {"op": "generate", "name": "tenant_a", "prompts": [A]},
        {"op": "engine", "extra": {"key_namespace": "staging"}},
        {"op": "generate", "name": "other_ns", "prompts": [A]},
        {"op": "engine", "extra": {"key_namespace": "prod", "require_cache_salt": True}},
        {"op": "generate", "name": "unsalted_required", "prompts": [{"tokens": U}]},
        {"op": "generate", "name": "salted_required", "prompts": [A]},
    ], extra={"chunk_size": 64})
    r = {x["name"]: x for x in res["runs"]}
    assert r["store_a"]["cached"] == [0]
    # another tenant, same tokens: looked up, nothing found; the owner hits
    assert r["tenant_b"]["cached"] == [0]
    assert r["tenant_b"]["gw_after"]["lookups"] == r["tenant_b"]["gw_before"]["lookups"] + 1
    assert r["tenant_b"]["gw_after"]["hit_chunks"] == r["tenant_b"]["gw_before"]["hit_chunks"]
    assert r["tenant_a"]["cached"] == [192]
    assert r["tenant_a"]["tokens"] == r["store_a"]["tokens"]
    # same salt, other namespace on the same gateway: no hit
    assert r["other_ns"]["cached"] == [0]
    # require_cache_salt: the unsalted request (stored earlier, unrestricted) sends no message
    u = r["unsalted_required"]
    assert u["cached"] == [0] and u["gw_before"] == u["gw_after"]
    assert r["salted_required"]["cached"] == [192]
    assert res["loads_equal"] == res["loads_checked"] > 0
