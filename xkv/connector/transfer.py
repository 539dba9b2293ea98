"""The transfer seam: how the worker issues page copies between the paged cache and the card.

Both handlers take a cache group's copies of one step at once, as ``xkv.kernels`` prepared steps
(validated and uploaded once, then one launch per layer): ``load_group`` for restores,
``load_before_forward`` for a restore's blocks the step's forward also writes (landed before the
forward: ``loads.load_transfers``' ``fence_tail``), ``prepare_saves`` + ``save_prepared`` (per layer, as vLLM's ``save_kv_layer`` comes) for saves;
``save_mode`` step: ``save_group`` + ``fence_saves_deferred``, ``order_after_saves`` at the next
bind (``saves`` module docstring).
``SyncTransferHandler`` (CPU tensors, vLLM's CPU engine, tests) runs them inline — on CPU the
kernels run their torch engine. ``cuda_transfer.CudaTransferHandler`` runs them on a load stream
(one event per layer, so a layer's attention waits for its own pages only) and a save stream
ordered after the layer's compute. Both implement :class:`TransferHandler` (the interface every caller, test fake
and the bench's checking wrapper is written against; no attribute is probed); the worker never
touches streams itself.
``pending_layers`` (layers whose per-layer fence no ``wait_layer`` consumed this step) and
``fence_loads`` (whatever runs next waits for every load) serve the worker's safety net for a
``wait_for_layer_load`` that never came (``xkv.connector.fences``). A group whose layers differ
in page size is prepared per size (the kernels take layers of one block size together).

Shapes and units: ``card`` is a uint8 1-D tensor (the whole card); ``offsets`` int64 [L, n] byte
offsets into it (host; row ``l`` for layer ``l``, see :func:`layer_offsets`); ``pools`` the
layers' ``xkv.layout.PagePool``; ``block_ids`` int64 [n] (host), the same for every layer.

Checksums (``verify_checksums``, ``xkv.connector.checksums``): ``load_group(..., checks=)`` takes a
group's kernels ``Checks`` (expected words, hash-only fragments with block id -1) and returns a
:class:`WordsReadback` whose ``get()`` gives the objects that did not match once the loads landed
(after ``sync_loads``, or once ``load_fence`` completed); ``prepare_saves(..., checks=)`` computes
the words while saving and :meth:`TransferHandler.save_words` queues their copy to the host before
the step's save fence. Both queue the small readback on the copies' own stream: no host wait.

Debug (``verify_restores``): a :class:`~xkv.connector.page_verify.PageVerifier` poisons the destination pages of every load
before the copy, then, once the copies finished, compares each restored (and each saved) block of
every layer with the card bytes it came from (went to), byte for byte, and logs the counts as
``XKV_VERIFY`` lines. It reads pages with plain torch indexing, not with the kernels under test.
"""

from __future__ import annotations

import abc
from typing import Any

from xkv import kernels
from xkv.connector.copy_tables import copy_table, layer_offsets  # noqa: F401 (re-exported)
from xkv.connector.group_copies import (
    CHECKSUM_PASSES,
    WordsReadback,
    prepare_by_size,
    prepare_group_restore,
    record_loads,
    restore_all,
    save_all,
)
from xkv.connector.page_verify import PageVerifier


def page_verifier(verify: bool) -> PageVerifier | None:
    """The ``verify_restores`` debug check of a handler (None when off)."""
    return PageVerifier() if verify else None


