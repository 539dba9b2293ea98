"""Which layers get a per-layer restore fence, and the safety net for a hook that never came.

vLLM calls ``wait_for_layer_load`` / ``save_kv_layer`` from the decorator around its unified
attention ops; an attention class whose ``forward`` does not go through those ops (on vLLM 0.29
CUDA: the DeepSeek-V3.2 / GLM-5.x sparse MLA class, DeepSeek-V4's, Kimi Linear's and K3's MLA)
never calls them. ``compat.layer_hooks`` tells, from each layer's class, which layers will call
them; this module turns that into the worker's plan:

* a layer known to call the hooks keeps its per-layer fence (``wait_for_layer_load`` waits for
  that layer's copies only, so restores overlap the forward);
* any other layer (and every state layer) is *bulk*: ``start_load_kv`` makes the compute stream
  wait for its copies before the forward starts; its save runs in ``wait_for_save``, after the
  step's compute (``saves.Saver``).

Safety net (a layer planned per-layer whose ``wait_for_layer_load`` did not come in a step with
loads — the forward may have read pages still being copied): the worker makes the compute stream
wait for every outstanding load, reports that step's loaded blocks as load errors so vLLM
recomputes them, aborts the step's saves of those requests (their later layers were computed
from those reads), warns once naming the layer and its class, and fences it in bulk from then
on. A layer-wise fan-out layer (``fanout_loads``) whose hook did not come is caught the same way
(the worker exchanges the rest first); fan-out keeps its batches (collective over the TP ranks),
so that group's restores are recomputed from then on. Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

log = logging.getLogger("xkv.connector")

UNKNOWN_CLASS = "<no layer object in vLLM's forward context>"


class HookPlan:
    """Per-layer fence plan of one worker rank.

    ``hooks``: layer -> (calls the per-layer hooks, class name), from ``compat.layer_hooks``;
    a layer it does not name (every layer when None: direct use without an engine) is not known
    to call them, so it is bulk. ``groups``: the layer names of every cache group, in group order;
    ``state_groups``: indices of groups that are always bulk (recurrent states).
    """

    def __init__(self, groups: list[tuple[str, ...]], state_groups: Iterable[int] = (),
                 hooks: Mapping[str, tuple[bool, str]] | None = None):
        self._groups = groups
        self._state = set(state_groups)
        self.classes: dict[str, str] = {}
        self.bulk: set[str] = set()  # layers fenced in start_load_kv, saved in wait_for_save
        for g, names in enumerate(groups):
            for n in names:
                fires, cls = (hooks or {}).get(n, (False, UNKNOWN_CLASS))
                self.classes[n] = cls
                if g in self._state or not fires:
                    self.bulk.add(n)
        self._declared = set(self.bulk)  # bulk from the start: no warning when they miss a hook
        self._bulk_of = self._index()
        self._warned_saves: set[str] = set()  # classes warned about for a missed save hook

    def _index(self) -> list[tuple[str, ...]]:
        return [tuple(n for n in names if n in self.bulk) for names in self._groups]

    def bulk_layers(self, group: int) -> tuple[str, ...]:
        """Layers of ``group`` whose loads the forward must not start before (precomputed: no
        per-layer host work for a group whose layers all call the hooks)."""
        return self._bulk_of[group]

    def start_lines(self) -> list[str]:
        """One line per class whose layers are fenced in bulk from the start (not states)."""
        by_cls: dict[str, list[str]] = {}
        for g, names in enumerate(self._groups):
            if g in self._state:
                continue
            for n in names:
                if n in self.bulk:
                    by_cls.setdefault(self.classes[n], []).append(n)
        return [f"XKV: {len(v)} layer(s) of class {cls} do not call vLLM's per-layer KV hooks "
                f"(e.g. {v[0]}): their restores complete before the forward, their saves run "
                "after it" for cls, v in sorted(by_cls.items())]

    def demote(self, layers: Iterable[str]) -> list[str]:
        """A planned per-layer fence did not come for ``layers``: fence them in bulk from now on;
        one warning per layer (the first time). Returns the layers newly demoted."""
        new = sorted(n for n in layers if n not in self.bulk)
        for n in new:
            self.bulk.add(n)
            log.warning(
                "xkv: layer %s (class %s) did not call wait_for_layer_load in a step that "
                "restored it: its forward may have read pages still being copied, so the "
                "step's restored blocks are reported as load errors (vLLM recomputes them); "
                "this layer's restores now complete before the forward", n, self.classes[n])
        if new:
            self._bulk_of = self._index()
        return new

    def missed_fences(self, handler: Any, loads: Iterable[Any],
                      layer_pos: Mapping[str, tuple[int, int]],
                      fanned: Iterable[str] = ()) -> list[Any]:
        """After the forward of a step with per-layer fenced loads: the load jobs (of
        ``loads``) whose group has a layer whose ``wait_for_layer_load`` did not come
        (``handler.pending_layers()``, plus ``fanned``: fan-out layers the caller already
        exchanged). For handler layers the compute stream first waits for every outstanding
        load (``handler.fence_loads()``); every such layer is demoted to bulk (warned once).
        Empty when every fence came (the common case: one host call, no GPU work)."""
        missed = handler.pending_layers()
        if missed:
            handler.fence_loads()
        missed = sorted({*missed, *fanned})
        if not missed:
            return []
        self.demote(missed)
        groups = {layer_pos[n][0] for n in missed if n in layer_pos}
        return [job for job in loads if any(gt.group in groups for gt in job.groups)]

    def note_bulk_saves(self, layers: Iterable[str]) -> None:
        """``layers`` were saved in ``wait_for_save`` because ``save_kv_layer`` did not come:
        warn once per layer class not already known to skip the hook."""
        miss = [n for n in layers if n not in self._declared]
        by_cls: dict[str, list[str]] = {}
        for n in miss:
            by_cls.setdefault(self.classes.get(n, UNKNOWN_CLASS), []).append(n)
        for cls, names in sorted(by_cls.items()):
            if cls in self._warned_saves:
                continue
            self._warned_saves.add(cls)
            log.warning(
                "xkv: layer(s) %s (class %s) did not call save_kv_layer: their pages are saved "
                "after the forward instead (wait_for_save)", ", ".join(names[:4]), cls)
