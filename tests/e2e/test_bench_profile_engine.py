"""bench/profile_steps.py on vLLM's CPU engine, with the multi case (``--multi``): the prompts
are stored, then restored together beside 4 decoding requests under the profiler, and the row
says how many tokens each prompt restored and where every connector hook ran (the GPU run uses
it to find where a many-request restore step spends what its copy does not explain)."""

from __future__ import annotations

import json

import pytest
from e2e_harness import run_bench

pytestmark = [pytest.mark.vllm, pytest.mark.slow]



def test_profile_steps_profiles_the_multi_case(models, tmp_path):
    out = tmp_path / "p"
    args = ["--model", models["llama"],
            "--out", str(out), "--lens", "300", "--modes", "eager", "--kinds", "xkv", "--reps",
            "1", "--backend", "", "--chunk-size", "128", "--vocab", "1024", "--card-gib", "0.25",
            "--kv-gib", "0.25", "--gpu-util", "0.1", "--max-batched", "2048", "--multi", "3",
            "--multi-len", "300", "--child-timeout", "600"]
    run_bench("profile_steps.py", args)
    (res,) = json.loads((out / "profile.json").read_text())
    rows = [r for r in res["rows"] if r["phase"] == "multi_profiled"]
    assert len(rows) == 1, [r["phase"] for r in res["rows"]]
    m = rows[0]
    # every prompt restored its whole 128-token chunks (2 of 300 tokens) in the profiled batch
    assert m["tokens"] == 300 and m["cached"] == [256, 256, 256] and m["ms"] > 0
    hooks = m["hooks"]
    assert hooks["start_load_kv"]["calls"] >= 1 and hooks["get_num_new_matched_tokens"]["calls"] >= 3
    assert hooks["update_state_after_alloc"]["calls"] >= 3
    text = (out / "profile.md").read_text()
    assert "profiled multi_profiled 300" in text
    assert m["alloc_retries"] == 0  # no CUDA allocator on the CPU engine: counted as none
    assert "cached tokens per prompt [256, 256, 256]; allocator retries 0; hooks: " in text
    assert not list(out.glob("trace_*.json"))  # the trace was read, then removed
