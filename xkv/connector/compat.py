"""Everything that depends on the installed vLLM, decided by feature detection (never versions).

The façade, this module and ``vllm_specs`` (the KV cache spec readers) are the only ones that
import vLLM, always lazily (inside functions), so ``import xkv.connector.compat`` stays cheap:
vLLM imports the connector class in its API process and config code too. Every read of a vLLM
object the connector makes is here or in ``vllm_specs`` (optional ``SchedulerOutput`` fields:
:func:`scheduled_blocks`).

One code base runs on vLLM 0.26, 0.28, 0.29 and 0.33. Every difference the connector cares about
is one probe in :func:`features` (listed below; docs/supported-models.md has the versions); callers ask for
the capability, never for a version string. What each probe means for xkv:

* ``cross_layer_api`` (26/28): we never set ``prefer_cross_layer_blocks``, so vLLM still calls
  ``register_kv_caches`` with per-layer tensors.
* ``generic_kv_views`` (29+): tensors are ``[B, H, N, C]`` views and the layout name is resolved
  once by the engine core (``KVCacheConfig.kv_cache_layout``); before, backends shape the tensors
  (``(B, H, N, 2D)``, 3-D MLA, Mamba as a list in 26) and the layout (``NHD``/``HND``) is a
  per-process setting: :func:`kv_cache_layout`.
* ``layer_stride_tensors`` (29+): ``KVCacheTensor(layers, layer_stride, ...)``, else ``shared_by``.
* ``sync_load_flag`` (29+): ``start_load_kv`` runs before the forward only when a sync load was
  scheduled (else after it); 26/28 always before. Our loads are sync, so both are right.
* ``block_aligned_local_hit`` (28+): ``get_num_new_matched_tokens`` gets the block-aligned local
  hit; 26 the raw one (a multiple of the hash block size, which our chunk maths floors anyway).
* ``kv_delivery_property`` (28+), ``transfer_results``/``failed_recving`` (33): our connector is
  best effort and loads synchronously; the defaults (``get_finished`` wrapped) are right.
* ``deterministic_none_hash`` (29+) and :func:`none_hash_seed`; ``tagged_extra_keys`` (33) and
  :func:`block_hash_scheme`: both decide which tokens a block hash stands for, so both enter
  every fingerprint (:func:`fingerprint_fields`): two vLLMs that hash differently never share
  objects on one gateway.
* V2 model runner (26/28: default for dense models on GPU; 29+: for every model where vLLM has
  Triton): :func:`v2_connector_wrapper` finds the wrapper through which that runner drives a
  connector; :func:`require_supported` refuses V2 only where the installed vLLM has none.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

from xkv.connector.config import ConfigError


@functools.cache
def features() -> dict[str, bool]:
    """Probes of the installed vLLM, by capability (what each means: the module docstring)."""
    import importlib.util

    from vllm.distributed.kv_transfer.kv_connector.v1 import base as b
    from vllm.v1.core import kv_cache_utils as ku
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.outputs import KVConnectorOutput

    base = b.KVConnectorBase_V1
    fields = getattr(SchedulerOutput, "__dataclass_fields__", {})
    out_fields = getattr(KVConnectorOutput, "__dataclass_fields__", {})
    return {
        # 26/28: register_cross_layers_kv_cache replaces register_kv_caches when we prefer it.
        "cross_layer_api": hasattr(base, "register_cross_layers_kv_cache"),
        # 29+: generic [B, H, N, C] views; layout resolved once (KVCacheConfig.kv_cache_layout).
        "generic_kv_views": importlib.util.find_spec("vllm.v1.kv_cache_layout") is not None,
        # 29+: KVCacheTensor(layers, layer_stride, ...) over one backing buffer.
        "layer_stride_tensors": "layers" in getattr(KVCacheTensor, "__dataclass_fields__", {}),
        # 29+: start_load_kv runs before the forward only when a sync load was scheduled.
        "sync_load_flag": "has_sync_kv_loads" in fields,
        # 28+: the local hit handed to get_num_new_matched_tokens is block aligned.
        "block_aligned_local_hit": hasattr(base, "supports_divergent_local_hybrid_hits"),
        # 28+: property that lets a best-effort cache opt out of mandatory delivery.
        "kv_delivery_property": hasattr(base, "requires_kv_delivery"),
        # 33: request-level load failures (hybrid models cannot report block errors before).
        "failed_recving": "failed_recving" in out_fields,
        "transfer_results": hasattr(b, "KVConnectorTransferResults"),
        # 29+: NONE_HASH has a fixed seed for sha256 when PYTHONHASHSEED is unset.
        "deterministic_none_hash": hasattr(ku, "get_none_hash_seed"),
        # 33: cache_salt/LoRA/multimodal extra keys are tagged tuples (hashes differ from 29).
        "tagged_extra_keys": block_hash_scheme() == "tagged",
        # 29+: a group can be excluded from KV transfer.
        "group_transfer_flag": "enable_kv_transfer"
        in getattr(KVCacheGroupSpec, "__dataclass_fields__", {}),
    }


def model_runner_v2(vllm_config: Any) -> bool:
    """True when this engine runs vLLM's V2 model runner (``VllmConfig.use_v2_model_runner``)."""
    return bool(getattr(vllm_config, "use_v2_model_runner", False))


