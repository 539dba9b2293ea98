"""Reading vLLM's KV cache specs: which groups the connector stores, their bytes per block, the
Mamba state policy, and the facts fan-out decides on. Split from ``compat`` (one idea: specs).

Like ``compat``, vLLM is imported lazily inside functions and differences between versions are
read by attribute name, never by version string.

Mamba / linear-attention groups become ``mamba`` state groups in vLLM's ``align`` and ``all``
cache modes (prefix caching on; ``xkv.connector.states`` says where each keeps its states); in
``none`` (prefix caching off) vLLM keeps no state at any block boundary, nothing restorable
would exist, and the model is refused at start with the switch that fixes it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from xkv.connector.config import ConfigError
from xkv.connector.registry import CacheGroup, state_group
from xkv.connector.states import STATE_MODES
from xkv.fanout.eligibility import CacheFacts
from xkv.layout import kinds


def layer_kind(spec: Any) -> str:
    """The kind (one of ``xkv.layout.kinds.KINDS``) of one per-layer vLLM KV cache spec, read
    duck-typed (class names along the MRO and a few fields), never by model name: the single
    classification of the registry and fan-out (the module docstring of ``kinds`` says what each
    kind is)."""
    names = [c.__name__ for c in type(spec).__mro__]
    if "MambaSpec" in names:
        return kinds.MAMBA
    if "SlidingWindowSpec" in names or "SlidingWindowMLASpec" in names:
        return kinds.SLIDING_WINDOW
    if names[0] == "MLAAttentionSpec":
        tps = getattr(spec, "tokens_per_state", 1)
        if (isinstance(tps, int) and tps != 1) or getattr(spec, "model_version", None) == "deepseek_v4":
            return kinds.MLA_COMPRESSED
        return kinds.MLA
    if names[0] == "FullAttentionSpec" and getattr(spec, "attention_chunk_size", None) is None:
        # With the hybrid allocator off a sliding-window layer is a FullAttentionSpec whose
        # blocks all exist, so its pages are complete and storable like any other.
        return kinds.ATTENTION
    return kinds.OTHER


def spec_kind(spec: Any) -> str:
    """The registry's kind of a group's KV cache spec (``xkv.layout.kinds``, the classification
    fan-out uses too). A ``UniformTypeKVCacheSpecs`` group (layers of one type, different page
    sizes) takes its layers' common kind when that is MLA or compressed MLA (a latent and its
    indexer cache), or a sliding window (refused, with that reason); an attention or Mamba such
    group stays ``other`` and refused (its sharding or state rules were never checked per
    layer)."""
    if not isinstance(getattr(spec, "kv_cache_specs", None), Mapping):
        return layer_kind(spec)
    k = kinds.group_kind([layer_kind(s) for s in _iter_layer_specs(spec)])
    return k if k in (*kinds.REPLICATED, kinds.SLIDING_WINDOW) else kinds.OTHER


def block_bytes(spec: Any) -> int:
    """Content bytes of one block of one layer (without page padding)."""
    for attr in ("unpadded_page_size_bytes", "real_page_size_bytes", "page_size_bytes"):
        v = getattr(spec, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    raise ValueError(f"xkv: cannot tell the page size of KV cache spec {spec!r}")


def cache_groups(kv_cache_config: Any) -> list[CacheGroup]:
    """Neutral rows for every transferable KV cache group, with vLLM's group index.

    The two roles see different configs: a worker's group of several layer types
    (``UniformTypeKVCacheSpecs``, e.g. an MLA latent and its indexer cache) keeps every layer's
    spec, the scheduler's keeps only its first layer's (``generate_scheduler_kv_cache_config``).
    Whatever the gateway must agree on (fingerprint, slot size) is therefore read from what
    both see: the first layer's spec class and the allocation's per-layer pages
    (``CacheGroup.layer_pages``, a mixed group only); the content size of each layer
    (``layer_bytes``) only the worker needs, to move bytes."""
    pages = _allocated_pages(kv_cache_config)
    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(g, "enable_kv_transfer", True):
            continue
        spec = g.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: per layer
        if isinstance(inner, Mapping) and inner:
            sizes = tuple(block_bytes(inner[n]) for n in g.layer_names)
            layer_bytes = sizes if len(set(sizes)) > 1 else ()  # an MLA latent + its indexer
            first = next(iter(inner.values()))  # the one spec the scheduler's config keeps
            one = block_bytes(first)
        else:
            layer_bytes, one, first = (), block_bytes(spec), spec
        laid = tuple(pages.get(n, 0) for n in g.layer_names)
        kind = spec_kind(spec)
        out.append(
            CacheGroup(
                index=i,
                kind=kind,
                layer_names=tuple(g.layer_names),
                block_size=int(spec.block_size),
                block_bytes=one,
                spec=type(first).__name__,
                layer_bytes=layer_bytes,
                layer_pages=laid if len(set(laid)) > 1 and min(laid) > 0 else (),
                **(_window(spec) if kind == kinds.SLIDING_WINDOW else {}),
            )
        )
    return out


def _allocated_pages(kv_cache_config: Any) -> dict[str, int]:
    """Bytes of one block of every layer as the allocation lays it out (padding included),
    from the ``KVCacheTensor`` rows both roles share: ``min(layer_stride, block_stride)`` on
    29+ (layer-outermost: the block stride; block-outermost: the layer stride), ``size /
    num_blocks`` for 26/28's ``shared_by`` tensors."""
    out: dict[str, int] = {}
    nb = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
    for t in getattr(kv_cache_config, "kv_cache_tensors", ()) or ():
        layers = getattr(t, "layers", None)
        if layers is not None and getattr(t, "layer_stride", None) is not None:
            page = min(int(t.layer_stride), int(t.block_stride))
        else:
            layers, page = getattr(t, "shared_by", ()) or (), int(t.size) // nb if nb else 0
        for n in layers:
            out.setdefault(n, page)
    return out


