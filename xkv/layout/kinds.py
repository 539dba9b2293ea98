"""The names of what one per-layer KV cache spec is: the single vocabulary the connector's registry
and ``xkv.fanout``'s eligibility both use (``connector -> fanout -> kernels -> layout``: this is
the lowest layer both may import). Reading a vLLM spec into one of them is the connector's
vLLM-facing side's job (``xkv.connector.vllm_specs.layer_kind``, beside ``compat``); this module
knows no vLLM class:

* ``attention`` — exactly ``FullAttentionSpec`` without chunked-local attention: K/V per token,
  heads split by tensor parallelism (one shard per rank);
* ``mla`` — exactly ``MLAAttentionSpec``, one state per token, not DeepSeek-V4: one latent
  replicated on every rank (DeepSeek-V2/V3, Kimi, and the DSA indexer cache of DeepSeek-V3.2 /
  GLM-5.x, also an ``MLAAttentionSpec``);
* ``mla_compressed`` — ``MLAAttentionSpec`` with ``tokens_per_state > 1`` or
  ``model_version == "deepseek_v4"`` (DeepSeek-V4's C4/C128 latent and its indexer): still
  replicated (one latent per state, ``max_tp_shards`` 1) and complete once the block's tokens
  are computed, so its pages are stored like MLA pages, but a block holds
  ``block_size / tokens_per_state`` states: fan-out does not take it;
* ``sliding_window`` — ``SlidingWindowSpec`` / ``SlidingWindowMLASpec`` (DeepSeek-V4's SWA and
  compressor-state caches, SWA layers under the hybrid allocator): vLLM frees the blocks that
  leave the window and restores only the window's tail, so the registry stores that tail
  (``xkv.connector.windows``); fan-out does not take it;
* ``mamba`` — a ``MambaSpec`` (recurrent states; one state per block in ``align`` mode);
* ``other`` — anything else (chunked-local, cross-attention, encoder-only, ...).
"""

from __future__ import annotations

ATTENTION = "attention"
MLA = "mla"
MLA_COMPRESSED = "mla_compressed"
SLIDING_WINDOW = "sliding_window"
MAMBA = "mamba"
OTHER = "other"

KINDS = (ATTENTION, MLA, MLA_COMPRESSED, SLIDING_WINDOW, MAMBA, OTHER)
#: one latent per state, identical on every TP rank: one shard, written once, read by all
REPLICATED = (MLA, MLA_COMPRESSED)
#: what NVLink fan-out may restore (a plain per-token latent)
FANOUT = (MLA,)


def group_kind(kinds: list[str]) -> str:
    """The kind of a cache group from its layers' kinds: their common kind; ``mla`` and
    ``mla_compressed`` together are ``mla_compressed`` (both replicated); any other mix is
    ``other`` (no single sharding rule)."""
    s = set(kinds)
    if len(s) == 1:
        return kinds[0]
    if s == {MLA, MLA_COMPRESSED}:
        return MLA_COMPRESSED
    return OTHER
