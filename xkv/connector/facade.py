"""``FusIOnXConnector``: vLLM's KV connector (V1 API, with SupportsHMA), a thin role façade.

The scheduler-role instance forwards to ``SchedulerSide``, the worker-role instance to
``WorkerSide``; this module only translates vLLM objects (KVCacheBlocks, SchedulerOutput,
KVConnectorOutput, metadata and stats base classes) and builds both halves from the validated
configuration. Importing it pulls in vLLM's connector base (vLLM imports the class in several
processes), but no network, no CUDA: those start only in ``__init__`` / ``register_kv_caches``.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from xkv.connector import compat
from xkv.connector.config import ConfigError, ConnectorConfig
from xkv.connector.keys import fingerprint
from xkv.connector.metadata import StepMetadata, WorkerReport
from xkv.connector.registry import build_registry, state_group
from xkv.connector.scheduler import SchedulerSide
from xkv.connector.stats import PromMetricsMixin, StatsMixin
from xkv.connector.worker import WorkerSide
from xkv.fanout import FanoutConfig
from xkv.layout import LayoutError

log = logging.getLogger("xkv.connector")


class FusIOnXConnectorMetadata(KVConnectorMetadata):
    """vLLM's metadata type around our ``StepMetadata``."""

    def __init__(self, step: StepMetadata):
        self.step = step


class FusIOnXWorkerMetadata(KVConnectorWorkerMetadata):
    def __init__(self, report: WorkerReport):
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, FusIOnXWorkerMetadata)
        return FusIOnXWorkerMetadata(self.report.aggregate(other.report))


class FusIOnXConnectorStats(StatsMixin, KVConnectorStats):
    """Connector counters in vLLM's 'KV Transfer metrics' line (``xkv.connector.stats``)."""

    def __init__(self, data: dict[str, Any] | None = None):
        StatsMixin.__init__(self, data)


try:  # per-connector Prometheus metrics (vLLM's KVConnectorProm calls build_prom_metrics)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

    class FusIOnXPromMetrics(PromMetricsMixin, KVConnectorPromMetrics):
        """``vllm:xkv_*`` counters on vLLM's /metrics (``xkv.connector.stats.PROM_COUNTERS``)."""

        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            KVConnectorPromMetrics.__init__(self, vllm_config, metric_types, labelnames,
                                            per_engine_labelvalues)
            self._register_counters()
except ImportError:  # a vLLM without per-connector Prometheus metrics
    FusIOnXPromMetrics = None


def _route_logs() -> None:
    """Send the ``xkv`` logger's records to vLLM's handlers (same format, same stream)."""
    xl = logging.getLogger("xkv")
    if xl.handlers:
        return
    vl = logging.getLogger("vllm")
    for h in vl.handlers:
        xl.addHandler(h)
    if vl.handlers:
        xl.setLevel(vl.level or logging.INFO)
        xl.propagate = False


def _gateway_factory(cfg: ConnectorConfig, timeout_s: float):
    def make():
        from xkv.gateway.client import GatewayClient

        return GatewayClient(cfg.gateway_host, cfg.xkv_gateway_port, timeout_s=timeout_s)

    return make


