"""Cache tensors built the way vLLM builds them, and the one check every layout test makes."""

from __future__ import annotations

import torch

from xkv.kernels import restore, save
from xkv.layout import PagePool

# logical [L, B, H, N, C] -> physical order (vllm/v1/kv_cache_layout.py, 0.29)
LAYOUT_ORDER = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def v29_views(layout, L, B, H, N, C, dtype=torch.bfloat16, *, pad_page=None, ratio=1):
    """``create_kv_cache_views`` of vLLM 0.29 on CPU: one int8 buffer, a [B*ratio, H, N/ratio, C] view
    per layer, strides from the layout (and the padded page for Mamba)."""
    e = torch.empty((), dtype=dtype).element_size()
    shape = (L, B * ratio, H, N // ratio, C * e)  # kernel blocks: ratio per scheduler block
    order = LAYOUT_ORDER[layout]
    st_ = [0] * 5
    cur = 1
    grid_end = max(order.index(0), order.index(1)) + 1
    for phys, d in reversed(tuple(enumerate(order))):
        if pad_page is not None and phys == grid_end - 1:
            cur = max(cur, pad_page)
        st_[d] = cur
        cur = st_[d] * shape[d]
    size = sum((s - 1) * t for s, t in zip(shape, st_, strict=True)) + 1
    raw = torch.zeros(size, dtype=torch.int8)
    v5 = torch.as_strided(raw, shape, st_)
    views = [v5[i].view(dtype) if dtype != torch.int8 else v5[i] for i in range(L)]
    return raw, views


def v26_attention(B, H, N, D2, dtype=torch.bfloat16, *, layout="NHD"):
    """0.26/0.28 FlashAttention: logical (B, H, N, 2D), NHD strides = memory [B, N, H, 2D]."""
    raw = torch.zeros(
        B * H * N * D2 * torch.empty((), dtype=dtype).element_size(), dtype=torch.int8
    )
    if layout == "NHD":
        return raw, raw.view(dtype).view(B, N, H, D2).permute(0, 2, 1, 3)
    return raw, raw.view(dtype).view(B, H, N, D2)


def byte_addresses(t: torch.Tensor) -> torch.Tensor:
    """Storage byte address of every byte of ``t``: shape ``t.shape + (element_size,)``."""
    e = t.element_size()
    addr = torch.full((), t.storage_offset() * e, dtype=torch.int64)
    for d, (n, s) in enumerate(zip(t.shape, t.stride(), strict=True)):
        shape = [1] * t.dim()
        shape[d] = n
        addr = addr + (torch.arange(n, dtype=torch.int64) * s * e).view(shape)
    return addr.unsqueeze(-1) + torch.arange(e, dtype=torch.int64)


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def logical_block_addresses(tensors, b, *, block_dim=0, ratio=1):
    tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
    a = (
        torch.cat(
            [byte_addresses(t.narrow(block_dim, b * ratio, ratio)).reshape(-1) for t in tensors]
        )
        .sort()
        .values
    )
    assert bool((a[1:] > a[:-1]).all()), "test bug: the logical block overlaps itself"
    return a


def check_pool(pool: PagePool, tensors, *, block_dim=0, ratio=1):
    """The pool's block b == the logical tensor's block b, for the first, a middle and the last block;
    and writing block b through the pool changes exactly those bytes."""
    tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
    raw = storage_bytes(tensors[0])
    g = torch.Generator().manual_seed(1)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=g))
    assert pool.num_blocks == tensors[0].shape[block_dim] // ratio
    assert pool.kernel_block_ratio == ratio
    for b in sorted({0, pool.num_blocks // 2, pool.num_blocks - 1}):
        addr = logical_block_addresses(tensors, b, block_dim=block_dim, ratio=ratio)
        assert addr.numel() == pool.block_bytes
        assert torch.equal(pool.block(b), raw[addr]), f"block {b}"
        # restore a fragment into block b: exactly the logical block's bytes change
        before = raw.clone()
        frag = torch.randint(0, 256, (pool.block_bytes,), dtype=torch.uint8, generator=g)
        restore(frag, [0], pool, [b])
        expect = before.clone()
        expect[addr] = frag
        assert torch.equal(raw, expect)
        out = torch.full((pool.block_bytes + 3,), 0xA5, dtype=torch.uint8)
        save(pool, [b], out, [3])
        assert torch.equal(out[3:], frag)
