"""Hybrid models (attention + Mamba2 / gated delta net) on vLLM's CPU engine with a real gateway.

For each tiny model, in one child process (three engines):

* reference: an engine without the connector;
* store: a fresh engine with the connector runs P1, and P2 whose state objects are aborted
  instead of committed (its attention chunks are stored: "a state object dropped");
* restore: a fresh engine (empty local cache) — P1 is restored up to its stored state boundary
  (``num_cached_tokens`` = the last full block of P1), every restored state page equals the
  bytes saved for that key, and the state is written to the boundary AND the running block;
  P2 gets no hit at all; greedy tokens of both equal the reference;
* the gateway SIGKILLed while a batch runs: correct tokens; afterwards zero hits, no crash;
* an engine without prefix caching is refused at start with a message that says to add it.

Chunk sizes are one block of the size vLLM chose on this CPU; ``..._on_another_cpu`` runs the
same with vLLM seeing a CPU of another kind (tests/e2e/cpu_kind.py: features hidden), so both
kinds' block sizes and kernels run wherever CI runs.
"""

import pytest
from hybrid_harness import KINDS, block_size, other_kinds_or_skip, run_hybrid

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LINE = "External KV cache turned off on this rank"


def prompt(n, base=10):
    return [(base + 7 * i) % 1000 + 4 for i in range(n)]


P1 = prompt(300)
P2 = prompt(300, base=555)
P3 = prompt(250, base=77)


@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_store_restore_drop_kill(hybrid_models, gateway, kind):
    _store_restore_drop_kill(hybrid_models, gateway, kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cpu", ["plain", "avx512bf16"])
def test_hybrid_store_restore_drop_kill_on_another_cpu(hybrid_models, gateway, kind, cpu):
    res = _store_restore_drop_kill(hybrid_models, gateway, kind, **other_kinds_or_skip(cpu))
    assert {e["cpu"]["avx512_bf16"] for e in res["engines"]} == {cpu == "avx512bf16"}
    assert {e["cpu"]["amx"] for e in res["engines"]} == {False}


def _store_restore_drop_kill(hybrid_models, gateway, kind, **emulate):
    drop = {"tokens": P2, "params": {"xkv_test_drop_state": True}}
    res, log = run_hybrid(hybrid_models, kind, gateway, [
        {"op": "engine", "connector": False},
        {"op": "generate", "name": "ref", "prompts": [{"tokens": p} for p in (P1, P2, P3)]},
        {"op": "engine"},
        {"op": "generate", "name": "store", "prompts": [{"tokens": P1}, drop]},
        {"op": "engine"},
        {"op": "generate", "name": "restore", "prompts": [{"tokens": P1}, {"tokens": P2}]},
        {"op": "reset"},
        {"op": "generate", "name": "during", "kill_after_s": 0.05, "max_tokens": 24,
         "prompts": [{"tokens": P3}, {"tokens": P1}]},
        {"op": "reset"},
        {"op": "generate", "name": "after", "prompts": [{"tokens": P1}, {"tokens": P2}]},
        {"op": "expect_error", "extra": {"xkv_test_prefix_caching": False}},
    ], extra={"chunk_size": {"blocks": 1}}, **emulate)
    bs = block_size(res)
    hit = (len(P1) - 1) // bs * bs  # the state after the prompt's last full block
    assert hit > 0, bs
    assert (f"XKV: chunk_size {bs} tokens (kv_connector_extra_config; vLLM's KV cache block "
            f"size {bs} tokens)") in log
    r = {x["name"]: x for x in res["runs"]}
    ref = r["ref"]["tokens"]
    assert r["store"]["cached"] == [0, 0]
    assert r["store"]["tokens"] == ref[:2]
    # restore: P1 from the card up to its stored state; P2 (no state object) not at all
    assert r["restore"]["cached"] == [hit, 0]
    assert r["restore"]["tokens"] == ref[:2]
    assert res["state_loads_checked"] > 0
    assert res["state_loads_equal"] == res["state_loads_checked"]
    assert res["state_loads_match_saved"] == res["state_loads_checked"]
    assert res["state_saves_checked"] > 0 and res["state_saves_equal"] == res["state_saves_checked"]
    assert res["loads_equal"] == res["loads_checked"] and res["saves_equal"] == res["saves_checked"]
    assert set(res["state_blocks_per_load"]) == {2}  # boundary block + running block
    assert r["restore"]["gw_after"]["leases"] == 0
    # the gateway killed mid-run: the same tokens, then zero hits, and the engine serves on
    assert r["during"]["gw_after"] is None
    assert [t[:8] for t in r["during"]["tokens"]] == [ref[2], ref[0]]
    assert r["after"]["cached"] == [0, 0] and r["after"]["tokens"] == ref[:2]
    assert log.count(LINE) == 1
    # without prefix caching vLLM keeps no state per block: refused at start, saying what to add
    (err,) = res["errors"]
    assert err is not None and "--enable-prefix-caching" in err and "prefix caching is off" in err
    return res


def test_chunked_prefill_states_at_every_step_end(hybrid_models, gateway):
    """With a small prefill budget (2 blocks a step) a prompt runs in several steps; every step
    that ends on a chunk boundary stores its state, so a prompt sharing only its first 2 blocks
    and a few tokens restores from the 2-block boundary (states saved from vLLM's block table
    of a running request). Prompt lengths are in blocks of the size vLLM chose (96 here)."""
    kind = "nemotron_h"
    bs = _probe_block(hybrid_models, gateway, kind)
    p1 = prompt(3 * bs + 12)  # 3 full blocks + a partial one (300 tokens for 96)
    p4 = p1[:2 * bs + 8] + prompt(bs + 4, base=901)  # shares 2 blocks + 8 tokens
    small = {"xkv_test_max_batched": 2 * bs}
    res, _ = run_hybrid(hybrid_models, kind, gateway, [
        {"op": "engine", "connector": False, "extra": small},
        {"op": "generate", "name": "ref", "prompts": [{"tokens": p1}, {"tokens": p4}]},
        {"op": "engine", "extra": small},
        {"op": "generate", "name": "store", "prompts": [{"tokens": p1}]},
        {"op": "engine", "extra": small},
        {"op": "generate", "name": "restore", "prompts": [{"tokens": p4}, {"tokens": p1}]},
    ], extra={"chunk_size": bs})
    assert block_size(res) == bs
    r = {x["name"]: x for x in res["runs"]}
    ref = r["ref"]["tokens"]
    assert r["store"]["tokens"] == ref[:1]
    # p1's states after 2 and 3 blocks, then p4's after 3 (restored at 2): x 2 state groups
    assert res["state_saves_checked"] == 3 * 2
    assert r["restore"]["cached"] == [2 * bs, 3 * bs]
    assert r["restore"]["tokens"] == [ref[1], ref[0]]
    assert res["state_loads_match_saved"] == res["state_loads_checked"] > 0


def _probe_block(hybrid_models, gateway, kind) -> int:
    """The block size vLLM chooses for ``kind`` on this CPU (an engine without the connector)."""
    res, _ = run_hybrid(hybrid_models, kind, gateway, [{"op": "engine", "connector": False}])
    return block_size(res)
