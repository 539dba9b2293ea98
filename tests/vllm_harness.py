"""The one vLLM test harness: version-neutral builders over the installed vLLM (0.26, 0.28, 0.29
or 0.33), on the CPU, for tests/connector and tests/compat (``pytest.importorskip`` it: it
imports vLLM).

Everything that differs between versions is chosen by the same probes the connector uses
(``xkv.connector.compat.features()``), never by a version string:

* ``make_kv_cache_config`` — ``KVCacheTensor(shared_by=...)`` per layer (26/28) or one
  ``KVCacheTensor(layers=..., layer_stride=...)`` per group over one buffer (29+);
* ``allocate`` — the tensors vLLM's own allocation code hands ``register_kv_caches``: 26/28
  through the runner helpers ``_allocate_kv_cache`` + ``_reshape_kv_cache`` with a real attention
  backend class (FlashAttention, FlashMLA, Mamba2; their shape code runs without a GPU), 29+
  through ``allocate_kv_cache`` with a ``KVCacheLayout``;
* ``raw_page`` — the oracle: block ``b`` of layer ``l`` as raw bytes of the backing buffer,
  computed from the ``KVCacheTensor`` description only (never from the tensor's strides), so a
  page mover that picked the wrong bytes cannot agree with it by construction;
* ``make_scheduler`` / ``make_request`` / ``step`` — a real ``Scheduler`` with FusIOnXConnector
  loaded by module path, and one engine step without a forward (``step``) or with a simulated
  forward on a worker connector (``step_with_worker``: per layer, wait for its load, write
  ``pattern`` bytes for the step's new blocks, ``save_kv_layer``);
* ``attention_cache_config`` / ``make_worker_caches`` — the two-layer attention or MLA cache of
  the connector tests and a worker connector over vLLM's own allocation of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from xkv.connector import compat, vllm_specs

MODULE = "xkv_vllm_connector.fusionx_connector"
ATTN_LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
MAMBA_LAYERS = ["model.layers.0.mixer", "model.layers.1.mixer"]
# Legacy (26/28) layout names and their 29+ equivalents: the same page bytes.
LAYOUTS = {"NHD": "LBNHC", "HND": "LBHNC"}


def layout_name(legacy: str) -> str:
    """The name this vLLM uses for ``legacy`` ("NHD"/"HND")."""
    return LAYOUTS[legacy] if compat.features()["generic_kv_views"] else legacy


def spec_for(kind: str, block_size: int):
    if kind == "attention":
        return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32,
                                 dtype=torch.float32)
    if kind == "mla":
        return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576,
                                dtype=torch.bfloat16)
    if kind == "mamba":
        # conv state (bf16) + ssm state (fp32), padded page: only the content is state.
        return MambaSpec(block_size=block_size, shapes=((3, 40), (2, 4, 8)),
                         dtypes=(torch.bfloat16, torch.float32), page_size_padded=512)
    raise ValueError(kind)


def make_kv_cache_config(kind: str, *, block_size: int, num_blocks: int,
                         layers: list[str] | None = None) -> KVCacheConfig:
    layers = list(layers or (MAMBA_LAYERS if kind == "mamba" else ATTN_LAYERS))
    spec = spec_for(kind, block_size)
    page = spec.page_size_bytes
    if compat.features()["layer_stride_tensors"]:
        tensors = [KVCacheTensor(size=page * num_blocks * len(layers), layers=list(layers),
                                 layer_stride=page * num_blocks, block_stride=page)]
    else:
        tensors = [KVCacheTensor(size=page * num_blocks, shared_by=[n]) for n in layers]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec(list(layers), spec)])


def _backend(kind: str):
    if kind == "attention":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
        return FlashAttentionBackend
    if kind == "mla":
        from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
        return FlashMLABackend
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionBackend
    return Mamba2AttentionBackend


@dataclass
class Caches:
    """What a worker registers, plus the raw backing bytes the oracle reads."""

    tensors: dict[str, Any]
    buffers: dict[str, torch.Tensor]  # layer -> uint8 view of its backing buffer
    offsets: dict[str, int]  # layer -> byte offset of its block 0 in that buffer
    block_stride: int
    page_bytes: int  # content bytes of one block of one layer
    layout: str | None = None
    extra: dict = field(default_factory=dict)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def allocate(kvc: KVCacheConfig, kind: str, *, layout: str | None = None,
             poison: int = 0xA5) -> Caches:
    """vLLM's own CPU allocation for ``kvc`` (one group), every byte poisoned."""
    g = kvc.kv_cache_groups[0]
    spec, bs = g.kv_cache_spec, g.kv_cache_spec.block_size
    content = vllm_specs.block_bytes(spec)
    if compat.features()["generic_kv_views"]:
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        name = layout or "LBNHC"
        kvc.kv_cache_layout = name
        tensors = allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout[name], [bs])
        kt = kvc.kv_cache_tensors[0]
        buf = _as_bytes(next(iter(tensors.values())))
        offsets = {n: kt.offset + i * kt.layer_stride for i, n in enumerate(kt.layers)}
        buffers = dict.fromkeys(kt.layers, buf)
        stride = kt.block_stride
    else:
        from vllm.v1.attention.backends.utils import set_kv_cache_layout
        from vllm.v1.worker.gpu.attn_utils import _allocate_kv_cache, _reshape_kv_cache
        from vllm.v1.worker.utils import AttentionGroup

        name = layout or "NHD"
        set_kv_cache_layout(name)  # what a backend's required layout does in a real worker
        raw = _allocate_kv_cache(kvc, {}, torch.device("cpu"))
        group = AttentionGroup(_backend(kind), list(g.layer_names), spec, 0)
        tensors = _reshape_kv_cache([group], raw, "auto", [bs], {}, kvc)
        buffers = {n: _as_bytes(raw[n]) for n in g.layer_names}
        offsets = dict.fromkeys(g.layer_names, 0)
        stride = spec.page_size_bytes
    for b in {id(x): x for x in buffers.values()}.values():
        b.fill_(poison)
    return Caches(tensors, buffers, offsets, stride, content, name)


