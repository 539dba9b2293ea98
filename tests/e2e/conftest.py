"""Real-engine tests: a real xkv-gateway on loopback per test, engines in child processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))


@pytest.fixture(scope="session")
def models():
    from tiny_models import ensure_model

    return {k: str(ensure_model(k)) for k in ("llama", "deepseek_v2")}