# The V2 runner's connector wrapper (its call order: tests/compat/test_v2_runner.py).
V2_WRAPPER_METHODS = ("pre_forward", "post_forward", "no_forward", "set_disabled")


def v2_connector_wrapper() -> Any:
    """The class through which the V2 model runner drives a KV connector
    (``ActiveKVConnector`` in 0.26-0.33), or None where this vLLM's V2 runner has none."""
    import importlib

    try:
        mod = importlib.import_module("vllm.v1.worker.gpu.kv_connector")
    except ImportError:
        return None
    cls = getattr(mod, "ActiveKVConnector", None)
    if cls is None or not all(callable(getattr(cls, m, None)) for m in V2_WRAPPER_METHODS):
        return None
    return cls


def require_supported(vllm_config: Any = None) -> None:
    """Refuse vLLM set-ups this connector cannot work with (raises ``ConfigError``).

    * The V2 model runner where this vLLM has no connector wrapper for it
      (:func:`v2_connector_wrapper`): nobody would call the connector's worker hooks. Where it
      has one (0.26-0.33) V2 is fine: xkv implements no ``handle_preemptions`` (whose place
      differs), waits for state loads inside ``start_load_kv`` (after V2's Mamba pre-copy, as
      after V1's), reads no runner internals, and takes the keyword arguments 0.33 adds.
    * A per-process random NONE_HASH (26/28 without ``PYTHONHASHSEED``): no key would ever be
      found again. ``ConnectorConfig`` already insists on ``PYTHONHASHSEED=0``; this is the
      same rule seen from vLLM's side.

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
    if vllm_config is not None and model_runner_v2(vllm_config) and v2_connector_wrapper() is None:
        raise ConfigError(
            "xkv: vLLM selected its V2 model runner, and this vLLM has no KV connector wrapper "
            "for it (vllm.v1.worker.gpu.kv_connector.ActiveKVConnector with "
            f"{', '.join(V2_WRAPPER_METHODS)}): the connector's hooks would never be called; "
            "start vLLM with VLLM_USE_V2_MODEL_RUNNER=0"
        )
    if vllm_config is not None and runtime_kv_scales(vllm_config):
        raise ConfigError(
            f"xkv: --kv-cache-dtype {vllm_config.cache_config.cache_dtype} with "
            "calculate_kv_scales: vLLM computes the k/v scales from the first batch, so every "
            "engine start may use other scales and a restored fp8 page would be read with scales "
            "it was not written with (a wrong token, not a miss); use the checkpoint's scales "
            "(calculate_kv_scales off) or a bf16 KV cache"
        )
    if none_hash_seed() == "random":
        raise ConfigError(
            "xkv: this vLLM seeds its block hashes randomly in every process unless "
            "PYTHONHASHSEED is set; start vLLM with PYTHONHASHSEED=0"
        )


def runtime_kv_scales(vllm_config: Any) -> bool:
    """An fp8 KV cache whose k/v scales vLLM computes at run time (``calculate_kv_scales``, on the
    cache or model config of the versions that have it). Static scales (the checkpoint's, else
    1.0) follow from the model, its revision and its quantization, which the fingerprint holds."""
    cc, mc = vllm_config.cache_config, vllm_config.model_config
    if not str(getattr(cc, "cache_dtype", "auto")).startswith("fp8"):
        return False
    return bool(getattr(cc, "calculate_kv_scales", False) or
                getattr(mc, "calculate_kv_scales", False))


def none_hash_seed(env: Mapping[str, str] | None = None) -> str:
    """What vLLM derives NONE_HASH (the parent of every first block hash) from.

    ``"env:<PYTHONHASHSEED>"`` when set (all versions); else ``"fixed:<seed>"`` where vLLM has a
    fixed default seed (29+, sha256 family), else ``"random"`` (26/28: ``os.urandom``).
    """
    env = os.environ if env is None else env
    seed = env.get("PYTHONHASHSEED")
    if seed is not None:
        return f"env:{seed}"
    if not features()["deterministic_none_hash"]:
        return "random"
    from vllm.v1.core import kv_cache_utils as ku

    default = getattr(ku, "DEFAULT_NONE_HASH_SEED", None)
    return f"fixed:{default}" if default else "random"


def kv_cache_layout(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """The KV cache layout name this process's tensors follow, or None if vLLM has none.

    29+: the name the engine core resolved once (``KVCacheConfig.kv_cache_layout``). 26/28:
    ``get_kv_cache_layout()``: ``VLLM_KV_CACHE_LAYOUT``, else a backend's required layout (set
    in the worker when the model loads), else the connector's, else ``"NHD"`` — a per-process
    answer, so the worker checks its tensors against it (``describe_cache(layout=...)``).
    """
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if not name:
        name = getattr(getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
    if name:
        return str(getattr(name, "name", name))
    if features()["generic_kv_views"]:
        return None
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    return str(get_kv_cache_layout())


def state_views(kv_caches: Mapping[str, Any], state_bytes: Mapping[str, int]) -> dict[str, Any]:
    """``kv_caches`` with every state layer's tensor cut to its content bytes.

    A Mamba layer is registered as a list of typed state tensors (26: content only), an int8
    ``(B, 1, 1, padded page)`` view (28: the padding included) or an int8 ``(B, 1, 1, content)``
    view with a padded block stride (29+). Told apart by form, the 28 view is narrowed to its
    first ``state_bytes[layer]`` bytes (the states, then padding), i.e. the 29+ form, so every
    version moves exactly the state bytes. ``state_bytes``: layer -> content bytes.
    """
    import torch

    out = dict(kv_caches)
    for name, n in state_bytes.items():
        t = out.get(name)
        if (isinstance(t, torch.Tensor) and t.dim() == 4 and t.element_size() == 1
                and t.shape[1:3] == (1, 1) and t.shape[3] > n):
            out[name] = t.narrow(3, 0, n)
    return out


def layout_hint(layout: str | None) -> str:
    """What to tell a user whose tensors do not follow ``layout`` (26/28: per-process names)."""
    if features()["generic_kv_views"]:
        return f"vLLM resolved KV cache layout {layout}"
    return (f"this vLLM's KV cache layout is chosen per process ({layout} here); set "
            "VLLM_KV_CACHE_LAYOUT (NHD or HND, what the attention backend uses) for every "
            "vLLM process so the scheduler and the workers agree")


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


def zeroes_new_blocks(kv_cache_config: Any) -> bool:
    """Whether the runner zeroes newly allocated KV blocks before the connector's bind
    (``KVCacheConfig.needs_kv_cache_zeroing``: Mamba models; 28+ also mixed-precision caches).
    A vLLM without the property: True (assume it does)."""
    value = getattr(kv_cache_config, "needs_kv_cache_zeroing", None)
    return value if isinstance(value, bool) else True


def parallel_sizes(vllm_config: Any) -> tuple[int, int, int]:
    """(tensor parallel size, pipeline parallel size, world size)."""
    p = vllm_config.parallel_config
    tp, pp = int(p.tensor_parallel_size), int(p.pipeline_parallel_size)
    return tp, pp, int(getattr(p, "world_size", tp * pp))


def replays_full_graphs(vllm_config: Any) -> bool:
    """vLLM captures and replays full CUDA graphs for some batches: its resolved
    ``compilation_config.cudagraph_mode`` has a full mode (``FULL``, ``FULL_DECODE_ONLY``,
    ``FULL_AND_PIECEWISE``). ``enforce_eager`` resolves it to ``NONE``; the connector's
    ``requires_piecewise_for_cudagraph`` to ``PIECEWISE``; the CPU engine captures none."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    has_full = getattr(mode, "has_full_cudagraphs", None)
    return bool(has_full()) if callable(has_full) else False


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 when no process group exists, e.g. unit tests)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0
    return int(ps.get_tensor_model_parallel_rank())


