"""xkv gateway: the process that owns the card (shared-memory KV slots) and its index, and the
client the connector uses to talk to it. Does not import torch or vLLM.

Start it with ``xkv-gateway`` (or ``python -m xkv.gateway``); tests and demos can use
:func:`xkv.gateway.testing.spawn_gateway`.
"""

from xkv.gateway.client import (
    ChunkRef,
    GatewayClient,
    GatewayError,
    GatewayUnavailable,
    LookupResult,
    Reservation,
    ReserveResult,
)
from xkv.gateway.protocol import (
    PROTOCOL_VERSION,
    ChunkSlots,
    ErrorCode,
    LayoutInfo,
    PingReply,
    ReserveStatus,
)

__all__ = [
    "PROTOCOL_VERSION",
    "ChunkRef",
    "ChunkSlots",
    "ErrorCode",
    "GatewayClient",
    "GatewayError",
    "GatewayUnavailable",
    "LayoutInfo",
    "LookupResult",
    "PingReply",
    "Reservation",
    "ReserveResult",
    "ReserveStatus",
]
