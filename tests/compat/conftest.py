"""Per-version tests: run unchanged under vLLM 0.26, 0.28, 0.29 and 0.33 (scripts/matrix.sh).

``VLLM_USE_V2_MODEL_RUNNER=0``: VllmConfig refuses the V2 runner without Triton, and the CUDA
wheels (0.26/0.33) would pick it on this CPU-only machine; test_v2_runner.py marks its configs V2
after construction and drives V2's own connector wrapper.
"""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def gateway_port():
    """Port of one real xkv-gateway (64 MiB card) shared by a module's tests."""
    from xkv.gateway.testing import running_gateway

    with running_gateway("64M") as port:
        yield port


@pytest.fixture(scope="session")
def llama_dir():
    from tiny_models import ensure_model

    return ensure_model("llama")
