"""Who writes and who reads every KV cache the engine allocated, decided once at start.

compat.py turns vLLM's ``KVCacheConfig`` into ``CacheGroup`` rows (no vLLM types here). For every
group the registry decides the sharding (one stored object = one chunk x one group x one shard,
all layers of the group, layer-major):

* ``attention`` — heads split by tensor parallelism: one shard per TP rank; rank r writes and
  reads shard r.
* ``mla`` / ``mla_compressed`` — one latent replicated on every TP rank (per token, or per
  ``tokens_per_state`` tokens: DeepSeek-V4): one shard, written by TP rank 0, read by every rank.
  A group's layers may differ in page size (an MLA latent and its indexer cache in one vLLM
  group): ``CacheGroup.layer_bytes``.
* ``mamba`` — recurrent state pages (Mamba2 conv + SSM state, gated-delta-net state) of a hybrid
  model in vLLM's ``align`` or ``all`` cache mode (``CacheGroup.state_mode``, see
  ``xkv.connector.states``): heads are split by TP, so one shard per rank, each rank
  writes and reads its own. A state is not a per-token cache: the object of chunk ``c`` holds
  ONE block per layer, the state after token ``(c + 1) * chunk_size`` (``blocks_per_object`` 1),
  and exists only where vLLM materialised that state (see docs/architecture.md).
* ``sliding_window`` — a sliding-window cache under vLLM's hybrid allocator (DeepSeek-V4's SWA
  and compressor-state caches, ``CacheGroup.sliding_window`` > 0): vLLM frees the blocks that
  leave the window and restores only the window's tail, so the object of chunk ``c`` holds the
  ``window_blocks`` blocks that end at the chunk's end (``xkv.connector.windows``). Sharded by
  heads (one shard per rank), or replicated when its layers keep an MLA latent
  (``CacheGroup.replicated``: ``SlidingWindowMLASpec``).

Groups may differ in block size (DeepSeek-V4: 256, 64, 8 and 4 tokens) when no state group is
present; ``chunk_size`` is then a multiple of every group's block size.

Kinds are the names of :mod:`xkv.layout.kinds` (shared with ``xkv.fanout``), read from vLLM's
specs by ``vllm_specs.layer_kind``. Any other kind
(chunked-local or cross-attention caches, ...) would be a cache that nobody writes, so restoring
the others would resume from a state that was never stored: the registry refuses the model at
start with ``RegistryError`` naming the group, its spec and its layers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from xkv.layout import kinds

if TYPE_CHECKING:
    from xkv.connector.metadata import GroupTransfer

SHARDED_KINDS = (kinds.ATTENTION,)
REPLICATED_KINDS = kinds.REPLICATED
STATE_KINDS = (kinds.MAMBA,)  # one state block per object, one shard per TP rank
WINDOW_KINDS = (kinds.SLIDING_WINDOW,)  # the window's tail blocks at the chunk's end


class RegistryError(ValueError):
    """A cache the connector cannot give a writer to, or an unsupported parallel layout."""


@dataclass(frozen=True)
class CacheGroup:
    """One KV cache group as the engine allocated it (per TP rank).

    ``block_size``: tokens per scheduler block. ``block_bytes``: bytes of one scheduler block of
    one layer on one rank (all runs of the page). ``layer_bytes``: the same per layer when the
    layers differ (e.g. an MLA latent and its indexer cache in one group; known to the worker
    role only), else empty; ``block_bytes`` is then the first layer's. ``layer_pages``: each
    layer's allocated page when they differ (both roles). ``spec``: vLLM's spec class name
    (of the group's first layer: the one the scheduler role's config keeps).
    """

    index: int
    kind: str
    layer_names: tuple[str, ...]
    block_size: int
    block_bytes: int
    spec: str = ""
    state_mode: str = ""  # state groups: vLLM's mamba_cache_mode ("align" | "all")
    layer_bytes: tuple[int, ...] = ()
    layer_pages: tuple[int, ...] = ()  # a mixed group: each layer's allocated page (padded)
    sliding_window: int = 0  # window groups: vLLM's sliding_window (tokens)
    extra_retained: int = 0  # window groups: vLLM's extra_retained_tokens (kept, not attended)
    replicated: bool = False  # window groups: one MLA latent, identical on every TP rank

    @property
    def window_blocks(self) -> int:
        """Window groups: the blocks vLLM keeps real for a prefix of ``T`` tokens (``T`` a
        multiple of ``block_size``, ``T >= sliding_window - 1 + extra_retained``): the blocks
        that end at ``T``, ``cdiv(sliding_window - 1 + extra_retained, block_size)``
        (``SlidingWindowManager.get_num_skipped_tokens``); 0 for other groups."""
        if self.sliding_window <= 0:
            return 0
        return max(1, -(-(self.sliding_window - 1 + self.extra_retained) // self.block_size))

    def bytes_of(self, layer: int) -> int:
        """Bytes of one block of layer ``layer`` (its index in the group)."""
        return self.layer_bytes[layer] if self.layer_bytes else self.block_bytes

    @property
    def bytes_all_layers(self) -> int:
        """Bytes of one block summed over the group's layers."""
        return sum(self.layer_bytes) if self.layer_bytes else self.block_bytes * len(self.layer_names)

    @property
    def slot_bytes_per_block(self) -> int:
        """Bytes one block of all layers takes in a stored object's slot: the allocated pages
        of a mixed group (what the scheduler role can see too: its config keeps one spec per
        group; the content, ``bytes_all_layers``, fits inside), else the content."""
        return sum(self.layer_pages) if self.layer_pages else self.bytes_all_layers