def tp_comms() -> tuple[Any, Any]:
    """(TP CPU group, vLLM's TP ``PyNcclCommunicator`` or None) for the fan-out restorer;
    (None, None) when no process group exists (unit tests: torch's default group is used)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None, None
    g = ps.get_tp_group()
    comm = getattr(g, "device_communicator", None)
    return g.cpu_group, getattr(comm, "pynccl_comm", None)


def _transfers_kv(fn: Any) -> bool:
    """``fn`` (a vLLM attention op) is wrapped by ``maybe_transfer_kv_layer``, the decorator
    that calls ``wait_for_layer_load`` / ``save_kv_layer`` (recognised by its wrapper's code,
    which ``functools.wraps`` leaves alone)."""
    try:
        from vllm.model_executor.layers.attention import kv_transfer_utils as ktu
    except ImportError:  # moved in some vLLM: trust no layer (bulk is always correct)
        return False
    prefix = ktu.maybe_transfer_kv_layer.__code__.co_qualname + ".<locals>."
    seen = 0
    while fn is not None and seen < 8:
        code = getattr(fn, "__code__", None)
        if code is not None and getattr(code, "co_qualname", "").startswith(prefix):
            return True
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return False


def layer_hooks(vllm_config: Any, layer_names: Any) -> dict[str, tuple[bool, str]]:
    """layer -> (its forward will call the per-layer KV hooks, its class name), by feature.

    vLLM calls ``wait_for_layer_load`` / ``save_kv_layer`` only from the decorator around
    ``unified_attention_with_output`` (reached by ``Attention.forward``, through the custom op
    or directly) and ``unified_mla_attention_with_output`` (reached by ``MLAAttention.forward``
    through the custom op only: its direct-call branch runs ``forward_impl`` undecorated). A
    layer fires iff its class keeps one of those two ``forward`` methods, the op it reaches
    still carries the decorator, and (MLA) it does not take the direct call. Any other class
    (DeepSeek-V3.2 / GLM-5.x sparse MLA, DeepSeek-V4, Kimi Linear / K3 MLA on 0.29 CUDA, a
    custom subclass overriding ``forward``), or a layer missing from the forward context, is
    reported as not firing: the worker fences and saves it in bulk. Never decided by model name.
    """
    import importlib

    routes: dict[Any, bool] = {}  # forward -> only through the custom op
    for mod, cls, op, op_only in (("attention", "Attention", "unified_attention_with_output", False),
                                  ("mla_attention", "MLAAttention",
                                   "unified_mla_attention_with_output", True)):
        try:
            m = importlib.import_module(f"vllm.model_executor.layers.attention.{mod}")
        except ImportError:  # not where 0.26-0.33 keep it: its layers are fenced in bulk
            continue
        if hasattr(m, cls) and _transfers_kv(getattr(m, op, None)):
            routes[getattr(m, cls).forward] = op_only
    ctx = getattr(getattr(vllm_config, "compilation_config", None),
                  "static_forward_context", None) or {}
    out = {}
    for name in layer_names:
        layer = ctx.get(name)
        if layer is None:
            out[name] = (False, "<no layer object in vLLM's forward context>")
            continue
        fwd = getattr(type(layer), "forward", None)
        op_only = routes.get(fwd)
        fires = op_only is not None and not (op_only and getattr(layer, "use_direct_call", False))
        out[name] = (fires, type(layer).__qualname__)
    return out


def layerwise_load_hook(vllm_config: Any, kv_cache_config: Any) -> bool:
    """Every layer of the transferable groups calls ``wait_for_layer_load`` (fan-out can then
    exchange layer by layer; else it runs in bulk inside ``start_load_kv``)."""
    names = [n for g in kv_cache_config.kv_cache_groups
             if getattr(g, "enable_kv_transfer", True) for n in g.layer_names]
    return all(fires for fires, _ in layer_hooks(vllm_config, names).values())


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
    f = features()
    tp, _, _ = parallel_sizes(vllm_config)
    spec = kv_cache_config.kv_cache_groups[plan.group.index].kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)  # the worker's config; the scheduler's keeps
    if isinstance(inner, dict) and inner:  # only this first spec: both roles read the same
        spec = next(iter(inner.values()))
    return {
        "model": str(mc.model),
        "revision": getattr(mc, "revision", None),
        "kv_dtype": str(getattr(spec, "dtype", None)),
        "cache_dtype": str(cc.cache_dtype),
        # fp8 pages decode with the layers' k/v scales: static ones come with the checkpoint
        # (model, revision, quantization method); run-time ones are refused (require_supported)
        "quantization": str(getattr(mc, "quantization", None)),
        "block_size": plan.group.block_size,
        "chunk_size": plan.chunk_size,
        "tp_size": tp,
        "group": plan.group.index,
        "num_groups": len(kv_cache_config.kv_cache_groups),
        "kind": plan.group.kind,
        "spec": plan.group.spec,
        "layers": list(plan.group.layer_names),
        "block_bytes": plan.group.block_bytes,
        # a group of mixed page sizes (MLA latent + indexer): every layer's allocated page (both
        # roles see it; the scheduler's config keeps one spec per group)
        **({"layer_pages": list(plan.group.layer_pages)} if plan.group.layer_pages else {}),
        # a window group's object is the window's tail at the chunk end: its window decides
        # which blocks it holds (absent for other groups: their fingerprints are unchanged)
        **({"sliding_window": plan.group.sliding_window,
            "extra_retained": plan.group.extra_retained,
            "window_blocks": plan.group.window_blocks} if plan.group.sliding_window else {}),
        "kv_layout": kv_cache_layout(vllm_config, kv_cache_config),
        # How vLLM builds the tensors it registers (backend shapes vs generic views): a layout
        # name means the same bytes only within one family.
        "kv_views": "generic" if f["generic_kv_views"] else "backend",
        "hash_algo": str(getattr(cc, "prefix_caching_hash_algo", "sha256")),
        # Which tokens a block hash stands for: tagged (33) vs untagged extra keys, and the
        # NONE_HASH seed rule (26/28 random per process unless PYTHONHASHSEED is set).
        "hash_scheme": block_hash_scheme(),
        "none_hash": none_hash_seed(),
        # Every probed behaviour: objects written under another set of vLLM behaviours are
        # never trusted, even where the fields above happen to agree (e.g. 0.26 and 0.28).
        "vllm_features": sorted(k for k, v in f.items() if v),
    }


def scheduled_blocks(so: Any) -> list[tuple[str, int, Any, bool]]:
    """Every request scheduled in ``so`` (vLLM's ``SchedulerOutput``, duck-typed):
    ``(request id, tokens computed before this step, block ids per group or None, replace)``.

    ``replace``: the block lists replace the request's (a new or resumed request, or vLLM's
    authoritative table) rather than extend them. Optional fields: ``kv_connector_block_state``
    (its ``block_ids`` table, position-indexed state lists, wins where present) and
    ``scheduled_cached_reqs.resumed_req_ids`` (a resumed request gets a new table).
    """
    snapshot = getattr(getattr(so, "kv_connector_block_state", None), "block_ids", None) or {}
    out = [(new.req_id, new.num_computed_tokens, snapshot.get(new.req_id, new.block_ids), True)
           for new in so.scheduled_new_reqs]
    cached = so.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", set()) or set()
    for i, req_id in enumerate(cached.req_ids):
        if req_id in snapshot:
            out.append((req_id, cached.num_computed_tokens[i], snapshot[req_id], True))
        else:
            out.append((req_id, cached.num_computed_tokens[i], cached.new_block_ids[i],
                        req_id in resumed))
    return out


def request_opted_out(request: Any) -> bool:
    """``kv_transfer_params: {"xkv_store": false}`` keeps a request off the card entirely.

    Anything but an absent key or ``True`` counts as opting out: an unexpected value can only
    reduce caching, never widen it.
    """
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or "xkv_store" not in params:
        return False
    return params["xkv_store"] is not True


def request_skips_checks(request: Any) -> bool:
    """``kv_transfer_params: {"xkv_verify": false}``: the request asks to restore without
    checksum checks (honoured only with ``allow_unverified_requests``, a benchmark setting).

    Only the literal ``False`` counts: any other value keeps the checks, so an unexpected value
    can never turn one off.
    """
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and params.get("xkv_verify") is False


def skips_prefix_read(request: Any) -> bool:
    """The request asked vLLM not to read any prefix cache (``skip_reading_prefix_cache``,
    where this vLLM has it): the connector offers no hit either."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))
