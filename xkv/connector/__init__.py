"""FusIOnXConnector internals: config, keys, registry, metadata, scheduler and worker sides.

Nothing here imports vLLM at import time; only ``facade`` and ``compat`` do.
"""
