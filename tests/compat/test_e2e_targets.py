"""bench/e2e_targets.py: issue 24's targets as bench/e2e_ttft.py marks them (no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import e2e_targets  # noqa: E402
import e2e_ttft  # noqa: E402
from e2e_targets import target_marks  # noqa: E402


def test_the_issues_thresholds():
    assert (e2e_targets.RATIO, e2e_targets.EXPOSED_X, e2e_targets.EXPOSED_MS) == (0.80, 1.10, 2.0)
    assert (e2e_targets.COLD_SHORT, e2e_targets.COLD_LONG) == (0.05, 0.02)


def test_a_row_marks_each_target_met_or_missed_at_its_edge():
    # 2048 tokens of 131072 B at 55 GB/s: bound 1.10 x 268435456 / 55e6 ms + 2 = 7.37 ms
    row = target_marks(2048, 19.2, 24.0, 12.0, 50.0, 52.5, 2048, 131072, 55.0)
    assert row == ("0.800 (met)", "7.2 (met)", "7.4", "+5.0% (met)")
    row = target_marks(2048, 19.3, 24.0, 11.9, 50.0, 52.6, 2048, 131072, 55.0)
    assert row == ("0.804 (missed)", "7.4 (missed)", "7.4", "+5.2% (missed)")
    # from 4096 tokens the cold limit is +2 %
    assert target_marks(4096, None, None, None, 100.0, 102.0, None, 131072, None)[3] == "+2.0% (met)"
    assert target_marks(4096, None, None, None, 100.0, 102.1, None, 131072, None)[3] == "+2.1% (missed)"


def test_missing_figures_give_dashes():
    assert target_marks(2048, None, None, None, None, None, None, 131072, None) == ("—",) * 4
    assert target_marks(2048, 20.0, 0.0, 10.0, 0.0, 50.0, 2048, 131072, None) == ("—",) * 4


def test_none_graphs_piecewise_changes_only_the_no_connector_engine_in_graphs_mode():
    """``--none-graphs piecewise``: the baseline engine runs the graph mode xkv's engines get."""
    a = e2e_ttft._args(["--none-graphs", "piecewise", "--kv-gib", "4"])
    kw = e2e_ttft.engine_kwargs(a, "none", 4096)
    assert kw["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert kw["kv_cache_memory_bytes"] == 4 << 30 and not kw["enforce_eager"]
    for kind in ("xkv", "offload", "xkv@verify_checksums=off"):
        assert "compilation_config" not in e2e_ttft.engine_kwargs(a, kind, 4096)
    assert "kv_transfer_config" not in kw
    eager = e2e_ttft._args(["--none-graphs", "piecewise", "--mode", "eager"])
    assert "compilation_config" not in e2e_ttft.engine_kwargs(eager, "none", 4096)
    assert "compilation_config" not in e2e_ttft.engine_kwargs(e2e_ttft._args([]), "none", 4096)
