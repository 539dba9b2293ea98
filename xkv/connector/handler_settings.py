"""The CUDA transfer handler's environment settings (``cuda_transfer.CudaTransferHandler`` reads
them once, at construction; a bad value refuses to start, naming the variable and the choices):

* ``XKV_LOAD_ENGINE`` / ``XKV_SAVE_ENGINE`` (:func:`engine`): the kernels' engine of restores /
  saves, one of ``xkv.kernels.ENGINES`` (default ``auto``);
* ``XKV_TAIL_ORDER`` (:func:`tail_order`): ``first`` (default: a restore's before-forward tail is
  issued before the group's copy, on the load stream) or ``last`` (after it, on a tail stream;
  an A/B switch until measured on a GPU: docs/configuration.md).
"""

from __future__ import annotations

import os

from xkv import kernels

TAIL_ORDERS = ("first", "last")


def tail_order() -> str:
    """``XKV_TAIL_ORDER``, one of :data:`TAIL_ORDERS`."""
    v = os.environ.get("XKV_TAIL_ORDER", "first")
    if v not in TAIL_ORDERS:
        raise ValueError(f"XKV_TAIL_ORDER={v!r}: expected one of {TAIL_ORDERS}")
    return v


def engine(var: str) -> str:
    """The engine environment variable ``var`` names, one of ``xkv.kernels.ENGINES``."""
    e = os.environ.get(var, "auto")
    if e not in kernels.ENGINES:
        raise ValueError(f"{var}={e!r}: expected one of {kernels.ENGINES}")
    return e