class TransferHandler(abc.ABC):
    """How a worker rank moves pages between its paged cache and the card (shapes and units:
    the module docstring). Loads: ``begin_loads`` once per batch, ``load_group`` per group,
    ``wait_layer`` per layer (the forward reads it next), ``sync_loads`` when the batch must have
    landed; ``load_fence`` marks everything issued so far (None: it already landed). Saves:
    ``prepare_saves`` once per group and step, ``save_prepared`` per layer, ``fence_saves`` once
    per step (the commit waits on what it returns; None: the bytes are on the card).
    ``verifier``: the ``verify_restores`` debug check (None when off)."""

    verifier: PageVerifier | None = None
    checksum_pass: str = "copy"  # verified restores: hashed in the copy, or after it in HBM
    #: ``loads.load_transfers`` issues a group's before-forward tail after its layers' copy (the
    #: handler copies the tail on a stream of its own, so the main copy starts without waiting
    #: for the tail's host work), not before it
    tail_last: bool = False

    def set_checksum_pass(self, mode: str) -> None:
        """``checksum_pass`` (``group_copies.CHECKSUM_PASSES``) for verified restores."""
        if mode not in CHECKSUM_PASSES:
            raise ValueError(f"checksum_pass={mode!r}: expected one of {CHECKSUM_PASSES}")
        self.checksum_pass = mode

    def hold_stream_memory(self, large_bytes: int) -> None:
        """At the worker's start, after warmup: reserve the device memory a copy step's tables,
        words and flags need (``large_bytes`` for a step that moves every block) so that no step
        allocates it; a handler without streams of its own has nothing to reserve."""
        return None

    @abc.abstractmethod
    def set_light_step(self, light: bool) -> None:
        """Before a step's :meth:`begin_loads`: whether the step computes few tokens
        (``light_steps.is_light``), so its forward cannot hide the copies: a handler may then
        restore in a few large launches (``light_steps.load_layer_groups``)."""

    @abc.abstractmethod
    def begin_loads(self) -> None:
        """A batch of loads follows: order it after the compute stream's work so far."""

    @abc.abstractmethod
    def load_group(self, names, card, offsets, pools, block_ids,
                   checks=None) -> WordsReadback | None:
        """Restore a group's ``L`` layers: ``offsets`` int64 ``[L, n]`` (host), ``pools[l]``
        is layer ``names[l]``, ``block_ids`` int64 ``[n]`` (host). ``checks`` (kernels
        ``Checks``): verify while copying; returns the mismatch flags' readback (else None)."""

    @abc.abstractmethod
    def load_before_forward(self, names, card, offsets, pools, block_ids) -> None:
        """:meth:`load_group` for blocks the step's forward also writes (``GroupTransfer.tail``):
        every layer's copy lands before the forward starts (vLLM writes a layer's new KV before
        its ``wait_for_layer_load``), no per-layer fence; ``verify_restores`` checks them at
        once."""

    @abc.abstractmethod
    def wait_layer(self, name: str) -> None:
        """What runs next on the compute stream waits for layer ``name``'s loads."""

    @abc.abstractmethod
    def pending_layers(self) -> list[str]:
        """Layers loaded this step whose :meth:`wait_layer` has not come."""

    @abc.abstractmethod
    def fence_loads(self) -> None:
        """Whatever runs next waits for every load issued (no host wait)."""

    @abc.abstractmethod
    def sync_loads(self) -> None:
        """Block until every load issued landed (then the verifier checks them)."""

    def load_fence(self) -> Any:
        """A marker after every load issued so far (``query()``/``synchronize()``), or None
        when they already landed (copies run inline)."""
        return None

    # Full CUDA graphs (``graph_waits``): per-layer waits captured into the graphs. A handler
    # without graphs has none, and a full-graph step's loads are then fenced before the forward.

    def enable_graph_waits(self, names) -> bool:
        """Keep a persistent per-layer event for ``names`` that a captured full graph can wait
        on; False: this handler cannot (no CUDA graphs here)."""
        return False

    def capture_wait(self, name: str) -> None:
        """While a full graph is captured: the capturing stream waits on layer ``name``'s
        persistent event (:meth:`enable_graph_waits`)."""
        return None

    def graph_waited(self) -> bool:
        """Before a full graph's replay with loads: True when the captured graphs wait for
        every layer loaded this step and not yet waited for (they are then consumed: the graph
        is their fence); False: the caller must fence them."""
        return False

    def verify_layers(self, names) -> None:
        """``verify_restores``: compare these (waited-for) layers' restored pages now, before
        the forward may change them (a Mamba ``align`` running block)."""
        if self.verifier is not None:
            self.verifier.check("restore", set(names))

    @abc.abstractmethod
    def prepare_saves(self, pools, block_ids, card, offsets, checks=None) -> Any:
        """A group's saves for one step, validated once: ``offsets`` int64 ``[L, n]`` (host);
        ``checks`` (kernels ``Checks``): compute the checksum words while saving."""

    def save_words(self, prep, num_layers: int) -> WordsReadback:
        """Queue the host copy of a checksummed save's words after its launches (call once
        every layer of ``prep`` was issued, before :meth:`fence_saves`)."""
        return WordsReadback(prep, num_layers)

    @abc.abstractmethod
    def save_prepared(self, prep, layer: int, name: str, pool, block_ids, card, offsets) -> None:
        """Save layer ``layer`` of ``prep`` (its pool ``pool``, card offsets ``offsets`` [n])."""

    @abc.abstractmethod
    def flush_saves(self) -> None:
        """Block until every save issued landed (then the verifier checks them)."""

    @abc.abstractmethod
    def fence_saves(self) -> Any:
        """A fence after every save issued (``synchronize()``), or None: already on the card.
        What runs next on the compute stream is ordered after those saves."""

    def save_group(self, names, pools, block_ids, card, offsets, checks=None) -> Any:
        """``save_mode`` step: every layer of a group at once, after the forward (``offsets``
        int64 ``[L, n]``, host; ``pools[l]`` is ``names[l]``); ``checks`` (kernels ``Checks``):
        the copies also compute the checksum words, and the prepared copies are returned for
        :meth:`save_words` (None without ``checks``). Default: per layer through
        :meth:`save_prepared` (what wrappers see); the real handlers: one launch per page size."""
        prep = self.prepare_saves(pools, block_ids, card, offsets, checks=checks)
        for i, (name, pool) in enumerate(zip(names, pools, strict=True)):
            self.save_prepared(prep, i, name, pool, block_ids, card, offsets[i])
        return prep if checks is not None else None

    def fence_saves_deferred(self) -> Any:
        """:meth:`fence_saves`, the compute stream not yet ordered after the saves: the caller
        calls :meth:`order_after_saves` before anything may overwrite the pages (step mode: at
        the next bind). Default: ordered at once (correct, no overlap)."""
        return self.fence_saves()

    def order_after_saves(self) -> None:
        """The compute stream waits (on the GPU) for every save :meth:`fence_saves_deferred`
        fenced; nothing to do for inline copies."""
        return None


