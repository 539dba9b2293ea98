"""``FusIOnXConnector``: vLLM's KV connector (V1 API, with SupportsHMA), a thin role façade.

The scheduler-role instance forwards to ``SchedulerSide``, the worker-role instance to
``WorkerSide``; this module only translates vLLM objects (KVCacheBlocks, SchedulerOutput,
KVConnectorOutput, metadata and stats base classes); ``xkv.connector.setup`` builds both halves
from the validated configuration, so ``__init__`` is the role choice. Importing it pulls in
vLLM's connector base (vLLM imports the class in several processes), but no network, no CUDA:
those start only in ``__init__`` / ``register_kv_caches``.
"""

from __future__ import annotations

import logging
import os
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

from xkv.connector import compat, early_issue, issue_profile, setup
from xkv.connector.config import keeps_full_graphs
from xkv.connector.metadata import StepMetadata, WorkerReport
from xkv.connector.scheduler import SchedulerSide
from xkv.connector.stats import PromMetricsMixin, StatsMixin
from xkv.connector.worker import WorkerSide
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


def runner_line(vllm_config: Any) -> str:
    """The start-up log line (rank 0) naming the model runner this engine uses."""
    env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    why = f"VLLM_USE_V2_MODEL_RUNNER={env}" if env is not None else "vLLM's choice"
    return f"XKV: vLLM model runner {'V2' if compat.model_runner_v2(vllm_config) else 'V1'} ({why})"


