"""The CUDA transfer handler: :class:`~xkv.connector.transfer.TransferHandler` on a GPU.

Restores run on a load stream (one event per layer, so a layer's attention waits for its own
pages only), saves on a save stream ordered after the layer's compute; ``checksum_pass`` ``hbm``
hashes on a check stream, ``XKV_TAIL_ORDER=last`` issues a restore's tail on a tail stream
(``handler_settings``). The seam, its shapes and units, and the CPU handler: ``transfer.py``.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from xkv import kernels
from xkv.connector import graph_waits, handler_settings, light_steps
from xkv.connector import group_copies as copies
from xkv.connector.load_timing import LoadTiming
from xkv.connector.transfer import TransferHandler, page_verifier
from xkv.kernels.stream_reserve import StreamReserve

log = logging.getLogger("xkv.connector")


class CudaTransferHandler(TransferHandler):
    """Loads on a side stream with one event per layer; saves on a save stream.

    Loads are ordered after everything already queued on the compute stream (vLLM zeroes newly
    allocated blocks there before the forward, and a sync load must land after that).

    Index tensors stay on the host: a prepared step uploads them once through pinned memory on
    the stream its copies run on, so issuing never waits for the GPU (a device index tensor would
    be read back by validation, a synchronisation that serialised issue and copy).
    ``XKV_LOAD_ENGINE`` / ``XKV_SAVE_ENGINE`` pick the kernels' engine (default ``auto``).
    ``XKV_TIMING=1`` logs, per step with loads, an ``XKV_TIMING`` line (``load_timing``);
    ``2`` also dumps every thread's stack when a step's launches take over 100 ms.
    A light step (:meth:`set_light_step`) restores a group of one page size in halving layer
    groups (``light_steps``; ``XKV_LOAD_GROUPS=layer``: per layer as any other step, ``whole``:
    one group).
    """

    def __init__(self, device: torch.device, verify: bool = False):
        self.device = device
        self.light_step = False
        self.group_mode = light_steps.group_mode()  # "layer": light steps restore per layer too
        self.load_stream = torch.cuda.Stream(device=device)
        self.save_stream = torch.cuda.Stream(device=device)
        self.check_stream = torch.cuda.Stream(device=device)  # checksum_pass "hbm": the hashes
        self.tail_last = handler_settings.tail_order() == "last"
        self.tail_stream = torch.cuda.Stream(device=device)  # tail_last: the tail's copies
        self.load_engine = handler_settings.engine("XKV_LOAD_ENGINE")
        self.save_engine = handler_settings.engine("XKV_SAVE_ENGINE")
        self.verifier = page_verifier(verify)
        self._events: dict[str, torch.cuda.Event] = {}
        timing = os.environ.get("XKV_TIMING", "0")
        self._timing = LoadTiming(timing in ("1", "2"),
                                  lambda: torch.cuda.Event(enable_timing=True),
                                  watch=timing == "2", counters=self._sync_counts)
        self._preps: list = []  # this step's prepared loads (see load_group)
        self._graph: graph_waits.GraphWaits | None = None  # enable_graph_waits
        self._unordered: torch.cuda.Event | None = None  # fence_saves_deferred's, not yet waited
        self._reserve = StreamReserve()  # hold_stream_memory: the copy streams' device blocks

    def set_light_step(self, light: bool) -> None:
        self.light_step = light

    def _sync_counts(self) -> dict[str, int]:
        """``XKV_TIMING``'s implicit synchronisations so far (load_timing): the caching
        allocator's retries and ``cudaMalloc`` calls on this device (one memory-stats read),
        the pinned pool's allocations."""
        st = torch.cuda.memory_stats(self.device)
        return {"alloc_retries": int(st.get("num_alloc_retries", 0)),
                "device_allocs": int(st.get("num_device_alloc", 0)),
                "pinned_allocs": kernels.pinned.pool().allocations}

    def hold_stream_memory(self, large_bytes: int) -> None:
        """At the worker's start: device blocks held for the copy streams until the first copy
        step, when they go to those streams' caches (``kernels.stream_reserve``: no step calls
        ``cudaMalloc``, an implicit synchronisation between the copies and the forward). The load
        and save streams get ``large_bytes`` (a step that moves every block), the tail and check
        streams small blocks only."""
        self._reserve.hold([self.load_stream, self.save_stream], large_bytes)
        self._reserve.hold([self.tail_stream, self.check_stream], 0)

    def begin_loads(self) -> None:
        self._reserve.release()
        self.load_stream.wait_stream(torch.cuda.current_stream(self.device))
        self._timing.begin(self.load_stream)

    def load_group(self, names, card, offsets, pools, block_ids, checks=None):
        """Restore a group's ``L`` layers on the load stream (``offsets`` int64 ``[L, n]``, host):
        validated and planned once, every table in one upload, then per layer only a launch and
        its event, which :meth:`wait_layer` fences (no host work per layer: the fixed cost of a
        restore step). A light step of one page size: one launch and event per layer group.
        ``checks``: the flags' readback is queued on the load stream after the last launch;
        ``checksum_pass`` "hbm": each layer's hash runs on :attr:`check_stream` after its copy's
        event, the readback after the last hash, and the load stream waits for it; "end": one
        hash of every layer on the load stream after the last copy (the layers' events come
        before it: the forward never waits for the hash), then the readback."""
        self._reserve.release()  # async loads come here without begin_loads
        t0, groups = time.perf_counter(), None
        checked = checks is not None
        hashed = checked and self.checksum_pass == "hbm"
        if (self.light_step and self.group_mode != "layer" and not hashed
                and len({p.block_bytes for p in pools}) == 1):
            groups = light_steps.load_layer_groups(len(pools), self.group_mode)
        with torch.cuda.stream(self.load_stream):
            if self.verifier is not None:
                copies.record_loads(self.verifier, names, card, offsets, pools, block_ids, checks)
            # with groups, every layer of a group waits on the group's event
            prep = copies.prepare_group_restore(
                card, offsets, pools, block_ids, checks, engine=self.load_engine,
                checksum_pass=self.checksum_pass, layer_groups=groups)
            groups = groups or [[i] for i in range(len(pools))]
            t1 = time.perf_counter()
            self._timing.planned(t1 - t0, t0)
            longest = 0.0
            self._timing.watch()
            for g, idx in enumerate(groups):
                ta = time.perf_counter()
                prep.launch(g)
                longest = max(longest, time.perf_counter() - ta)
                if self._graph is not None:  # each layer's own persistent event (graph_waits)
                    for i in idx:
                        ev = self._events[names[i]] = self._graph.record(names[i],
                                                                         self.load_stream)
                else:
                    ev = torch.cuda.Event()
                    ev.record(self.load_stream)
                    for i in idx:
                        self._events[names[i]] = ev
                if hashed:  # layer g's hash beside layer g + 1's copy; the forward never waits
                    self.check_stream.wait_event(ev)
                    prep.launch_check(g, self.check_stream)
            if checked and self.checksum_pass == "end":
                prep.launch_checks()  # after every copy and its event, on the load stream
            t2 = time.perf_counter()
            self._timing.unwatch()
            self._timing.launched(t2 - t1, longest)
            if hashed:  # the flags after the last hash; whoever waits for loads waits for them
                with torch.cuda.stream(self.check_stream):
                    flags = copies.WordsReadback(prep, len(pools))
                self.load_stream.wait_stream(self.check_stream)
            else:
                flags = copies.WordsReadback(prep, len(pools)) if checked else None
            self._timing.read_back(time.perf_counter() - t2)
        self._preps.append(prep)  # tables and buffers referenced until sync_loads
        # the end of the copies (not of the step: sync_loads comes after the forward)
        self._timing.issued(int(block_ids.numel()) * sum(p.block_bytes for p in pools),
                            len(groups), self.load_stream, checked)
        return flags

    def load_before_forward(self, names, card, offsets, pools, block_ids) -> None:
        """One launch for every layer (per page size) on the load stream, then the compute
        stream waits for it (on the GPU) before the forward, so the forward's own KV of these
        blocks lands after the copy. A few blocks: the wait is short."""
        t0 = time.perf_counter()
        compute = torch.cuda.current_stream(self.device)
        stream = self.tail_stream if self.tail_last else self.load_stream
        if self.tail_last:  # after the compute stream's work so far, as begin_loads orders loads
            stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            if self.verifier is not None:
                self.verifier.record_tail(names, card, offsets, pools, block_ids)
            copies.restore_all(card, offsets, pools, block_ids, self.load_engine)
            ev = torch.cuda.Event()
            ev.record(stream)
        compute.wait_event(ev)
        if self.tail_last:  # load fences, sync_loads and the timing's end cover the tail too
            self.load_stream.wait_event(ev)
        if self.verifier is not None:
            self.verifier.check_tail(names)
        self._timing.tail(int(block_ids.numel()) * sum(p.block_bytes for p in pools),
                          time.perf_counter() - t0)

    def wait_layer(self, name: str) -> None:
        ev = self._events.pop(name, None)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def pending_layers(self) -> list[str]:
        """Layers whose per-layer event no :meth:`wait_layer` consumed this step (no GPU work)."""
        return list(self._events)

    def enable_graph_waits(self, names) -> bool:
        """One persistent external event per layer of ``names`` (``graph_waits``), recorded
        after that layer's copy in every restore; False where this torch has no external
        events."""
        if not graph_waits.supported():
            return False
        self._graph = graph_waits.GraphWaits(names, self.load_stream)
        return True

    def capture_wait(self, name: str) -> None:
        if self._graph is not None:
            self._graph.capture(name, torch.cuda.current_stream(self.device))

    def graph_waited(self) -> bool:
        if self._graph is None or not self._graph.covers(self._events):
            return False
        self._events.clear()
        return True

    def load_fence(self) -> torch.cuda.Event:
        """A CUDA event on the load stream after every load issued so far."""
        ev = torch.cuda.Event()
        ev.record(self.load_stream)
        return ev

    def fence_loads(self) -> None:
        """The compute stream waits (on the GPU) for every load issued so far: whatever is queued
        next (a recompute of blocks reported as load errors, the next forward) cannot be
        overwritten by a late copy."""
        torch.cuda.current_stream(self.device).wait_stream(self.load_stream)
        self._events.clear()

    def sync_loads(self) -> None:
        t0 = time.perf_counter()
        self.load_stream.synchronize()
        self._timing.synced(time.perf_counter() - t0)
        self._events.clear()
        self._preps.clear()
        line = self._timing.report()
        if line is not None:
            log.info("%s", line)
        if self.verifier is not None:
            self.verifier.check("restore")
            torch.cuda.current_stream(self.device).synchronize()

    def prepare_saves(self, pools, block_ids, card, offsets, checks=None):
        """A group's saves for one step (``offsets`` int64 ``[L, n]``, host): validated once,
        tables uploaded once on the save stream, where every :meth:`save_prepared` launches."""
        self._reserve.release()
        with torch.cuda.stream(self.save_stream):
            return copies.prepare_by_size(lambda ps, offs, ck: kernels.prepare_save(
                ps, block_ids, card, offs, engine=self.save_engine, checks=ck), pools, offsets,
                checks)

    def save_words(self, prep, num_layers: int) -> copies.WordsReadback:
        """Queued on the save stream, after every save issued so far."""
        with torch.cuda.stream(self.save_stream):
            return copies.WordsReadback(prep, num_layers)

    def save_prepared(self, prep, layer: int, name: str, pool, block_ids, card, offsets) -> None:
        """Save layer ``layer`` of ``prep``: the save stream waits for the compute stream (the
        layer's new pages were written there), then one launch."""
        self.save_stream.wait_stream(torch.cuda.current_stream(self.device))
        prep.launch(layer)  # on the save stream (prep.stream)
        if self.verifier is not None:
            self.verifier.record("save", card, offsets, pool, block_ids)

    def flush_saves(self) -> None:
        self.save_stream.synchronize()
        if self.verifier is not None:
            self.verifier.check("save")
            torch.cuda.current_stream(self.device).synchronize()

    def fence_saves(self) -> torch.cuda.Event | None:
        """A fence after every save issued so far, without blocking the host: an event on the
        save stream (blocking-sync, so a thread waiting on it sleeps rather than spins).

        The compute stream waits on it too (on the GPU, not the host): whatever vLLM queues next
        (zeroing a reallocated block, the next forward) must not overwrite pages the save stream
        is still reading, or a committed chunk could hold torn bytes. That wait costs the GPU only
        the save stream's tail past the last layer. With ``verify_restores`` the copies are
        waited for here and checked (debug path), and None is returned."""
        if self.verifier is not None:
            self.flush_saves()
            return None
        ev = torch.cuda.Event(blocking=True)
        ev.record(self.save_stream)
        torch.cuda.current_stream(self.device).wait_event(ev)
        self._unordered = None  # an earlier deferred fence is before this one on the save stream
        return ev

    def save_group(self, names, pools, block_ids, card, offsets, checks=None):
        """One launch per page size (:func:`group_copies.save_all`; with ``checks`` the words
        too, and its prepared copies returned) on the save stream, after the compute stream's
        work so far (the forward that wrote the pages)."""
        self._reserve.release()
        self.save_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.save_stream):
            prep = copies.save_all(pools, block_ids, card, offsets, self.save_engine, checks)
        if self.verifier is not None:
            for i, pool in enumerate(pools):
                self.verifier.record("save", card, offsets[i], pool, block_ids)
        return prep

    def fence_saves_deferred(self) -> torch.cuda.Event | None:
        """A blocking-sync event on the save stream, the compute stream NOT waiting on it yet: the
        copies overlap sampling and the next step's preparation until :meth:`order_after_saves`.
        ``verify_restores``: waited for and checked here (None)."""
        if self.verifier is not None:
            self.flush_saves()
            return None
        ev = torch.cuda.Event(blocking=True)
        ev.record(self.save_stream)
        self._unordered = ev
        return ev

    def order_after_saves(self) -> None:
        """The compute stream waits (on the GPU) for the last deferred fence, which covers every
        earlier save (one stream): a reallocated block's new KV cannot overtake its copy."""
        ev, self._unordered = self._unordered, None
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