def _window(spec: Any) -> dict[str, Any]:
    """A sliding-window group's window as vLLM's ``SlidingWindowManager`` reads it (from the
    group's first layer spec; vLLM groups only layers of one window): ``sliding_window``,
    ``extra_retained_tokens``, and whether its layers keep an MLA latent (replicated on every
    TP rank, ``SlidingWindowMLASpec``). Layers that disagree are left without a window (the
    registry then refuses the group)."""
    specs = list(_iter_layer_specs(spec))
    wins = {(int(getattr(s, "sliding_window", 0) or 0),
             int(getattr(s, "extra_retained_tokens", 0) or 0)) for s in specs}
    mla = {"SlidingWindowMLASpec" in [c.__name__ for c in type(s).__mro__] for s in specs}
    if len(wins) != 1 or len(mla) != 1:
        return {}
    (w, extra), = wins
    return {"sliding_window": w, "extra_retained": extra, "replicated": mla.pop()}


def _mamba_mode(vllm_config: Any, spec: Any) -> str:
    """vLLM's Mamba cache mode for a ``MambaSpec`` group (the spec's field, else the config's)."""
    mode = getattr(spec, "mamba_cache_mode", None)
    if not mode or mode == "none":
        mode = getattr(vllm_config.cache_config, "mamba_cache_mode", None) or mode
    return str(mode or "none")


def state_groups(vllm_config: Any, kv_cache_config: Any, groups: list[CacheGroup]) -> list[CacheGroup]:
    """Mamba / linear-attention groups become ``mamba`` state groups, after checking that vLLM
    keeps a state per block boundary: ``mamba_cache_mode`` ``"align"`` or ``"all"``, the modes
    prefix caching turns on (``states.STATE_MODES``).

    Without prefix caching vLLM runs Mamba models with ``mamba_cache_mode="none"``: one state
    block per request, no state at any block boundary, so nothing restorable would ever exist
    (and the attention pages alone would resume from a wrong state). Refused at start.
    """
    from vllm.v1.kv_cache_interface import MambaSpec

    out = []
    for g in groups:
        spec = kv_cache_config.kv_cache_groups[g.index].kv_cache_spec
        if not isinstance(spec, MambaSpec):
            out.append(g)
            continue
        cc = vllm_config.cache_config
        mode = _mamba_mode(vllm_config, spec)
        if not getattr(cc, "enable_prefix_caching", False) or mode == "none":
            raise ConfigError(
                f"xkv: hybrid model with a {getattr(spec, 'mamba_type', 'Mamba')} state cache "
                f"(KV cache group {g.index}) but prefix caching is off, so vLLM keeps no Mamba "
                "state per block (mamba_cache_mode='none') and nothing could be restored: add "
                "--enable-prefix-caching (LLM(enable_prefix_caching=True)) to use "
                "FusIOnXConnector with this model"
            )
        if mode not in STATE_MODES:
            raise ConfigError(
                f"xkv: mamba_cache_mode={mode!r}: FusIOnXConnector restores Mamba states in "
                f"vLLM's {' and '.join(repr(m) for m in STATE_MODES)} modes only; remove "
                "--mamba-cache-mode (vLLM then picks one of them with --enable-prefix-caching)"
            )
        if mode == "all" and int(spec.block_size) != int(cc.block_size):
            # 0.26: 'all' sets mamba_block_size from the Mamba chunk size; a larger --block-size
            # leaves the attention groups on another block size than the state groups.
            raise ConfigError(
                f"xkv: mamba_cache_mode='all' with Mamba block size {spec.block_size} but "
                f"attention block size {cc.block_size}: FusIOnXConnector needs one block size "
                f"for every KV cache group; start vLLM with --block-size {spec.block_size} "
                "(or without --block-size), or with --mamba-cache-mode align"
            )
        if getattr(spec, "num_speculative_blocks", 0):
            raise ConfigError(
                "xkv: speculative decoding with a Mamba state cache is not supported by "
                "FusIOnXConnector (the running state block moves with the draft tokens)"
            )
        content = getattr(spec, "state_content_size_bytes", None)
        if not isinstance(content, int) or content <= 0:
            content = sum(
                math.prod(shape) * dt.itemsize
                for shape, dt in zip(spec.shapes, spec.dtypes, strict=True)
            )
        out.append(state_group(g, content, mode))
    return out


