"""Scheduler side: lookups, load plans, save reservations, leases. No vLLM types, no tensors.

One request's life (see docs/architecture.md):

1. ``get_num_new_matched_tokens`` — chunk keys from ``request.block_hashes``; one LOOKUP (leased)
   for the chunks past the local hit; answer the tokens of the stored prefix, at most
   ``num_tokens - 1 - num_computed_tokens`` (a synchronous full hit crashes vLLM's scheduler).
   vLLM may ask several times: the answer is cached per (request, local hit), so a repeated
   question sends no message and takes no second lease.
2. ``update_state_after_alloc`` — turn the promised tokens into a load job (block ids per group,
   chunk slot offsets); release the lease at once if nothing is loaded.
3. ``build_connector_meta`` — the step's loads, plus saves: prompt chunks that become complete in
   this step are reserved on the gateway (first writer wins) and handed to workers.
4. Workers report finished loads (``update_connector_output``); the lease is released once every
   rank finished, and in any case when the request finishes.

Failure: ``MAX_FAILURES`` consecutive ``GatewayUnavailable`` (dead, restarted, or deadlines
missed; a single slow answer only costs that request its hit) turn the connector off for good: zero hits, no
saves, and ``StepMetadata.turned_off`` tells every worker to turn off too.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from xkv.connector.config import ConnectorConfig
from xkv.connector.keys import chunk_keys, event_fields
from xkv.connector.metadata import (
    ChunkRef,
    GroupTransfer,
    StepMetadata,
    TransferJob,
    WorkerReport,
)
from xkv.connector.registry import Registry
from xkv.connector.states import add_running_blocks, probe_states, saved_boundary, state_load
from xkv.connector.stats import ConnectorStats
from xkv.gateway.client import GatewayError, GatewayUnavailable

log = logging.getLogger("xkv.connector")

#: Consecutive failed gateway calls (no reply within the deadline, dead, restarted) after which a
#: process stops using the external cache until vLLM and the gateway are restarted together.
MAX_FAILURES = 3


def request_opted_out(request: Any) -> bool:
    """``kv_transfer_params: {"xkv_store": false}`` keeps a request off the card entirely.

    Anything but an absent key or ``True`` counts as opting out: an unexpected value can only
    reduce caching, never widen it.
    """
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or "xkv_store" not in params:
        return False
    return params["xkv_store"] is not True


@dataclass
class _Lookup:
    """A LOOKUP answer, reused while vLLM asks the same question again."""

    local: int  # tokens vLLM already had (block aligned)
    num_hashes: int
    start: int  # first chunk looked up
    hits: int  # chunks present from `start`
    ext: int  # tokens promised
    lease_id: int | None
    slots: dict[int, list[Any]]  # {cache group: [chunk - start] -> ChunkSlots}
    keys: list[bytes]
    state_lease_id: int | None = None  # state groups: the lease of the hit boundary's state
    state_slots: dict[int, Any] = field(default_factory=dict)  # {state group: ChunkSlots}

    def leases(self) -> list[int]:
        return [x for x in (self.lease_id, self.state_lease_id) if x is not None]


@dataclass
class _ReqState:
    request: Any
    block_ids: list[list[int]]
    next_save_chunk: int = 0
    present: set[int] = field(default_factory=set)  # chunks the gateway reported stored
    lease_ids: set[int] = field(default_factory=set)


class SchedulerSide:
    """The scheduler-role half of FusIOnXConnector (one per engine)."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        registry: Registry,
        fingerprints: Sequence[str],
        *,
        hash_block_size: int,
        world_size: int,
        gateway_factory: Callable[[], Any],
        load: bool = True,
        save: bool = True,
    ):
        self.cfg = cfg
        self.load, self.save = load, save  # kv_role: consumer loads only, producer saves only
        self.registry = registry
        self.chunk_size = registry.groups[0].chunk_size
        self._attn = [g for g, p in enumerate(registry.groups) if not p.is_state]
        self._block_size = registry.groups[0].group.block_size  # one size for all groups (façade)
        self._state = [g for g, p in enumerate(registry.groups) if p.is_state]
        if self.chunk_size % hash_block_size:
            raise ValueError(
                f"chunk_size={self.chunk_size} is not a multiple of vLLM's hash block size "
                f"{hash_block_size}"
            )
        self.hashes_per_chunk = self.chunk_size // hash_block_size
        self.world_size = world_size
        self.stats = ConnectorStats()
        self.turned_off = False
        self._failures = 0  # consecutive GatewayUnavailable
        self._lookups: dict[str, _Lookup] = {}
        self._states: dict[str, _ReqState] = {}
        self._pending_loads: list[TransferJob] = []
        self._load_leases: dict[int, tuple[str, list[int]]] = {}  # job -> (req id, leases)
        self._loads_done: Counter = Counter()
        self._next_job = 1
        self.gw = None
        self.layout_ids: tuple[int, ...] = ()
        self.epoch = 0
        try:
            self.gw = gateway_factory()
            infos = [
                self.gw.register_layout(cfg.key_namespace, fp, p.num_shards, p.registered_bytes)
                for p, fp in zip(registry.groups, fingerprints, strict=True)
            ]
            self.layout_ids = tuple(i.layout_id for i in infos)
            self.epoch = infos[0].epoch
        except GatewayError as e:  # dead, or refused our layout (e.g. larger than the card)
            self._turn_off(f"unusable at start: {e}")

    # ------------------------------------------------------------------ lookups

    def _eligible(self, request: Any) -> bool:
        if self.turned_off or request_opted_out(request):
            return False
        # require_cache_salt: an unsalted request never reaches the gateway (no message at all).
        return bool(getattr(request, "cache_salt", None)) or not self.cfg.require_cache_salt

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens loadable past ``num_computed_tokens`` (block-aligned local hit)."""
        if (
            not self.load
            or not self._eligible(request)
            or getattr(request, "skip_reading_prefix_cache", False)
        ):
            return 0
        req_id = request.request_id
        num_hashes = len(request.block_hashes)
        cached = self._lookups.get(req_id)
        if cached and cached.local == num_computed_tokens and cached.num_hashes == num_hashes:
            return cached.ext
        if cached:
            self._drop_lookup(req_id)
        stop = num_hashes // self.hashes_per_chunk
        if self._state:
            # a state is stored at chunk ends only: a hit must end on a chunk vLLM will not compute
            stop = min(stop, (request.num_tokens - 1) // self.chunk_size)
        start = num_computed_tokens // self.chunk_size
        if stop <= start:
            return 0
        keys = chunk_keys(request.block_hashes, self.hashes_per_chunk, start, stop)
        lease = state_lease = None
        try:
            res = self.gw.lookup(
                [(self.layout_ids[g], keys) for g in self._attn],
                lease=True,
                timeout_s=self.cfg.lookup_timeout_ms / 1000,
            )
            lease = res.lease_id or None  # the gateway answers 0 when it took no lease
            hits = min(res.num_chunks, stop - start)
            state_slots: dict[int, Any] = {}
            if self._state and hits:
                hits, state_lease, state_slots = probe_states(
                    self.gw, [self.layout_ids[g] for g in self._state], self._state, keys,
                    hits, self.cfg.lookup_timeout_ms / 1000)
        except GatewayUnavailable as e:
            self._release_all(lease, state_lease)
            self._unavailable(f"LOOKUP failed: {e}")
            return 0
        except GatewayError as e:
            self._release_all(lease, state_lease)
            self.stats.add("gateway_errors")
            log.warning("xkv: LOOKUP refused for request %s: %s", req_id, e)
            return 0
        self._failures = 0
        self.stats.add("lookups")
        ext = max(0, (start + hits) * self.chunk_size - num_computed_tokens)
        # vLLM computes at least the last token: when the stored prefix reaches it, restore every
        # whole block before it (block granularity inside the last stored chunk), not a chunk less
        last_block = (request.num_tokens - 1) // self._block_size * self._block_size
        ext = min(ext, max(0, last_block - num_computed_tokens))
        if self.registry.multi_group and ext and (
            lease is None or (self._state and state_lease is None)
            or (self._state and num_computed_tokens + ext != (start + hits) * self.chunk_size)
        ):
            # Decision 6: vLLM <= 0.29 cannot take a block load error for a hybrid model, so a
            # hit is promised only when every byte of it is leased (and, with states, when it
            # ends exactly on the stored state's boundary).
            ext = 0
        if ext == 0:
            self._release_all(lease, state_lease)
            lease = state_lease = None
        self.stats.add("lookup_chunks_hit", hits)
        self._lookups[req_id] = _Lookup(
            local=num_computed_tokens,
            num_hashes=num_hashes,
            start=start,
            hits=hits,
            ext=ext,
            lease_id=lease,
            slots={g: list(res.slots[i]) for i, g in enumerate(self._attn)},
            keys=keys,
            state_lease_id=state_lease,
            state_slots=state_slots,
        )
        return ext

    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """After vLLM allocated the request's blocks (all groups); plan the load if any."""
        req_id = request.request_id
        lk = self._lookups.pop(req_id, None)
        old = self._states.pop(req_id, None)
        if old:  # re-admitted after preemption: its earlier leases are useless now
            for lease in old.lease_ids:
                self._release(lease)
        st = _ReqState(request=request, block_ids=[list(b) for b in block_ids])
        self._states[req_id] = st
        if lk is not None:
            st.present.update(range(lk.start, lk.start + lk.hits))
        if num_external_tokens == 0:
            if lk is not None:
                self._release_all(*lk.leases())
            return
        if lk is None or lk.ext != num_external_tokens:
            # vLLM never admits external tokens we did not offer; refusing beats loading garbage.
            raise RuntimeError(
                f"xkv: request {req_id} admitted with {num_external_tokens} external tokens but "
                f"the connector offered {lk.ext if lk else 'none'}"
            )
        groups = []
        for g, plan in enumerate(self.registry.groups):
            bs, k = plan.group.block_size, plan.blocks_per_chunk
            ids = st.block_ids[plan.group.index]
            if plan.is_state:
                c = lk.start + lk.hits - 1
                cs = lk.state_slots[g]
                ref = ChunkRef(lk.keys[c - lk.start], tuple(cs.offsets), tuple(cs.generations))
                groups.append(state_load(g, ids, lk.local + num_external_tokens, bs, ref, req_id))
                continue
            first, last = lk.local // bs, (lk.local + num_external_tokens) // bs
            if last > len(ids):
                raise RuntimeError(
                    f"xkv: request {req_id} group {g}: {len(ids)} blocks allocated, "
                    f"{last} needed for {lk.local + num_external_tokens} tokens"
                )
            chunks_used = sorted({i // k for i in range(first, last)})
            index = {c: n for n, c in enumerate(chunks_used)}
            refs = tuple(
                ChunkRef(
                    key=lk.keys[c - lk.start],
                    offsets=tuple(lk.slots[g][c - lk.start].offsets),
                    generations=tuple(lk.slots[g][c - lk.start].generations),
                )
                for c in chunks_used
            )
            groups.append(
                GroupTransfer(
                    group=g,
                    block_ids=tuple(ids[first:last]),
                    chunk_of=tuple(index[i // k] for i in range(first, last)),
                    block_in_chunk=tuple(i % k for i in range(first, last)),
                    chunks=refs,
                )
            )
        job = TransferJob(self._job_id(), req_id, tuple(groups), num_external_tokens)
        self._pending_loads.append(job)
        if lk.leases():
            st.lease_ids.update(lk.leases())
            self._load_leases[job.job_id] = (req_id, lk.leases())
        self.stats.add("tokens_promised", num_external_tokens)

    # ------------------------------------------------------------------ per step

    def build_connector_meta(self, so: Any) -> StepMetadata:
        """The step's loads and saves. ``so``: vLLM's SchedulerOutput (duck-typed)."""
        snapshot = getattr(getattr(so, "kv_connector_block_state", None), "block_ids", None) or {}
        saves: list[TransferJob] = []
        computed: dict[str, int] = {}  # tokens each request had before this step
        for new in so.scheduled_new_reqs:
            st = self._states.get(new.req_id)
            if st is None:
                continue
            computed[new.req_id] = new.num_computed_tokens
            st.block_ids = [list(b) for b in snapshot.get(new.req_id, new.block_ids)]
            self._plan_save(st, new.num_computed_tokens, so.num_scheduled_tokens, saves)
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            st = self._states.get(req_id)
            if st is None:
                continue
            computed[req_id] = cached.num_computed_tokens[i]
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in resumed:
                    st.block_ids = [list(b) for b in new_ids]
                else:
                    for g, b in enumerate(new_ids):
                        st.block_ids[g].extend(b)
            if req_id in snapshot:  # vLLM's authoritative table (position-indexed state lists)
                st.block_ids = [list(b) for b in snapshot[req_id]]
            self._plan_save(st, cached.num_computed_tokens[i], so.num_scheduled_tokens, saves)
        loads, self._pending_loads = tuple(self._pending_loads), []
        if self._state:
            loads = tuple(
                add_running_blocks(job, self.registry, self._states[job.req_id].block_ids,
                                   computed.get(job.req_id),
                                   so.num_scheduled_tokens.get(job.req_id, 0))
                if job.req_id in self._states else job
                for job in loads
            )
        return StepMetadata(
            loads=loads,
            saves=tuple(saves),
            epoch=self.epoch,
            layout_ids=self.layout_ids,
            turned_off=self.turned_off,
        )

    def _plan_save(
        self, st: _ReqState, computed: int, scheduled: dict[str, int], out: list[TransferJob]
    ) -> None:
        req = st.request
        if not self.save or not self._eligible(req):
            return
        n_sched = scheduled.get(req.request_id, 0)
        end = min(computed + n_sched, req.num_prompt_tokens)
        hashed = len(req.block_hashes) // self.hashes_per_chunk
        c_end = min(end // self.chunk_size, hashed)
        cands = [c for c in range(st.next_save_chunk, c_end) if c not in st.present]
        st.next_save_chunk = max(st.next_save_chunk, c_end)
        groups: list[GroupTransfer] = []
        for g in self._attn if cands else ():
            plan = self.registry.groups[g]
            k, ids = plan.blocks_per_chunk, st.block_ids[plan.group.index]
            todo = [c for c in cands if (c + 1) * k <= len(ids)]
            if todo and not self._reserve(
                req, g, todo, lambda c, k=k, ids=ids: ids[c * k : (c + 1) * k], groups
            ):
                return
        c = saved_boundary(computed, n_sched, req.num_prompt_tokens, self.chunk_size, hashed)
        for g in self._state if c is not None else ():
            plan = self.registry.groups[g]
            ids, i = st.block_ids[plan.group.index], (c + 1) * plan.blocks_per_chunk - 1
            ok = i >= len(ids) or ids[i] == 0 or self._reserve(  # ids[i]: the running block
                req, g, [c], lambda _c, b=ids[i]: [b], groups)
            if not ok:
                return
        if groups:
            ntok = len(cands) * self.chunk_size
            out.append(TransferJob(self._job_id(), req.request_id, tuple(groups), ntok))

    def _reserve(self, req: Any, g: int, chunks: list[int], blocks_of, out: list) -> bool:
        """RESERVE ``chunks`` of group ``g``; a GroupTransfer of the reserved ones goes to
        ``out`` (``blocks_of(c)``: the blocks of chunk c in object order). False when the
        gateway is unavailable (the caller stops planning this request's saves)."""
        keys = [chunk_keys(req.block_hashes, self.hashes_per_chunk, c, c + 1)[0] for c in chunks]
        try:
            kw = (event_fields(req.block_hashes, self.hashes_per_chunk, chunks,  # KV events
                               self.chunk_size // self.hashes_per_chunk,
                               self.registry.groups[g].group.index)
                  if getattr(self.gw, "events_enabled", False) is True else {})
            res = self.gw.reserve(self.layout_ids[g], keys, **kw)
        except GatewayUnavailable as e:
            self._unavailable(f"RESERVE failed: {e}")
            return False
        except GatewayError as e:
            self.stats.add("gateway_errors")
            log.warning("xkv: RESERVE refused for request %s: %s", req.request_id, e)
            return True
        self._failures = 0
        refs, blocks, chunk_of, pos = [], [], [], []
        for c, r in zip(chunks, res, strict=True):
            if r is None:  # stored already, being written elsewhere, or no space
                continue
            b = list(blocks_of(c))
            chunk_of.extend([len(refs)] * len(b))
            refs.append(ChunkRef(r.key, tuple(r.offsets), tuple(r.generations)))
            blocks.extend(b)
            pos.extend(range(len(b)))
        if refs:
            self.stats.add("chunks_reserved", len(refs))
            out.append(GroupTransfer(g, tuple(blocks), tuple(chunk_of), tuple(pos), tuple(refs)))
        return True

    def update_connector_output(self, report: WorkerReport | None) -> None:
        if report is None:
            return
        for job_id, n in report.loads_done.items():
            self._loads_done[job_id] += n
            if self._loads_done[job_id] >= self.world_size:
                del self._loads_done[job_id]
                req_lease = self._load_leases.pop(job_id, None)
                if req_lease:
                    req_id, leases = req_lease
                    st = self._states.get(req_id)
                    if st:
                        st.lease_ids.difference_update(leases)
                    self._release_all(*leases)

    def request_finished(self, request: Any) -> None:
        req_id = request.request_id
        self._drop_lookup(req_id)
        st = self._states.pop(req_id, None)
        if st:
            for lease in st.lease_ids:
                self._release(lease)
        for job_id in [j for j, (r, _) in self._load_leases.items() if r == req_id]:
            del self._load_leases[job_id]
            self._loads_done.pop(job_id, None)

    # ------------------------------------------------------------------ helpers

    def _drop_lookup(self, req_id: str) -> None:
        lk = self._lookups.pop(req_id, None)
        if lk:
            self._release_all(*lk.leases())

    def _release_all(self, *leases: int | None) -> None:
        for lease in leases:
            if lease is not None:
                self._release(lease)

    def _release(self, lease_id: int) -> None:
        if self.turned_off or self.gw is None:
            return
        try:
            self.gw.release(lease_id)
            self._failures = 0
        except GatewayUnavailable as e:
            self._unavailable(f"RELEASE failed: {e}")
        except GatewayError as e:
            self.stats.add("gateway_errors")
            log.debug("xkv: RELEASE %s refused: %s", lease_id, e)

    def _job_id(self) -> int:
        self._next_job += 1
        return self._next_job - 1

    def _unavailable(self, reason: str) -> None:
        self._failures += 1
        self.stats.add("gateway_errors")
        if self._failures >= MAX_FAILURES:
            self._turn_off(f"{reason} ({self._failures} failed calls in a row)")
        else:
            log.warning("xkv scheduler: %s; no external hit for this call", reason)

    def _turn_off(self, reason: str) -> None:
        if self.turned_off:
            return
        self.turned_off = True
        self.stats.add("gateway_errors")
        log.warning(
            "xkv scheduler: gateway %s:%d %s; answering zero hits and saving nothing from now on "
            "(restart the gateway and vLLM together to turn it back on)",
            self.cfg.gateway_host,
            self.cfg.xkv_gateway_port,
            reason,
        )

    def shutdown(self) -> None:
        for req_id in list(self._states):
            st = self._states.pop(req_id)
            for lease in st.lease_ids:
                self._release(lease)
        for req_id in list(self._lookups):
            self._drop_lookup(req_id)
        if self.gw is not None:
            try:
                self.gw.close()
            except Exception:  # closing a dead socket must not mask shutdown
                log.debug("xkv: gateway close failed", exc_info=True)
