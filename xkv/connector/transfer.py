"""The transfer seam: how the worker issues page copies between the paged cache and the card.

``SyncTransferHandler`` (CPU tensors, vLLM's CPU engine, tests) runs ``xkv.kernels`` inline — on
CPU the kernels run their torch reference. ``CudaTransferHandler`` issues the same calls on a
load stream (one event per layer, so a layer's attention waits for its own pages only) and a save
stream ordered after the layer's compute. Both have the same methods; the worker never touches
streams itself.

Shapes and units: ``card`` is a uint8 1-D tensor (the whole card); ``offsets`` int64 [n] byte
offsets into it; ``pool`` an ``xkv.layout.PagePool``; ``block_ids`` int64 [n].
"""

from __future__ import annotations

import torch

from xkv import kernels


class SyncTransferHandler:
    """Copies run inline, in call order; every method returns once the bytes moved."""

    def begin_loads(self) -> None:
        return None

    def load_layer(self, name: str, card, offsets, pool, block_ids) -> None:
        kernels.restore(card, offsets, pool, block_ids)

    def wait_layer(self, name: str) -> None:
        return None

    def sync_loads(self) -> None:
        return None

    def save_layer(self, name: str, pool, block_ids, card, offsets) -> None:
        kernels.save(pool, block_ids, card, offsets)

    def flush_saves(self) -> None:
        return None


class CudaTransferHandler:
    """Loads on a side stream with one event per layer; saves on a save stream.

    Loads are ordered after everything already queued on the compute stream (vLLM zeroes newly
    allocated blocks there before the forward, and a sync load must land after that).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.load_stream = torch.cuda.Stream(device=device)
        self.save_stream = torch.cuda.Stream(device=device)
        self._events: dict[str, torch.cuda.Event] = {}
        # index tensors kept alive until the copies reading them finished
        self._keep: dict[str, list[torch.Tensor]] = {"load": [], "save": []}

    def _dev(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        d = t.to(self.device, non_blocking=True)
        self._keep[kind].append(d)
        return d

    def begin_loads(self) -> None:
        self.load_stream.wait_stream(torch.cuda.current_stream(self.device))

    def load_layer(self, name: str, card, offsets, pool, block_ids) -> None:
        with torch.cuda.stream(self.load_stream):
            kernels.restore(card, self._dev(offsets, "load"), pool, self._dev(block_ids, "load"))
            ev = torch.cuda.Event()
            ev.record(self.load_stream)
        self._events[name] = ev

    def wait_layer(self, name: str) -> None:
        ev = self._events.pop(name, None)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def sync_loads(self) -> None:
        self.load_stream.synchronize()
        self._events.clear()
        self._keep["load"].clear()

    def save_layer(self, name: str, pool, block_ids, card, offsets) -> None:
        # The layer's new pages were written by work queued on the compute stream.
        self.save_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.save_stream):
            kernels.save(pool, self._dev(block_ids, "save"), card, self._dev(offsets, "save"))

    def flush_saves(self) -> None:
        self.save_stream.synchronize()
        self._keep["save"].clear()