class FusIOnXConnector(KVConnectorBase_V1, SupportsHMA):
    """External prefix cache on the xkv gateway's card. See docs/architecture.md."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        _route_logs()
        compat.require_supported(vllm_config)
        ktc = self._kv_transfer_config
        cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        if cfg.gateway_host in ("localhost", "127.0.0.1", "::1"):
            cfg.check_port_clash(compat.kv_events_endpoint(vllm_config))
        if kv_cache_config is None:
            raise ConfigError("xkv: vLLM passed no kv_cache_config; this vLLM is not supported")
        tp, pp, world = compat.parallel_sizes(vllm_config)
        cfg.check_fanout_groups(tp)
        groups = _state_groups(vllm_config, kv_cache_config, compat.cache_groups(kv_cache_config))
        sizes = {g.block_size for g in groups}
        if len(sizes) > 1:
            raise ConfigError(f"xkv: KV cache groups with different block sizes {sorted(sizes)}")
        chunk = cfg.resolve_chunk_size(groups[0].block_size if groups else 1)
        self._cfg = cfg
        self._registry = build_registry(groups, tp_size=tp, pp_size=pp, chunk_size=chunk,
                                        slot_alignment=cfg.slot_alignment_bytes)
        fps = [
            fingerprint({**compat.fingerprint_fields(vllm_config, kv_cache_config, p),
                         **_state_fields(kv_cache_config, p)})
            for p in self._registry.groups
        ]
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._num_blocks = kv_cache_config.num_blocks
        # The same name enters the fingerprint; the worker checks its tensors against it.
        self._kv_layout = compat.kv_cache_layout(vllm_config, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                cfg,
                self._registry,
                fps,
                hash_block_size=compat.hash_block_size(vllm_config, kv_cache_config),
                world_size=world,
                gateway_factory=_gateway_factory(cfg, cfg.gateway_timeout_ms / 1000),
                load=ktc.is_kv_consumer,
                save=ktc.is_kv_producer,
            )
        else:
            self._tp_rank = compat.tp_rank()
            # the fan-out keys' own validation (xkv.fanout); ConnectorConfig checked the rest
            fan_cfg = FanoutConfig.from_extra_config(ktc.kv_connector_extra_config)
            fanout = (functools.partial(_fanout_factory, fan_cfg, vllm_config, kv_cache_config,
                                        self._tp_rank, tp) if fan_cfg.enabled else None)
            self._worker = WorkerSide(
                self._registry,
                fps,
                namespace=cfg.key_namespace,
                tp_rank=self._tp_rank,
                gateway_factory=_gateway_factory(cfg, cfg.gateway_timeout_ms / 1000),
                handler_factory=functools.partial(_handler_factory, verify=cfg.verify_restores),
                fanout_factory=fanout,
            )

    # ================================================================ scheduler role

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(
            request, blocks.get_block_ids(), num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return FusIOnXConnectorMetadata(self._scheduler.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, FusIOnXWorkerMetadata):
            self._scheduler.update_connector_output(meta.report)

    def request_finished(self, request: Any, block_ids: list[int]):
        assert self._scheduler is not None
        self._scheduler.request_finished(request)
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]):
        return self.request_finished(request, [])

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: nothing is lost if a save is dropped

    # ================================================================ worker role

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        states = {n: p.group.block_bytes for p in self._registry.groups if p.is_state
                  for n in p.group.layer_names}
        kv_caches = compat.state_views(kv_caches, states)
        try:
            lines = self._worker.register_kv_caches(
                kv_caches, num_blocks=self._num_blocks, layout=self._kv_layout
            )
        except LayoutError as e:
            raise LayoutError(f"{e} ({compat.layout_hint(self._kv_layout)})") from e
        if self._tp_rank == 0:
            for line in lines:
                log.info(line)
            for line in self._registry.describe_layout():
                log.debug(line)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self._worker is not None and isinstance(
            connector_metadata, FusIOnXConnectorMetadata
        )
        self._worker.bind(connector_metadata.step)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs):
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]):
        assert self._worker is not None
        self._worker.get_finished()
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        report = self._worker.take_report()
        return FusIOnXWorkerMetadata(report) if report is not None else None

    # ================================================================ both roles

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._scheduler or self._worker
        data = side.stats.take() if side is not None else None
        return FusIOnXConnectorStats(data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return FusIOnXConnectorStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        if FusIOnXPromMetrics is None:
            return None
        return FusIOnXPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # restores and saves hang on the per-layer hooks; fan-out's all-gather + scatter run in
        # wait_for_layer_load too, which a full CUDA graph would skip on replay
        return True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # pages move as bytes; the resolved layout is part of the fingerprint

    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.shutdown()


def _state_groups(vllm_config: Any, kv_cache_config: Any, groups: list) -> list:
    """Mamba / linear-attention groups become ``mamba`` state groups, after checking that vLLM
    keeps a state per block (``mamba_cache_mode == "align"``, which prefix caching turns on).

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
        mode = str(getattr(spec, "mamba_cache_mode", None) or getattr(cc, "mamba_cache_mode", ""))
        if not getattr(cc, "enable_prefix_caching", False) or mode == "none":
            raise ConfigError(
                f"xkv: hybrid model with a {getattr(spec, 'mamba_type', 'Mamba')} state cache "
                f"(KV cache group {g.index}) but prefix caching is off, so vLLM keeps no Mamba "
                "state per block (mamba_cache_mode='none') and nothing could be restored: add "
                "--enable-prefix-caching (LLM(enable_prefix_caching=True)) to use "
                "FusIOnXConnector with this model"
            )
        if mode != "align":
            raise ConfigError(
                f"xkv: mamba_cache_mode={mode!r}: FusIOnXConnector restores Mamba states in "
                "vLLM's 'align' mode only (the default with --enable-prefix-caching); remove "
                "--mamba-cache-mode or set it to 'align'"
            )
        if getattr(spec, "num_speculative_blocks", 0):
            raise ConfigError(
                "xkv: speculative decoding with a Mamba state cache is not supported by "
                "FusIOnXConnector (the running state block moves with the draft tokens)"
            )
        content = getattr(spec, "state_content_size_bytes", None)
        if not isinstance(content, int) or content <= 0:
            content = sum(
                math.prod(shape) * torch.empty((), dtype=dt).element_size()
                for shape, dt in zip(spec.shapes, spec.dtypes, strict=True)
            )
        out.append(state_group(g, content))
    return out


def _state_fields(kv_cache_config: Any, plan: Any) -> dict[str, Any]:
    """What else must match to share a state group's objects: the state tensors' shapes and
    dtypes (two SSM cache dtypes of one size, fp16 vs bf16, would otherwise share a layout)."""
    if not plan.is_state:
        return {}
    spec = kv_cache_config.kv_cache_groups[plan.group.index].kv_cache_spec
    return {
        "state_shapes": [list(s) for s in spec.shapes],
        "state_dtypes": [str(d) for d in spec.dtypes],
        "mamba_type": str(getattr(spec, "mamba_type", "")),
        "mamba_cache_mode": str(getattr(spec, "mamba_cache_mode", "")),
    }


def _handler_factory(device: torch.device, verify: bool = False):
    from xkv.connector.transfer import CudaTransferHandler, SyncTransferHandler

    if device.type == "cuda":
        return CudaTransferHandler(device, verify=verify)
    return SyncTransferHandler(verify=verify)


def _fanout_factory(fan_cfg: FanoutConfig, vllm_config: Any, kv_cache_config: Any, tp_rank: int,
                    tp_size: int, kv_caches: dict, device: torch.device):
    """The worker's fan-out restorer (None = off, one warning saying why). Called once on every
    TP rank after the KV cache was allocated: ``build_restorer`` is collective over the TP group."""
    from xkv.fanout import build_restorer, facts_from_vllm

    facts = facts_from_vllm(vllm_config, kv_cache_config,
                            layer_views=list(kv_caches.values()),
                            layerwise_hook=compat.layerwise_load_hook(vllm_config),
                            cuda=device.type == "cuda")
    cpu_group, pynccl = compat.tp_comms()
    restorer, _ = build_restorer(fan_cfg, facts, tp_rank, tp_size, device,
                                 cpu_group=cpu_group, tp_pynccl=pynccl)
    return restorer
