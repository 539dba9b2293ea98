"""Verified restores end to end (issue 25): a real xkv-gateway whose card is corrupted between
the engine that stored a prompt and a fresh engine that restores it. Every restored object
fails its checksum, its blocks are recomputed (load errors, ``kv_load_failure_policy
"recompute"``), greedy tokens equal the no-connector run, the worker names the keys and the
gateway drops the objects."""

import pytest
from e2e_harness import run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def prompt(n, base=10):
    return [(base + 7 * i) % 1000 + 4 for i in range(n)]


P1 = prompt(300)  # 4 full chunks of 64 + a partial one
EXTRA = {"chunk_size": 64}  # verify_checksums: on by default (docs/verification.md): the default is tested


def test_corrupted_card_is_recomputed_never_decoded(models, gateway):
    res, log = run_engine(models, "llama", gateway, [
        {"op": "engine", "connector": False},
        {"op": "generate", "name": "ref", "prompts": [{"tokens": P1}]},
        {"op": "engine"},
        {"op": "generate", "name": "store", "prompts": [{"tokens": P1}]},
        {"op": "engine"},
        {"op": "generate", "name": "clean", "prompts": [{"tokens": P1}]},
        {"op": "corrupt_card", "stride": 509},
        {"op": "engine"},
        {"op": "generate", "name": "corrupt", "prompts": [{"tokens": P1}]},
        {"op": "log_stats"},
    ], extra=EXTRA)
    runs = {r["name"]: r for r in res["runs"]}
    ref = runs["ref"]["tokens"]
    assert runs["store"]["tokens"] == ref
    # a clean restore: verified, no mismatch
    assert runs["clean"]["cached"] == [256] and runs["clean"]["tokens"] == ref
    # the corrupted card: every restored object mismatches, vLLM recomputes, same tokens
    assert runs["corrupt"]["tokens"] == ref
    assert log.count("xkv: restored bytes did not match their checksum") >= 1
    assert "checksum_mismatches=" in log
    assert "turned off" not in log
