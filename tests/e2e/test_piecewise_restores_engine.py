"""``piecewise_restores_from`` on vLLM's CPU engine with a real gateway: with ``full_cuda_graphs``
a full hit of at least that many restored tokens leaves vLLM two tokens to compute (on a GPU a
step vLLM runs with piecewise graphs, so the restore overlaps the forward), a shorter one keeps
the one-token step. The CPU engine has no CUDA graphs: what this shows is that vLLM's real
scheduler and xkv's worker take the two-token step, every restored page equals its card bytes
(``verify``) and the greedy tokens equal the no-connector run's."""

import pytest
from e2e_harness import run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def prompt(n, base=10):
    return [(base + 7 * i) % 1000 + 4 for i in range(n)]


# whole chunks of one block of whatever size vLLM's CPU backend chose (16-128 tokens on the CPUs
# seen, each dividing 128): a full hit restores every token but the last, whatever that size
LONG = prompt(256)  # a full hit of 255 restored tokens
SHORT = prompt(128, base=301)  # a full hit of 127


def test_long_full_hits_leave_two_tokens_and_keep_the_tokens(models, gateway):
    ps = [{"tokens": p} for p in (LONG, SHORT)]
    res, log = run_engine(models, "llama", gateway, [
        {"op": "engine", "connector": False},
        {"op": "generate", "name": "ref", "prompts": ps},
        {"op": "engine"},
        {"op": "generate", "name": "store", "prompts": ps},
        {"op": "engine", "extra": {"full_cuda_graphs": True, "piecewise_restores_from": 200}},
        {"op": "generate", "name": "restore", "prompts": ps},
    ], extra={"chunk_size": {"blocks": 1}})
    assert 128 % res["engines"][-1]["block_size"] == 0, res["engines"]
    runs = {r["name"]: r for r in res["runs"]}
    assert runs["store"]["cached"] == [0, 0]
    # 255 restorable tokens >= 200: two computed; 127 < 200: one, as without the setting
    assert runs["restore"]["cached"] == [254, 127]
    assert runs["restore"]["tokens"] == runs["ref"]["tokens"]
    assert res["loads_checked"] > 0 and res["loads_equal"] == res["loads_checked"]
    assert "full hits of >= 200 restored tokens leave vLLM two tokens to compute" in log
