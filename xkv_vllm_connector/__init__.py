"""vLLM plugin package of xkv: ``register()`` makes ``FusIOnXConnector`` loadable by name.

vLLM calls ``register`` in every process through the ``vllm.general_plugins`` entry point
(``xkv = "xkv_vllm_connector:register"``). It only records a lazy loader, so it is cheap, and
calling it twice is harmless. ``kv_connector_module_path="xkv_vllm_connector.fusionx_connector"``
works with or without it.
"""

from __future__ import annotations

CONNECTOR_NAME = "FusIOnXConnector"
MODULE_PATH = "xkv_vllm_connector.fusionx_connector"


def register() -> None:
    """Register ``FusIOnXConnector`` with vLLM's connector factory (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", {})
    if CONNECTOR_NAME in registry:
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)
    except ValueError:  # registered concurrently, or under a registry we cannot see
        return
