"""The calibration ``engine="auto"`` follows: the ranking (pure), and measuring it on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_buffers import GEOMS, gpu_and_cpu
from pools import POISON, oracle, random_bytes

import xkv.kernels as K
from xkv.kernels import staged
from xkv.kernels.calibrate import Calibration


def test_auto_follows_calibration():
    cal = Calibration(
        sizes=(4096, 65536),
        restore=(("triton", "staged", "copy_engine"), ("staged", "copy_engine", "triton")),
        save=(("staged", "triton", "copy_engine"), ("copy_engine", "triton", "staged")),
        gbps={},
    )
    big = staged.STAGED_MIN_BYTES
    assert cal.engine_for(False, 100, big, True) == "triton"
    assert cal.engine_for(False, 70000, big, True) == "staged"
    assert cal.engine_for(False, 70000, big - 1, True) in (
        "copy_engine",
        "triton",
    )  # too small to stage
    assert cal.engine_for(False, 70000, big, False) in (
        "copy_engine",
        "triton",
    )  # GPU flat: no staging
    assert cal.engine_for(True, 5000, big, True) == "staged"


def test_no_calibration_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    assert K.calibrate() is None and K.calibration() is None


@pytest.mark.gpu
def test_calibrate_and_auto():
    cal = K.calibrate(sizes=(4096, 262144), total_bytes=16 << 20)
    assert cal.sizes == (4096, 262144) and K.calibration() is cal
    for d in ("restore", "save"):
        for size in cal.sizes:
            assert set(cal.gbps[d][size]) == {"triton", "copy_engine", "staged"}
            assert all(v > 0 for v in cal.gbps[d][size].values())
    g = GEOMS["256k"]
    raw_cpu, pool_cpu, raw_gpu, pool_gpu = gpu_and_cpu(g, 8, fill=POISON)
    data = random_bytes(2 * g.block_bytes, 9)
    offs = np.array([[0, g.block_bytes]])
    oracle(raw_cpu, [pool_cpu], data, offs, np.array([5, 0]), save=False)
    K.restore(data.pin_memory(), [0, g.block_bytes], pool_gpu, [5, 0])  # auto
    torch.cuda.synchronize()
    assert torch.equal(raw_gpu.cpu(), raw_cpu)
    K.set_calibration(None)
