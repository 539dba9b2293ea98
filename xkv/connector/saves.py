"""The save path of a worker rank (:class:`Saver`) and the deferred COMMIT of a step's saves
(:class:`Committer`): publish a chunk only after its bytes are on the card, without blocking the
engine's host thread on the save stream.

Per step, ``Saver.save_layer`` copies the layer's pages of the reserved chunks to their slots
(``save_kv_layer``); ``Saver.wait_for_save`` first saves every layer whose hook did not come
this step (state layers, and attention classes that bypass vLLM's decorated op: the copies are
ordered after the step's compute, the forward is done), then decides commit or abort for every
chunk (a chunk with a layer still not written, or of a request whose restore was not fenced, is
aborted), fences the copies and hands the batch to the committer.

vLLM (0.26) calls ``wait_for_save`` after the forward and *before* it launches logits and sampling.
Blocking the host there on the save stream, then on a COMMIT round trip, lets the GPU run dry
(measured: ~7 ms per request on the H200). Instead the worker records, per step, one fence on the
save stream (a CUDA event; ``None`` from the CPU handler, whose copies already finished) and hands
the step's decisions (which keys of which group/shard to commit or abort) to a :class:`Committer`:

* fence ``None``: sent at once, inline (the CPU path stays synchronous, as the tests expect);
* otherwise: a daemon thread waits on the fence (a blocking-sync event: the thread sleeps, it
  does not spin or hold the GIL), then sends the batch: one COMMIT (and at most one ABORT) per
  group and shard for every job of the step, not one per request. Batches are sent in step order.

A fence that cannot be waited on (a CUDA error) turns its commits into aborts: bytes that may be
torn are never published. With ``verify_checksums`` the save copies also compute each object's
checksum words (``checksums.save_checks``; read back on the save stream before the fence) and
every COMMIT carries them. The gateway's write TTL stays the backstop for a process that dies with
reserved slots.

``save_mode`` (``Saver(mode=...)``):

* ``"layer"``: as above: per layer, as ``save_kv_layer`` comes (the first call of a group plans
  the step: ~0.25 ms of host time per layer on the H200's host, in the forward's critical path),
  and ``fence_saves`` makes the compute stream wait for the save stream before sampling;
* ``"step"``: ``save_kv_layer`` does nothing (no launch, no allocation, no lookup);
  ``wait_for_save`` saves every layer of every group at once (``TransferHandler.save_group``: one
  validation and one launch per page size, on the save stream after the compute stream's forward)
  and fences it with ``fence_saves_deferred``: the copies overlap sampling and the next steps.
  The compute stream waits for them at a later :meth:`Saver.bind` only when that step may write
  a block whose copy may still run (``StepMetadata.written_blocks``, the blocks of its scheduled
  requests, and the blocks its loads fill, meet the blocks of a fence not yet completed; unknown
  written blocks: always): a block freed and handed to another request is never overwritten
  before its copy ran, and a step that touches none of them does not wait. Only for models
  where nothing the runner runs before the bind writes KV pages: no recurrent-state group
  (their pages are rewritten in place, and vLLM zeroes new blocks of hybrid caches before the
  bind), no zeroing of new blocks (mixed-precision caches) and no copy-on-write of partial
  prefix hits (a group whose block size differs from the hash block size): ``setup.save_mode``
  falls back to ``"layer"`` elsewhere, saying why. A step whose ``wait_for_save`` never came is saved at the next bind (its forward
  is done; the next one has not started).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from xkv.connector.checksums import commit_words, save_checks, session_words
from xkv.connector.commits import Committer, SaveBatch  # noqa: F401 (re-exported)
from xkv.connector.metadata import StepMetadata
from xkv.connector.registry import Registry
from xkv.connector.session import GatewaySession, SessionOff
from xkv.connector.stats import ConnectorStats
from xkv.connector.transfer import TransferHandler, copy_table
from xkv.gateway.client import ChunkRef, GatewayError, GatewayUnavailable
from xkv.gateway.protocol import MAX_KEYS

log = logging.getLogger("xkv.connector")


def save_groups(registry: Registry, pool_names: Sequence[str], tp_rank: int,
                page_bytes: dict[str, int]) -> list[list[int]]:
    """The layer groups one save launch copies together with ``save_mode`` step (every layer of
    a cache group this rank writes, per page size: ``transfer.save_all``), as indices into
    ``pool_names`` (the warmup's order)."""
    at = {name: i for i, name in enumerate(pool_names)}
    out: list[list[int]] = []
    for plan in registry.groups:
        if not plan.writes(tp_rank):
            continue
        by_size: dict[int, list[int]] = {}
        for n in plan.group.layer_names:
            if n in at:
                by_size.setdefault(page_bytes[n], []).append(at[n])
        out += list(by_size.values())
    return out


class Saver:
    """Saves of one worker rank (see the module docstring).

    ``pools``/``layer_pos``: layer -> PagePool, layer -> (group, index in group) of the registered
    caches; ``handler``: the transfer handler; ``on_bulk_saves(names)``: told which non-state
    layers were saved in bulk (the worker's ``HookPlan.note_bulk_saves`` warns once). COMMIT/ABORT
    go through ``session``; their counters, counted on the committer thread, reach ``stats`` on
    the engine thread (:meth:`merge_counts`).
    """

    def __init__(self, registry: Registry, tp_rank: int, session: GatewaySession,
                 stats: ConnectorStats, handler: TransferHandler, *,
                 pools: Mapping[str, Any], layer_pos: Mapping[str, tuple[int, int]],
                 on_bulk_saves: Callable[[list[str]], None], mode: str = "layer"):
        if mode not in ("layer", "step"):
            raise ValueError(f"save mode {mode!r}: expected 'layer' or 'step'")
        if mode == "step" and any(p.is_state for p in registry.groups):
            raise ValueError("save mode 'step' with recurrent-state groups: their pages are "
                             "rewritten before the next step's bind (use 'layer')")
        self.mode = mode
        self.registry, self.tp_rank, self.session, self.stats = registry, tp_rank, session, stats
        self.handler, self.pools, self.layer_pos = handler, pools, layer_pos
        self.on_bulk_saves = on_bulk_saves
        self._meta: StepMetadata | None = None
        # the layers written this step per group (every job of a group is saved by one call);
        # the step whose saves were issued (step mode: are owed) and not yet fenced; whether
        # this step's wait_for_save ran (vLLM 0.33 calls it every step, and it must act once)
        self._saved: dict[int, set[int]] = {}
        self._unflushed: StepMetadata | None = None
        self._flushed = False
        # step mode: (fence, block ids it copies) of deferred fences the compute stream has not
        # been ordered after yet
        self._inflight: list[tuple[Any, frozenset[int]]] = []
        self._plan: dict[int, tuple] = {}  # group -> (jobs, block ids, [L, n] offsets, prepared)
        # checksummed groups of the step: group -> (columns, {id(transfer): its index})
        self._cols: dict[int, tuple] = {}
        self._committer = Committer(self._send, name=f"xkv-commit-{tp_rank}")
        self._counts: Counter = Counter()
        self._counts_lock = threading.Lock()
        # requests whose saves of this step are aborted (their forward read unfenced pages)
        self._tainted: set[str] = set()

    @property
    def pending(self) -> int:
        """Fenced batches not yet committed."""
        return self._committer.pending

    @property
    def has_unflushed(self) -> bool:
        """Saves were issued (step mode: are owed) in a step whose ``wait_for_save`` has not run
        yet."""
        return self._unflushed is not None

    def bind(self, meta: StepMetadata) -> None:
        if self._unflushed is not None:
            # saves of a step whose wait_for_save never came: issue (step mode), fence and
            # commit them now
            self._finish(self._unflushed)
        self._order_if_needed(meta)
        self._flushed = False
        self._meta = meta
        self._plan = {}
        self._cols = {}
        self._tainted = set()
        if self.mode == "step" and meta.saves:
            self._unflushed = meta

    def taint(self, req_ids: set[str]) -> None:
        """Abort this step's saves of ``req_ids`` (decided before ``wait_for_save`` flushes)."""
        self._tainted |= req_ids

    def save_layer(self, layer_name: str) -> None:
        """Copy ``layer_name``'s pages of this step's reserved chunks to their slots (step mode:
        nothing; ``wait_for_save`` copies every layer)."""
        if self.mode == "step":
            return
        meta, card = self._meta, self.session.card
        if meta is None or not meta.saves or self.session.turned_off or card is None:
            return
        pos = self.layer_pos.get(layer_name)
        if pos is None:
            return
        g, layer = pos
        plan = self.registry.groups[g]
        if not plan.writes(self.tp_rank) or meta.epoch != self.session.epoch:
            return
        t0 = time.perf_counter()
        if g not in self._plan:
            # once per group and step: every layer's offsets, validated and uploaded together
            transfers = [(job, gt) for job in meta.saves for gt in job.groups if gt.group == g]
            blocks, offs = copy_table(plan, self.tp_rank, [gt for _, gt in transfers])
            prep = None
            if transfers:
                pools = [self.pools[n] for n in plan.group.layer_names]
                checks = None
                if session_words(self.session).get(g):
                    checks, cols = save_checks([gt for _, gt in transfers])
                    self._cols[g] = (cols, {id(gt): t for t, (_, gt) in enumerate(transfers)})
                prep = self.handler.prepare_saves(pools, blocks, card, offs, checks=checks)
            self._plan[g] = ([job for job, _ in transfers], blocks, offs, prep)
        jobs, blocks, offs, prep = self._plan[g]
        if not jobs:
            return
        self.handler.save_prepared(prep, layer, layer_name, self.pools[layer_name], blocks, card,
                                   offs[layer])
        self._saved.setdefault(g, set()).add(layer)
        self._unflushed = meta
        self.stats.add("bytes_saved", len(blocks) * plan.group.bytes_of(layer))
        self.stats.add("seconds_saved", time.perf_counter() - t0)

    def wait_for_save(self) -> None:
        """Fence the step's saves and hand its commits over; never blocks on the save copies.

        Commits are sent once every layer's bytes are on the card: inline on the CPU handler,
        from the committer thread after the save stream's event on CUDA (vLLM 0.26 calls this
        before it launches logits and sampling, so a host wait here would idle the GPU)."""
        meta = self._meta
        if meta is None or not meta.saves or self._flushed:
            return
        self._flushed = True
        t0 = time.perf_counter()
        if self.mode == "step":
            self._finish(meta)
            self.stats.add("seconds_saved", time.perf_counter() - t0)
            return
        # Layers whose save_kv_layer did not come (state layers have no hook; some attention
        # classes bypass vLLM's decorated op): saved here, after the forward that wrote them;
        # the copies wait for the compute stream (save_prepared).
        for g, plan in enumerate(self.registry.groups):
            names = plan.group.layer_names
            done = self._saved.get(g, ())
            if len(done) == len(names) or not plan.writes(self.tp_rank):
                continue
            missing = [n for i, n in enumerate(names) if i not in done]
            for name in missing:
                self.save_layer(name)
            if not plan.is_state and self._saved.get(g):
                self.on_bulk_saves(missing)
        self._flush(meta)
        self.stats.add("seconds_saved", time.perf_counter() - t0)

    def clear(self) -> None:
        self._meta = None

    def _order_if_needed(self, meta: StepMetadata) -> None:
        """Step mode: make the compute stream wait for the deferred save copies if this step may
        write a block one of them still reads (see the module docstring)."""
        self._inflight = [(f, b) for f, b in self._inflight if not f.query()]
        if not self._inflight:
            return
        if meta.written_blocks is not None:
            writes = set(meta.written_blocks)
            for job in meta.loads + meta.async_loads:
                for gt in job.groups:
                    writes.update(gt.block_ids)
            if all(writes.isdisjoint(b) for _, b in self._inflight):
                return
        self.handler.order_after_saves()  # the last fence: every earlier copy too
        self._inflight = []

    def _finish(self, meta: StepMetadata) -> None:
        """Step mode: save every layer of ``meta``'s jobs, then fence and commit; layer mode:
        fence and commit what was saved."""
        if self.mode == "step":
            self._save_step(meta)
        self._flush(meta)

    def _save_step(self, meta: StepMetadata) -> None:
        """Step mode: every layer of every group this rank writes, in one ``save_group`` call per
        group (after the forward: the save stream waits for the compute stream). Nothing when the
        session is off, has no card or another gateway epoch (the chunks are then aborted)."""
        card = self.session.card
        if self.session.turned_off or card is None or meta.epoch != self.session.epoch:
            return
        for g, plan in enumerate(self.registry.groups):
            if not plan.writes(self.tp_rank):
                continue
            transfers = [gt for job in meta.saves for gt in job.groups if gt.group == g]
            if not transfers:
                continue
            blocks, offs = copy_table(plan, self.tp_rank, transfers)
            names = plan.group.layer_names
            pools = [self.pools[n] for n in names]
            if session_words(self.session).get(g):
                # verified saves: the checksum words come from the copies (one launch per page
                # size, after the forward; the words are read back in _flush)
                checks, cols = save_checks(transfers)
                self._cols[g] = (cols, {id(gt): t for t, gt in enumerate(transfers)})
                prep = self.handler.save_group(names, pools, blocks, card, offs, checks=checks)
                self._plan[g] = ([job for job in meta.saves], blocks, offs, prep)
            else:
                self.handler.save_group(names, pools, blocks, card, offs)
            self._saved[g] = set(range(len(names)))
            self.stats.add("bytes_saved",
                           len(blocks) * sum(plan.group.bytes_of(i) for i in range(len(names))))

    def _flush(self, meta: StepMetadata) -> None:
        """Decide commit/abort for every save job of ``meta`` (from the layers written), fence
        the copies and submit the batch. A chunk with a layer not written is aborted."""
        self._unflushed = None
        saved, self._saved = self._saved, {}
        words = {g: self._words_of(g, cols) for g, cols in self._cols.items()
                 if self._plan.get(g, (None,) * 4)[3] is not None}
        # None: the bytes are on the card already; step mode: the compute stream waits for the
        # copies only at a later bind that may overwrite one of their blocks (_order_if_needed)
        fence = (self.handler.fence_saves_deferred() if self.mode == "step"
                 else self.handler.fence_saves())
        if self.mode == "step" and fence is not None:
            self._inflight.append((fence, frozenset(
                b for job in meta.saves for gt in job.groups for b in gt.block_ids)))
        batch = SaveBatch()
        for job in meta.saves:
            for gt in job.groups:
                plan = self.registry.groups[gt.group]
                if not plan.writes(self.tp_rank):
                    continue
                keys = list(gt.chunks)  # COMMIT/ABORT present each one's token
                complete = len(saved.get(gt.group, ())) == len(plan.group.layer_names)
                if not complete and keys:
                    # Still a layer not written (the session turned off mid-step, or the step's
                    # wait_for_save never came): committing would publish unwritten bytes.
                    log.debug("xkv: request %s group %d: not every layer was saved this step; "
                              "aborting %d chunk(s)", job.req_id, gt.group, len(keys))
                if job.req_id in self._tainted:
                    complete = False
                w = words.get(gt.group)
                batch.add(gt.group, plan.shard_of(self.tp_rank), complete, keys, job.req_id,
                          None if w is None else (lambda w=w, gt=gt: w(gt)))
        self._committer.submit(fence, batch)

    def _words_of(self, g: int, cols_of: tuple) -> Callable[[Any], list[bytes]]:
        """Group ``g``'s save words, read back after the step's launches: ``f(transfer)`` gives
        that transfer's chunks' COMMIT bytes (valid once the save fence passed)."""
        cols, index = cols_of
        rb = self.handler.save_words(self._plan[g][3], len(self.registry.groups[g].group
                                                            .layer_names))
        host: list = []

        def of(gt) -> list[bytes]:
            if not host:
                host.append(rb.get())
            return commit_words(host[0], cols, index[id(gt)], len(gt.chunks))

        return of

    def _send(self, batch: SaveBatch) -> None:
        """COMMIT (or ABORT) every key of ``batch``: one message per group, shard and kind (split
        at the protocol's key limit). Runs on the committer thread on CUDA."""
        for (g, shard, ok), jobs in batch.items.items():
            keys = [k for ks, _, _ in jobs for k in ks]
            reqs = ",".join(sorted({r for _, r, _ in jobs}))
            sums = None
            if ok and jobs and all(w is not None for _, _, w in jobs):
                sums = [b for _, _, w in jobs for b in w()]
            for i in range(0, len(keys), MAX_KEYS):
                self._send_one(g, shard, ok, keys[i:i + MAX_KEYS], reqs,
                               None if sums is None else sums[i:i + MAX_KEYS])

    def _send_one(self, g: int, shard: int, ok: bool, keys: list[ChunkRef], reqs: str,
                  sums: list[bytes] | None = None) -> None:
        what = f"{'COMMIT' if ok else 'ABORT'} for request(s) {reqs}"
        lids = self.session.layout_ids  # () if the session never opened: call() raises first
        try:
            if ok:
                kw = {} if sums is None else {"checksums": sums}
                self.session.call(what, lambda c: c.commit(lids[g], shard, keys, **kw))
                self._count("chunks_saved", len(keys))
            else:
                self.session.call(what, lambda c: c.abort(lids[g], shard, keys))
                self._count("save_errors", len(keys))
        except SessionOff:
            self._count("save_errors", len(keys))
        except GatewayUnavailable:  # counted (and maybe turned off) by the session
            self._count("save_errors", len(keys))
            self._count("gateway_errors")
        except GatewayError as e:
            self._count("save_errors", len(keys))
            self._count("gateway_errors")
            log.warning("xkv: %s refused: %s", what, e)
        except ValueError as e:  # the client refused before sending (e.g. checksum words)
            self._count("save_errors", len(keys))
            log.warning("xkv: %s not sent: %s", what, e)

    def _count(self, name: str, value: float = 1) -> None:
        with self._counts_lock:
            self._counts[name] += value

    def merge_counts(self) -> None:
        """Move the committer thread's counters into ``stats`` (engine thread)."""
        with self._counts_lock:
            counts, self._counts = self._counts, Counter()
        for name, value in counts.items():
            self.stats.add(name, value)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every fenced batch was committed (tests, shutdown); False on timeout."""
        ok = self._committer.drain(timeout_s)
        self.merge_counts()
        return ok

    def wait_committed(self, timeout_s: float | None = None) -> bool:
        """:meth:`drain` without moving the counters (any thread: the worker's background
        release waits here before it lets go of the card)."""
        return self._committer.drain(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Fence and send what is left; commits waiting on their fence go out before the
        session closes."""
        if self._unflushed is not None:
            self._finish(self._unflushed)
        self._committer.close(timeout_s=timeout_s)
        self.merge_counts()
