"""Short versions of bench/gateway_soak.py (issue 14): 4 engines' worth of traffic with STATS
and /metrics every 100 ms never turns a client off; under client SIGKILLs, late writers and a
gateway restart no reader ever copies a wrong byte."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gateway_soak  # noqa: E402

pytestmark = pytest.mark.slow


def test_soak_four_engines_no_turn_off():
    out = gateway_soak.run("soak", 15.0, clients=4)
    assert out["engines_reported"] == 4, out
    assert out["turn_offs"] == 0 and out["wrong_bytes"] == 0, out
    assert out["lookups"] > 500 and out["hit_chunks"] > 0 and out["written"] > 0, out
    assert out["scrapes"] > 50 and out["scrape_errors"] == 0, out


def test_fault_soak_no_wrong_bytes():
    out = gateway_soak.run("fault", 15.0, clients=4)
    assert out["wrong_bytes"] == 0, out
    assert out["checked_bytes"] > 0 and out["hit_chunks"] > 0, out
    assert out["killed_clients"] > 0 and out["gateway_restarts"] == 1, out
    assert out["late_commits"] > 0 and out["late_applied"] == 0, out
