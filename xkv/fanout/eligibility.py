"""Whether a model/deployment may fan out, and the one warning that says why not.

``decide(config, facts)`` is a pure function of the validated config and ``CacheFacts`` (what the
connector learned from vLLM: ``xkv.connector.vllm_specs.fanout_facts`` reads them; this package
never reads vLLM objects). ``report(decision)`` logs a refusal as
exactly one ``WARNING`` per process; the restore then runs exactly as without fan-out.
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass

from xkv.fanout.config import FanoutConfig
from xkv.layout import kinds

logger = logging.getLogger("xkv.fanout")


class Reason(enum.Enum):
    OK = "eligible"
    DISABLED = "nvlink_fanout is off"
    NO_CUDA = "no CUDA device (fan-out needs NVIDIA GPUs)"
    NOT_MLA = "the model does not use MLA, so its KV cache differs between TP ranks"
    HYBRID = "hybrid model: its Mamba/linear-attention states are sharded per TP rank"
    NOT_REPLICATED = "a cache spec is not a plain MLA latent identical on every rank"
    BLOCK_OUTERMOST = "block-outermost KV cache layout (DeepSeek-V4 style): a layer is not contiguous"
    LAYOUT = "a layer's KV cache view is not contiguous"
    TP1 = "tensor_parallel_size is 1"
    CONTEXT_PARALLEL = "decode/prefill context parallelism shards the latent across TP ranks"
    DBO = "dual-batch overlap (ubatching) is on"
    NO_NVLINK = "no NVLink peer among the TP ranks (fan-out group of one)"
    TOPOLOGY = "NVLink topology could not be read"
    NCCL = "NCCL could not be loaded or initialised"
    MEMORY = "not enough free GPU memory for the staging buffer"
    SLOW_EXCHANGE = "the NVLink exchange is slower than 2x one PCIe link"


class Mode(enum.Enum):
    #: all layers are exchanged at wait_for_layer_load, one layer at a time
    LAYERWISE = "layerwise"
    #: the model's attention never calls wait_for_layer_load: all layers inside start_load_kv
    BULK = "bulk"


@dataclass(frozen=True)
class Decision:
    on: bool
    reason: Reason
    detail: str = ""
    mode: Mode | None = None

    @property
    def message(self) -> str:
        text = self.reason.value
        return f"{text} ({self.detail})" if self.detail else text


#: what one transferable per-layer cache spec is: the connector registry's classification
#: (``xkv.connector.vllm_specs.layer_kind``); fan-out restores ``kinds.FANOUT`` (a plain MLA latent) only
SPEC_MLA = kinds.MLA  # MLAAttentionSpec, one token per state, not DeepSeek-V4: identical on all ranks
SPEC_MLA_COMPRESSED = kinds.MLA_COMPRESSED  # DeepSeek-V4 C4/C128 latent and indexer
SPEC_SLIDING_WINDOW = kinds.SLIDING_WINDOW  # DeepSeek-V4 SWA and compressor-state caches
SPEC_ATTENTION = kinds.ATTENTION
SPEC_MAMBA = kinds.MAMBA
SPEC_OTHER = kinds.OTHER


@dataclass(frozen=True)
class CacheFacts:
    """What fan-out must know about the model and deployment (duck-typed from vLLM)."""

    use_mla: bool
    tp_size: int
    spec_kinds: tuple[str, ...] = ()
    is_hybrid: bool = False
    block_outermost: bool = False
    layers_contiguous: bool = True
    dcp_size: int = 1
    pcp_size: int = 1
    ubatching: bool = False
    layerwise_hook: bool = True
    cuda: bool = True


def decide(config: FanoutConfig, facts: CacheFacts) -> Decision:
    """Static eligibility (topology, NCCL and memory are checked later by ``build_restorer``)."""
    if not config.enabled:
        return Decision(False, Reason.DISABLED)
    if not facts.cuda:
        return Decision(False, Reason.NO_CUDA)
    if facts.is_hybrid or SPEC_MAMBA in facts.spec_kinds:
        return Decision(False, Reason.HYBRID)
    if not facts.use_mla:
        return Decision(False, Reason.NOT_MLA)
    if facts.block_outermost:
        return Decision(False, Reason.BLOCK_OUTERMOST)
    bad = sorted({k for k in facts.spec_kinds if k not in kinds.FANOUT})
    if bad or not facts.spec_kinds:
        return Decision(False, Reason.NOT_REPLICATED, f"spec kinds {bad or 'none'}")
    if not facts.layers_contiguous:
        return Decision(False, Reason.LAYOUT)
    if facts.tp_size <= 1:
        return Decision(False, Reason.TP1)
    if facts.dcp_size > 1 or facts.pcp_size > 1:
        return Decision(False, Reason.CONTEXT_PARALLEL,
                        f"decode_context_parallel_size={facts.dcp_size}, "
                        f"prefill_context_parallel_size={facts.pcp_size}")
    if facts.ubatching:
        return Decision(False, Reason.DBO)
    mode = Mode.LAYERWISE if facts.layerwise_hook else Mode.BULK
    return Decision(True, Reason.OK, mode=mode)


_report_lock = threading.Lock()
_reported: Decision | None = None


def report(decision: Decision) -> bool:
    """Log the outcome once per process: one WARNING for the first refusal of an enabled
    fan-out, one INFO when it is on. Returns True when this call logged."""
    global _reported
    if decision.reason is Reason.DISABLED:
        return False
    with _report_lock:
        if _reported is not None:
            return False
        _reported = decision
    if decision.on:
        logger.info("XKV: NVLink fan-out on (%s mode)", decision.mode.value if decision.mode else "?")
    else:
        logger.warning("XKV: NVLink fan-out off: %s; restoring on every rank as usual",
                       decision.message)
    return True


def _reset_report_for_tests() -> None:
    global _reported
    with _report_lock:
        _reported = None


