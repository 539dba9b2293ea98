"""vllm_specs: what the connector reads from vLLM's KV cache specs for fan-out (moved here from
tests/fanout with ``facts_from_vllm``, now ``xkv.connector.vllm_specs.fanout_facts``)."""

from types import SimpleNamespace as NS

import pytest

from xkv.connector.vllm_specs import fanout_facts, fanout_spec_kind
from xkv.fanout.config import FanoutConfig
from xkv.fanout.eligibility import Reason, decide

ON = FanoutConfig(enabled=True)


# ---- facts from duck-typed vLLM objects (class names as in vLLM 0.29; vLLM itself not imported)
def _vllm(use_mla=True, hybrid=False, tp=4, dcp=1, pcp=1):
    return NS(model_config=NS(use_mla=use_mla, is_hybrid=hybrid),
              parallel_config=NS(tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                                 prefill_context_parallel_size=pcp, use_ubatching=False))


class AttentionSpec:
    pass


class FullAttentionSpec(AttentionSpec):
    pass


class MLAAttentionSpec(FullAttentionSpec):
    tokens_per_state = 1
    model_version = None


class MambaSpec:
    pass


class SlidingWindowMLASpec(AttentionSpec):
    pass


def _dsv4_spec():
    s = MLAAttentionSpec()
    s.tokens_per_state, s.model_version = 4, "deepseek_v4"
    return s


def test_fanout_facts_shapes():
    groups = [NS(kv_cache_spec=NS(kv_cache_specs={"l0": MLAAttentionSpec(), "l1": MLAAttentionSpec()}),
                 enable_kv_transfer=True)]
    kvc = NS(kv_cache_groups=groups, kv_cache_layout="LBNHC")
    f = fanout_facts(_vllm(), kvc, cuda=True)
    assert f.spec_kinds == ("mla", "mla") and decide(ON, f).on
    # DeepSeek-V4: block-outermost, compressed and sliding-window MLA specs
    kv4 = NS(kv_cache_groups=[NS(kv_cache_spec=_dsv4_spec()), NS(kv_cache_spec=SlidingWindowMLASpec())],
             kv_cache_layout="BLHNC")
    f4 = fanout_facts(_vllm(), kv4, cuda=True)
    assert f4.block_outermost and f4.spec_kinds == ("mla_compressed", "sliding_window")
    assert decide(ON, f4).reason is Reason.BLOCK_OUTERMOST
    # Kimi Linear: MLA + Mamba groups
    kvk = NS(kv_cache_groups=[NS(kv_cache_spec=MLAAttentionSpec()), NS(kv_cache_spec=MambaSpec())])
    assert decide(ON, fanout_facts(_vllm(hybrid=True), kvk, cuda=True)).reason is Reason.HYBRID
    # attention-only model
    kva = NS(kv_cache_groups=[NS(kv_cache_spec=FullAttentionSpec())])
    assert decide(ON, fanout_facts(_vllm(use_mla=False), kva, cuda=True)).reason is Reason.NOT_MLA
    # groups not transferred are ignored (draft/MTP)
    kvt = NS(kv_cache_groups=[NS(kv_cache_spec=MLAAttentionSpec(), enable_kv_transfer=True),
                              NS(kv_cache_spec=FullAttentionSpec(), enable_kv_transfer=False)])
    assert fanout_facts(_vllm(), kvt, cuda=True).spec_kinds == ("mla",)
    # a non-contiguous layer view
    import torch
    view = torch.zeros(4, 8)[:, ::2]
    f5 = fanout_facts(_vllm(), kvc, layer_views=[view], cuda=True)
    assert decide(ON, f5).reason is Reason.LAYOUT
    assert decide(ON, fanout_facts(_vllm(dcp=2), kvc, cuda=True)).reason is Reason.CONTEXT_PARALLEL


@pytest.mark.vllm
def test_fanout_facts_from_real_vllm_specs():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec as F
    from vllm.v1.kv_cache_interface import MLAAttentionSpec as M

    mla = M(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    full = F(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert fanout_spec_kind(mla) == "mla" and fanout_spec_kind(full) == "attention"


class _Spec:  # duck-typed specs: the classification reads class names and fields only
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _spec(cls_name, *bases, **kw):
    base = tuple(type(b, (_Spec,), {}) for b in bases) or (_Spec,)
    return type(cls_name, base, {})(**kw)


def test_one_classification():
    """vLLM's per-layer specs read into ``xkv.layout.kinds`` names, here beside compat (the
    one place that knows vLLM), for the registry and fan-out alike."""
    from xkv.connector.vllm_specs import layer_kind
    from xkv.layout import kinds

    assert layer_kind(_spec("MLAAttentionSpec", tokens_per_state=1)) == kinds.MLA
    assert layer_kind(_spec("MLAAttentionSpec", tokens_per_state=4,
                            model_version="deepseek_v4")) == kinds.MLA_COMPRESSED
    assert layer_kind(_spec("MLAAttentionSpec", tokens_per_state=4)) == kinds.MLA_COMPRESSED
    assert layer_kind(_spec("SlidingWindowMLASpec", "SlidingWindowSpec")) == kinds.SLIDING_WINDOW
    assert layer_kind(_spec("FullAttentionSpec", attention_chunk_size=None)) == kinds.ATTENTION
    assert layer_kind(_spec("FullAttentionSpec", attention_chunk_size=64)) == kinds.OTHER
    assert layer_kind(_spec("Mamba2Spec", "MambaSpec")) == kinds.MAMBA
    assert layer_kind(_spec("CrossAttentionSpec")) == kinds.OTHER
    assert not hasattr(kinds, "classify")  # the lowest layer knows no vLLM class
