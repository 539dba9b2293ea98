"""What both connector roles need, built once from vLLM's configuration.

``build(vllm_config, kv_cache_config, kv_transfer_config)`` validates the settings
(``ConnectorConfig``), reads the KV cache groups (``vllm_specs``), decides writers and readers
(``registry``), and computes each group's layout fingerprint; ``scheduler_side`` and
``worker_side`` then build the role the façade was created for. The façade's ``__init__`` is
only the role choice. vLLM objects are read through ``compat``/``vllm_specs`` only (no vLLM
import here).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from xkv.connector import compat, vllm_specs
from xkv.connector.async_loads import AsyncLoadWorker
from xkv.connector.config import ConfigError, ConnectorConfig, keeps_full_graphs
from xkv.connector.fanout_loads import FanoutLoads
from xkv.connector.fences import HookPlan
from xkv.connector.keys import fingerprint
from xkv.connector.loads import LoadOutcomes
from xkv.connector.registry import STATE_KINDS, Registry, build_registry
from xkv.connector.saves import Saver
from xkv.connector.scheduler import SchedulerSide
from xkv.connector.stats import ConnectorStats
from xkv.connector.transfer import TransferHandler

if TYPE_CHECKING:  # worker.py builds its parts with worker_parts below (it imports this)
    from xkv.connector.worker import WorkerParts, WorkerSide

LOOPBACK = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Setup:
    """The validated configuration and the cache plan shared by both roles."""

    cfg: ConnectorConfig
    registry: Registry
    fingerprints: list[str]
    chunk_line: str  # the start-up line naming the chunk size and where it came from
    num_blocks: int  # blocks per KV cache tensor
    kv_layout: str | None  # the layout name vLLM resolved (enters every fingerprint)
    tp_size: int
    world_size: int
    load: bool  # kv_role lets this engine load (consumer or both)
    save: bool  # ... and save (producer or both)


def build(vllm_config: Any, kv_cache_config: Any, kv_transfer_config: Any) -> Setup:
    """Everything both roles need; raises ``ConfigError`` (or a ``RegistryError``/``ValueError``
    naming the setting) for a deployment the connector refuses."""
    compat.require_supported(vllm_config)
    cfg = ConnectorConfig.from_extra(kv_transfer_config.kv_connector_extra_config)
    if cfg.gateway_host in LOOPBACK:
        cfg.check_port_clash(compat.kv_events_endpoint(vllm_config))
    if kv_cache_config is None:
        raise ConfigError("xkv: vLLM passed no kv_cache_config; this vLLM is not supported")
    tp, pp, world = compat.parallel_sizes(vllm_config)
    cfg.check_fanout_groups(tp)
    groups = vllm_specs.state_groups(vllm_config, kv_cache_config,
                                     vllm_specs.cache_groups(kv_cache_config))
    # a chunk is a multiple of every group's block size (DeepSeek-V4: 256, 64, 8, 4 tokens),
    # as vLLM chose them (they differ by CPU and backend): the default follows them
    sizes = [g.block_size for g in groups] or [1]
    states = any(g.kind in STATE_KINDS for g in groups)
    chunk = cfg.resolve_chunk_size(*sizes, states=states)
    registry = build_registry(groups, tp_size=tp, pp_size=pp, chunk_size=chunk,
                              slot_alignment=cfg.slot_alignment_bytes)
    fps = [fingerprint({**compat.fingerprint_fields(vllm_config, kv_cache_config, p),
                        **vllm_specs.state_fields(kv_cache_config, p)})
           for p in registry.groups]
    return Setup(cfg=cfg, registry=registry, fingerprints=fps,
                 chunk_line=cfg.chunk_line(chunk, *sizes, states=states),
                 num_blocks=kv_cache_config.num_blocks,
                 kv_layout=compat.kv_cache_layout(vllm_config, kv_cache_config),
                 tp_size=tp, world_size=world,
                 load=bool(kv_transfer_config.is_kv_consumer),
                 save=bool(kv_transfer_config.is_kv_producer))


def gateway_factory(cfg: ConnectorConfig, timeout_s: float) -> Callable[[], Any]:
    """A function that opens a gateway client (called once per role, inside the session)."""

    def make():
        from xkv.gateway.client import GatewayClient

        return GatewayClient(cfg.gateway_host, cfg.xkv_gateway_port, timeout_s=timeout_s,
                             curve_server_key=cfg.xkv_gateway_curve_server_key,
                             curve_client_keys=cfg.xkv_gateway_curve_client_key)

    return make


def scheduler_side(s: Setup, vllm_config: Any, kv_cache_config: Any) -> SchedulerSide:
    return SchedulerSide(
        s.cfg, s.registry, s.fingerprints,
        hash_block_size=compat.hash_block_size(vllm_config, kv_cache_config),
        world_size=s.world_size,
        gateway_factory=gateway_factory(s.cfg, s.cfg.gateway_timeout_ms / 1000),
        load=s.load, save=s.save,
    )


def save_mode(requested: str, registry: Registry, *, zeroing: bool,
              hash_block_size: int) -> tuple[str, str]:
    """The save mode a worker runs and the start-up line that says why (``saves`` module
    docstring): ``"step"`` defers the compute stream's wait for the copies to the next step's
    bind, which is safe only if nothing the runner queues before that bind writes KV pages."""
    if requested != "step":
        return requested, f"XKV: stores: save_mode {requested!r} (one copy per layer hook)"
    why = []
    if any(p.is_state for p in registry.groups):
        why.append("recurrent-state groups (pages rewritten in place every step)")
    if zeroing:
        why.append("vLLM zeroes new blocks before the connector's bind")
    sizes = sorted({p.group.block_size for p in registry.groups if not p.is_state})
    if any(b != hash_block_size for b in sizes):
        why.append(f"block sizes {sizes} != hash block {hash_block_size} tokens (copy-on-write "
                   "of partial prefix hits before the bind)")
    if why:
        return "layer", ("XKV: stores: save_mode 'step' requested, 'layer' used: "
                         + "; ".join(why))
    return "step", "XKV: stores: save_mode 'step' (one launch per group after the forward)"


def worker_side(s: Setup, vllm_config: Any, kv_cache_config: Any, tp_rank: int) -> WorkerSide:
    from xkv.connector.worker import WorkerSide

    mode, line = save_mode(s.cfg.save_mode, s.registry,
                           zeroing=compat.zeroes_new_blocks(kv_cache_config),
                           hash_block_size=compat.hash_block_size(vllm_config, kv_cache_config))
    fanout = (functools.partial(_fanout_factory, s, vllm_config, kv_cache_config, tp_rank)
              if s.cfg.fanout.enabled else None)
    return WorkerSide(
        s.registry, s.fingerprints,
        namespace=s.cfg.key_namespace,
        tp_rank=tp_rank,
        gateway_factory=gateway_factory(s.cfg, s.cfg.gateway_timeout_ms / 1000),
        handler_factory=functools.partial(_new_handler, verify=s.cfg.verify_restores,
                                          checksum_pass=s.cfg.checksum_pass),
        fanout_factory=fanout,
        reattach=s.cfg.reattach,
        full_hit_restore=s.cfg.full_hit_restore,
        save_mode=mode, save_line=line,
        verify_checksums=s.cfg.verify_checksums,
        full_graphs=keeps_full_graphs(s.cfg.extra),
    )


def worker_parts(registry: Registry, tp_rank: int, session: Any, stats: ConnectorStats,
                 outcomes: LoadOutcomes, pools: dict[str, Any],
                 layer_pos: dict[str, tuple[int, int]],
                 hooks: Mapping[str, tuple[bool, str]] | None,
                 new_handler: Callable[[], TransferHandler], restorer: Any,
                 save_mode: str = "layer") -> WorkerParts:
    """Everything a worker rank builds once its caches are registered, each piece whole:
    ``pools``/``layer_pos`` from ``register_kv_caches``; ``hooks`` from ``compat.layer_hooks``
    (the fence plan); ``new_handler()`` makes a transfer handler (one for sync loads and saves,
    one per in-flight async batch); ``restorer``: the fan-out restorer (None: off);
    ``save_mode``: the saver's (:func:`save_mode`)."""
    from xkv.connector.worker import WorkerParts

    plan = HookPlan([p.group.layer_names for p in registry.groups],
                    [i for i, p in enumerate(registry.groups) if p.is_state], hooks)
    handler = new_handler()
    return WorkerParts(
        pools=pools, layer_pos=layer_pos, hooks=plan, handler=handler,
        saver=Saver(registry, tp_rank, session, stats, handler, pools=pools, layer_pos=layer_pos,
                    on_bulk_saves=plan.note_bulk_saves, mode=save_mode),
        async_loads=AsyncLoadWorker(registry, tp_rank, outcomes, stats, pools=pools,
                                    new_handler=new_handler),
        fanout=(FanoutLoads(restorer, registry, tp_rank, pools, stats)
                if restorer is not None else None),
    )


