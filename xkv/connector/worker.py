"""Worker side (every TP rank): byte-page views, restores, saves, commits, load errors.

Pages are moved as whole bytes (``xkv.layout.PagePool``), never per token or per K/V half: on
vLLM's CPU backend a page is ``[heads, 2*block_size, head_dim]`` (K rows then V rows), on GPU
backends K and V share the last dim; byte pages are right for both.

Per step: ``start_load_kv`` issues every layer's reads (one call per layer and group, all jobs of
the step together) through the transfer handler; ``wait_for_layer_load(layer)`` waits for that
layer only; ``save_kv_layer`` copies the layer's pages of reserved chunks to their slots;
MLA groups can be fanned out over NVLink instead (``xkv.fanout``, docs/fanout.md): each rank
copies 1/N of a layer and the group all-gathers the rest at ``wait_for_layer_load``.
``wait_for_save`` fences the step's saves and hands the COMMITs of shards whose every layer was
written (ABORTs otherwise) to ``saves.Committer``, sent once the copies finished;
``get_finished`` checks the generation of every slot read (an evicted-and-reused slot is a load
error, never wrong bytes) and collects the step's load errors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

from xkv.connector.metadata import GroupTransfer, StepMetadata, WorkerReport
from xkv.connector.registry import GroupPlan, Registry
from xkv.connector.saves import Committer, SaveBatch
from xkv.connector.scheduler import MAX_FAILURES
from xkv.connector.stats import ConnectorStats
from xkv.connector.transfer import SyncTransferHandler
from xkv.gateway.client import GatewayError, GatewayUnavailable
from xkv.gateway.protocol import MAX_KEYS
from xkv.layout import PagePool, describe_cache

log = logging.getLogger("xkv.connector")

TURNED_OFF_LINE = "External KV cache turned off on this rank"


class WorkerSide:
    """The worker-role half of FusIOnXConnector (one per TP rank)."""

    def __init__(
        self,
        registry: Registry,
        fingerprints: list[str],
        *,
        namespace: str,
        tp_rank: int,
        gateway_factory: Callable[[], Any],
        handler_factory: Callable[[torch.device], Any] | None = None,
        fanout_factory: Callable[[Mapping[str, torch.Tensor], torch.device], Any] | None = None,
    ):
        self.registry = registry
        self.fingerprints = fingerprints
        self.namespace = namespace
        self.tp_rank = tp_rank
        self._gateway_factory = gateway_factory
        self._handler_factory = handler_factory
        # (kv_caches, device) -> FanoutRestorer | None; collective over the TP group, so every rank
        # calls it exactly once, in register_kv_caches, whatever happens to its gateway
        self._fanout_factory = fanout_factory
        self.restorer: Any = None
        self._fanout_layers: set[str] = set()  # this step's layers restored by the restorer
        self.stats = ConnectorStats()
        self.turned_off = False
        self._failures = 0  # consecutive GatewayUnavailable
        self.gw = None
        self.card: torch.Tensor | None = None
        self.epoch = 0
        self.layout_ids: tuple[int, ...] = ()
        self.pools: dict[str, PagePool] = {}
        self.layer_pos: dict[str, tuple[int, int]] = {}  # layer -> (group, index in group)
        self.handler: Any = SyncTransferHandler()
        self._meta: StepMetadata | None = None
        self._load_checks: list[tuple[GroupTransfer, int]] = []  # (transfer, chunk index)
        self._loads_done: Counter = Counter()
        self._load_errors: set[int] = set()
        # Saves: the layers written this step per group (every job of a group is saved by the
        # same call); the step whose saves were issued and not yet fenced; whether this step's
        # wait_for_save ran (vLLM 0.33 calls it every step, and it must act once per step).
        self._saved: dict[int, set[int]] = {}
        self._unflushed: StepMetadata | None = None
        self._save_flushed = False
        # COMMIT/ABORT run on the committer's thread once the save fence completed (CUDA), or
        # inline (CPU); its counters reach self.stats on the engine thread (_merge_commit_stats).
        self._committer = Committer(self._send_saves, name=f"xkv-commit-{tp_rank}")
        self._commit_stats: Counter = Counter()
        self._commit_lock = threading.Lock()
        self._batch = SaveBatch()  # the decisions of the step being flushed
        self._t_load = 0.0
        self._save_plan: dict[int, tuple] = {}

    # ------------------------------------------------------------------ start

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], *, num_blocks: int, layout: str | None = None
    ) -> list[str]:
        """Byte-page views of every cache; HELLO per group; map the card. Returns log lines
        (the façade logs them on TP rank 0)."""
        expected = {n: (p.group.index, i) for p in self.registry.groups
                    for i, n in enumerate(p.group.layer_names)}
        unknown = sorted(set(kv_caches) - set(expected))
        if unknown:
            raise ValueError(
                f"xkv: KV cache tensors {unknown} belong to no KV cache group: nobody would "
                "write them, refusing to start"
            )
        missing = sorted(set(expected) - set(kv_caches))
        if missing:
            raise ValueError(f"xkv: KV cache group layers {missing} have no registered tensor")
        for plan in self.registry.groups:
            for name in plan.group.layer_names:
                # layout: the name vLLM resolved; describe_cache checks the strides against it.
                pool = describe_cache(kv_caches[name], num_blocks=num_blocks, layout=layout,
                                      kind=plan.group.kind)
                if pool.block_bytes != plan.group.block_bytes:
                    raise ValueError(
                        f"xkv: layer {name}: {pool.block_bytes} bytes per block in memory, "
                        f"{plan.group.block_bytes} expected from the KV cache spec"
                    )
                self.pools[name] = pool
        self.layer_pos = expected
        device = next(iter(self.pools.values())).base.device if self.pools else torch.device("cpu")
        if self._handler_factory is not None:
            self.handler = self._handler_factory(device)
        if self._fanout_factory is not None:
            self.restorer = self._fanout_factory(kv_caches, device)
        try:
            self.gw = self._gateway_factory()
            infos = [
                self.gw.register_layout(self.namespace, fp, p.num_shards, p.registered_bytes)
                for p, fp in zip(self.registry.groups, self.fingerprints, strict=True)
            ]
            self.layout_ids = tuple(i.layout_id for i in infos)
            self.epoch = infos[0].epoch
            self.card = torch.frombuffer(self.gw.map_card(), dtype=torch.uint8)
            if device.type == "cuda":
                from xkv import kernels

                self.card = kernels.register_host(self.card)
        except GatewayError as e:  # dead, refused our layout, or its card is not mappable here
            self.turn_off(f"gateway unusable at start: {e}")
        lines = [f"XKV: {len(self.pools)} cache tensors registered for exchange"]
        return lines + self.registry.log_lines()

    # ------------------------------------------------------------------ loads

    def bind(self, meta: StepMetadata) -> None:
        if self._unflushed is not None:
            # saves issued in a step whose wait_for_save never came: fence and commit them now
            self._flush_saves(self._unflushed)
        self._save_flushed = False
        self._meta = meta
        self._save_plan = {}  # group -> (jobs, block ids, layer-0 offsets), built on first use
        if meta.turned_off and not self.turned_off:
            self.turn_off("the scheduler side lost the gateway")

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None or not meta.loads:
            return
        # Loads promised before a turn-off still run: they need no gateway message, the card
        # stays mapped, and the generation check below catches a reused slot. A card that was
        # never mapped, or offsets from another gateway process (epoch), cannot be read.
        usable = self.card is not None and meta.epoch == self.epoch
        by_group: dict[int, list[GroupTransfer]] = {}
        for job in meta.loads:
            for gt in job.groups:
                by_group.setdefault(gt.group, []).append(gt)
        if not usable:
            if not self.turned_off and meta.epoch != self.epoch:
                self.turn_off(f"gateway epoch changed ({self.epoch} -> {meta.epoch})")
            self._no_block_errors("the card is not mapped on this rank, or its gateway changed")
            # The other ranks are inside the restorer's agreement for this batch: join it with
            # an empty source, which this rank refuses, so every rank restores as usual.
            self._fanout_begin(torch.empty(0, dtype=torch.uint8), by_group)
            for job in meta.loads:
                self._fail(job.block_ids())
                self._loads_done[job.job_id] += 1
            return
        t0 = time.perf_counter()
        self.handler.begin_loads()
        for job in meta.loads:
            for gt in job.groups:
                self._load_checks.extend((gt, c) for c in range(len(gt.chunks)))
            self._loads_done[job.job_id] += 1
        fanned = self._fanout_begin(self.card, by_group)
        for g, transfers in by_group.items():
            plan = self.registry.groups[g]
            blocks = torch.tensor([b for gt in transfers for b in gt.block_ids], dtype=torch.int64)
            if g not in fanned:
                base, step = self._base_offsets(plan, transfers), self._layer_stride(plan)
                for layer, name in enumerate(plan.group.layer_names):
                    offs = base + layer * step
                    self.handler.load_layer(name, self.card, offs, self.pools[name], blocks)
            if plan.is_state:
                # State layers get no wait_for_layer_load call: the forward must start after
                # their pages (boundary and running block) landed.
                for name in plan.group.layer_names:
                    self.handler.wait_layer(name)
            nbytes = len(blocks) * plan.group.block_bytes * len(plan.group.layer_names)
            self.stats.add("bytes_restored", nbytes)
            self.stats.add("blocks_restored", len(blocks))
        self._t_load = time.perf_counter() - t0

    def _fanout_begin(self, src: torch.Tensor, by_group: dict[int, list[GroupTransfer]]) -> set[int]:
        """Hand this step's MLA group loads to the fan-out restorer; returns the groups it took
        (empty: restore them through the handler). Built from scheduler metadata only, so every
        TP rank calls ``begin`` with the same loads (it agrees across ranks inside)."""
        self._fanout_layers = set()
        if self.restorer is None:
            return set()
        from xkv.fanout import LayerLoad

        groups, loads = [], []
        for g, transfers in by_group.items():
            plan = self.registry.groups[g]
            if plan.group.kind != "mla" or plan.is_state:
                continue
            # host index tensors: the restorer validates and plans on the host
            blocks = torch.tensor([b for gt in transfers for b in gt.block_ids], dtype=torch.int64)
            base, step = self._base_offsets(plan, transfers), self._layer_stride(plan)
            groups.append(g)
            loads += [LayerLoad(name, base + layer * step, self.pools[name], blocks)
                      for layer, name in enumerate(plan.group.layer_names)]
        if not loads or not self.restorer.begin(src, loads):
            return set()
        self._fanout_layers = {ld.layer for ld in loads}
        return set(groups)

    def _fanout_finish(self) -> None:
        """Exchange whatever the forward left (layers without a wait hook), then wait for the
        fanned-out copies so the generation check below follows the bytes it vouches for."""
        if self.restorer is None or not self._fanout_layers:
            return
        self.restorer.finish()
        self._fanout_layers = set()
        dev = self.restorer.device
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    def _base_offsets(self, plan: GroupPlan, transfers: list[GroupTransfer]) -> torch.Tensor:
        """int64 [n]: card offset of each block of ``transfers`` for layer 0 (this rank's shard).

        Layer ``l`` adds ``l * k * block_bytes`` (objects are layer-major)."""
        shard = plan.shard_of(self.tp_rank)
        bb = plan.group.block_bytes
        return torch.tensor(
            [
                gt.chunks[c].offsets[shard] + j * bb
                for gt in transfers
                for c, j in zip(gt.chunk_of, gt.block_in_chunk, strict=True)
            ],
            dtype=torch.int64,
        )

    @staticmethod
    def _layer_stride(plan: GroupPlan) -> int:
        return plan.blocks_per_object * plan.group.block_bytes

    def wait_for_layer_load(self, layer_name: str) -> None:
        if layer_name in self._fanout_layers:
            self.restorer.wait_layer(layer_name)  # all-gather + scatter on the compute stream
        else:
            self.handler.wait_layer(layer_name)

    # ------------------------------------------------------------------ saves

    def save_kv_layer(self, layer_name: str) -> None:
        meta = self._meta
        if meta is None or not meta.saves or self.turned_off or self.card is None:
            return
        pos = self.layer_pos.get(layer_name)
        if pos is None:
            return
        g, layer = pos
        plan = self.registry.groups[g]
        if not plan.writes(self.tp_rank) or meta.epoch != self.epoch:
            return
        t0 = time.perf_counter()
        if g not in self._save_plan:
            transfers = [(job, gt) for job in meta.saves for gt in job.groups if gt.group == g]
            blocks = torch.tensor([b for _, gt in transfers for b in gt.block_ids],
                                  dtype=torch.int64)
            base = self._base_offsets(plan, [gt for _, gt in transfers])
            self._save_plan[g] = ([job for job, _ in transfers], blocks, base)
        jobs, blocks, base = self._save_plan[g]
        if not jobs:
            return
        offs = base + layer * self._layer_stride(plan)
        self.handler.save_layer(layer_name, self.pools[layer_name], blocks, self.card, offs)
        self._saved.setdefault(g, set()).add(layer)
        self._unflushed = meta
        self.stats.add("bytes_saved", len(blocks) * plan.group.block_bytes)
        self.stats.add("seconds_saved", time.perf_counter() - t0)

    def wait_for_save(self) -> None:
        """Fence the step's saves and hand its commits over; never blocks on the save copies.

        Commits are sent once every layer's bytes are on the card: inline on the CPU handler,
        from the committer thread after the save stream's event on CUDA (vLLM 0.26 calls this
        before it launches logits and sampling, so a host wait here would idle the GPU)."""
        meta = self._meta
        if meta is None or not meta.saves or self._save_flushed:
            return
        self._save_flushed = True
        t0 = time.perf_counter()
        # State layers have no save_kv_layer hook: their end-of-step state is saved here, after
        # the forward that wrote it.
        for plan in self.registry.groups:
            if plan.is_state:
                for name in plan.group.layer_names:
                    self.save_kv_layer(name)
        self._flush_saves(meta)
        self.stats.add("seconds_saved", time.perf_counter() - t0)

    def _flush_saves(self, meta: StepMetadata) -> None:
        """Decide commit/abort for every save job of ``meta`` (from the layers written), fence
        the copies and submit the batch. A chunk with a layer not written is aborted."""
        self._unflushed = None
        saved, self._saved = self._saved, {}
        fence = self.handler.fence_saves()  # None: the bytes are on the card already
        self._batch = SaveBatch()
        for job in meta.saves:
            for gt in job.groups:
                plan = self.registry.groups[gt.group]
                if not plan.writes(self.tp_rank):
                    continue
                keys = [c.key for c in gt.chunks]
                complete = len(saved.get(gt.group, ())) == len(plan.group.layer_names)
                self._finish_save(plan, gt.group, keys, complete, job)
        batch, self._batch = self._batch, SaveBatch()
        self._committer.submit(fence, batch)

    def _finish_save(self, plan: GroupPlan, g: int, keys: list[bytes], ok: bool, job) -> None:
        """Record one job's decision for group ``g`` in this step's batch (sent by _send_saves)."""
        if not ok and keys:
            # A layer without a save hook call (CUDA graph replay, a layer vLLM skipped):
            # committing would publish bytes that were never written.
            log.warning(
                "xkv: request %s group %d: not every layer was saved this step; "
                "aborting %d chunk(s)", job.req_id, g, len(keys))
        self._batch.add(g, plan.shard_of(self.tp_rank), ok, keys, job.req_id)

    def _send_saves(self, batch: SaveBatch) -> None:
        """COMMIT (or ABORT) every key of ``batch``: one message per group, shard and kind (split
        at the protocol's key limit). Runs on the committer thread on CUDA: counters go to
        ``_commit_stats``; failures count towards turning this rank off, as before."""
        for (g, shard, ok), jobs in batch.items.items():
            keys = [k for ks, _ in jobs for k in ks]
            reqs = ",".join(sorted({r for _, r in jobs}))
            for i in range(0, len(keys), MAX_KEYS):
                self._send_one(g, shard, ok, keys[i:i + MAX_KEYS], reqs)

    def _send_one(self, g: int, shard: int, ok: bool, keys: list[bytes], reqs: str) -> None:
        if self.turned_off or self.gw is None:
            self._count("save_errors", len(keys))
            return
        what = "COMMIT" if ok else "ABORT"
        try:
            if ok:
                self.gw.commit(self.layout_ids[g], shard, keys)
                self._count("chunks_saved", len(keys))
            else:
                self.gw.abort(self.layout_ids[g], shard, keys)
                self._count("save_errors", len(keys))
            self._failures = 0
        except GatewayUnavailable as e:
            self._count("save_errors", len(keys))
            self._count("gateway_errors")
            self._failures += 1
            if self._failures >= MAX_FAILURES:
                self.turn_off(f"{what} failed {self._failures} times in a row: {e}")
            else:
                log.warning("xkv: %s for request(s) %s failed: %s", what, reqs, e)
        except GatewayError as e:
            self._count("save_errors", len(keys))
            self._count("gateway_errors")
            log.warning("xkv: %s refused for request(s) %s: %s", what, reqs, e)

    def _count(self, name: str, value: float = 1) -> None:
        with self._commit_lock:
            self._commit_stats[name] += value

    def _merge_commit_stats(self) -> None:
        with self._commit_lock:
            counts, self._commit_stats = self._commit_stats, Counter()
        for name, value in counts.items():
            self.stats.add(name, value)

    def drain_saves(self, timeout_s: float | None = None) -> bool:
        """Wait until every fenced save batch was committed (tests, shutdown); False on timeout."""
        ok = self._committer.drain(timeout_s)
        self._merge_commit_stats()
        return ok

    # ------------------------------------------------------------------ end of step

    def get_finished(self) -> None:
        """Wait for the step's reads and verify every slot read still holds what was leased."""
        self._merge_commit_stats()
        self._fanout_finish()
        if not self._load_checks:
            return
        t0 = time.perf_counter()
        self.handler.sync_loads()
        for gt, c in self._load_checks:
            plan = self.registry.groups[gt.group]
            shard = plan.shard_of(self.tp_rank)
            ref = gt.chunks[c]
            try:
                ok = self.gw.slot_generation(ref.offsets[shard]) == ref.generations[shard]
            except (GatewayError, ValueError):
                ok = False
            if not ok:
                self._no_block_errors(f"slot of chunk {ref.key.hex()[:16]} was reused")
                self._fail(b for b, cc in zip(gt.block_ids, gt.chunk_of, strict=True) if cc == c)
        self._load_checks = []
        self.stats.add("seconds_restored", self._t_load + time.perf_counter() - t0)
        self._t_load = 0.0

    def take_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def take_report(self) -> WorkerReport | None:
        if not self._loads_done:
            return None
        done, self._loads_done = self._loads_done, Counter()
        return WorkerReport(loads_done=done)

    def clear(self) -> None:
        self._meta = None

    # ------------------------------------------------------------------ failure

    def _no_block_errors(self, why: str) -> None:
        """vLLM <= 0.29 crashes its scheduler on block load errors of multi-group (hybrid)
        models, and 0.33 refuses them; the scheduler side only promises leased data there, so
        this is a broken invariant: stop with a clear message rather than hand vLLM errors it
        cannot take (or restore bytes that are not the request's)."""
        if self.registry.multi_group:
            raise RuntimeError(
                f"xkv: a promised load cannot be completed on tp rank {self.tp_rank} ({why}); "
                "vLLM cannot recompute blocks of a model with several KV cache groups"
            )

    def _fail(self, block_ids) -> None:
        before = len(self._load_errors)
        self._load_errors.update(block_ids)
        self.stats.add("load_errors", len(self._load_errors) - before)

    def turn_off(self, reason: str) -> None:
        if self.turned_off:
            return
        self.turned_off = True
        log.warning("%s (tp rank %d: %s)", TURNED_OFF_LINE, self.tp_rank, reason)

    def shutdown(self) -> None:
        if self.restorer is not None:
            try:
                self.restorer.close()
            except Exception:
                log.debug("xkv: fan-out close failed", exc_info=True)
            self.restorer = None
        if self._unflushed is not None:
            self._flush_saves(self._unflushed)
        # commits still waiting on their fence go out before the connection closes
        self._committer.close(timeout_s=10.0)
        self._merge_commit_stats()
        if self.gw is not None:
            try:
                self.gw.close()
            except Exception:
                log.debug("xkv: gateway close failed", exc_info=True)
