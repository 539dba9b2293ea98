"""The worker's MLA restores through ``xkv.fanout`` (docs/fanout.md): each TP rank of an NVLink
group copies 1/N of a layer from the card and the group all-gathers the rest, at the layer's
``wait_for_layer_load``. Other groups, and batches the restorer declines, restore through the
transfer handler as usual.

Everything here is built from scheduler metadata only, so every TP rank calls the restorer with
the same loads (it agrees across ranks inside ``begin``).

Verified restores (``verify_checksums``): a fanned-out group whose chunks came with their words is
checked after the exchange: at each layer's ``wait_for_layer_load``, once the all-gather put the
layer's pages into the cache and before the layer computes (so the forward's own writes into the
last block are not hashed), ``kernels.prepare_page_hash`` hashes the pages in HBM on the compute
stream; pages the step does not restore but the object holds are hashed from the card. Every rank
checks the whole layer it will read, its peers' slices included. Bulk mode (models that never call
the hook) exchanges every layer in ``begin`` and hashes them all right after, before the forward.
A group with a layer whose hook never came in layer-wise mode stays unverified (counted in
``blocks_unverified``): that layer is exchanged after the forward, which may have written into its
last block. The flags go to the worker's ``LoadOutcomes`` as for any verified restore (read once
per step).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from xkv.connector.checksums import restore_checks
from xkv.connector.group_copies import WordsReadback
from xkv.connector.loads import PendingCheck, verified
from xkv.connector.metadata import GroupTransfer
from xkv.connector.registry import Registry
from xkv.connector.transfer import copy_table

log = logging.getLogger("xkv.connector")


class FanoutLoads:
    """One worker rank's fan-out restores. ``restorer``: an ``xkv.fanout.FanoutRestorer``;
    ``pools``: layer -> ``xkv.layout.PagePool``."""

    def __init__(self, restorer: Any, registry: Registry, tp_rank: int,
                 pools: Mapping[str, Any], stats: Any = None):
        self.restorer, self.registry, self.tp_rank, self.pools = restorer, registry, tp_rank, pools
        self.stats = stats  # ConnectorStats: blocks left unverified (a layer without its hook)
        self.layers: set[str] = set()  # this step's layers the restorer restores
        self.waited: set[str] = set()  # ... whose wait_for_layer_load came
        self.checked: set[int] = set()  # this step's fanned groups that are verified
        self._hashes: dict[str, tuple[Any, int]] = {}  # layer -> (PageHash, index), not yet hashed
        self._pending: list[tuple[PendingCheck, Any]] = []  # (check, its PageHash)
        self._on_checks: Callable[[PendingCheck], None] | None = None

    def begin(self, src: torch.Tensor, by_group: Mapping[int, list[GroupTransfer]],
              check_words: Mapping[int, int] | None = None,
              on_checks: Callable[[PendingCheck], None] | None = None) -> set[int]:
        """Hand this step's MLA group loads to the restorer; returns the groups it took (empty:
        restore them through the handler). ``src``: the card (an empty tensor on a rank whose
        card is unusable: it joins the agreement, which then declines on every rank).
        ``check_words[g]``: group ``g``'s words per object; a taken group whose chunks all came
        with words is verified (:attr:`checked`), its :class:`PendingCheck` to ``on_checks``
        once its hashes are queued (:meth:`finish`)."""
        from xkv.fanout import LayerLoad

        self.layers, self.waited, self.checked = set(), set(), set()
        self._hashes, self._pending, self._on_checks = {}, [], on_checks
        groups, loads = [], []
        for g, transfers in by_group.items():
            plan = self.registry.groups[g]
            if plan.group.kind != "mla" or plan.is_state:
                continue
            # host index tensors: the restorer validates and plans on the host
            blocks, offs = copy_table(plan, self.tp_rank, transfers)
            groups.append(g)
            loads += [LayerLoad(name, offs[layer], self.pools[name], blocks)
                      for layer, name in enumerate(plan.group.layer_names)]
        if not loads or not self.restorer.begin(src, loads):
            return set()
        self.layers = {ld.layer for ld in loads}
        if on_checks is not None:
            for g in groups:
                self._prepare_check(src, g, by_group[g], (check_words or {}).get(g, 0))
            if self.restorer.mode.value != "layerwise":  # exchanged above: hash before the forward
                for layer in list(self._hashes):
                    self._hash(layer)
        return set(groups)

    def _prepare_check(self, src: torch.Tensor, g: int, transfers: list[GroupTransfer],
                       cw: int) -> None:
        from xkv.kernels import prepare_page_hash

        plan = self.registry.groups[g]
        if not verified(plan, transfers, cw):
            return
        rc = restore_checks(plan, self.tp_rank, transfers, cw)
        if rc is None:
            return
        blocks, offs = copy_table(plan, self.tp_rank, rc.transfers)
        names = plan.group.layer_names
        ph = prepare_page_hash(src, offs, [self.pools[n] for n in names], blocks, rc.checks)
        for li, name in enumerate(names):
            self._hashes[name] = (ph, li)
        pc = PendingCheck(g, plan.shard_of(self.tp_rank), tuple(transfers), rc.cols, None)
        self._pending.append((pc, ph))
        self.checked.add(g)

    def wait_layer(self, layer: str) -> None:
        self.waited.add(layer)
        self.restorer.wait_layer(layer)  # all-gather + scatter on the compute stream
        self._hash(layer)

    def _hash(self, layer: str) -> None:
        """Queue ``layer``'s hash on the current (compute) stream: after its exchange, before
        the layer computes."""
        got = self._hashes.pop(layer, None)
        if got is not None:
            got[0].launch(got[1], torch.cuda.current_stream() if self.restorer.device.type
                          == "cuda" else None)

    def unfenced(self) -> list[str]:
        """Layers of this step's layer-wise batch whose ``wait_for_layer_load`` never came: the
        forward read them before their exchange (bulk mode exchanges everything in ``begin``)."""
        if self.restorer.mode.value != "layerwise":  # xkv.fanout.Mode
            return []
        return sorted(self.layers - self.waited)

    def finish(self) -> None:
        """Exchange whatever the forward left (layers without a wait hook), then wait for the
        fanned-out copies, so a generation check afterwards follows the bytes it vouches for."""
        if not self.layers:
            return
        self.restorer.finish()
        self.layers = set()
        # A layer whose hook never came was exchanged just now, maybe after the forward wrote
        # into its last block: hashing it could raise a false alarm, and the forward read it
        # unfenced (those blocks fail: ``hooks.missed_fences``). Its group stays unverified.
        left = {id(ph) for ph, _ in self._hashes.values()}
        self._hashes = {}
        for pc, ph in self._pending:  # the flags' host copy, queued after every hash
            if id(ph) in left:
                if self.stats is not None:
                    self.stats.add("blocks_unverified",
                                   sum(len(gt.block_ids) for gt in pc.transfers))
            elif self._on_checks is not None:
                self._on_checks(dataclasses.replace(pc, flags=WordsReadback(ph, ph.checks.shape[0])))
        self._pending = []
        dev = self.restorer.device
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    def close(self) -> None:
        try:
            self.restorer.close()
        except Exception:
            log.debug("xkv: fan-out close failed", exc_info=True)

