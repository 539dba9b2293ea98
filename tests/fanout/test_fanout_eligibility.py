"""The refusal matrix: who may fan out, and exactly one warning per process naming why not."""

import logging
from types import SimpleNamespace as NS

import pytest

from xkv.fanout import eligibility as el
from xkv.fanout.config import FanoutConfig
from xkv.fanout.eligibility import CacheFacts, Mode, Reason, decide, facts_from_vllm, report

ON = FanoutConfig(enabled=True)
MLA = CacheFacts(use_mla=True, tp_size=8, spec_kinds=("mla",) * 61)


@pytest.fixture(autouse=True)
def _fresh_report():
    el._reset_report_for_tests()
    yield
    el._reset_report_for_tests()


@pytest.mark.parametrize("facts, reason", [
    (MLA, Reason.OK),
    (CacheFacts(use_mla=True, tp_size=8, spec_kinds=("mla",) * 4, layerwise_hook=False), Reason.OK),
    (CacheFacts(use_mla=False, tp_size=8, spec_kinds=("attention",) * 4), Reason.NOT_MLA),
    (CacheFacts(use_mla=True, tp_size=8, spec_kinds=("mla", "mamba"), is_hybrid=True), Reason.HYBRID),
    (CacheFacts(use_mla=True, tp_size=8, spec_kinds=("mla", "mamba")), Reason.HYBRID),  # Kimi Linear/K3
    (CacheFacts(use_mla=True, tp_size=8, spec_kinds=("mla_other", "mla"), block_outermost=True),
     Reason.BLOCK_OUTERMOST),  # DeepSeek-V4
    (CacheFacts(use_mla=True, tp_size=8, spec_kinds=("mla_other",)), Reason.NOT_REPLICATED),
    (CacheFacts(use_mla=True, tp_size=8, spec_kinds=()), Reason.NOT_REPLICATED),
    (CacheFacts(use_mla=True, tp_size=8, spec_kinds=("mla",), layers_contiguous=False), Reason.LAYOUT),
    (CacheFacts(use_mla=True, tp_size=1, spec_kinds=("mla",)), Reason.TP1),
    (CacheFacts(use_mla=True, tp_size=8, spec_kinds=("mla",), dcp_size=8), Reason.CONTEXT_PARALLEL),
    (CacheFacts(use_mla=True, tp_size=8, spec_kinds=("mla",), pcp_size=2), Reason.CONTEXT_PARALLEL),
    (CacheFacts(use_mla=True, tp_size=8, spec_kinds=("mla",), ubatching=True), Reason.DBO),
    (CacheFacts(use_mla=True, tp_size=8, spec_kinds=("mla",), cuda=False), Reason.NO_CUDA),
])
def test_matrix(facts, reason):
    d = decide(ON, facts)
    assert d.reason is reason and d.on == (reason is Reason.OK)
    if d.on:
        assert d.mode is (Mode.LAYERWISE if facts.layerwise_hook else Mode.BULK)


def test_disabled_is_silent(caplog):
    caplog.set_level(logging.DEBUG, "xkv.fanout")
    d = decide(FanoutConfig(), MLA)
    assert d.reason is Reason.DISABLED and not report(d)
    assert not caplog.records


def test_exactly_one_warning_per_process(caplog):
    caplog.set_level(logging.INFO, "xkv.fanout")
    cases = [CacheFacts(use_mla=False, tp_size=2, spec_kinds=("attention",)),
             CacheFacts(use_mla=True, tp_size=1, spec_kinds=("mla",)), MLA]
    logged = [report(decide(ON, f)) for f in cases for _ in range(3)]
    assert logged.count(True) == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and len(caplog.records) == 1
    assert "fan-out off" in warnings[0].getMessage() and Reason.NOT_MLA.value in warnings[0].getMessage()


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


def test_facts_from_vllm_shapes():
    groups = [NS(kv_cache_spec=NS(kv_cache_specs={"l0": MLAAttentionSpec(), "l1": MLAAttentionSpec()}),
                 enable_kv_transfer=True)]
    kvc = NS(kv_cache_groups=groups, kv_cache_layout="LBNHC")
    f = facts_from_vllm(_vllm(), kvc, cuda=True)
    assert f.spec_kinds == ("mla", "mla") and decide(ON, f).on
    # DeepSeek-V4: block-outermost, compressed and sliding-window MLA specs
    kv4 = NS(kv_cache_groups=[NS(kv_cache_spec=_dsv4_spec()), NS(kv_cache_spec=SlidingWindowMLASpec())],
             kv_cache_layout="BLHNC")
    f4 = facts_from_vllm(_vllm(), kv4, cuda=True)
    assert f4.block_outermost and f4.spec_kinds == ("mla_other", "mla_other")
    assert decide(ON, f4).reason is Reason.BLOCK_OUTERMOST
    # Kimi Linear: MLA + Mamba groups
    kvk = NS(kv_cache_groups=[NS(kv_cache_spec=MLAAttentionSpec()), NS(kv_cache_spec=MambaSpec())])
    assert decide(ON, facts_from_vllm(_vllm(hybrid=True), kvk, cuda=True)).reason is Reason.HYBRID
    # attention-only model
    kva = NS(kv_cache_groups=[NS(kv_cache_spec=FullAttentionSpec())])
    assert decide(ON, facts_from_vllm(_vllm(use_mla=False), kva, cuda=True)).reason is Reason.NOT_MLA
    # groups not transferred are ignored (draft/MTP)
    kvt = NS(kv_cache_groups=[NS(kv_cache_spec=MLAAttentionSpec(), enable_kv_transfer=True),
                              NS(kv_cache_spec=FullAttentionSpec(), enable_kv_transfer=False)])
    assert facts_from_vllm(_vllm(), kvt, cuda=True).spec_kinds == ("mla",)
    # a non-contiguous layer view
    import torch
    view = torch.zeros(4, 8)[:, ::2]
    f5 = facts_from_vllm(_vllm(), kvc, layer_views=[view], cuda=True)
    assert decide(ON, f5).reason is Reason.LAYOUT
    assert decide(ON, facts_from_vllm(_vllm(dcp=2), kvc, cuda=True)).reason is Reason.CONTEXT_PARALLEL


@pytest.mark.vllm
def test_facts_from_real_vllm_specs():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec as F
    from vllm.v1.kv_cache_interface import MLAAttentionSpec as M

    mla = M(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    full = F(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert el.classify_spec(mla) == "mla" and el.classify_spec(full) == "attention"