class SyncTransferHandler(TransferHandler):
    """Copies run inline, in call order; every method returns once the bytes moved."""

    def __init__(self, verify: bool = False) -> None:
        self.verifier = page_verifier(verify)
        self.light_step = False
        self._pending: set[str] = set()  # layers loaded this step, not yet waited for

    def set_light_step(self, light: bool) -> None:
        """Kept (tests read it); inline copies have no launches or fences to save."""
        self.light_step = light

    def begin_loads(self) -> None:
        return None

    def load_group(self, names, card, offsets, pools, block_ids, checks=None):
        """Restore a group's ``L`` layers: ``offsets`` int64 ``[L, n]`` (host), ``pools[l]`` is
        layer ``names[l]``; validated once (:func:`xkv.kernels.prepare_restore`)."""
        if self.verifier is not None:
            record_loads(self.verifier, names, card, offsets, pools, block_ids, checks)
        hashed = checks is not None and self.checksum_pass == "hbm"
        prep = prepare_group_restore(card, offsets, pools, block_ids, checks,
                                     checksum_pass=self.checksum_pass)
        for i in range(len(pools)):
            prep.launch(i)
            if hashed:
                prep.launch_check(i)
        if checks is not None and self.checksum_pass == "end":
            prep.launch_checks()
        self._pending.update(names)
        return WordsReadback(prep, len(pools)) if checks is not None else None

    def load_before_forward(self, names, card, offsets, pools, block_ids) -> None:
        """Inline, like every copy here; verified at once."""
        if self.verifier is not None:
            self.verifier.record_tail(names, card, offsets, pools, block_ids)
        restore_all(card, offsets, pools, block_ids, "auto")
        if self.verifier is not None:
            self.verifier.check_tail(names)

    def wait_layer(self, name: str) -> None:
        self._pending.discard(name)

    def pending_layers(self) -> list[str]:
        """Layers loaded this step whose :meth:`wait_layer` has not come (their copies already
        finished here: the CPU copies run inline)."""
        return sorted(self._pending)

    def fence_loads(self) -> None:
        """Order what runs next after every load issued (inline copies: nothing to wait for)."""
        self._pending.clear()

    def sync_loads(self) -> None:
        self._pending.clear()
        if self.verifier is not None:
            self.verifier.check("restore")

    def prepare_saves(self, pools, block_ids, card, offsets, checks=None):
        """A group's saves for one step, validated once: ``offsets`` int64 ``[L, n]`` (host)."""
        return prepare_by_size(lambda ps, offs, ck: kernels.prepare_save(ps, block_ids, card, offs,
                                                                  checks=ck),
                        pools, offsets, checks)

    def save_prepared(self, prep, layer: int, name: str, pool, block_ids, card, offsets) -> None:
        """Layer ``layer`` of ``prep`` (its pool ``pool``, card offsets ``offsets`` [n])."""
        prep.launch(layer)
        if self.verifier is not None:
            self.verifier.record("save", card, offsets, pool, block_ids)

    def flush_saves(self) -> None:
        if self.verifier is not None:
            self.verifier.check("save")

    def fence_saves(self) -> None:
        """The copies ran inline: nothing to wait for (None), the caller commits at once."""
        self.flush_saves()

    def save_group(self, names, pools, block_ids, card, offsets, checks=None):
        """Every layer inline, one call per page size (:func:`save_all`; with ``checks`` the
        words too, and its prepared copies returned)."""
        prep = save_all(pools, block_ids, card, offsets, "auto", checks)
        if self.verifier is not None:
            for i, pool in enumerate(pools):
                self.verifier.record("save", card, offsets[i], pool, block_ids)
        return prep
