"""Real-engine tests: a real xkv-gateway on loopback per test, engines in child processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))


@pytest.fixture
def gateway():
    """(process, port) of a fresh xkv-gateway with a 256 MiB card."""
    from xkv.gateway.testing import spawn_gateway, stop_gateway

    proc, port = spawn_gateway("256M")
    yield proc, port
    stop_gateway(proc)


@pytest.fixture(scope="session")
def models():
    from tiny_models import ensure_model

    return {k: str(ensure_model(k)) for k in ("llama", "deepseek_v2")}
