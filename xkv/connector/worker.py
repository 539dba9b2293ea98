"""Worker side (every TP rank): byte-page views, restores, load errors; saves via ``saves.Saver``.

Pages are moved as whole bytes (``xkv.layout.PagePool``), never per token or per K/V half: on
vLLM's CPU backend a page is ``[heads, 2*block_size, head_dim]`` (K rows then V rows), on GPU
backends K and V share the last dim; byte pages are right for both.

Per step: ``start_load_kv`` issues every layer's reads (one call per layer and group, all jobs of
the step together) through the transfer handler; ``wait_for_layer_load(layer)`` waits for that
layer only. Blocks the step's forward also writes (a full hit's partly restored last block,
``GroupTransfer.tail``) land for every layer before the forward; a light step (few tokens
computed, ``light_steps``) lets the handler restore in a few layer groups. Layers that never call the per-layer hooks (their attention class bypasses vLLM's
decorated op) are fenced in bulk inside ``start_load_kv`` instead, and a per-layer fence that
did not come is caught after the forward (``fences.HookPlan``: load errors, then bulk). MLA
groups can be fanned out over NVLink instead (``fanout_loads.FanoutLoads``, docs/fanout.md):
each rank copies 1/N of a layer and the group all-gathers the rest at ``wait_for_layer_load``.
``save_kv_layer``/``wait_for_save`` are the :class:`~xkv.connector.saves.Saver`'s;
``get_finished`` checks the generation of every slot read (an evicted-and-reused slot is a load
error, never wrong bytes) and collects the step's load errors. Restores of parked requests
(``load_mode`` async) are issued whole and polled by an ``async_loads.AsyncLoadWorker``; both
restore paths share ``loads.py`` (card check, issue, slot-generation check, load errors). The
gateway connection (HELLO, card, failures, turn-off) is a
:class:`~xkv.connector.session.GatewaySession`. Everything that needs the registered caches
(page pools, fence plan, transfer handler, saver, async loader, fan-out) is built together at
``register_kv_caches`` by ``setup.worker_parts`` (:class:`WorkerParts`), never wired afterwards.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from xkv.connector import card_pin, graph_waits, light_steps
from xkv.connector.async_loads import AsyncLoadWorker
from xkv.connector.cache_pools import cache_pools
from xkv.connector.checksums import check_words, session_words
from xkv.connector.fanout_loads import FanoutLoads
from xkv.connector.fences import HookPlan
from xkv.connector.loads import LoadOutcomes, by_group, issue
from xkv.connector.metadata import StepMetadata, TransferJob, WorkerReport
from xkv.connector.registry import Registry
from xkv.connector.saves import Saver
from xkv.connector.session import GatewaySession, LayoutSpec
from xkv.connector.setup import worker_parts
from xkv.connector.stats import ConnectorStats
from xkv.connector.transfer import SyncTransferHandler, TransferHandler
from xkv.connector.turnoff import OffPath, record_fences
from xkv.connector.warmup import (
    check_lines,
    choose_restore_path,
    compile_copies,
    copy_engine_from_bytes,
    restores_may_take_copy_engine,
)
from xkv.layout import PagePool

log = logging.getLogger("xkv.connector")

TURNED_OFF_LINE = "External KV cache turned off on this rank"
REATTACHED_LINE = "External KV cache re-attached on this rank"


def _register_card(card: torch.Tensor) -> torch.Tensor:
    return card_pin.pin_beside_engine(card)  # in segments: see card_pin


def _unregister_card(card: torch.Tensor, limit: int | None = None) -> int:
    return card_pin.unpin(card, limit)


@dataclasses.dataclass(frozen=True)
class WorkerParts:
    """What a worker rank builds once its caches are registered (``setup.worker_parts``):
    ``pools`` layer -> ``PagePool``; ``layer_pos`` layer -> (group, index in group); the fence
    plan; the transfer handler of sync loads and saves; the saver; the async loader (a handler
    of its own per batch); the NVLink fan-out restores (None: off on this rank)."""

    pools: dict[str, PagePool]
    layer_pos: dict[str, tuple[int, int]]
    hooks: HookPlan
    handler: TransferHandler
    saver: Saver
    async_loads: AsyncLoadWorker
    fanout: FanoutLoads | None


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
        handler_factory: Callable[[torch.device], TransferHandler] | None = None,
        fanout_factory: Callable[[Mapping[str, torch.Tensor], torch.device], Any] | None = None,
        reattach: bool = False,
        full_hit_restore: bool = True,
        save_mode: str = "layer",
        save_line: str = "",
        verify_checksums: bool = True,
        full_graphs: bool = False,
    ):
        """``reattach``: follow the scheduler to a restarted gateway (see :meth:`bind`).
        ``full_graphs``: vLLM keeps full CUDA graphs (``full_cuda_graphs``): their captures get
        per-layer restore waits where the handler can (``graph_waits``).
        ``handler_factory(device)``: a transfer handler (default: the inline CPU one).
        ``save_mode``: the saver's (``setup.save_mode``), ``save_line`` its start-up line.
        ``verify_checksums``: saves compute checksum words, restores check them
        (``checksums.py``)."""
        self.registry = registry
        self._save_mode, self._save_line = save_mode, save_line
        self.tp_rank = tp_rank
        # full hits end inside a block (GroupTransfer.tail): warm the all-layer tail launch
        self._warm_tails = full_hit_restore
        self._handler_factory = handler_factory or (lambda device: SyncTransferHandler())
        # (kv_caches, device) -> FanoutRestorer | None; collective over the TP group, so every rank
        # calls it exactly once, in register_kv_caches, whatever happens to its gateway
        self._fanout_factory = fanout_factory
        self.parts: WorkerParts | None = None  # built by register_kv_caches
        self.stats = ConnectorStats()
        self.verify_checksums = verify_checksums
        self._full_graphs = full_graphs and graph_waits.enabled()
        self.graph_waits = False  # the handler keeps per-layer events for full graphs' captures
        self.copy_engine_restores = False  # some restore may skip the Triton kernel (warmup.py)
        self.copy_engine_from: int | None = None  # restores of >= this many bytes may (warmup.py)
        self._graph_logged = False  # the first full-graph step with loads logged its fence
        self.session = GatewaySession(
            gateway_factory,
            [LayoutSpec(fp, p.num_shards, p.registered_bytes,
                        check_words(p, verify_checksums))
             for p, fp in zip(registry.groups, fingerprints, strict=True)],
            namespace=namespace, on_off=self._log_off, map_card=True, reattach=reattach,
            on_reattach=self._log_reattach)
        self._scheduler_off = False  # the scheduler side is off too: no load will come
        self._last_attach = 0.0  # monotonic time of this rank's last attach attempt
        self.outcomes = LoadOutcomes(registry, tp_rank, self.session, self.stats)
        # letting go of the card and attaching again run on this thread, never the engine's
        self.offpath = OffPath(self.session, self._wait_committed, name=f"xkv-offpath-{tp_rank}")
        #: Seconds bind waits for a background attach to finish (one lookup deadline: a small
        #: card is in use at once, a large one from a later step).
        self.attach_wait_s = 0.05
        self._meta: StepMetadata | None = None
        self._load_checks: list[TransferJob] = []  # read this step: generations checked
        self._t_load = 0.0
        self._check_fences = False  # this step issued per-layer fenced loads: check after forward

    def _part(self) -> WorkerParts:
        if self.parts is None:
            raise RuntimeError("xkv: the worker is used before register_kv_caches")
        return self.parts

    # the parts, once registered (the handler is shared by sync loads and saves)
    pools = property(lambda self: self._part().pools)
    layer_pos = property(lambda self: self._part().layer_pos)
    hooks = property(lambda self: self._part().hooks)
    handler = property(lambda self: self._part().handler)
    saver = property(lambda self: self._part().saver)
    async_loads = property(lambda self: self._part().async_loads)

    @property
    def fanout(self) -> FanoutLoads | None:
        return self.parts.fanout if self.parts is not None else None

    @property
    def restorer(self) -> Any:
        """The fan-out restorer (None: fan-out off on this rank)."""
        return self.fanout.restorer if self.fanout is not None else None

    @property
    def turned_off(self) -> bool:
        return self.session.turned_off

    @property
    def card(self) -> torch.Tensor | None:
        return self.session.card

    @property
    def layout_ids(self) -> tuple[int, ...]:
        return self.session.layout_ids

    # ------------------------------------------------------------------ start

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], *, num_blocks: int, layout: str | None = None,
        hooks: Mapping[str, tuple[bool, str]] | None = None,
    ) -> list[str]:
        """Byte-page views of every cache; HELLO per group; map the card. Returns log lines
        (the façade logs them on TP rank 0). ``hooks``: layer -> (its class calls the per-layer
        hooks, class name), from ``compat.layer_hooks``; a layer not in it is fenced in bulk."""
        pools, expected = cache_pools(self.registry, kv_caches, num_blocks=num_blocks,
                                      layout=layout)
        device = next(iter(pools.values())).base.device if pools else torch.device("cpu")
        # collective over the TP group: every rank calls it, whatever happens to its gateway
        restorer = (self._fanout_factory(kv_caches, device)
                    if self._fanout_factory is not None else None)
        self.parts = worker_parts(self.registry, self.tp_rank, self.session, self.stats,
                                  self.outcomes, pools, expected, hooks,
                                  lambda: self._handler_factory(device), restorer,
                                  save_mode=self._save_mode)
        cuda = device.type == "cuda"
        self.offpath.device = device if cuda else None
        t0 = time.perf_counter()
        self.session.open(register_card=_register_card if cuda else None,
                          unregister_card=_unregister_card if cuda else None)
        # start-up phases at INFO, each as it ends: a slow or stuck start shows where it is
        log.info("XKV: gateway session opened (card mapped: %s) in %.1f s",
                 self.session.card is not None, time.perf_counter() - t0)
        ring_line = None
        if cuda and self.pools:
            ring_line = choose_restore_path(self.handler, self.pools, self.session.card)
            compile_copies(self.registry, self.pools, self.session.card, self.handler,
                           self.session.check_words, tp_rank=self.tp_rank,
                           save_mode=self._save_mode, tails=self._warm_tails)
        # the probe's verdict, for XKV_EARLY_ISSUE's auto (early_issue.auto_off_reason)
        self.copy_engine_restores = cuda and restores_may_take_copy_engine(self.handler, device)
        self.copy_engine_from = copy_engine_from_bytes(self.handler, device) if cuda else None
        if self._full_graphs and cuda and self.fanout is None:
            self.graph_waits = self.handler.enable_graph_waits(
                [n for p in self.registry.groups for n in p.group.layer_names])
        lines = [f"XKV: {len(self.pools)} cache tensors registered for exchange"]
        lines += [ring_line] if ring_line else []
        lines += [self._save_line] if self._save_line else []
        return lines + self.registry.log_lines() + self.hooks.start_lines() + check_lines(
            self.registry, self.session.check_words, self.verify_checksums, self.fanout is not None)

    # ------------------------------------------------------------------ loads

    def bind(self, meta: StepMetadata) -> None:
        """The step's metadata. ``meta.turned_off``: turn off too. A scheduler that is on while
        this rank is off (it re-probed the gateway), or with ``reattach`` on another gateway
        epoch, makes this rank attach again, at most once a second, in the background
        (``turnoff.OffPath``): the new card is used from the step after the attach finished
        (waiting ``attach_wait_s`` at most here); until then this step's loads are load errors
        (never old offsets on a new card) and its saves are aborted."""
        self.saver.bind(meta)
        self._meta = meta
        self.offpath.note_step()  # a retired card waits for an idle engine
        ses = self.session
        same = meta.epoch == ses.epoch or not ses.epoch
        self._adopt(0.0)
        if meta.turned_off:
            self._scheduler_off = True
            ses.turn_off("the scheduler side lost the gateway")
        elif meta.epoch and ((ses.turned_off and same) or (
                ses.reattach_enabled and (ses.turned_off or meta.epoch != ses.epoch))):
            self._scheduler_off = False
            if not ses.turned_off:
                ses.turn_off(f"gateway epoch changed ({ses.epoch} -> {meta.epoch})")
            if not self._let_go_card():
                return  # async copies from the old card still run: a later step attaches
            now = time.monotonic()
            if not self.offpath.attaching and now - self._last_attach >= 1.0:
                self._last_attach = now  # the scheduler reached it: try now, then 1/s
                self.offpath.attach()
            self._adopt(self.attach_wait_s)

    def _wait_committed(self, timeout_s: float) -> bool:
        return self.parts is None or self.parts.saver.wait_committed(timeout_s)

    def _fence_owners(self) -> list:
        return [self.handler, self.restorer] if self.parts is not None else []

    def _let_go_card(self) -> bool:
        """Hand the card of a session that is off to the background thread (after the copies
        issued so far, see ``turnoff``); False while async loads still read it."""
        if self.parts is not None and self.async_loads.in_flight:
            return False
        self.offpath.release(self.session.detach(),
                             record_fences(self._fence_owners(), self.offpath.device))
        return True

    def _adopt(self, wait_s: float | None) -> None:
        """Use a finished background attach (at a step boundary only)."""
        att = self.offpath.take_attached(wait_s)
        if att is not None:
            old = self.session.adopt(att)  # [None, None]: the old card was detached before
            if any(x is not None for x in old):
                self.offpath.release(old, record_fences(self._fence_owners(),
                                                        self.offpath.device))

    @property
    def in_step(self) -> bool:
        """A step's metadata is bound and not yet cleared."""
        return self._meta is not None

    def restore_bytes(self, loads: Iterable[TransferJob]) -> int:
        """Bytes this rank's restore of ``loads`` copies (every layer of every block)."""
        return sum(len(gt.block_ids) * self.registry.groups[gt.group].group.bytes_all_layers
                   for job in loads for gt in job.groups)

    def may_take_copy_engine(self, loads: Iterable[TransferJob]) -> bool:
        """Whether the restore of ``loads`` (one step's) is large enough that a copy of it may
        run on the copy engine (:attr:`copy_engine_from`; the kernels decide per cache group,
        on no more bytes than these)."""
        start = self.copy_engine_from
        return start is not None and self.restore_bytes(loads) >= start

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None or not meta.loads:
            return
        # Loads promised before a turn-off still run: they need no gateway message, the card
        # stays mapped, and the generation check below catches a reused slot. A card that was
        # never mapped, or offsets from another gateway process (epoch), cannot be read.
        groups = by_group(meta.loads)
        card = self.outcomes.usable_card(meta.epoch)
        if card is None and self.registry.multi_group and self.offpath.attaching:
            # vLLM cannot take load errors of this model: wait for the card being attached
            self._adopt(None)
            card = self.outcomes.usable_card(meta.epoch)
        if card is None:
            if self.session.card is not None:
                self.session.turn_off(
                    f"gateway epoch changed ({self.session.epoch} -> {meta.epoch})")
            # The other ranks are inside the restorer's agreement for this batch: join it with
            # an empty source, which this rank refuses, so every rank restores as usual.
            if self.fanout is not None:
                self.fanout.begin(torch.empty(0, dtype=torch.uint8), groups)
            self.outcomes.fail_unusable(meta.loads)
            return
        t0 = time.perf_counter()
        # a step that computes few tokens (a full hit computes one) cannot hide its copies under
        # the forward: the handler may then use a few large launches instead of one per layer
        self.handler.set_light_step(light_steps.is_light(meta.scheduled_tokens))
        self.handler.begin_loads()
        for job in meta.loads:
            self.outcomes.finished(job)
        self._load_checks.extend(meta.loads)
        words = session_words(self.session)
        fanned = (self.fanout.begin(card, groups, words, self.outcomes.add_check)
                  if self.fanout is not None else set())
        self._check_fences = bool(fanned)  # layer-wise fan-out fences: checked too
        issue(self.handler, self.registry, self.tp_rank, card, groups, self.pools, self.stats,
              skip=fanned, fence_tail=True, check_words=words,
              on_checks=self.outcomes.add_check,
              checked=self.fanout.checked if self.fanout is not None else ())
        for g in groups:
            if g in fanned:
                continue
            # State layers and layers whose class never calls wait_for_layer_load: the forward
            # must start after their pages (states: boundary and running block) landed. The
            # others keep their per-layer fence, checked after the forward.
            bulk = self.hooks.bulk_layers(g)
            for name in bulk:
                self.handler.wait_layer(name)
            if bulk:
                self.handler.verify_layers(bulk)  # debug: before the forward rewrites any
            self._check_fences = self._check_fences or len(bulk) < len(
                self.registry.groups[g].group.layer_names)
        self._t_load = time.perf_counter() - t0

    def start_async_loads(self) -> None:
        """Issue the step's async loads (after the sync ones: those feed this step)."""
        meta = self._meta
        if meta is not None and meta.async_loads:
            self.async_loads.start(meta.async_loads, self.outcomes.usable_card(meta.epoch))

    def finished_async_loads(self) -> set[str]:
        """Requests whose async load completed on this rank (``finished_recving``); polls."""
        self.async_loads.poll()
        return self.async_loads.take_finished()

    def capturing(self) -> bool:
        """vLLM is capturing a CUDA graph on this thread's stream and this rank puts per-layer
        restore waits into full graphs (``graph_waits``)."""
        return self.graph_waits and torch.cuda.is_current_stream_capturing()

    def capture_wait(self, layer_name: str) -> None:
        """``wait_for_layer_load`` while a full graph is captured: a wait node on the layer's
        event, in the graph (``graph_waits``)."""
        self.handler.capture_wait(layer_name)

    def fence_full_graph_step(self) -> None:
        """The step's forward is a full graph's replay, where no per-layer hook runs: its loads
        are waited for by the graph's own per-layer waits where every loaded layer has one
        (``graph_waits``), else the compute stream waits for every layer now, before the forward
        reads a page."""
        waited = self.handler.graph_waited()  # False unless enabled (never with the fan-out)
        if not waited:
            for plan in self.registry.groups:
                for name in plan.group.layer_names:
                    self.wait_for_layer_load(name)
        if not self._graph_logged:
            self._graph_logged = True
            log.info("XKV: restores in full-CUDA-graph steps: %s", (
                "the graph waits for each layer's copy (per-layer waits captured)" if waited else
                "fenced before the forward (" + (
                    "the captured graphs lack a layer's wait" if self.graph_waits else
                    "no external CUDA events on this device and torch" if self._full_graphs else
                    "graph waits off: full_cuda_graphs false or XKV_GRAPH_WAITS=0") + ")"))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.fanout is not None and layer_name in self.fanout.layers:
            self.fanout.wait_layer(layer_name)
        else:
            self.handler.wait_layer(layer_name)

    def _fence_check(self) -> None:
        """After the forward: restores a layer read without its per-layer fence (see
        ``HookPlan.missed_fences``) become load errors, and those requests' saves of this step
        are aborted (their later layers were computed from those reads)."""
        if not self._check_fences:
            return
        self._check_fences = False
        loads = self._meta.loads if self._meta is not None else ()
        fanned = self.fanout.unfenced() if self.fanout is not None else []
        if fanned:  # exchange the rest now: what runs next is ordered after it
            self.fanout.finish()
        jobs = self.hooks.missed_fences(self.handler, loads, self.layer_pos, fanned)
        if jobs:
            self.outcomes.no_block_errors("a layer did not call wait_for_layer_load (warned above)")
            for job in jobs:
                self.outcomes.fail(job.block_ids())
            self.saver.taint({job.req_id for job in jobs})

    # ------------------------------------------------------------------ saves

    def save_kv_layer(self, layer_name: str) -> None:
        self.saver.save_layer(layer_name)

    def wait_for_save(self) -> None:
        self._fence_check()  # before the step's commit decisions
        self.saver.wait_for_save()

    def drain_saves(self, timeout_s: float | None = None) -> bool:
        """Wait until every fenced save batch was committed (tests, shutdown); False on timeout."""
        return self.saver.drain(timeout_s)

    # ------------------------------------------------------------------ end of step

    def get_finished(self) -> None:
        """Wait for the step's reads and verify every slot read still holds what was leased."""
        self.saver.merge_counts()
        if self.fanout is not None:
            self.fanout.finish()
        self._fence_check()  # a step whose wait_for_save did not run
        if not self._load_checks:
            self._release_card_if_unused()
            return
        t0 = time.perf_counter()
        self.handler.sync_loads()
        self.outcomes.check_stale(self._load_checks)
        self.outcomes.check_sums()  # the step's mismatch flags, read once
        self._load_checks = []
        self.stats.add("seconds_restored", self._t_load + time.perf_counter() - t0)
        self._t_load = 0.0
        self._release_card_if_unused()

    def _release_card_if_unused(self) -> None:
        """Off here and on the scheduler side: no load can come any more, so the card is
        retired: unregistered and unmapped in the background once every copy issued so far and
        the commit thread are done and the engine is idle (``turnoff``: never on the engine
        thread, never while it steps: an unregister stalls every CUDA call of the process)."""
        if self._scheduler_off and self.session.turned_off and self.session.card is not None:
            self._let_go_card()

    def take_load_errors(self) -> set[int]:
        return self.outcomes.take_errors()

    def take_report(self) -> WorkerReport | None:
        return self.outcomes.take_report()

    def clear(self) -> None:
        self._meta = None
        if self.parts is not None:
            self.saver.clear()

    def turn_off(self, reason: str) -> None:
        self.session.turn_off(reason)

    def _log_off(self, reason: str) -> None:
        log.warning("%s (tp rank %d: %s)", TURNED_OFF_LINE, self.tp_rank, reason)

    def _log_reattach(self, epoch: int) -> None:
        log.warning("%s (tp rank %d: gateway epoch %d)", REATTACHED_LINE, self.tp_rank, epoch)

    def shutdown(self) -> None:
        parts = self.parts
        if parts is not None:
            if parts.fanout is not None:
                parts.fanout.close()
                self.parts = dataclasses.replace(parts, fanout=None)
            parts.async_loads.poll(wait=True)
            parts.saver.close(timeout_s=10.0)
        left = self.offpath.close()  # a card being let go is let go first
        if left is not None:
            self.session.let_go(left)
        self.session.close()
