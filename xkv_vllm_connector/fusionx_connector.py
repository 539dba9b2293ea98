"""Entry module named in ``--kv-transfer-config``: ``kv_connector_module_path`` points here.

The names ``xkv_vllm_connector.fusionx_connector`` and ``FusIOnXConnector`` are the public
interface; the implementation lives in ``xkv.connector``.
"""

from xkv.connector.facade import (
    FusIOnXConnector,
    FusIOnXConnectorMetadata,
    FusIOnXConnectorStats,
    FusIOnXWorkerMetadata,
)

__all__ = [
    "FusIOnXConnector",
    "FusIOnXConnectorMetadata",
    "FusIOnXConnectorStats",
    "FusIOnXWorkerMetadata",
]
