"""bench/e2e_ttft.py with ``--start-together`` on vLLM's CPU engine (the GPU runs use it to spend
device time measuring, not starting engines): three engines (no connector, xkv, an xkv
variant) start at once, then measure one at a time; every kind's rows and the logprob checks
are there, as one after the other."""

from __future__ import annotations

import json

import pytest
from e2e_harness import run_bench

pytestmark = [pytest.mark.vllm, pytest.mark.slow]



def test_e2e_ttft_engines_started_together(models, tmp_path):
    out = tmp_path / "o"
    kinds = ["none", "xkv", "xkv@verify_checksums=off"]
    args = ["--model", models["llama"],
            "--out", str(out), "--kinds", ",".join(kinds), "--backend", "", "--mode", "eager",
            "--lens", "300", "--reps", "2", "--cold-reps", "1", "--multi", "0",
            "--multi-len", "300", "--after-kill", "1", "--ref-chunks", "2", "--chunk-size", "128",
            "--vocab", "1024", "--card-gib", "0.25", "--max-batched", "2048", "--kv-gib", "0.25",
            "--child-timeout", "400", "--lookup-timeout-ms", "2000", "--start-together",
            "--gpu-util", "0.1", "--ab-unverified", "--decode-tokens", "4", "--decode-batch", "2"]
    p = run_bench("e2e_ttft.py", args)
    res = json.loads((out / "e2e_ttft.json").read_text())
    assert res["rc"] == dict.fromkeys(kinds, 0), p.stdout[-3000:]
    t = res["times"]
    # every engine was up before the first one measured; measurements one at a time, in order
    assert max(t[k]["ready"] for k in kinds) <= min(t[k]["go"] for k in kinds)
    for a, b in zip(kinds, kinds[1:], strict=False):
        assert t[a]["end"] <= t[b]["go"]
    assert "died while starting" not in p.stdout
    phases = {(r["kind"], r["phase"]) for r in res["rows"]}
    for k in kinds[1:]:
        assert {(k, "first_restore"), (k, "cold"), (k, "restore")} <= phases
    assert {("none", "cold"), ("none", "gpu_hit"), ("xkv", "after_kill_cold")} <= phases
    # each engine's first hit after start against its steady median, variants too: a restore
    # (connectors) or a GPU hit (none, vLLM recomputing the last block)
    firsts = [r for r in res["rows"] if r["phase"] in ("first_restore", "first_hit")]
    assert sorted((r["kind"], r["phase"]) for r in firsts) == [
        ("none", "first_hit"), ("xkv", "first_restore"),
        ("xkv@verify_checksums=off", "first_restore")]
    assert all(r["cached"] > 0 for r in firsts)  # hits, not cold prefills
    for k, what in (("none", "first GPU hit"), ("xkv", "first restore"),
                    ("xkv@verify_checksums=off", "first restore")):
        assert f"{what} after start ({k}, 300 tokens): " in p.stdout, p.stdout[-3000:]
    # the no-connector engine's first decode-shaped GPU hit (one token computed, a restore
    # step's shape) and its steady repeats: a prompt one past a block boundary of vLLM's choice
    dec = [r for r in res["rows"] if r["phase"] in ("first_decode_hit", "decode_hit")]
    assert [(r["kind"], r["phase"]) for r in dec] == [
        ("none", "first_decode_hit"), ("none", "decode_hit"), ("none", "decode_hit")]
    m = dec[0]["tokens"]
    assert 2 <= m <= 301 and all(r["tokens"] == m and r["cached"] == m - 1 for r in dec), dec
    assert f"first decode-shaped GPU hit after start (none, {m} tokens): " in p.stdout
    # restores are whole 128-token chunks (2 of the 300 tokens), whatever block size the CPU's
    # backend chose
    assert {r["cached"] for r in res["rows"] if r["phase"] == "restore"} == {256}
    # --ab-unverified: each xkv restore repetition also restored unchecked in the same engine
    ab = [r["phase"] for r in res["rows"] if r["kind"] == "xkv"
          and r["phase"] in ("restore", "restore_unverified")]
    assert ab == ["restore", "restore_unverified", "restore_unverified", "restore"]
    assert {r["cached"] for r in res["rows"] if r["phase"] == "restore_unverified"} == {256}
    assert "same-engine checked / unchecked restore (xkv, 300 tokens, 2 pairs)" in p.stdout
    assert "allow_unverified_requests is on" in (out / "xkv.log").read_text()
    # the restored first token's logprobs equal the no-connector run's, for both xkv kinds (the
    # hit's cached count is vLLM's block-granular one: read from the run)
    for k in kinds[1:]:
        ok = [ln for ln in p.stdout.splitlines()
              if ln.startswith(f"first-token top-5 logprobs, {k} restored (cached ")]
        assert len(ok) == 1 and ok[0].endswith(": True"), p.stdout[-3000:]
    # --decode-tokens / --decode-batch: each kind's two restored (GPU-hit) prompts generated 4
    # tokens together, --reps times
    dec = [r for r in res["rows"] if r["phase"] == "decode"]
    assert sorted(r["kind"] for r in dec) == sorted(k for k in kinds for _ in range(2 * 2))
    assert all(len(r["out_tokens"]) == 4 and r["tpot_ms"] > 0 and r["cached"] > 0
               and r["batch"] == 2 for r in dec)
    assert ("decode after a restore (GPU hit for none), 300-token prompt, 2 requests at once, "
            "ms per output token") in p.stdout
