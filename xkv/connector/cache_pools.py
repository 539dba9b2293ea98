"""The worker's byte-page view of vLLM's KV cache tensors: one ``xkv.layout.PagePool`` per layer,
checked against the registry before anything is registered: every tensor belongs to a KV cache
group, every layer of a group has a tensor, and each layer's page is as large as the KV cache
spec says (a mismatch would move wrong bytes, so it refuses to start). No vLLM types."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from xkv.connector.registry import Registry
from xkv.layout import PagePool, describe_cache, kinds


def pool_kind(kind: str, replicated: bool = False) -> str | None:
    """The label a registry kind gives its page pools (messages only): a sliding window's
    pages are an MLA latent or attention heads."""
    if kind == kinds.SLIDING_WINDOW:
        return "mla" if replicated else "attention"
    return "mla" if kind in kinds.REPLICATED else kind


def cache_pools(registry: Registry, kv_caches: Mapping[str, torch.Tensor], *, num_blocks: int,
                layout: str | None) -> tuple[dict[str, PagePool], dict[str, tuple[int, int]]]:
    """(layer -> its ``PagePool``, layer -> (group, index in the group)). ``layout``: the name
    vLLM resolved for attention pages (``describe_cache`` checks their strides against it).
    ``ValueError`` names the layers when a tensor belongs to no group, a group layer has no
    tensor, or a page's size differs from the spec's."""
    expected = {n: (p.group.index, i) for p in registry.groups
                for i, n in enumerate(p.group.layer_names)}
    unknown = sorted(set(kv_caches) - set(expected))
    if unknown:
        raise ValueError(
            f"xkv: KV cache tensors {unknown} belong to no KV cache group: nobody would "
            "write them, refusing to start"
        )
    missing = sorted(set(expected) - set(kv_caches))
    if missing:
        raise ValueError(f"xkv: KV cache group layers {missing} have no registered tensor")
    pools: dict[str, PagePool] = {}
    for plan in registry.groups:
        for i, name in enumerate(plan.group.layer_names):
            # A state page's tensors (a Mamba2 SSM state is [B, heads, head_dim, state]) are not
            # [B, H, N, C] views: no layout applies.
            pool = describe_cache(kv_caches[name], num_blocks=num_blocks,
                                  layout=None if plan.is_state else layout,
                                  kind=pool_kind(plan.group.kind, plan.group.replicated))
            if pool.block_bytes != plan.group.bytes_of(i):
                raise ValueError(
                    f"xkv: layer {name}: {pool.block_bytes} bytes per block in memory, "
                    f"{plan.group.bytes_of(i)} expected from the KV cache spec"
                )
            pools[name] = pool
    return pools, expected
