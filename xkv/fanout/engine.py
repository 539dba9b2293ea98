"""The fan-out restore of one batch: copy my share, exchange, scatter, layer by layer.

Per round (see ``xkv.fanout.plan``) with staging slot ``s = round % slots``:

- copy stream: wait until slot ``s`` is free, copy this rank's share of the round from the card
  (host memory) into ``slot[lo:hi]`` with ``xkv.kernels.restore_slice`` (or a few DMA copies when
  the share is a handful of contiguous ranges), record "copied";
- compute stream, at ``wait_layer`` (vLLM's ``wait_for_layer_load``): wait "copied", in-place
  all-gather of ``n_ranks * share`` bytes, ``xkv.kernels.unpack`` into the paged cache, record
  "free", then queue the copy of round ``round + slots``.

All collectives are issued from the compute stream in layer order, so every NCCL call of the
process keeps one order on all ranks. Before the first copy of a batch every TP rank states
whether its inputs are valid and all ranks agree (host collective); if any rank is not, no rank
issues a collective and ``begin`` returns False everywhere (the caller restores as usual).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from xkv.fanout.comm import Exchanger
from xkv.fanout.config import FanoutConfig
from xkv.fanout.eligibility import Mode
from xkv.fanout.plan import ALIGN, PlanError, Round, plan_batch
from xkv.kernels import host
from xkv.layout import contiguous_runs

logger = logging.getLogger("xkv.fanout")

#: a share made of more contiguous host ranges than this is copied by restore_slice, not DMA
MAX_DMA_COPIES = 16


@dataclass(frozen=True)
class LayerLoad:
    """Restore of one cache of one layer: block ``block_ids[i]`` of ``dst`` <-
    ``src[src_offsets[i] : src_offsets[i] + dst.block_bytes]`` (``src`` = the card, per batch).
    ``src_offsets``/``block_ids``: int64 ``[n]`` (CPU preferred: validated on the host)."""

    layer: str
    src_offsets: torch.Tensor
    dst: Any  # xkv.layout.PagePool
    block_ids: torch.Tensor


@dataclass
class _Batch:
    src: torch.Tensor
    loads: list[LayerLoad]
    rounds: list[Round]
    offs: list[torch.Tensor]  # per load, int64 on the CPU (the kernels take host index tensors)
    bids: list[torch.Tensor]
    runs: list[list[tuple[int, int, int]]]  # per load: (first block, n blocks, src byte offset)
    layer_end: dict[str, int]  # layer -> index of its last round + 1
    next_copy: int = 0
    next_scatter: int = 0
    keep: list[torch.Tensor] = field(default_factory=list)


class FanoutRestorer:
    """Fan-out restores for one worker. Build with ``xkv.fanout.build_restorer`` (which also
    resolves topology, creates the communicator and probes it) or directly in tests.

    ``active=False``: this TP rank is in a group of its own; it still takes part in ``begin``'s
    agreement (so the others never wait for it) and then restores as usual.
    ``share_copy``: ``"kernel"`` (restore_slice), ``"dma"`` (copy engine when the share is at most
    ``MAX_DMA_COPIES`` contiguous ranges, else restore_slice) or ``"auto"`` (= dma).
    ``max_programs``: SM budget of the share copy (it overlaps compute; None = the kernels'
    default). ``scatter_programs``: SM budget of the scatter (staging -> cache), which runs on the
    compute stream right before the layer, so it takes every SM by default (a 4-program
    device-to-device copy would cost more than the host copy it follows).
    """

    def __init__(self, config: FanoutConfig, exchanger: Exchanger, device: torch.device | str, *,
                 mode: Mode = Mode.LAYERWISE, active: bool = True, share_copy: str = "auto",
                 max_programs: int | None = None, scatter_programs: int | None = None,
                 staging: torch.Tensor | None = None) -> None:
        if share_copy not in ("kernel", "dma", "auto"):
            raise ValueError(f"share_copy={share_copy!r}: expected 'kernel', 'dma' or 'auto'")
        self.config, self.exchanger, self.mode, self.active = config, exchanger, mode, active
        self.device = torch.device(device)
        self.share_copy, self.max_programs = share_copy, max_programs
        self.slots, self.slot_bytes = config.slots, config.slot_bytes
        need = self.slots * self.slot_bytes
        if staging is None:
            staging = torch.empty(need, dtype=torch.uint8, device=self.device) if active else None
        elif staging.dtype != torch.uint8 or staging.dim() != 1 or staging.numel() < need or staging.device != self.device:
            raise ValueError(f"staging must be a 1-D uint8 tensor of >= {need} bytes on {self.device}, "
                             f"got {staging.dtype} {tuple(staging.shape)} on {staging.device}")
        self.staging = staging
        self._cuda = self.device.type == "cuda"
        if scatter_programs is None and self._cuda:
            scatter_programs = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.scatter_programs = scatter_programs
        if self._cuda and active:
            self._copy_stream = torch.cuda.Stream(self.device)
            self._copied = [torch.cuda.Event() for _ in range(self.slots)]
            self._free = [torch.cuda.Event() for _ in range(self.slots)]
        self._batch: _Batch | None = None
        self._arange = torch.arange(0, dtype=torch.int64)
        self.last_error: str | None = None
        self.stats = {"batches": 0, "skipped_small": 0, "disagreed": 0, "rounds": 0,
                      "bytes_copied": 0, "bytes_gathered": 0}

    # ---------------------------------------------------------------- batch API
    def begin(self, src: torch.Tensor, loads: Sequence[LayerLoad]) -> bool:
        """Plan and start a batch (vLLM's ``start_load_kv``); call on every TP rank with the same
        metadata. True: fan-out restores these loads (call ``wait_layer`` per layer, or nothing
        more in bulk mode). False: the caller restores them as usual (``last_error`` says why if
        this rank's inputs were invalid)."""
        self.finish()
        loads = list(loads)
        per_layer: dict[str, int] = {}
        for ld in loads:
            per_layer[ld.layer] = per_layer.get(ld.layer, 0) + ld.block_ids.numel() * ld.dst.block_bytes
        # decided from metadata only: identical on every rank, so no agreement needed to skip
        if not per_layer or max(per_layer.values()) < max(self.config.min_layer_bytes, 1):
            self.stats["skipped_small"] += 1
            return False
        try:  # from metadata and config only: the same outcome on every rank
            rounds = plan_batch([(ld.block_ids.numel(), ld.dst.block_bytes) for ld in loads],
                                self.exchanger.size, self.slot_bytes, ALIGN)
        except PlanError as e:
            self.last_error = str(e)
            return False
        self.last_error = None
        try:  # everything the copies and the scatter could refuse, before any collective
            self._validate(src, loads)
        except ValueError as e:
            self.last_error = str(e)
        if not self.exchanger.agree(self.last_error is None):
            self.stats["disagreed"] += 1
            if self.last_error:
                logger.error("XKV fan-out: invalid restore on this rank, batch restored without fan-out: %s",
                             self.last_error)
            return False
        if not self.active:
            return False
        layer_end: dict[str, int] = {}
        for i, r in enumerate(rounds):
            layer_end[loads[r.seg].layer] = i + 1
        # host index tensors: the kernels read them on the host (a device tensor would cost a sync)
        offs = [ld.src_offsets.to("cpu", torch.int64) for ld in loads]
        bids = [ld.block_ids.to("cpu", torch.int64) for ld in loads]
        longest = max((r.n_blocks for r in rounds), default=0)
        if self._arange.numel() < longest:
            self._arange = torch.arange(longest, dtype=torch.int64)
        runs = [contiguous_runs(o, ld.dst.block_bytes) for o, ld in zip(offs, loads, strict=True)]
        self._batch = _Batch(src, loads, rounds, offs, bids, runs, layer_end)
        if self._cuda:  # copies start after the work queued so far (e.g. the previous step's reads)
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        self.stats["batches"] += 1
        for j in range(min(self.slots, len(rounds))):
            self._issue_copy(j)
        if self.mode is Mode.BULK:
            self.finish()
        return True

    def wait_layer(self, layer: str) -> None:
        """Exchange and scatter every round up to the end of ``layer`` on the current stream
        (vLLM's ``wait_for_layer_load``). A layer this batch does not restore is a no-op."""
        b = self._batch
        if b is None or layer not in b.layer_end:
            return
        self._drain(b.layer_end[layer])

    def finish(self) -> None:
        """Exchange and scatter whatever is left of the batch (end of the forward, bulk mode)."""
        b = self._batch
        if b is not None:
            self._drain(len(b.rounds))
            self._batch = None

    def close(self) -> None:
        self.finish()
        self.exchanger.close()
        self.staging = None

    # ---------------------------------------------------------------- internals
    def _validate(self, src: torch.Tensor, loads: list[LayerLoad]) -> None:
        if not isinstance(src, torch.Tensor) or src.dtype != torch.uint8 or src.dim() != 1:
            raise ValueError(f"src must be a 1-D uint8 tensor (the card), got {getattr(src, 'dtype', type(src))}")
        if self._cuda and src.device.type == "cpu":
            from xkv.kernels import is_host_accessible

            if not is_host_accessible(src):
                raise ValueError("src is host memory that is neither pinned nor registered "
                                 "(xkv.kernels.register_host it once)")
        elif src.device != self.device:
            raise ValueError(f"src is on {src.device}, fan-out runs on {self.device}")
        for ld in loads:
            bb, n = ld.dst.block_bytes, ld.block_ids.numel()
            for name, t in (("src_offsets", ld.src_offsets), ("block_ids", ld.block_ids)):
                if t.dtype != torch.int64 or t.dim() != 1:
                    raise ValueError(f"layer {ld.layer}: {name} must be int64 1-D, got {t.dtype} {tuple(t.shape)}")
            if ld.src_offsets.numel() != n:
                raise ValueError(f"layer {ld.layer}: {ld.src_offsets.numel()} src_offsets for {n} block_ids")
            if n == 0:
                continue
            offs, bids = ld.src_offsets.cpu(), ld.block_ids.cpu()
            if int(offs.min()) < 0 or int(offs.max()) + bb > src.numel():
                raise ValueError(f"layer {ld.layer}: src_offsets span [{int(offs.min())}, {int(offs.max()) + bb}) "
                                 f"outside the card of {src.numel()} bytes")
            if ld.dst.device != self.device:
                raise ValueError(f"layer {ld.layer}: cache on {ld.dst.device}, fan-out runs on {self.device}")
            if torch.unique(bids).numel() != n:
                raise ValueError(f"layer {ld.layer}: block_ids has duplicates")
            if int(bids.min()) < 0 or int(bids.max()) >= ld.dst.num_blocks:
                raise ValueError(f"layer {ld.layer}: block_ids span [{int(bids.min())}, {int(bids.max())}] "
                                 f"outside the cache of {ld.dst.num_blocks} blocks")

    def _slot(self, j: int) -> torch.Tensor:
        s = j % self.slots
        return self.staging[s * self.slot_bytes:(s + 1) * self.slot_bytes]

    def _issue_copy(self, j: int) -> None:
        b = self._batch
        r = b.rounds[j]
        s = j % self.slots
        ctx = torch.cuda.stream(self._copy_stream) if self._cuda else contextlib.nullcontext()
        with ctx:
            if self._cuda:
                self._copy_stream.wait_event(self._free[s])
            ranks = range(r.n_ranks) if self.exchanger.copies_all_shares else (self.exchanger.rank,)
            for rank in ranks:
                lo, hi = r.share_range(rank)
                if hi > lo:
                    self._copy_share(b, r, self._slot(j), lo, hi)
                    self.stats["bytes_copied"] += hi - lo
            if self._cuda:
                self._copied[s].record(self._copy_stream)

    def _copy_share(self, b: _Batch, r: Round, slot: torch.Tensor, lo: int, hi: int) -> None:
        """slot[lo:hi] <- bytes [lo, hi) of the round's payload (blocks b0..b1 of load r.seg)."""
        bb = r.block_bytes
        if self.share_copy in ("dma", "auto"):
            pieces = []
            for first, count, off in b.runs[r.seg]:
                a = max(first, r.b0) - r.b0  # run's blocks inside the round, round-relative
                z = min(first + count, r.b1) - r.b0
                plo, phi = max(a * bb, lo), min(z * bb, hi)
                if phi > plo:
                    pieces.append((plo, phi, off + (r.b0 - first) * bb))
                if len(pieces) > MAX_DMA_COPIES:
                    break
            if len(pieces) <= MAX_DMA_COPIES:
                for plo, phi, base in pieces:
                    host.copy_bytes(slot[plo:phi], b.src[base + plo:base + phi])  # card pieces
                return
        from xkv.kernels import restore_slice
        from xkv.layout import PagePool

        pool = PagePool(base=slot[: r.nbytes], num_blocks=r.n_blocks, block_bytes=bb, block_stride=bb,
                        runs=((0, bb),), kind="mla")
        restore_slice(b.src, b.offs[r.seg][r.b0:r.b1], pool, self._arange[: r.n_blocks], lo, hi,
                      max_programs=self.max_programs)

    def _drain(self, end: int) -> None:
        from xkv.kernels import unpack

        b = self._batch
        while b.next_scatter < end:
            j = b.next_scatter
            r, s, slot = b.rounds[j], j % self.slots, self._slot(j)
            if self._cuda:
                cur = torch.cuda.current_stream(self.device)
                cur.wait_event(self._copied[s])
            if r.n_ranks > 1 and not self.exchanger.copies_all_shares:
                self.exchanger.all_gather_inplace(slot, r.share)
                self.stats["bytes_gathered"] += r.gathered
            load = b.loads[r.seg]
            unpack(slot[: r.nbytes], load.dst, b.bids[r.seg][r.b0:r.b1], max_programs=self.scatter_programs)
            if self._cuda:
                self._free[s].record(cur)
            self.stats["rounds"] += 1
            b.next_scatter = j + 1
            if j + self.slots < len(b.rounds):
                self._issue_copy(j + self.slots)
