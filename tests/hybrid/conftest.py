"""Hybrid-model engine tests: a real xkv-gateway per test, engines in a child process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[0] / "models"))
sys.path.insert(0, str(HERE.parents[0] / "e2e"))


@pytest.fixture(scope="session")
def hybrid_models():
    from tiny_models import ensure_model

    return {k: str(ensure_model(k)) for k in ("nemotron_h", "granitemoehybrid", "qwen3_next")}
