"""xkv.layout.pool: PagePool's own checks, its overlap test and its label."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from layout_helpers import v26_attention, v29_views

from xkv.layout import LayoutError, PagePool, describe_cache


def test_pagepool_rejects_inconsistent_fields():
    base = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(LayoutError):
        PagePool(
            base=base, num_blocks=4, block_bytes=30, block_stride=30, runs=((0, 30),)
        )  # 120 > 100
    with pytest.raises(LayoutError):
        PagePool(base=base, num_blocks=2, block_bytes=31, block_stride=30, runs=((0, 30),))
    with pytest.raises(LayoutError):
        PagePool(base=base.float(), num_blocks=1, block_bytes=4, block_stride=4, runs=((0, 4),))


def test_overlaps():
    raw, views = v29_views("BLNHC", L=2, B=4, H=2, N=16, C=64)
    a, b = (describe_cache(v) for v in views)
    assert not a.overlaps(b) and a.overlaps(a)


def test_kind_is_the_callers_label():
    _, t = v26_attention(4, 2, 16, 128, layout="NHD")
    assert describe_cache(t, kind="mla").kind == "mla"
    with pytest.raises(LayoutError, match="kind"):
        describe_cache(t, kind="sliding")


@given(stride=st.integers(1, 4096), runs=st.lists(
    st.tuples(st.integers(0, 2048), st.integers(1, 2048)), min_size=1, max_size=4),
    at=st.integers(0, 64))
def test_derived_values_equal_their_definitions(stride, runs, at):
    """The cached ``data_ptr``, ``span``, ``extent``, ``device`` and ``alignment`` are what their
    definitions give, and ``alignment % 4 == 0`` exactly when every stride, address and run
    value is a multiple of 4 (the checked copies' test)."""
    runs = tuple(runs)
    span = max(o + n for o, n in runs)
    raw = torch.zeros(at + 3 * stride + span + 64, dtype=torch.uint8)
    base = raw[at:]
    p = PagePool(base=base, num_blocks=3, block_bytes=sum(n for _, n in runs),
                 block_stride=stride, runs=runs)
    assert p.data_ptr == base.data_ptr() and p.device == base.device
    assert p.span == span and p.extent == 2 * stride + span
    vals = [stride, base.data_ptr(), *(x for r in runs for x in r)]
    assert all(v % p.alignment == 0 for v in vals)
    assert (p.alignment % 4 == 0) == all(v % 4 == 0 for v in vals)
    assert p.alignment == math.gcd(*vals)