@dataclass(frozen=True)
class GroupPlan:
    group: CacheGroup
    num_shards: int  # shards of one stored object
    writer_ranks: tuple[int, ...]  # TP ranks that write (and commit) their shard
    reader_ranks: tuple[int, ...]  # TP ranks that restore
    chunk_size: int  # tokens per object
    blocks_per_chunk: int  # k scheduler blocks per object
    slot_alignment: int = 1  # slot_alignment_bytes: registered shard size is a multiple of it

    @property
    def is_state(self) -> bool:
        """A recurrent-state group: one block per object, the state at the chunk's end."""
        return self.group.kind in STATE_KINDS

    @property
    def is_window(self) -> bool:
        """A sliding-window group: an object holds the window's tail at the chunk's end."""
        return self.group.kind in WINDOW_KINDS

    @property
    def at_boundary(self) -> bool:
        """Only the object at a hit's last chunk is read (state and window groups); the other
        groups need every chunk of the hit."""
        return self.is_state or self.is_window

    @property
    def blocks_per_object(self) -> int:
        """Blocks of one layer inside an object: k for caches, 1 for a state group,
        ``window_blocks`` for a window group."""
        if self.is_window:
            return self.group.window_blocks
        return 1 if self.is_state else self.blocks_per_chunk

    @property
    def shard_bytes(self) -> int:
        """Bytes of one shard of one object: blocks_per_object x the block bytes of every layer
        (layer-major)."""
        return self.blocks_per_object * self.group.bytes_all_layers

    @property
    def registered_bytes(self) -> int:
        """Shard size told to the gateway, the same in both roles: the object's bytes (a mixed
        group: each layer's allocated page, ``CacheGroup.slot_bytes_per_block``, which the
        content ``shard_bytes`` fits in) rounded up to ``slot_alignment`` (a remote card wants
        4 KiB-aligned objects even when a page is not)."""
        a = self.slot_alignment
        return -(-(self.blocks_per_object * self.group.slot_bytes_per_block) // a) * a

    def object_offset(self, layer: int, block: int) -> int:
        """Bytes from the start of a shard's object to block ``block`` (its index in the object)
        of layer ``layer``: objects are layer-major, ``(layer * blocks_per_object + block) *
        block_bytes`` (with per-layer sizes: the earlier layers' ``blocks_per_object *
        bytes_of(l)``, then ``block * bytes_of(layer)``). The one home of the stored-object
        layout (loads, saves, fan-out, tests)."""
        g, k = self.group, self.blocks_per_object
        if not g.layer_bytes:
            return (layer * k + block) * g.block_bytes
        return k * sum(g.layer_bytes[:layer]) + block * g.layer_bytes[layer]

    def card_offsets(self, tp_rank: int, transfers: Iterable[GroupTransfer],
                     layer: int = 0) -> list[int]:
        """Card byte offset of every block of ``transfers`` (in order) for layer ``layer`` of
        the shard ``tp_rank`` reads or writes."""
        return self.card_offsets_array(tp_rank, transfers, layer).tolist()

    def card_offsets_array(self, tp_rank: int, transfers: Iterable[GroupTransfer],
                           layer: int = 0) -> np.ndarray:
        """:meth:`card_offsets` as int64 ``[n]``, vectorised per transfer (a 16k-token restore
        has 1024 blocks per group: the restore's host path). ``object_offset(layer, j)`` is
        ``object_offset(layer, 0) + j * step``, ``step`` the layer's page bytes."""
        shard = self.shard_of(tp_rank)
        g = self.group
        start = self.object_offset(layer, 0)
        step = g.layer_bytes[layer] if g.layer_bytes else g.block_bytes
        parts = []
        for gt in transfers:
            if not gt.chunk_of:  # (GroupTransfer refuses chunk_of / block_in_chunk unequal)
                continue
            base = np.fromiter((ch.offsets[shard] for ch in gt.chunks), np.int64,
                               len(gt.chunks))
            parts.append(base[np.asarray(gt.chunk_of, np.int64)] + start
                         + np.asarray(gt.block_in_chunk, np.int64) * step)
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def shard_of(self, tp_rank: int) -> int:
        """The shard rank ``tp_rank`` reads (and writes, if it is a writer)."""
        return tp_rank if self.num_shards > 1 else 0

    def writes(self, tp_rank: int) -> bool:
        return tp_rank in self.writer_ranks


@dataclass(frozen=True)
class Registry:
    groups: tuple[GroupPlan, ...]
    tp_size: int

    @property
    def multi_group(self) -> bool:
        """Several KV cache groups (a hybrid model): vLLM <= 0.29 cannot take block-level load
        errors for these, so a promised load must never fail (the scheduler promises only
        leased data there)."""
        return len(self.groups) > 1

    @property
    def hit_granularity(self) -> int:
        """Tokens a hit is a multiple of: the lcm of every group's block size (vLLM's
        scheduler block size for a hybrid model)."""
        return math.lcm(*(p.group.block_size for p in self.groups))

    @property
    def num_caches(self) -> int:
        return sum(len(p.group.layer_names) for p in self.groups)

    def log_lines(self) -> list[str]:
        """The start-up lines of the spec (rank 0), after the 'registered for exchange' line."""
        w = ", ".join(
            f"g{p.group.index}[{p.group.kind}]={_ranks(p.writer_ranks, self.tp_size, 'own shard')}"
            for p in self.groups
        )
        r = ", ".join(
            f"g{p.group.index}[{p.group.kind}]="
            f"{_ranks(p.reader_ranks, self.tp_size, 'own shard' if p.num_shards > 1 else 'shard 0')}"
            for p in self.groups
        )
        return [
            f"KV cache registry: {self.num_caches} cache(s) in {len(self.groups)} group(s); "
            f"writers: {w} ; readers: {r}",
            f"KV cache layout: {len(self.groups)} group(s)",
        ]

    def describe_layout(self) -> list[str]:
        return [
            f"  g{p.group.index}: {p.group.kind} ({p.group.spec}), {len(p.group.layer_names)} "
            f"layer(s), block {p.group.block_size} tokens = {p.group.block_bytes} B/layer, "
            f"chunk {p.chunk_size} tokens ({p.blocks_per_chunk} blocks), "
            f"{p.num_shards} shard(s) of {p.shard_bytes} B"
            for p in self.groups
        ]


def build_registry(
    groups: list[CacheGroup], *, tp_size: int, pp_size: int, chunk_size: int,
    slot_alignment: int = 1,
) -> Registry:
    """Decide shards, writers and readers for every group; refuse caches nobody would write."""
    if pp_size != 1:
        raise RegistryError(
            f"pipeline parallel size {pp_size}: FusIOnXConnector supports tensor parallelism "
            "only (pipeline_parallel_size=1)"
        )
    if tp_size < 1:
        raise RegistryError(f"tensor parallel size {tp_size}: expected >= 1")
    if not groups:
        raise RegistryError("the engine allocated no KV cache group: nothing to exchange")
    for g in groups:
        known = SHARDED_KINDS + REPLICATED_KINDS + STATE_KINDS + WINDOW_KINDS
        if g.kind not in known or (g.kind in WINDOW_KINDS and g.sliding_window <= 0):
            why = (" (a sliding window whose window size is unknown)"
                   if g.kind in WINDOW_KINDS else "")
            raise RegistryError(
                f"KV cache group {g.index} ({g.spec or g.kind}, layers {list(g.layer_names)[:4]}"
                f"{'...' if len(g.layer_names) > 4 else ''}) has no writer{why}: "
                "FusIOnXConnector stores full-attention, MLA (also compressed), sliding-window "
                "and Mamba/linear-attention state caches only, so restoring the other groups "
                "would resume from a state nobody saved. This model is not supported yet."
            )
    sizes = {g.block_size for g in groups}
    if len(sizes) > 1 and any(g.kind in STATE_KINDS for g in groups):
        raise RegistryError(
            f"KV cache groups with different block sizes {sorted(sizes)} and a recurrent-state "
            "group: FusIOnXConnector places a state at a chunk end only when every group has "
            "one block size"
        )
    plans = []
    for g in groups:
        if g.kind in REPLICATED_KINDS or (g.kind in WINDOW_KINDS and g.replicated):
            shards, writers = 1, (0,)
        else:
            shards, writers = tp_size, tuple(range(tp_size))
        if not g.layer_names:
            raise RegistryError(f"KV cache group {g.index} has no layers")
        if g.layer_bytes and (len(g.layer_bytes) != len(g.layer_names)
                              or min(g.layer_bytes) <= 0):
            raise RegistryError(
                f"KV cache group {g.index}: layer_bytes={list(g.layer_bytes)} for "
                f"{len(g.layer_names)} layers: expected one positive size per layer"
            )
        if g.block_size <= 0 or g.block_bytes <= 0:
            raise RegistryError(
                f"KV cache group {g.index}: block_size={g.block_size} tokens, "
                f"block_bytes={g.block_bytes}: expected positive values"
            )
        if chunk_size % g.block_size:
            raise RegistryError(
                f"chunk_size={chunk_size} is not a multiple of group {g.index}'s block size "
                f"{g.block_size}"
            )
        plans.append(
            GroupPlan(
                group=g,
                num_shards=shards,
                writer_ranks=writers,
                reader_ranks=tuple(range(tp_size)),
                chunk_size=chunk_size,
                blocks_per_chunk=chunk_size // g.block_size,
                slot_alignment=slot_alignment,
            )
        )
    if all(p.is_state for p in plans):
        raise RegistryError(
            "only recurrent-state KV cache groups and no attention group: FusIOnXConnector "
            "restores a state together with the attention pages of its prefix; a pure "
            "state-space model is not supported"
        )
    if all(p.at_boundary for p in plans):
        raise RegistryError(
            "only sliding-window (and state) KV cache groups, no full-attention or MLA group: "
            "FusIOnXConnector finds a hit through the full-attention/MLA objects of every "
            "chunk of it; a model of sliding-window layers only is not supported"
        )
    return Registry(groups=tuple(plans), tp_size=tp_size)


def state_group(g: CacheGroup, content_bytes: int, mode: str = "align") -> CacheGroup:
    """``g`` (a vLLM ``MambaSpec`` group) as a ``mamba`` state group whose block is the state's
    ``content_bytes`` (conv + SSM state), not the padded page vLLM allocates; ``mode``: vLLM's
    ``mamba_cache_mode`` (where its states live, ``xkv.connector.states.STATE_MODES``)."""
    if content_bytes <= 0:
        raise RegistryError(
            f"KV cache group {g.index} ({g.spec}): state content of {content_bytes} bytes"
        )
    if mode not in ("align", "all"):
        raise RegistryError(
            f"KV cache group {g.index} ({g.spec}): Mamba cache mode {mode!r}, expected 'align' "
            "or 'all'"
        )
    return replace(g, kind="mamba", block_bytes=int(content_bytes), state_mode=mode)


def _ranks(ranks: tuple[int, ...], tp_size: int, what: str) -> str:
    if len(ranks) == tp_size:
        return f"all {tp_size} rank(s) ({what})" if tp_size > 1 else f"rank 0 ({what})"
    return f"rank(s) {','.join(map(str, ranks))} ({what})"
