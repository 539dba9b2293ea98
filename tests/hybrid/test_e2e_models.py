"""bench/e2e_models.py on the CPU (the GPU runs of bench/e2e_ttft.py use it): engine options,
hybrid block sizes against vLLM's own sizing code, and the verify child's state-page check."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import e2e_models as M  # noqa: E402

SMALL = str(ROOT / "bench" / "models" / "nemotronh_small")


def _args(*argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=SMALL)
    ap.add_argument("--chunk-size", type=int, default=256)
    M.add_args(ap)
    return ap.parse_args(list(argv))


def test_engine_kwargs_and_chunk():
    assert M.engine_kwargs(_args()) == {} and M.connector_extra(_args()) == {}
    assert M.connector_extra(_args("--lookup-timeout-ms", "900")) == {"lookup_timeout_ms": 900}
    a = _args("--kv-cache-dtype", "fp8", "--calculate-kv-scales", "--mamba-cache-mode", "align")
    assert M.engine_kwargs(a) == {"kv_cache_dtype": "fp8", "calculate_kv_scales": True,
                                  "mamba_cache_mode": "align"}
    assert M.chunk_tokens(_args()) == 256
    assert M.chunk_tokens(_args("--chunk-size", "0")) == 640  # vLLM 0.26 default: 'all'
    assert M.chunk_tokens(_args("--chunk-size", "0", "--mamba-cache-mode", "align")) == 528
    llama = str(ROOT / "bench" / "models" / "llama8b")
    assert M.chunk_tokens(_args("--model", llama, "--chunk-size", "0")) == 256
    assert M.is_hybrid(SMALL) and not M.is_hybrid(llama)


def test_small_config_is_a_nemotron_h_hybrid():
    c = json.loads(Path(SMALL, "config.json").read_text())
    pat = c["hybrid_override_pattern"]
    assert len(pat) == c["num_hidden_layers"] == 12 and set(pat) == {"M", "*", "-"}
    assert pat.count("M") == 6 and pat.count("*") == 2 and c["vocab_size"] <= 131072
    assert c["mamba_num_heads"] * c["mamba_head_dim"] == c["expand"] * c["hidden_size"]


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["align", "all"])
def test_hybrid_block_size_is_vllms(hybrid_models, mode):
    """The formula equals vLLM's own sizing (``Platform._align_hybrid_block_size``) for the
    FlashAttention backend class (what the H200 runs; alignment 16) and the CPU backend
    (alignment 32, the block sizes the CPU engine tests see: nemotron_h 96 in 'align')."""
    pytest.importorskip("vllm")
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    for model in (hybrid_models["nemotron_h"], SMALL):
        for backend, align in ((FlashAttentionBackend, 16), (CPUAttentionBackend, 32)):
            mc = ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16",
                             max_model_len=2048)
            vc = VllmConfig(
                model_config=mc,
                cache_config=CacheConfig(block_size=align, enable_prefix_caching=True,
                                         mamba_cache_mode=mode),
                scheduler_config=SchedulerConfig(max_model_len=2048, is_encoder_decoder=False,
                                                 enable_chunked_prefill=True,
                                                 max_num_batched_tokens=2048),
                device_config=DeviceConfig("cpu"))
            current_platform._align_hybrid_block_size(vc, backend)
            assert vc.cache_config.mamba_cache_mode == mode
            want = vc.cache_config.block_size
            assert M.hybrid_block_size(model, mode, align) == want, (model, backend, mode)
            assert vc.cache_config.mamba_block_size == want  # one block size for every group
    assert M.hybrid_block_size(hybrid_models["nemotron_h"], "align", 32) == 96


def test_state_check_compares_before_the_forward():
    """StateCheck on the CPU handler: a restored state page is compared with the card right
    after its copy (a later in-place update, as the forward makes to an 'align' running block,
    is not seen), the handler's own verifier no longer sees state pages, saves are compared
    too, and a wrong card byte is counted."""
    from xkv.connector.transfer import SyncTransferHandler
    from xkv.layout import describe_cache

    for k in M.COUNTS:
        M.COUNTS[k] = 0
    h = M.StateCheck(SyncTransferHandler(verify=True))
    state = describe_cache(torch.zeros(6, 1, 1, 64, dtype=torch.int8), num_blocks=6, kind="mamba")
    attn = describe_cache(torch.zeros(6, 2, 4, 8, dtype=torch.float32), num_blocks=6,
                          layout="LBHNC", kind="attention")
    card = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    ids = torch.tensor([1, 4])
    h.load_group(["m"], card, torch.tensor([[0, 64]]), [state], ids)
    h.load_group(["a"], card, torch.tensor([[1024, 2048]]), [attn], ids)
    assert [x[2].kind for x in h.inner.verifier.pending["restore"]] == ["attention"]
    h.wait_layer("m")
    assert M.COUNTS["state_restores"] == 2 and M.COUNTS["state_restores_differ"] == 0
    state.base.view(6, 64)[4].fill_(7)  # the forward advances the running block in place
    h.sync_loads()  # the handler's own check: attention pages only, still equal
    assert h.inner.verifier.checked["restore"] == 2 and h.inner.verifier.mismatched["restore"] == 0
    card[64] ^= 0xFF  # the card no longer holds block 4's bytes
    h.load_group(["m"], card, torch.tensor([[0, 64]]), [state], ids)
    card[64] ^= 0xFF
    h.wait_layer("m")
    assert M.COUNTS["state_restores"] == 4 and M.COUNTS["state_restores_differ"] == 1
    prep = h.prepare_saves([state], torch.tensor([2]), card, torch.tensor([[3000]]))
    h.save_prepared(prep, 0, "m", state, torch.tensor([2]), card, torch.tensor([3000]))
    assert M.COUNTS["state_saves"] == 1 and M.COUNTS["state_saves_differ"] == 0
    lines = M.report_lines({"info": {"verify_states": dict(M.COUNTS)}})
    assert "4 restored block-layers compared with the card, 1 differ; 1 saved, 0 differ" in lines[0]


def test_e2e_ttft_options_and_report(tmp_path):
    """The CPU dry path of bench/e2e_ttft.py: its options parse (the new ones included) and
    ``--report-only`` prints the state-page line of a verify run."""
    import subprocess

    ttft = ROOT / "bench" / "e2e_ttft.py"
    h = subprocess.run([sys.executable, str(ttft), "--help"], capture_output=True, text=True,
                       timeout=60)
    assert h.returncode == 0, h.stderr
    for opt in ("--kv-cache-dtype", "--calculate-kv-scales", "--mamba-cache-mode"):
        assert opt in h.stdout
    res = {"args": {"model": SMALL, "backend": "FLASH_ATTN"}, "rows": [], "ref": {},
           "verify": ["XKV_VERIFY restore checked=8 mismatched=0 total_checked=8 total_mismatched=0"],
           "rc": {"verify": 0},
           "info": {"verify_states": {"state_restores": 12, "state_restores_differ": 0,
                                      "state_saves": 30, "state_saves_differ": 0}}}
    (tmp_path / "r.json").write_text(json.dumps(res))
    p = subprocess.run([sys.executable, str(ttft), "--report-only", str(tmp_path / "r.json"),
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "state pages, before the forward): 12 restored block-layers" in p.stdout
    assert "byte-exact check (restore): 8 block-layers compared with the card, 0 differ" in p.stdout


@pytest.mark.vllm
@pytest.mark.slow
def test_e2e_ttft_verify_child_on_the_cpu_engine(hybrid_models, tmp_path):
    """bench/e2e_ttft.py's verify kind end to end on vLLM's CPU engine with the tiny Nemotron-H
    ('align' mode; the CPU engine cannot run 'all'), a fresh second engine restoring the ref
    prompt: state pages checked before the forward, every other page by verify_restores."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "o"
    cmd = [sys.executable, str(ROOT / "bench" / "e2e_ttft.py"), "--model", hybrid_models["nemotron_h"],
           "--out", str(out), "--kinds", "verify", "--backend", "", "--mode", "eager",
           "--lens", "300", "--verify-lens", "300", "--multi", "0", "--multi-len", "300",
           "--ref-chunks", "2", "--chunk-size", "128", "--mamba-cache-mode", "align",
           "--vocab", "1024", "--card-gib", "0.25", "--max-batched", "2048", "--port", str(port),
           "--child-timeout", "400", "--verify-fresh-engine",
           "--lookup-timeout-ms", "2000"]  # a loaded 2-core box misses the 50 ms default
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "e2e_ttft.json").read_text())
    assert res["rc"] == {"verify": 0}
    st = res["info"]["verify_states"]
    # restores into boundary + running block ('align'), 2 state layers, 2 restores at least
    assert st["state_restores"] >= 8 and st["state_restores_differ"] == 0
    assert st["state_saves"] > 0 and st["state_saves_differ"] == 0
    assert res["ref"]["verify"]["restored"]["cached"] == 256  # by the second engine
    tot = {"restore": None, "save": None}
    for line in p.stdout.splitlines():
        if line.startswith("byte-exact check (restore)") or line.startswith("byte-exact check (save)"):
            tot[line.split("(")[1].split(")")[0]] = line
    assert tot["restore"] and tot["restore"].endswith(", 0 differ") and " 0 block-layers" not in tot["restore"]
    assert tot["save"] and tot["save"].endswith(", 0 differ")
