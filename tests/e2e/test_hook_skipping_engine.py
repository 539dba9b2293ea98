"""A real CPU engine where one attention layer never calls vLLM's per-layer KV hooks
(``hook_skipping.py``, reproducing the attention classes of GLM-5.x, DeepSeek-V3.2, Kimi Linear
and K3 on vLLM 0.29 with CUDA), with FusIOnXConnector and a real xkv-gateway.

* class detection: the layer's class overrides ``forward``, the connector sees it at start and
  fences and saves that layer in bulk: stores committed (the restore hits), greedy tokens equal
  the run without the connector, every restored page equals the card and every saved slot the
  computed page, no warning per step;
* run-time safety net: the class looks like vLLM's ``Attention`` but the instance skips the
  hooks: the first save warns once and saves it after the forward; the first restore reports
  its blocks as load errors (vLLM recomputes, tokens still right) and warns once; from then on
  the layer is bulk and restores hit without errors or warnings.
"""

import pytest
from e2e_harness import run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def prompt(n, base=10):
    return [(base + 7 * i) % 1000 + 4 for i in range(n)]


P1 = prompt(300)  # 4 full chunks of 64 + a partial one
Q1 = prompt(200, base=41)
EXTRA = {"chunk_size": 64}
LAYER = "model.layers.1.self_attn.attn"


def _steps():
    return [
        {"op": "engine", "connector": False},
        {"op": "generate", "name": "ref", "prompts": [{"tokens": P1}, {"tokens": Q1}]},
        {"op": "engine"},
        {"op": "generate", "name": "store", "prompts": [{"tokens": P1}]},
        {"op": "generate", "name": "store2", "prompts": [{"tokens": Q1}]},
        {"op": "engine"},
        {"op": "generate", "name": "restore", "prompts": [{"tokens": P1}]},
        {"op": "reset"},
        {"op": "generate", "name": "again", "prompts": [{"tokens": P1}]},
        {"op": "reset"},
        {"op": "generate", "name": "restore2", "prompts": [{"tokens": Q1}]},
    ]


def _common(res, log):
    runs = {r["name"]: r for r in res["runs"]}
    ref = runs["ref"]["tokens"]
    assert runs["store"]["cached"] == [0] and runs["store"]["tokens"] == [ref[0]]
    assert runs["store2"]["tokens"] == [ref[1]]
    for name in ("restore", "again"):
        assert runs[name]["tokens"] == [ref[0]], name
    assert runs["restore2"]["tokens"] == [ref[1]]
    # every chunk of both prompts was committed, the skipping layer included
    assert runs["store"]["gw_after"]["committed"] - runs["store"]["gw_before"]["committed"] == 4
    assert runs["store2"]["gw_after"]["committed"] - runs["store2"]["gw_before"]["committed"] == 3
    assert res["loads_checked"] > 0 and res["loads_equal"] == res["loads_checked"]
    assert res["saves_checked"] > 0 and res["saves_equal"] == res["saves_checked"]
    assert "not every layer was saved" not in log and "turned off" not in log
    return runs


def test_layer_class_without_hooks_is_bulk(models, gateway):
    res, log = run_engine(models, "llama", gateway, _steps(), extra=EXTRA,
                          env={"XKV_TEST_SKIP_HOOKS": "class"}, imports=["hook_skipping"])
    runs = _common(res, log)
    # detected at start: full hits from the first restore on, nothing warned at run time
    assert runs["restore"]["cached"] == [256] and runs["again"]["cached"] == [256]
    assert runs["restore2"]["cached"] == [192]
    line = "XKV: 1 layer(s) of class HookSkippingAttention do not call vLLM's per-layer KV hooks"
    assert log.count(line) == 2  # once per engine with the connector (rank 0)
    assert f"e.g. {LAYER}" in log
    assert "did not call save_kv_layer" not in log
    assert "did not call wait_for_layer_load" not in log


@pytest.mark.parametrize("save_mode", ["layer", "step"])
def test_hooks_skipped_by_an_instance_are_caught_at_run_time(models, gateway, save_mode):
    res, log = run_engine(models, "llama", gateway, _steps(),
                          extra={**EXTRA, "save_mode": save_mode},
                          env={"XKV_TEST_SKIP_HOOKS": "instance"}, imports=["hook_skipping"])
    runs = _common(res, log)
    assert "do not call vLLM's per-layer KV hooks" not in log  # the class looks like Attention
    # saves, layer mode: the layer is saved after the forward; one warning for the storing
    # engine (two prompts, many steps), none per step; the restoring engine has nothing new to
    # save. Step mode saves every layer after the forward anyway: nothing to warn about. The
    # mode that ran is the one the engine's start-up line names (step falls back to layer where
    # the CPU's backend chose block sizes step mode cannot take).
    ran_step = "XKV: stores: save_mode 'step' (one launch per group" in log
    assert ran_step or "XKV: stores: save_mode" in log
    assert ran_step == (save_mode == "step" and "'layer' used" not in log)
    assert log.count("did not call save_kv_layer") == (0 if ran_step else 1)
    # the first restore's blocks were load errors (recomputed); then the layer is bulk
    assert log.count("did not call wait_for_layer_load") == 1
    assert f"layer {LAYER} (class Attention)" in log
    assert runs["again"]["cached"] == [256] and runs["restore2"]["cached"] == [192]
