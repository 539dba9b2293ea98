"""The refusal matrix: who may fan out, and exactly one warning per process naming why not."""

import logging

import pytest

from xkv.fanout import eligibility as el
from xkv.fanout.config import FanoutConfig
from xkv.fanout.eligibility import CacheFacts, Mode, Reason, decide, report

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
    (CacheFacts(use_mla=True, tp_size=8, spec_kinds=("mla_compressed", "mla"), block_outermost=True),
     Reason.BLOCK_OUTERMOST),  # DeepSeek-V4
    (CacheFacts(use_mla=True, tp_size=8, spec_kinds=("mla_compressed",)), Reason.NOT_REPLICATED),
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
