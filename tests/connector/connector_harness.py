"""A real vLLM ``Scheduler`` on the CPU with FusIOnXConnector loaded by module path (notes §9).

No forward pass: ``step()`` schedules, hands the connector metadata to an optional worker-side
connector, and feeds back a fake model output (one sampled token per request).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PYTHONHASHSEED", "0")

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

MODULE = "xkv_vllm_connector.fusionx_connector"
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def make_vllm_config(model_dir, *, block_size=32, extra=None, kv_role="kv_both",
                     max_num_batched_tokens=2048, policy="recompute") -> VllmConfig:
    mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                     max_model_len=2048)
    return VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="FusIOnXConnector", kv_connector_module_path=MODULE, kv_role=kv_role,
            kv_connector_extra_config=dict(extra or {}), kv_load_failure_policy=policy),
    )


def make_kv_cache_config(*, block_size=32, num_blocks=256, mla=False) -> KVCacheConfig:
    if mla:
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576,
                                dtype=torch.bfloat16)
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32,
                                 dtype=torch.float32)
    page = spec.page_size_bytes
    tensors = [KVCacheTensor(size=page * num_blocks * len(LAYERS), layers=list(LAYERS),
                             layer_stride=page * num_blocks, block_stride=page)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def make_scheduler(vllm_config, kv_cache_config) -> Scheduler:
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size,
                     log_stats=True)


_HASH_READY = False
LAST_STATS = None  # SchedulerStats of the last step()


def make_request(req_id, tokens, *, block_size=32, max_tokens=4, salt=None, params=None):
    global _HASH_READY
    if not _HASH_READY:
        init_none_hash(sha256)
        _HASH_READY = True
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                        extra_args={"kv_transfer_params": params} if params is not None else None)
    return Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=sp,
                   pooling_params=None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(block_size, sha256))


def step(scheduler, worker=None):
    """One engine step; returns (scheduler_output, step metadata)."""
    so = scheduler.schedule()
    meta = so.kv_connector_metadata
    kv_out = KVConnectorOutput()
    if worker is not None:
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        worker.get_finished(so.finished_req_ids)
        kv_out.invalid_block_ids = worker.get_block_ids_with_load_errors()
        kv_out.kv_connector_worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
    reqs = list(so.num_scheduled_tokens)
    # A request still inside its prompt samples nothing this step.
    sampled = [[] if scheduler.requests[r].num_computed_tokens < scheduler.requests[r].num_prompt_tokens
               else [5] for r in reqs]
    out = ModelRunnerOutput(req_ids=reqs, req_id_to_index={r: i for i, r in enumerate(reqs)},
                            sampled_token_ids=sampled, kv_connector_output=kv_out)
    outs = scheduler.update_from_output(so, out)
    global LAST_STATS
    LAST_STATS = next((o.scheduler_stats for o in outs.values() if o.scheduler_stats), None)
    return so, meta.step


# ---------------------------------------------------------------- worker side on CPU tensors


def make_worker(vllm_config, kv_cache_config, *, layout="LBHNC", poison=0xA5):
    """A worker-role FusIOnXConnector with real vLLM CPU cache views (``allocate_kv_cache``),
    every byte poisoned. Returns (connector, kv_caches)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from xkv_vllm_connector.fusionx_connector import FusIOnXConnector

    kv_cache_config.kv_cache_layout = layout
    bs = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout[layout], [bs])
    raw = next(iter(caches.values()))
    torch.empty(0, dtype=torch.uint8).set_(raw.untyped_storage()).fill_(poison)
    conn = FusIOnXConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    conn.register_kv_caches(caches)
    return conn, caches


def page(kv: torch.Tensor, block: int) -> torch.Tensor:
    """Block ``block``'s page of a ``[B, H, N, C]`` view, as bytes (block-compact layouts)."""
    return kv[block].contiguous().view(-1).view(torch.uint8)


def pattern(tokens, layer: str, nbytes: int) -> torch.Tensor:
    """Deterministic stand-in for the K/V bytes of a block whose prefix is ``tokens``."""
    g = torch.Generator().manual_seed(hash((tuple(tokens), layer)) & ((1 << 62) - 1))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def write_page(kv, block, data):
    kv[block].view(-1).view(torch.uint8).copy_(data) if kv[block].is_contiguous() else None
    assert torch.equal(page(kv, block), data)


def step_with_worker(scheduler, worker, caches, block_size, *, layers_saved=None):
    """One step with a simulated forward: per layer, wait for its load, 'compute' the blocks of
    this step's new tokens (write ``pattern`` bytes), then call save_kv_layer."""
    so = scheduler.schedule()
    meta = so.kv_connector_metadata
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    work = []  # (kv-independent) list of (block id, token prefix) computed this step
    rows = [(n.req_id, n.block_ids[0], n.num_computed_tokens) for n in so.scheduled_new_reqs]
    c = so.scheduled_cached_reqs
    for i, rid in enumerate(c.req_ids):
        rows.append((rid, None, c.num_computed_tokens[i]))
    for rid, _, computed in rows:
        req = scheduler.requests[rid]
        ids = scheduler.kv_cache_manager.get_block_ids(rid)[0]
        end = computed + so.num_scheduled_tokens[rid]
        toks = list(req.all_token_ids)
        for b in range(computed // block_size, -(-end // block_size)):
            work.append((ids[b], toks[: min(end, (b + 1) * block_size)]))
    for li, name in enumerate(caches):
        worker.wait_for_layer_load(name)
        nbytes = page(caches[name], 0).numel()
        for bid, toks in work:
            write_page(caches[name], bid, pattern(toks, name, nbytes))
        if layers_saved is None or li < layers_saved:
            worker.save_kv_layer(name, caches[name], None)
    worker.wait_for_save()
    worker.get_finished(so.finished_req_ids)
    kv_out = KVConnectorOutput(invalid_block_ids=worker.get_block_ids_with_load_errors(),
                               kv_connector_worker_meta=worker.build_connector_worker_meta(),
                               kv_connector_stats=worker.get_kv_connector_stats())
    worker.clear_connector_metadata()
    reqs = list(so.num_scheduled_tokens)
    sampled = [[] if scheduler.requests[r].num_computed_tokens < scheduler.requests[r].num_prompt_tokens
               else [5] for r in reqs]
    out = ModelRunnerOutput(req_ids=reqs, req_id_to_index={r: i for i, r in enumerate(reqs)},
                            sampled_token_ids=sampled, kv_connector_output=kv_out)
    scheduler.update_from_output(so, out)
    return so, meta.step, kv_out