def state_fields(kv_cache_config: Any, plan: Any) -> dict[str, Any]:
    """What else must match to share a group's objects. State groups: the state tensors' shapes
    and dtypes (two SSM cache dtypes of one size, fp16 vs bf16, would otherwise share a layout)
    and the Mamba cache mode. Every group of a hybrid model carries the mode: the two modes run
    other kernels' chunkings, so neither a state nor the attention pages computed after it are
    mixed between engines of different modes. Models without state groups: nothing."""
    from vllm.v1.kv_cache_interface import MambaSpec

    modes = sorted({str(getattr(g.kv_cache_spec, "mamba_cache_mode", ""))
                    for g in kv_cache_config.kv_cache_groups
                    if isinstance(g.kv_cache_spec, MambaSpec)})
    if not plan.is_state:
        return {"mamba_cache_mode": modes} if modes else {}
    spec = kv_cache_config.kv_cache_groups[plan.group.index].kv_cache_spec
    return {
        "state_shapes": [list(s) for s in spec.shapes],
        "state_dtypes": [str(d) for d in spec.dtypes],
        "mamba_type": str(getattr(spec, "mamba_type", "")),
        "mamba_cache_mode": plan.group.state_mode or str(getattr(spec, "mamba_cache_mode", "")),
    }


def fanout_spec_kind(spec: Any) -> str:
    """Kind of one per-layer vLLM cache spec for fan-out: the registry's classification
    (:func:`layer_kind`; fan-out takes ``kinds.FANOUT`` only)."""
    return layer_kind(spec)


def _iter_layer_specs(group_spec: Any) -> Iterable[Any]:
    inner = getattr(group_spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    if isinstance(inner, Mapping):
        return list(inner.values())
    return [group_spec]


def fanout_facts(vllm_config: Any, kv_cache_config: Any, *, layer_views: Iterable[Any] = (),
                 layerwise_hook: bool = True, cuda: bool | None = None) -> CacheFacts:
    """Collect fan-out's ``CacheFacts`` from vLLM's ``VllmConfig`` and ``KVCacheConfig`` (0.26-0.33).

    ``layer_views`` are the per-layer cache tensors handed to ``register_kv_caches``: each must be
    contiguous with ``stride(0) * itemsize == page``. ``layerwise_hook`` is False when some restored
    layer's attention never calls ``wait_for_layer_load`` (DeepSeek-V3.2 / GLM-5 DSA).
    """
    model = vllm_config.model_config
    par = vllm_config.parallel_config
    groups = getattr(kv_cache_config, "transfer_groups", None)
    if groups is None:
        groups = [g for g in kv_cache_config.kv_cache_groups if getattr(g, "enable_kv_transfer", True)]
    kinds = tuple(fanout_spec_kind(s) for g in groups for s in _iter_layer_specs(g.kv_cache_spec))
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or ""
    block_outermost = str(layout).upper().startswith("B")
    contiguous = all(bool(v.is_contiguous()) for v in layer_views)
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    return CacheFacts(
        use_mla=bool(getattr(model, "use_mla", False)),
        tp_size=int(getattr(par, "tensor_parallel_size", 1)),
        spec_kinds=kinds,
        is_hybrid=bool(getattr(model, "is_hybrid", False)),
        block_outermost=block_outermost,
        layers_contiguous=contiguous,
        dcp_size=int(getattr(par, "decode_context_parallel_size", 1) or 1),
        pcp_size=int(getattr(par, "prefill_context_parallel_size", 1) or 1),
        ubatching=bool(getattr(par, "use_ubatching", False)),
        layerwise_hook=layerwise_hook,
        cuda=bool(cuda),
    )
