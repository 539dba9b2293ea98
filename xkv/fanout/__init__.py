"""NVLink fan-out for MLA restores: each rank of an NVLink group copies 1/N of a layer from host
memory and the group all-gathers the rest over NVLink (NCCL) right before the layer computes.

The connector's worker uses, in this order (see docs/fanout.md and docs/internal-api.md):

- ``FanoutConfig.from_extra_config(extra)``: the validated ``nvlink_fanout*`` keys;
- ``CacheFacts`` (what the connector read from vLLM: ``xkv.connector.vllm_specs.fanout_facts``)
  and ``decide(config, facts) -> Decision`` (static eligibility, pure);
- ``build_restorer(config, facts, tp_rank, tp_size, device, cpu_group=..., tp_pynccl=...)`` on
  every TP rank after the KV cache is allocated -> ``(FanoutRestorer | None, Decision)``;
- per batch ``restorer.begin(card, [LayerLoad, ...]) -> bool`` in ``start_load_kv`` (False: restore
  as usual), ``restorer.wait_layer(name)`` in ``wait_for_layer_load``, ``restorer.finish()`` at the
  end of the forward, ``restorer.close()`` at shutdown.

This package imports neither vLLM nor ``xkv.connector``; it uses ``xkv.kernels`` (share copies,
scatter) and ``xkv.layout``.
"""

from xkv.fanout.build import build_restorer, probe_exchange
from xkv.fanout.comm import (
    ExchangeError,
    Exchanger,
    LocalExchanger,
    NcclExchanger,
    NcclLib,
    PyncclExchanger,
    TorchExchanger,
)
from xkv.fanout.config import FanoutConfig, FanoutConfigError
from xkv.fanout.eligibility import (
    CacheFacts,
    Decision,
    Mode,
    Reason,
    decide,
    report,
)
from xkv.fanout.engine import FanoutRestorer, LayerLoad
from xkv.fanout.plan import Round, plan_batch, plan_segment, share_bytes
from xkv.fanout.topology import TopologyError, clique_partition, local_gpu_uuid, partition_for

__all__ = [
    "CacheFacts", "Decision", "ExchangeError", "Exchanger", "FanoutConfig", "FanoutConfigError",
    "FanoutRestorer", "LayerLoad", "LocalExchanger", "Mode", "NcclExchanger", "NcclLib",
    "PyncclExchanger", "Reason", "Round", "TopologyError", "TorchExchanger", "build_restorer",
    "clique_partition", "decide", "local_gpu_uuid", "partition_for",
    "plan_batch", "plan_segment", "probe_exchange", "report", "share_bytes",
]
