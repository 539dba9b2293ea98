"""xkv.layout.describe: every cache form of vllm-connector-api.md §4 becomes the right byte pages.

Tensors are built the way vLLM builds them (same shapes, strides, storage offsets as measured in the
notes); the check is always the same: the PagePool's bytes of block b are exactly the bytes of the
logical tensor's block b, in address order, and nothing else.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from layout_helpers import LAYOUT_ORDER, check_pool, v26_attention, v29_views

from xkv.layout import KV_CACHE_LAYOUTS, LayoutError, describe_cache

# ---- vLLM 0.26 / 0.28 ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_v26_attention(layout):
    _, t = v26_attention(8, 2, 16, 128, layout=layout)
    pool = describe_cache(t, layout=layout)
    assert (pool.block_bytes, pool.block_stride, pool.runs, pool.kind) == (
        8192,
        8192,
        ((0, 8192),),
        None,  # the kind is the caller's label, never guessed
    )
    check_pool(pool, t)


def test_v26_layout_mismatch_is_an_error():
    _, t = v26_attention(8, 2, 16, 128, layout="NHD")
    with pytest.raises(LayoutError) as e:
        describe_cache(t, layout="HND")
    msg = str(e.value)
    assert "shape=(8, 2, 16, 128)" in msg and "stride=(4096, 128, 256, 1)" in msg and "LBHNC" in msg


def test_v26_mla_3d_and_fp8_ds_mla():
    raw = torch.zeros(9 * 64 * 576 * 2, dtype=torch.int8)
    t = raw.view(torch.bfloat16).view(9, 64, 576)
    pool = describe_cache(t)
    assert (pool.block_bytes, pool.block_stride) == (64 * 576 * 2, 64 * 576 * 2)
    check_pool(pool, t)
    ds = torch.zeros(12, 64, 656, dtype=torch.uint8)
    pool = describe_cache(ds)
    assert pool.block_bytes == 64 * 656
    check_pool(pool, ds)


def test_v26_mamba_state_list():
    """0.26: [conv (B, 3, 256) bf16, ssm (B, 4, 16, 8) fp32], as_strided over 32 KiB pages."""
    raw = torch.zeros(6 * 32768, dtype=torch.int8)
    conv = torch.as_strided(raw.view(torch.bfloat16), (6, 3, 256), (16384, 256, 1))
    ssm = torch.as_strided(
        raw.view(torch.float32), (6, 4, 16, 8), (8192, 128, 8, 1), 3 * 256 * 2 // 4
    )
    pool = describe_cache([conv, ssm], page_bytes=3584)
    assert (pool.block_bytes, pool.block_stride, pool.runs) == (
        3584,
        32768,
        ((0, 3584),),
    )
    check_pool(pool, [conv, ssm])


def test_v28_mamba_int8_padded_page():
    raw = torch.zeros(5 * 32768, dtype=torch.int8)
    t = raw.view(5, 1, 1, 32768)
    pool = describe_cache(t, page_bytes=32768)
    assert (pool.block_bytes, pool.block_stride) == (32768, 32768)
    check_pool(pool, t)


def test_kv_first():
    """ROCm (2, B, N, H, D): a block is its K page and its V page."""
    raw = torch.zeros(2 * 6 * 16 * 2 * 64 * 2, dtype=torch.int8)
    t = raw.view(torch.bfloat16).view(2, 6, 16, 2, 64)
    pool = describe_cache(t)
    page = 16 * 2 * 64 * 2
    assert pool.runs == ((0, page), (6 * page, page)) and pool.block_stride == page
    check_pool(pool, t, block_dim=1)


def test_hpc_kv_second():
    t = torch.zeros(6, 2, 16, 2, 64, dtype=torch.bfloat16)
    pool = describe_cache(t)
    assert pool.runs == ((0, 2 * 16 * 2 * 64 * 2),)
    check_pool(pool, t)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_v26_cross_layer_tensor(layout):
    """register_cross_layers_kv_cache: (L, B, H, N, 2D), memory [B, L, N, H, 2D] (NHD) or [B, H, L, N, 2D]."""
    L, B, H, N, D2 = 3, 5, 2, 16, 64
    order = (1, 0, 3, 2, 4) if layout == "NHD" else (1, 2, 0, 3, 4)
    shape = (L, B, H, N, D2)
    phys = tuple(shape[d] for d in order)
    t = torch.zeros(phys, dtype=torch.bfloat16).permute(*[order.index(d) for d in range(5)])
    assert t.shape == shape
    pool = describe_cache(t, block_dim=1)
    assert pool.runs == ((0, L * H * N * D2 * 2),)
    check_pool(pool, t, block_dim=1)


def test_kernel_block_ratio():
    _, t = v26_attention(12, 2, 16, 128, layout="HND")
    pool = describe_cache(t, num_blocks=4)
    assert (pool.num_blocks, pool.kernel_block_ratio, pool.block_bytes) == (4, 3, 3 * 8192)
    check_pool(pool, t, ratio=3)
    assert describe_cache(t, kernel_block_ratio=3).block_bytes == pool.block_bytes
    with pytest.raises(LayoutError):
        describe_cache(t, num_blocks=5)
    with pytest.raises(LayoutError):
        describe_cache(t, num_blocks=4, kernel_block_ratio=2)


# ---- vLLM 0.29+: [B, H, N, C] views over one int8 buffer ------------------------------------------


@pytest.mark.parametrize("layout", KV_CACHE_LAYOUTS)
def test_v29_attention_every_layout(layout):
    raw, views = v29_views(layout, L=2, B=6, H=2, N=16, C=128)
    for v in views:
        pool = describe_cache(v, layout=layout)
        assert pool.block_bytes == 2 * 16 * 128 * 2
        assert len(pool.runs) == (2 if layout in ("LHBNC", "BHLNC") else 1)
        check_pool(pool, v)


@pytest.mark.parametrize("layout", ["BLNHC", "BLHNC"])
def test_v29_block_outermost_layers_join(layout):
    raw, views = v29_views(layout, L=3, B=5, H=2, N=16, C=64)
    pool = describe_cache(views, layout=layout)
    assert pool.runs == ((0, 3 * 2 * 16 * 64 * 2),)
    check_pool(pool, views)


def test_v29_bhlnc_layers_join_as_runs():
    raw, views = v29_views("BHLNC", L=2, B=4, H=2, N=16, C=64)
    pool = describe_cache(views)
    assert len(pool.runs) == 1  # per head the layers are adjacent: one block is one run again
    check_pool(pool, views)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "LHBNC"])
def test_v29_layer_outermost_layers_do_not_join(layout):
    raw, views = v29_views(layout, L=2, B=4, H=2, N=16, C=64)
    with pytest.raises(LayoutError, match="block stride"):
        describe_cache(views)


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_v29_mla(layout):
    raw, views = v29_views(layout, L=2, B=7, H=1, N=16, C=576)
    for v in views:
        pool = describe_cache(v, layout=layout)
        assert pool.block_bytes == 16 * 576 * 2
        check_pool(pool, v)


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_v29_mamba_padded(layout):
    raw, views = v29_views(layout, L=2, B=5, H=1, N=1, C=3584, dtype=torch.int8, pad_page=32768)
    for v in views:
        pool = describe_cache(v, layout=layout, page_bytes=3584)
        assert pool.block_bytes == 3584
        check_pool(pool, v)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_v29_kernel_blocks(layout):
    raw, views = v29_views(layout, L=2, B=4, H=2, N=32, C=64, ratio=2)
    v = views[1]
    assert v.shape == (8, 2, 16, 64)
    pool = describe_cache(v, num_blocks=4, layout=layout)
    assert pool.kernel_block_ratio == 2 and pool.runs == ((0, 2 * 2 * 16 * 64 * 2),)
    check_pool(pool, v, ratio=2)


# ---- errors -------------------------------------------------------------------------------------


def test_errors_name_shape_strides_layout():
    t = torch.zeros(4, 8, 3)[:, :, :2].permute(
        0, 2, 1
    )  # innermost dim strided: 8-byte runs... fine
    describe_cache(t)  # a valid (if scattered) description
    over = torch.zeros(64).as_strided((4, 16), (8, 1))  # blocks overlap
    with pytest.raises(LayoutError, match=r"overlap.*shape=\(4, 16\) stride=\(8, 1\)"):
        describe_cache(over)
    with pytest.raises(LayoutError, match="unknown KV cache layout"):
        describe_cache(torch.zeros(4, 2, 16, 8), layout="XYZ")
    with pytest.raises(LayoutError, match="page_bytes"):
        describe_cache(torch.zeros(4, 2, 16, 8), page_bytes=123)
    with pytest.raises(LayoutError, match="max 4096"):
        describe_cache(torch.zeros(2, 8192, 2)[:, :, :1])
    with pytest.raises(LayoutError, match="scalar"):
        describe_cache(torch.zeros(()))
    with pytest.raises(LayoutError, match="share one buffer"):
        describe_cache([torch.zeros(4, 8), torch.zeros(4, 8)])
    with pytest.raises(LayoutError):
        describe_cache([])
    with pytest.raises(LayoutError, match="strides do not match layout LHBNC"):
        describe_cache(v29_views("LBNHC", 1, 4, 2, 16, 8)[1][0], layout="LHBNC")


# ---- property: random strides of the 5 logical dims -------------------------------------------


@given(
    layout=st.sampled_from(KV_CACHE_LAYOUTS),
    L=st.integers(1, 3),
    B=st.integers(1, 5),
    H=st.integers(1, 3),
    N=st.integers(1, 5),
    C=st.integers(1, 9),
    dtype=st.sampled_from([torch.int8, torch.bfloat16, torch.float32]),
    layer=st.integers(0, 2),
)
def test_any_layout_any_shape(layout, L, B, H, N, C, dtype, layer):
    raw, views = v29_views(layout, L, B, H, N, C, dtype=dtype)
    v = views[min(layer, L - 1)]
    pool = describe_cache(v, layout=layout)
    check_pool(pool, v)
    if LAYOUT_ORDER[layout][0] == 1 and L > 1:  # block-outermost: the layers join
        joined = describe_cache(views)
        check_pool(joined, views)


# ---- the real vLLM 0.29 allocation --------------------------------------------------------------


@pytest.mark.vllm
def test_vllm_allocate_kv_cache_every_layout():
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    def allocate(layout, groups, nblocks, kernel_block_sizes=None):
        cc = SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            prefix_cache_retention_interval=None,
            num_gpu_blocks_override=nblocks,
        )
        cfg = get_kv_cache_config_from_groups(SimpleNamespace(cache_config=cc), groups, 1 << 30)
        return cfg, allocate_kv_cache(cfg, torch.device("cpu"), layout, kernel_block_sizes)

    attn = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    for layout in KVCacheLayout:
        cfg, caches = allocate(layout, [KVCacheGroupSpec(["l0", "l1"], attn)], 6)
        for t in caches.values():
            pool = describe_cache(
                t, num_blocks=cfg.num_blocks, layout=layout, page_bytes=attn.page_size_bytes
            )
            check_pool(pool, t)
        if layout.is_block_outermost:
            check_pool(
                describe_cache(list(caches.values()), num_blocks=cfg.num_blocks),
                list(caches.values()),
            )

    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    cfg, caches = allocate(KVCacheLayout.LBNHC, [KVCacheGroupSpec(["m0", "m1"], mla)], 5)
    for t in caches.values():
        assert t.shape == (5, 1, 16, 576)
        check_pool(describe_cache(t, num_blocks=cfg.num_blocks, layout="LBNHC"), t)

    # kernel blocks: manager block 32 tokens, kernel block 16
    attn32 = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    cfg, caches = allocate(KVCacheLayout.LBHNC, [KVCacheGroupSpec(["k0"], attn32)], 4, [16])
    t = caches["k0"]
    assert t.shape[0] == 8
    pool = describe_cache(t, num_blocks=cfg.num_blocks, layout="LBHNC")
    assert pool.kernel_block_ratio == 2
    check_pool(pool, t, ratio=2)

    # hybrid: attention + Mamba pages overlay one buffer (page padded to the attention page)
    attn64 = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    mamba = MambaSpec(
        block_size=64,
        shapes=((3, 256), (4, 16, 8)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=attn64.page_size_bytes,
    )
    for layout in (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC):
        groups = [KVCacheGroupSpec(["a0"], attn64), KVCacheGroupSpec(["s0"], mamba)]
        cfg, caches = allocate(layout, groups, 4)
        m = caches["s0"]
        assert m.dtype == torch.int8 and m.shape[1:3] == (1, 1)
        pool = describe_cache(m, num_blocks=cfg.num_blocks, layout=layout)
        assert pool.block_bytes == 3584
        check_pool(pool, m)
        check_pool(
            describe_cache(caches["a0"], num_blocks=cfg.num_blocks, layout=layout), caches["a0"]
        )
