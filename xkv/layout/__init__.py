"""Byte-page views of the KV cache tensors vLLM hands a connector.

Every cache form vLLM 0.26-0.33 registers (each one built by that version's own allocation code in
``tests/compat``, and by hand in ``tests/layout``) is reduced to
one :class:`PagePool`: ``num_blocks`` scheduler blocks, each ``block_bytes`` long, made of the same
contiguous byte ``runs`` at a fixed ``block_stride``. Kernels copy those bytes without knowing heads,
tokens or dtypes, so one kernel serves every backend and layout.

Forms understood (the first dim of size ``num_blocks * kernel_block_ratio`` is the block dim):

* 0.26/0.28 attention ``(B, H, N, 2D)`` with NHD or HND strides, one run per block;
* MLA ``(B, N, 576)`` (3-D, 0.26/0.28), ``(B, 1, N, 576)`` (0.29+) and 656-byte ``fp8_ds_mla`` rows;
* 0.29+ ``[B, H, N, C]`` views over one shared int8 buffer in every ``KVCacheLayout``: ``LBNHC``,
  ``LBHNC``, ``BLNHC``, ``BLHNC`` give one run per block; ``LHBNC`` and ``BHLNC`` (H outside B) give
  one run per head;
* Mamba: a list of state tensors (0.26, pages rebuilt from the first tensor's block stride) or one int8
  ``(B, 1, 1, C)`` page per block (0.28+, padded block stride: only the content is copied);
* K/V-first ``(2, B, ...)``: two runs per block (K page, V page);
* block-outermost caches (a block holds every layer): a list of per-layer views, or the 0.26/0.28
  cross-layer tensor with ``block_dim=1``, become one run per block across the layers.

A tensor whose pages are not what the description says raises :class:`LayoutError` naming its shape,
strides, dtype and layout. No vLLM import here: layouts are recognised from strides.

:mod:`xkv.layout.kinds` names what a per-layer KV cache spec is (attention, MLA, compressed MLA,
sliding window, Mamba, other) for both the connector's registry and ``xkv.fanout`` (the
connector's ``vllm_specs.layer_kind`` reads vLLM's specs into those names).
"""

from xkv.layout import kinds
from xkv.layout.describe import KV_CACHE_LAYOUTS, describe_cache
from xkv.layout.pool import LayoutError, PagePool
from xkv.layout.runs import contiguous_runs

__all__ = [
    "KV_CACHE_LAYOUTS",
    "LayoutError",
    "PagePool",
    "contiguous_runs",
    "describe_cache",
    "kinds",
]