def raw_page(c: Caches, layer: str, block: int) -> torch.Tensor:
    """The oracle: content bytes of ``block`` of ``layer`` (a view of the backing buffer)."""
    o = c.offsets[layer] + block * c.block_stride
    return c.buffers[layer][o: o + c.page_bytes]


# ------------------------------------------------------------------ scheduler side


def make_vllm_config(model_dir, *, block_size: int = 32, extra=None, dtype="float32",
                     kv_role="kv_both", max_num_batched_tokens=2048, policy=None) -> VllmConfig:
    """``policy``: ``kv_load_failure_policy`` ("recompute" / "fail"; None: vLLM's default, and
    nothing passed where this vLLM has no such field)."""
    mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype,
                     max_model_len=2048)
    kt = {} if policy is None else {"kv_load_failure_policy": policy}
    return VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=16,
                                         max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="FusIOnXConnector", kv_connector_module_path=MODULE, kv_role=kv_role,
            kv_connector_extra_config=dict(extra or {}), **kt),
    )


def make_scheduler(vllm_config: VllmConfig, kvc: KVCacheConfig) -> Scheduler:
    vllm_config.cache_config.num_gpu_blocks = kvc.num_blocks
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kvc,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=kvc.kv_cache_groups[0].kv_cache_spec.block_size, log_stats=True)


def make_worker(vllm_config: VllmConfig, kvc: KVCacheConfig, caches: Caches):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from xkv_vllm_connector.fusionx_connector import FusIOnXConnector

    conn = FusIOnXConnector(vllm_config, KVConnectorRole.WORKER, kvc)
    conn.register_kv_caches(caches.tensors)
    return conn


_HASH_READY = False


def make_request(req_id: str, tokens, *, block_size: int = 32, salt=None, max_tokens=4,
                 params=None) -> Request:
    """``params``: the request's ``kv_transfer_params``."""
    global _HASH_READY
    if not _HASH_READY:
        init_none_hash(sha256)
        _HASH_READY = True
    extra = {} if params is None else {"extra_args": {"kv_transfer_params": params}}
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **extra)
    return Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=sp,
                   pooling_params=None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(block_size, sha256))


def pattern(tokens, layer: str, nbytes: int) -> torch.Tensor:
    """Deterministic stand-in for the bytes of a block whose prefix is ``tokens``."""
    seed = int.from_bytes(sha256((tuple(tokens), layer))[:7], "little")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


LAST_STATS = None  # SchedulerStats of the last step()


