"""The worker's MLA restores through ``xkv.fanout`` (docs/fanout.md): each TP rank of an NVLink
group copies 1/N of a layer from the card and the group all-gathers the rest, at the layer's
``wait_for_layer_load``. Other groups, and batches the restorer declines, restore through the
transfer handler as usual.

Everything here is built from scheduler metadata only, so every TP rank calls the restorer with
the same loads (it agrees across ranks inside ``begin``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from xkv.connector.metadata import GroupTransfer
from xkv.connector.registry import Registry
from xkv.connector.transfer import copy_table

log = logging.getLogger("xkv.connector")


class FanoutLoads:
    """One worker rank's fan-out restores. ``restorer``: an ``xkv.fanout.FanoutRestorer``;
    ``pools``: layer -> ``xkv.layout.PagePool``."""

    def __init__(self, restorer: Any, registry: Registry, tp_rank: int,
                 pools: Mapping[str, Any]):
        self.restorer, self.registry, self.tp_rank, self.pools = restorer, registry, tp_rank, pools
        self.layers: set[str] = set()  # this step's layers the restorer restores
        self.waited: set[str] = set()  # ... whose wait_for_layer_load came

    def begin(self, src: torch.Tensor, by_group: Mapping[int, list[GroupTransfer]]) -> set[int]:
        """Hand this step's MLA group loads to the restorer; returns the groups it took (empty:
        restore them through the handler). ``src``: the card (an empty tensor on a rank whose
        card is unusable: it joins the agreement, which then declines on every rank)."""
        from xkv.fanout import LayerLoad

        self.layers, self.waited = set(), set()
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
        return set(groups)

    def wait_layer(self, layer: str) -> None:
        self.waited.add(layer)
        self.restorer.wait_layer(layer)  # all-gather + scatter on the compute stream

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
        dev = self.restorer.device
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    def close(self) -> None:
        try:
            self.restorer.close()
        except Exception:
            log.debug("xkv: fan-out close failed", exc_info=True)
