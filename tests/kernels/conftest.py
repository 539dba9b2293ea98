"""Every kernel test starts and ends without a calibration: ``engine="auto"`` means Triton on CUDA
(and the torch engine on CPU) unless the test calibrates."""

import pytest

import xkv.kernels as K


@pytest.fixture(autouse=True)
def _calibration_off():
    K.set_calibration(None)
    yield
    K.set_calibration(None)
