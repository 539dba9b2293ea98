"""register_host / unregister_host / is_host_accessible."""

from __future__ import annotations

import pytest
import torch

import xkv.kernels as K


def test_register_host_without_cuda_is_a_noop():
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    t = torch.zeros(10, dtype=torch.uint8)
    assert K.register_host(t) is t
    K.unregister_host(t)
    with pytest.raises(ValueError):
        K.register_host(t[::2])


@pytest.mark.gpu
def test_register_host_round_trip():
    t = torch.zeros(1 << 20, dtype=torch.uint8)
    assert not K.is_host_accessible(t)
    K.register_host(t)
    assert K.is_host_accessible(t) and K.is_host_accessible(t[4096:8192])
    K.register_host(t)  # idempotent
    K.unregister_host(t)
    assert not K.is_host_accessible(t)
