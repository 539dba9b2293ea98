"""A DeepSeek-V2-like MLA model (head size 576) on vLLM's CPU engine.

vLLM picks its MLA backend by CPU: AMX_MLA on AMX CPUs (block size a multiple of 32; local
prefix caching on), else the reference CPU_MLA (block 16 whatever is asked; local prefix caching
off). The test asks block 32 (both take it) and chunks of 64 (a multiple of both), reads back the
block size vLLM chose, and also runs with vLLM seeing another CPU kind (tests/e2e/cpu_kind.py)
where this CPU can show one: an AMX CPU runs CPU_MLA too. Each engine is fresh, so every hit is
the connector's. vLLM's own CPU MLA prefill and decode disagree numerically, so the oracle is:
the restored pages equal the saved bytes (checked in-process, bit-exact) and the first
generated token matches.
"""

import pytest
from e2e_harness import block_size, native_kind, other_kinds_or_skip, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def prompt(n, base=10):
    return [(base + 11 * i) % 1000 + 4 for i in range(n)]


P1, P2 = prompt(300), prompt(150, base=99)


def test_mla_store_restore(models, gateway):
    _store_restore(models, gateway, native_kind())


@pytest.mark.parametrize("cpu", ["plain", "avx512bf16"])
def test_mla_store_restore_on_another_cpu(models, gateway, cpu):
    _store_restore(models, gateway, cpu, **other_kinds_or_skip(cpu))


def _store_restore(models, gateway, cpu, **emulate):
    res, log = run_engine(models, "deepseek_v2", gateway, [
        {"op": "engine"},
        {"op": "generate", "name": "store", "prompts": [{"tokens": P1}, {"tokens": P2}]},
        {"op": "engine"},
        {"op": "generate", "name": "restore", "prompts": [{"tokens": P1}, {"tokens": P2}]},
    ], extra={"chunk_size": 64}, **emulate)
    amx = cpu == "amx"
    assert {e["cpu"]["amx"] for e in res["engines"]} == {amx}
    assert f"Using {'AMX_MLA' if amx else 'CPU_MLA'} backend" in log
    bs = block_size(res)
    assert bs == (32 if amx else 16)
    runs = {r["name"]: r for r in res["runs"]}
    assert runs["store"]["cached"] == [0, 0]
    assert runs["restore"]["cached"] == [256, 128]
    for a, b in zip(runs["store"]["tokens"], runs["restore"]["tokens"], strict=True):
        assert a[0] == b[0]
    assert res["loads_checked"] == (256 + 128) // bs * 2  # blocks x layers
    assert res["loads_equal"] == res["loads_checked"]
    assert res["saves_checked"] > 0 and res["saves_equal"] == res["saves_checked"]
    assert "KV cache registry: 2 cache(s) in 1 group(s); writers: g0[mla]=" in log
    # MLAAttention calls the per-layer hooks: its restores keep per-layer fences (no bulk)
    assert "do not call vLLM's per-layer KV hooks" not in log
    assert "did not call wait_for_layer_load" not in log and "did not call save_kv_layer" not in log
