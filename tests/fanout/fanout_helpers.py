"""Shared builders for the fan-out tests: a card laid out as the stored-object format says, a
vLLM-shaped MLA cache per layer ([num_blocks, 1, block_size, 576] bf16), and an independent oracle."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xkv.fanout import LayerLoad

POISON = 0xA5


def mla_pool(cache: torch.Tensor):
    """PagePool of a contiguous vLLM MLA cache view [num_blocks, 1, block_size, C]."""
    from xkv.layout import PagePool

    base = cache.view(torch.uint8).reshape(-1)
    bb = base.numel() // cache.shape[0]
    return PagePool(base=base, num_blocks=cache.shape[0], block_bytes=bb, block_stride=bb,
                    runs=((0, bb),), kind="mla")


@dataclass
class MlaCase:
    card: torch.Tensor
    caches: list[torch.Tensor]
    loads: list[LayerLoad]
    expected: list[torch.Tensor]  # oracle result per layer (uint8 view of the whole cache)


def make_case(*, layers: int = 3, num_blocks: int = 40, block_size: int = 16, width: int = 576,
              chunk_blocks: int = 2, chunks: int = 5, seed: int = 0, device: str | torch.device = "cpu",
              card: torch.Tensor | None = None) -> MlaCase:
    """Restore ``chunks * chunk_blocks`` blocks into random blocks of each layer's cache.

    Stored-object layout (docs/internal-api.md): chunk c's slot at a random slot offset; layer l,
    block j of the chunk at ``slot + (l * k + j) * block_bytes``. Identical on every rank for a
    given seed."""
    g = torch.Generator().manual_seed(seed)
    bb = block_size * width * 2
    slot = -(-layers * chunk_blocks * bb // 4096) * 4096
    n_slots = chunks + 3
    if card is None:
        card = torch.randint(0, 256, (n_slots * slot,), dtype=torch.uint8, generator=g)
    slot_of = torch.randperm(n_slots, generator=g)[:chunks] * slot
    n = chunks * chunk_blocks
    block_ids = torch.randperm(num_blocks, generator=g)[:n].to(torch.int64)
    caches, loads, expected = [], [], []
    for layer in range(layers):
        offs = torch.tensor([int(slot_of[c]) + (layer * chunk_blocks + j) * bb
                             for c in range(chunks) for j in range(chunk_blocks)], dtype=torch.int64)
        cache = torch.empty(num_blocks, 1, block_size, width, dtype=torch.bfloat16, device=device)
        cache.view(torch.uint8).fill_(POISON)
        exp = torch.full((num_blocks, bb), POISON, dtype=torch.uint8)
        for i in range(n):
            exp[block_ids[i]] = card[offs[i]:offs[i] + bb].cpu()
        caches.append(cache)
        loads.append(LayerLoad(f"model.layers.{layer}.self_attn.attn", offs, mla_pool(cache), block_ids.clone()))
        expected.append(exp.reshape(-1))
    return MlaCase(card, caches, loads, expected)


def cache_bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8).reshape(-1).cpu()