def _new_handler(device: Any, *, verify: bool, checksum_pass: str) -> TransferHandler:
    """:func:`make_handler` (looked up at each call: tests wrap it) with ``checksum_pass`` set
    where it is not the default."""
    h = make_handler(device, verify=verify)
    if checksum_pass != "copy":
        h.set_checksum_pass(checksum_pass)
    return h


def make_handler(device: Any, verify: bool = False) -> TransferHandler:
    """The transfer handler for the device the caches live on (``xkv.connector.transfer``)."""
    from xkv.connector.cuda_transfer import CudaTransferHandler
    from xkv.connector.transfer import SyncTransferHandler

    if device.type == "cuda":
        return CudaTransferHandler(device, verify=verify)
    return SyncTransferHandler(verify=verify)


def _fanout_factory(s: Setup, vllm_config: Any, kv_cache_config: Any, tp_rank: int,
                    kv_caches: dict, device: Any) -> Any:
    """The worker's fan-out restorer (None = off, one warning saying why). Called once on every
    TP rank after the KV cache was allocated: ``build_restorer`` is collective over the TP group."""
    from xkv.fanout import build_restorer

    facts = vllm_specs.fanout_facts(vllm_config, kv_cache_config,
                                    layer_views=list(kv_caches.values()),
                                    layerwise_hook=compat.layerwise_load_hook(vllm_config,
                                                                           kv_cache_config),
                                    cuda=device.type == "cuda")
    cpu_group, pynccl = compat.tp_comms()
    restorer, _ = build_restorer(s.cfg.fanout, facts, tp_rank, s.tp_size, device,
                                 cpu_group=cpu_group, tp_pynccl=pynccl)
    return restorer