def finish_step(scheduler: Scheduler, so, kv_out) -> None:
    """Feed back a fake model output: one sampled token per request past its prompt."""
    global LAST_STATS
    reqs = list(so.num_scheduled_tokens)
    sampled = [[] if scheduler.requests[r].num_computed_tokens
               < scheduler.requests[r].num_prompt_tokens else [5] for r in reqs]
    out = ModelRunnerOutput(req_ids=reqs, req_id_to_index={r: i for i, r in enumerate(reqs)},
                            sampled_token_ids=sampled, kv_connector_output=kv_out)
    outs = scheduler.update_from_output(so, out)
    LAST_STATS = next((o.scheduler_stats for o in outs.values() if o.scheduler_stats), None)


def step(scheduler: Scheduler, worker=None):
    """One engine step without a forward; returns (scheduler_output, step metadata)."""
    so = scheduler.schedule()
    meta = so.kv_connector_metadata
    kv_out = KVConnectorOutput()
    if worker is not None:
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        _, kv_out.finished_recving = worker.get_finished(so.finished_req_ids)
        kv_out.invalid_block_ids = worker.get_block_ids_with_load_errors()
        kv_out.kv_connector_worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
    finish_step(scheduler, so, kv_out)
    return so, meta.step


def step_with_worker(scheduler: Scheduler, worker, caches, block_size: int, *,
                     layers_saved: int | None = None):
    """One step with a simulated forward: per layer, wait for its load, 'compute' the blocks of
    this step's new tokens (write ``pattern`` bytes: through the oracle for a ``Caches``, into
    the block of a ``{layer: tensor}`` view otherwise), then ``save_kv_layer`` (only the first
    ``layers_saved`` layers when given). Returns (scheduler_output, step metadata,
    KVConnectorOutput with the worker's stats)."""
    so = scheduler.schedule()
    meta = so.kv_connector_metadata
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    work = step_work(scheduler, so, block_size)
    tensors = caches.tensors if isinstance(caches, Caches) else caches
    for li, (name, kv) in enumerate(tensors.items()):
        worker.wait_for_layer_load(name)
        compute_layer(caches, name, work)
        if layers_saved is None or li < layers_saved:
            worker.save_kv_layer(name, kv, None)
    worker.wait_for_save()
    _, recv = worker.get_finished(so.finished_req_ids)  # async loads done (vLLM's finished_recving)
    kv_out = KVConnectorOutput(finished_recving=recv,
                               invalid_block_ids=worker.get_block_ids_with_load_errors(),
                               kv_connector_worker_meta=worker.build_connector_worker_meta())
    if "kv_connector_stats" in getattr(KVConnectorOutput, "__dataclass_fields__", {}):
        kv_out.kv_connector_stats = worker.get_kv_connector_stats()
    worker.clear_connector_metadata()
    finish_step(scheduler, so, kv_out)
    return so, meta.step, kv_out


