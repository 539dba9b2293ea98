"""Disk-tier tests; the engine test reuses tests/e2e's harness and tests/models' tiny models."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "models"))
sys.path.insert(0, str(HERE.parent / "e2e"))  # e2e_harness + engine_driver: reused, not copied


@pytest.fixture(scope="session")
def models():
    from tiny_models import ensure_model

    return {"llama": str(ensure_model("llama"))}
