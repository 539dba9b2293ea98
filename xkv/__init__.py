"""xkv: an external prefix cache for vLLM.

Layers, one way only (enforced by the import-linter contracts in ``pyproject.toml``):
``xkv.connector -> xkv.fanout -> xkv.kernels -> xkv.layout`` and ``xkv.connector -> xkv.gateway``
(its client); ``xkv.gateway`` never imports torch.
Importing ``xkv`` imports nothing heavy.
"""

__version__ = "0.1.0"
