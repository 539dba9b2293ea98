"""xkv.layout.pool: PagePool's own checks, its overlap test and its label."""

from __future__ import annotations

import pytest
import torch
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
