"""The copy engine's fragment plan: address math only, executed here with memmove.

The batched driver call itself needs a GPU: ``engine="copy_engine"`` is in every ``gpu`` test of
``test_page_copy.py``, ``test_staging.py`` and ``test_prepared.py``.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pools import (
    POISON,
    layer_jobs,
    layers_buffer_size,
    oracle,
    pools_over,
    random_bytes,
    single_jobs,
    slice_case,
)

from xkv.kernels import copy_engine
from xkv.kernels.jobs import build_job, offsets_arg


def _execute_plan(job) -> None:
    dsts, srcs, sizes = copy_engine.plan(job)
    for d, s, z in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, z)


@given(job=single_jobs(save=False), seed=st.integers(0, 2**16), data=st.data())
def test_copy_engine_plan_restore_slice(job, seed, data):
    raw, flat, pool, expect, ids, offs, lo, hi = slice_case(job, seed, data)
    _execute_plan(
        build_job([pool], ids, flat, offsets_arg(offs, 1, "src_offsets"), save=False, lo=lo, hi=hi)
    )
    assert torch.equal(raw, expect)


@given(job=layer_jobs(save=True), seed=st.integers(0, 2**16))
def test_copy_engine_plan_save_layers(job, seed):
    geoms, offsets, ids, offs, flat_size = job
    raw = random_bytes(layers_buffer_size(geoms, offsets), seed)
    flat = torch.full((flat_size,), POISON, dtype=torch.uint8)
    pools = pools_over(raw, geoms, offsets)
    expect = flat.clone()
    oracle(raw, pools, expect, offs, ids, save=True)
    _execute_plan(build_job(pools, ids, flat, offsets_arg(offs, len(pools), "dst_offsets"), save=True))
    assert torch.equal(flat, expect)


def test_unavailable_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    assert not copy_engine.available()