def step_work(scheduler: Scheduler, so, block_size: int) -> list[tuple[int, list[int]]]:
    """(block id, token prefix) of every block step ``so`` computes (first KV cache group)."""
    work = []
    for rid, n in so.num_scheduled_tokens.items():
        req = scheduler.requests[rid]
        ids = scheduler.kv_cache_manager.get_block_ids(rid)[0]
        end = req.num_computed_tokens  # schedule() already counted this step's tokens
        toks = list(req.all_token_ids)
        for b in range((end - n) // block_size, -(-end // block_size)):
            work.append((ids[b], toks[: min(end, (b + 1) * block_size)]))
    return work


def compute_layer(caches, name: str, work) -> None:
    """'Compute' layer ``name`` for ``work`` (:func:`step_work`): write each block's ``pattern``
    bytes, through the oracle for a ``Caches``, into the block of a ``{layer: tensor}`` view
    otherwise."""
    for bid, toks in work:
        if isinstance(caches, Caches):
            raw_page(caches, name, bid).copy_(pattern(toks, name, caches.page_bytes))
        else:
            kv = caches[name]
            write_page(kv, bid, pattern(toks, name, page(kv, 0).numel()))


def page(kv: torch.Tensor, block: int) -> torch.Tensor:
    """Block ``block``'s page of a ``[B, H, N, C]`` view, as bytes (block-compact layouts)."""
    return kv[block].contiguous().view(-1).view(torch.uint8)


def write_page(kv: torch.Tensor, block: int, data: torch.Tensor) -> None:
    assert kv[block].is_contiguous(), "write_page needs a block-compact layout; use a Caches"
    kv[block].view(-1).view(torch.uint8).copy_(data)
    assert torch.equal(page(kv, block), data)


# ------------------------------------------------------------------ the connector tests' cache


def attention_cache_config(*, block_size: int = 32, num_blocks: int = 256,
                           mla: bool = False) -> KVCacheConfig:
    """Two layers of full attention (fp32) or MLA (bf16 latent) in one group."""
    return make_kv_cache_config("mla" if mla else "attention", block_size=block_size,
                                num_blocks=num_blocks)


def make_worker_caches(vllm_config: VllmConfig, kvc: KVCacheConfig, *, layout: str = "LBHNC"):
    """A worker-role FusIOnXConnector over vLLM's own allocation of ``kvc`` (every byte
    poisoned) in ``layout``. Returns (connector, {layer: tensor})."""
    kind = "mla" if isinstance(kvc.kv_cache_groups[0].kv_cache_spec, MLAAttentionSpec) else "attention"
    caches = allocate(kvc, kind, layout=layout)
    return make_worker(vllm_config, kvc, caches), caches.tensors


# ------------------------------------------------------------------ hybrid (attention + Mamba)

HYBRID_LAYERS = ("model.layers.0.mixer", "model.layers.1.self_attn.attn")


def make_hybrid(block_size: int, num_blocks: int, mode: str = "align"):
    """A hybrid model's cache as vLLM lays it out: an attention group and a Mamba group (cache
    mode ``mode``) whose padded state page equals the attention page, both overlaying one
    buffer, allocated by this vLLM's own code. Returns (KVCacheConfig, tensors, raw uint8
    buffer, page bytes, state content bytes)."""
    mamba, attn = HYBRID_LAYERS
    a = spec_for("attention", block_size)
    page = a.page_size_bytes
    m = MambaSpec(block_size=block_size, shapes=((3, 40), (2, 4, 8)),
                  dtypes=(torch.bfloat16, torch.float32), page_size_padded=page,
                  mamba_cache_mode=mode)
    groups = [KVCacheGroupSpec([mamba], m), KVCacheGroupSpec([attn], a)]
    if compat.features()["layer_stride_tensors"]:
        tensors = [KVCacheTensor(size=page * num_blocks, layers=[n], layer_stride=page * num_blocks,
                                 block_stride=page) for n in HYBRID_LAYERS]
    else:
        tensors = [KVCacheTensor(size=page * num_blocks, shared_by=list(HYBRID_LAYERS))]
    kvc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)
    if compat.features()["generic_kv_views"]:
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        kvc.kv_cache_layout = "LBHNC"
        caches = allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout["LBHNC"],
                                   [block_size, block_size])
        buf = _as_bytes(caches[attn])
    else:
        from vllm.v1.attention.backends.utils import set_kv_cache_layout
        from vllm.v1.worker.gpu.attn_utils import _allocate_kv_cache, _reshape_kv_cache
        from vllm.v1.worker.utils import AttentionGroup

        set_kv_cache_layout("HND")
        raw = _allocate_kv_cache(kvc, {}, torch.device("cpu"))
        ag = [AttentionGroup(_backend("mamba"), [mamba], m, 0),
              AttentionGroup(_backend("attention"), [attn], a, 1)]
        caches = _reshape_kv_cache(ag, raw, "auto", [block_size, block_size], {}, kvc)
        buf = _as_bytes(raw[attn])
    state = 3 * 40 * 2 + 2 * 4 * 8 * 4
    return kvc, caches, buf, page, state


def gateway_engine(model_dir, *, chunk_size: int, reattach: bool):
    """A scheduler and one worker with the connector, attention caches in vLLM's CPU layout,
    the re-probe interval 0 (the test decides when time has passed): (scheduler, worker, caches)."""
    vc = make_vllm_config(model_dir, policy="recompute",
                          extra={"chunk_size": chunk_size, "reattach": reattach})
    kcfg = attention_cache_config()
    kcfg.kv_cache_layout = "LBHNC"
    sched = make_scheduler(vc, kcfg)
    wk, caches = make_worker_caches(vc, attention_cache_config(), layout="LBHNC")
    for side in (sched.connector._scheduler, wk._worker):
        side.session.reattach_interval_s = 0.0
    return sched, wk, caches