class FusIOnXConnector(KVConnectorBase_V1, SupportsHMA):
    """External prefix cache on the xkv gateway's card. See docs/architecture.md."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        _route_logs()
        s = setup.build(vllm_config, kv_cache_config, self._kv_transfer_config)
        self._registry, self._num_blocks, self._kv_layout = s.registry, s.num_blocks, s.kv_layout
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # XKV_EARLY_ISSUE: the scheduler side hands each step to its engine's worker on this
        # thread (early_issue.py); the engine id pairs the two roles of one engine
        self._engine_id = str(getattr(self._kv_transfer_config, "engine_id", "") or "")
        self._early = early_issue.enabled()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = setup.scheduler_side(s, vllm_config, kv_cache_config)
        else:
            self._tp_rank = compat.tp_rank()
            self._worker = setup.worker_side(s, vllm_config, kv_cache_config, self._tp_rank)
            self._start_lines = [s.chunk_line, runner_line(vllm_config)]
            self._issue_profile = issue_profile.from_env()  # XKV_PROFILE_ISSUE: a diagnostic
            self._handover = early_issue.Handover()

    # ================================================================ scheduler role

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        assert self._scheduler is not None
        n = self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        return n, self._scheduler.load_async(request.request_id)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(
            request, blocks.get_block_ids(), num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        meta = FusIOnXConnectorMetadata(self._scheduler.build_connector_meta(scheduler_output))
        worker = early_issue.peer(self._engine_id) if self._early else None
        if worker is not None:
            worker._issue_at_scheduling(meta.step)
        return meta

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
                kv_caches, num_blocks=self._num_blocks, layout=self._kv_layout,
                hooks=compat.layer_hooks(self._vllm_config, kv_caches),
            )
        except LayoutError as e:
            raise LayoutError(f"{e} ({compat.layout_hint(self._kv_layout)})") from e
        if self._tp_rank == 0:
            for line in [*lines, *self._start_lines]:
                log.info(line)
            for line in self._registry.describe_layout():
                log.debug(line)
        if self._early:
            early_issue.register(self._engine_id, self, compat.parallel_sizes(self._vllm_config)[2],
                                 fanout=self._worker.fanout is not None,
                                 auto_why=self._early_auto_why())
            self._handover.note_thread()

    def _early_auto_why(self) -> str:
        """``XKV_EARLY_ISSUE=auto``: why this engine does not issue early ('' = it does); after
        :meth:`register_kv_caches` (the graph waits and the ring probe are settled)."""
        assert self._worker is not None
        return early_issue.auto_off_reason(
            full_graphs=self._worker.graph_waits and compat.replays_full_graphs(self._vllm_config),
            copy_engine=self._worker.copy_engine_restores)

    def _issue_at_scheduling(self, step: StepMetadata) -> None:
        """``XKV_EARLY_ISSUE``: the scheduler side of this engine built ``step`` on this thread:
        bind it and issue its restores now, if the worker is between steps and the restore is
        too small for the copy engine to take it (early issue was measured with the Triton
        kernel's restores only: a larger one is issued by ``start_load_kv``; early_issue.py)."""
        assert self._worker is not None
        if self._handover.may_issue(step, between_steps=not self._worker.in_step) and not (
                self._worker.may_take_copy_engine(step.loads)):
            self._worker.bind(step)
            self._issue(step.loads)
            self._handover.issued(step)

    def _issue(self, loads: tuple) -> None:
        """The worker's issue of the bound step's restores (``loads``: its load jobs), profiled
        under ``XKV_PROFILE_ISSUE``."""
        self._issue_profile.call(self._worker.start_load_kv, loads=bool(loads),
                                 kind=issue_profile.step_kind(loads)
                                 if loads and self._issue_profile.enabled else "")

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self._worker is not None and isinstance(
            connector_metadata, FusIOnXConnectorMetadata
        )
        if not self._handover.take(connector_metadata.step):  # else bound at scheduling
            self._worker.bind(connector_metadata.step)
        self._handover.note_thread()

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """``kwargs``: what 0.33's V2 runner adds (``scheduler_output``, ``request_state_indices``,
        ``request_ids``, ``num_tokens``, ``attn_metadata``); the step's metadata has all we use.

        vLLM runs the per-layer hooks only under a forward context with attention metadata
        (``maybe_transfer_kv_layer``), and a full CUDA graph's replay runs none. A context
        without metadata (V2's full-graph step, no-forward steps, which have no sync loads) or
        one whose ``cudagraph_runtime_mode`` is ``FULL`` (V1's full-graph step) means no
        ``wait_for_layer_load`` will come: every layer's sync load is fenced now, before the
        forward can read a page (async loads complete on their own). Full graphs run only with
        ``full_cuda_graphs`` (:meth:`requires_piecewise_for_cudagraph`: otherwise vLLM turns any
        full ``cudagraph_mode`` into PIECEWISE). ``None`` (tests driving the hooks by hand)
        fences nothing. A full-graph step's loads are waited for inside the graph where its
        capture put a wait before every loaded layer (``graph_waits``,
        :meth:`WorkerSide.fence_full_graph_step`)."""
        assert self._worker is not None
        # a bound step only (not the capture case of has_connector_metadata below)
        meta = self._get_connector_metadata() if super().has_connector_metadata() else None
        loads = bool(isinstance(meta, FusIOnXConnectorMetadata) and meta.step.loads)
        if not self._handover.started():  # else issued when it was scheduled (XKV_EARLY_ISSUE)
            self._issue(meta.step.loads if loads else ())
        self._worker.start_async_loads()
        if loads and forward_context is not None and (
                getattr(forward_context, "attn_metadata", None) is None
                or getattr(getattr(forward_context, "cudagraph_runtime_mode", None), "name",
                           None) == "FULL"):
            self._worker.fence_full_graph_step()

    def has_connector_metadata(self) -> bool:
        """Also true while vLLM captures a CUDA graph on a rank with ``graph_waits``: vLLM's
        per-layer hook decorator then calls :meth:`wait_for_layer_load`, which puts the layer's
        restore wait into the graph (a capture binds no metadata)."""
        return super().has_connector_metadata() or (
            self._worker is not None and self._worker.capturing())

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        # a capture binds no step (checked first: no CUDA query in a serving step's hooks)
        if not self._worker.in_step and self._worker.capturing():
            self._worker.capture_wait(layer_name)
        else:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs):
        assert self._worker is not None
        if self._worker.in_step or not self._worker.capturing():  # a capture saves nothing
            self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]):
        assert self._worker is not None
        self._worker.get_finished()
        return None, self._worker.finished_async_loads() or None

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
        """False (vLLM keeps its full CUDA graphs for decode-only batches) unless
        ``full_cuda_graphs`` is false or the NVLink fan-out is on; True: piecewise graphs only.
        A full graph's replay runs no per-layer hook: its capture put a wait on each layer's
        restore into the graph (``graph_waits``), and a step whose graphs lack one fences every
        restore before the forward (:meth:`start_load_kv`; saves of layers without their hook
        run after the forward). The default since stop 53: on the H100 full graphs decoded at
        the no-connector speed where piecewise ones cost up to 1.9 x per token (TRITON_ATTN),
        with restores as fast or faster except Qwen-shaped 8k (+10 %; bench/RESULTS.md "stop 52",
        "stop 53"), and on the MLA model 22 % faster at 4k (stop 54). The fan-out's all-gathers
        stay in the hooks."""
        return not keeps_full_graphs(extra_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # pages move as bytes; the resolved layout is part of the fingerprint

    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.shutdown()
