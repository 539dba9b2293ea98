"""What the scheduler side tells every worker for one engine step, and what workers answer.

Frozen dataclasses keyed by job ids the scheduler assigns (never by request id alone: a request can
be preempted and re-admitted with new blocks). No vLLM types: the façade wraps ``StepMetadata`` in
vLLM's ``KVConnectorMetadata`` and ``WorkerReport`` in ``KVConnectorWorkerMetadata``.

Offsets are byte offsets into the card; a chunk's object for one shard starts at its slot offset
and is layer-major: layer ``l``, block ``j`` of the chunk at ``offset + (l * k + j) * block_bytes``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# One stored object of one group from LOOKUP to COMMIT: its key and, per shard, slot offset and
# generation (the COMMIT/ABORT token). The gateway client's type, so it crosses unchanged.
from xkv.gateway.client import ChunkRef

__all__ = ["ChunkRef", "GroupTransfer", "StepMetadata", "TransferJob", "WorkerReport",
           "load_transfer"]


@dataclass(frozen=True)
class GroupTransfer:
    """Blocks of one cache group moved between the paged cache and the card.

    ``block_ids[i]`` (a scheduler block of this group) is block ``block_in_chunk[i]`` of
    ``chunks[chunk_of[i]]``. For saves every chunk is complete (all k blocks listed).

    ``tail``: how many of the last ``block_ids`` of a load the same step also writes (0 or 1: a
    restore that ends inside a block, the rest of which vLLM computes). vLLM writes a layer's new
    KV before it calls that layer's ``wait_for_layer_load``, so a sync restore copies these
    blocks of every layer before the forward starts (``loads.load_transfers``); the step's
    own values then win, never a late copy.
    """

    group: int
    block_ids: tuple[int, ...]
    chunk_of: tuple[int, ...]
    block_in_chunk: tuple[int, ...]
    chunks: tuple[ChunkRef, ...]
    tail: int = 0
    #: loads with ``verify_checksums``: per chunk, its object's checksum words as the LOOKUP
    #: returned them (``num_shards * check_words`` little-endian uint32, shard-major); () or an
    #: empty entry: not verified (``xkv.connector.checksums``)
    checks: tuple[bytes, ...] = ()
    #: object positions below this do not exist in the chunks' objects (a sliding window's
    #: early chunk: ``windows.tail``); a verified restore hashes positions [first_page, k) only
    first_page: int = 0

    def __post_init__(self) -> None:
        n = len(self.block_ids)
        if len(self.chunk_of) != n or len(self.block_in_chunk) != n:
            raise ValueError(
                f"GroupTransfer(group={self.group}): {n} block ids but {len(self.chunk_of)} "
                f"chunk indices and {len(self.block_in_chunk)} in-chunk positions"
            )
        if any(not 0 <= c < len(self.chunks) for c in self.chunk_of):
            raise ValueError(f"GroupTransfer(group={self.group}): chunk index out of range")
        if not 0 <= self.tail <= n:
            raise ValueError(f"GroupTransfer(group={self.group}): tail {self.tail} not in [0, {n}]")
        if self.checks and len(self.checks) != len(self.chunks):
            raise ValueError(f"GroupTransfer(group={self.group}): {len(self.checks)} checksum "
                             f"entries for {len(self.chunks)} chunks")

    def stale_blocks(self, shard: int, generation_of: Callable[[int], int]) -> list[int]:
        """Blocks read from a chunk whose slot (of ``shard``) no longer holds the generation
        that was leased (``generation_of(slot offset)``: the card's current one): a slot
        evicted and reused while it was read — load errors, never wrong bytes. The one check
        of sync and async restores, after their copies finished."""
        stale = {c for c, ref in enumerate(self.chunks)
                 if generation_of(ref.offsets[shard]) != ref.generations[shard]}
        if not stale:
            return []
        return [b for b, c in zip(self.block_ids, self.chunk_of, strict=True) if c in stale]


def load_transfer(group: int, ids: Sequence[int], first: int, last: int, blocks_per_chunk: int,
                  chunk_ref: Callable[[int], ChunkRef], tail: int = 0) -> GroupTransfer:
    """Load of blocks ``[first, last)`` of one group's block list ``ids`` (scheduler blocks of
    the request); block ``i`` is block ``i % k`` of chunk ``i // k``, whose object is
    ``chunk_ref(chunk)``; ``tail``: see :class:`GroupTransfer`."""
    k = blocks_per_chunk
    used = sorted({i // k for i in range(first, last)})
    index = {c: n for n, c in enumerate(used)}
    return GroupTransfer(
        group=group,
        block_ids=tuple(ids[first:last]),
        chunk_of=tuple(index[i // k] for i in range(first, last)),
        block_in_chunk=tuple(i % k for i in range(first, last)),
        chunks=tuple(chunk_ref(c) for c in used),
        tail=tail,
    )


@dataclass(frozen=True)
class TransferJob:
    """A load (card -> pages) or a save (pages -> card) of one request in one step."""

    job_id: int
    req_id: str
    groups: tuple[GroupTransfer, ...]
    num_tokens: int  # tokens this job covers (for stats)

    def block_ids(self) -> set[int]:
        return {b for g in self.groups for b in g.block_ids}


@dataclass(frozen=True)
class StepMetadata:
    """Everything workers need for one step. ``epoch``: the gateway process the offsets belong
    to; ``layout_ids[g]``: the gateway's id of group g's layout; ``turned_off``: the scheduler
    side lost the gateway (workers turn off too, once). ``async_loads``: restores of parked
    requests, issued whole and reported in ``finished_recving`` once done (async_loads.py).
    ``written_blocks``: every block id handed to a request scheduled in this step (the blocks
    its forward may write), for ``save_mode`` step (``saves.Saver.bind``); None: not known."""

    loads: tuple[TransferJob, ...] = ()
    async_loads: tuple[TransferJob, ...] = ()
    saves: tuple[TransferJob, ...] = ()
    epoch: int = 0
    scheduled_tokens: int = -1  # tokens the step computes (-1: unknown); light_steps.is_light
    layout_ids: tuple[int, ...] = ()
    turned_off: bool = False
    written_blocks: tuple[int, ...] | None = None


@dataclass
class WorkerReport:
    """Worker -> scheduler, aggregated over ranks: how many ranks finished each load job.

    ``loads_done[job_id]`` counts ranks; the scheduler releases a load's lease once every reader
    rank finished it (a backstop release happens when the request finishes).
    """

    loads_done: Counter = field(default_factory=Counter)

    def aggregate(self, other: WorkerReport) -> WorkerReport:
        return WorkerReport(loads_done=self.loads_done + other.loads_done)
