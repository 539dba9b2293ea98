"""xkv: an external prefix cache for vLLM.

Layers, one way only: ``xkv.connector -> (xkv.kernels | xkv.fanout | xkv.gateway) -> xkv.layout``.
Importing ``xkv`` imports nothing heavy.
"""

__version__ = "0.1.0"
