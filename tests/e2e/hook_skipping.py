"""Imported in the engine process (scenario key ``imports``): one attention layer of the tiny
Llama stops calling vLLM's per-layer KV hooks, as the attention classes of GLM-5.x,
DeepSeek-V3.2, Kimi Linear and K3 do on vLLM 0.29 with CUDA (their ``forward`` runs the
attention without going through the op that ``maybe_transfer_kv_layer`` decorates).

``XKV_TEST_SKIP_HOOKS`` picks how the layer skips them:

* ``class``: the layer's class becomes ``HookSkippingAttention``, an ``Attention`` subclass whose
  ``forward`` calls the undecorated op: what the connector's class detection must see;
* ``instance``: the class stays ``Attention`` but the instance's ``forward`` is replaced: the
  detection cannot see it, so the worker's safety net must catch it at run time.

``XKV_TEST_SKIP_LAYER`` names the layer (default ``model.layers.1.self_attn.attn``).
"""

from __future__ import annotations

import inspect
import os
import types

import torch
from vllm.model_executor.layers.attention import attention as _A

MODE = os.environ.get("XKV_TEST_SKIP_HOOKS", "class")
TARGET = os.environ.get("XKV_TEST_SKIP_LAYER", "model.layers.1.self_attn.attn")
_RAW_OP = inspect.unwrap(_A.unified_attention_with_output)  # the attention, no connector calls


def _undecorated_forward(self, query, key, value, output_shape=None, output_dtype=None):
    """Attention for ``[tokens, heads * head_size]`` inputs, writing the KV cache and reading it
    like ``Attention.forward``, but never through the decorated op (no hook is called)."""
    n = query.shape[0]
    out = torch.empty((n, self.num_heads * self.head_size_v), dtype=output_dtype or query.dtype,
                      device=query.device)
    q = query.view(-1, self.num_heads, self.head_size)
    k = key.view(-1, self.num_kv_heads, self.head_size)
    v = value.view(-1, self.num_kv_heads, self.head_size_v)
    if not self.attn_backend.forward_includes_kv_cache_update:
        _A.unified_kv_cache_update(k, v, self.layer_name)
    _RAW_OP(q, k, v, out.view(-1, self.num_heads, self.head_size_v), self.layer_name)
    return out


class HookSkippingAttention(_A.Attention):
    forward = _undecorated_forward


_init = _A.Attention.__init__


def _patched_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    if self.layer_name != TARGET:
        return
    if MODE == "class":
        self.__class__ = HookSkippingAttention
    else:
        object.__setattr__(self, "forward", types.MethodType(_undecorated_forward, self))


_A.Attention.__init__ = _patched_init
