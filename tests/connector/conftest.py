import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("PYTHONHASHSEED", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))


@pytest.fixture
def fake_gateway(monkeypatch):
    """A FakeGateway that every FusIOnXConnector built in this test talks to."""
    from connector_fakes import FakeGateway

    gw = FakeGateway()
    import xkv.connector.setup as setup

    monkeypatch.setattr(setup, "gateway_factory", lambda cfg, timeout_s: gw.client)
    return gw


@pytest.fixture(scope="session")
def llama_dir():
    from tiny_models import ensure_model

    return ensure_model("llama")
