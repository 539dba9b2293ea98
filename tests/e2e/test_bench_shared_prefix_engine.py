"""bench/shared_prefix.py on vLLM's CPU engine with a variant kind: the GPU run that decides
``load_mode``'s default compares ``sync`` and ``auto`` on the same workload in one call, so the
variant's engine must get its option and its own gateway, every timed request must hit its
prefix, and the report must name each xkv kind against the no-connector outputs."""

from __future__ import annotations

import json

import pytest
from e2e_harness import run_bench

pytestmark = [pytest.mark.vllm, pytest.mark.slow]



def test_shared_prefix_runs_a_variant_kind_beside_plain_xkv(models, tmp_path):
    out = tmp_path / "o"
    kinds = ["none", "xkv", "xkv@load_mode=auto"]
    prefix_len, suffix = 384, 40
    # a KV cache of ~1100 tokens (512 B each: two concurrent requests of 490), sized in bytes so
    # that it holds as many tokens whatever block size the CPU's backend picks: eight prefixes
    # fall out of it and come back from the card
    args = ["--model", models["llama"],
            "--out", str(out), "--kinds", ",".join(kinds), "--backend", "", "--prefixes", "8",
            "--prefix-len", str(prefix_len), "--suffix", str(suffix), "--batch", "2",
            "--rounds", "2", "--out-tokens", "2", "--gpu-blocks", "0", "--kv-gib", "0.000525",
            "--gpu-util", "0.1", "--max-batched", "2048", "--chunk-size", "128", "--vocab",
            "1024", "--card-gib", "0.25", "--child-timeout", "400", "--lookup-timeout-ms", "2000",
            "--engine-stats"]
    # the suite's VLLM_CPU_KVCACHE_SPACE (scripts/test.sh: 1 GiB) would size the CPU engine's
    # cache instead of --kv-gib: every prefix would stay cached
    p = run_bench("shared_prefix.py", args, unset=("VLLM_CPU_KVCACHE_SPACE",))
    res = json.loads((out / "shared_prefix.json").read_text())
    assert res["rc"] == dict.fromkeys(kinds, 0), p.stdout[-3000:]
    assert list(res["kinds"]) == kinds
    for kind in kinds:
        r = res["kinds"][kind]
        assert len(r["round_ms"]) == 2 and len(r["outputs"]) == 2
        assert [len(c) for c in r["cached"]] == [2, 2]
    # every timed request of both xkv kinds had its whole prefix (3 chunks of 128 tokens), while
    # the same requests without a connector missed some on the GPU: those came from the card
    none_hits = [c for rnd in res["kinds"]["none"]["cached"] for c in rnd]
    assert 0 in none_hits, none_hits
    for kind in kinds[1:]:
        assert [c for rnd in res["kinds"][kind]["cached"] for c in rnd] == [prefix_len] * 4
    # the variant's engine ran with its option (its log says so), the plain one without it
    assert "XKV: restores: load_mode 'auto'" in (out / "xkv@load_mode=auto.log").read_text()
    assert "XKV: restores: load_mode" not in (out / "xkv.log").read_text()
    for kind in kinds[1:]:
        assert f"| {kind} | " in p.stdout, p.stdout[-3000:]
    assert p.stdout.count(" of 4 |") == 2, p.stdout[-3000:]
    # --engine-stats: vLLM's own counters per timed round; the connectors' hits are the cards',
    # the no-connector engine has none, and every round took engine steps
    for kind in kinds:
        rows = res["kinds"][kind]["engine"]
        assert len(rows) == 2 and all(r["steps"] > 0 for r in rows), (kind, rows)
        conn = sum(r["connector_hit_tokens"] for r in rows)
        assert conn == 0 if kind == "none" else conn > 0, (kind, rows)
        assert f"{kind}: per round (mean of 2): " in p.stdout, p.stdout[-3000:]
        # and where each finished request's time went (vLLM's request-phase histograms)
        # (2 output tokens: every finished request spent time in prefill and in decode)
        assert all(sum(r[k] for r in rows) > 0 for k in ("requests", "prefill_ms", "decode_ms")), (
            kind, rows)
