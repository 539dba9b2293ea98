"""Scheduler side: lookups, load plans, save reservations, leases. No vLLM types, no tensors.

One request's life (see docs/architecture.md):

1. ``get_num_new_matched_tokens`` — chunk keys from ``request.block_hashes``; one LOOKUP (leased)
   for the chunks past the local hit; answer the tokens of the stored prefix, at most
   ``num_tokens - 1 - num_computed_tokens`` (a synchronous full hit crashes vLLM's scheduler;
   one attention group may end inside a block, so a full hit computes one token; two with
   ``piecewise_restores_from``, see :func:`two_token_restores_from`).
   vLLM may ask several times: the answer is cached per (request, local hit), so a repeated
   question sends no message and takes no second lease.
2. ``update_state_after_alloc`` — turn the promised tokens into a load job (block ids per group,
   chunk slot offsets); release the lease at once if nothing is loaded.
3. ``build_connector_meta`` — the step's loads, plus saves: prompt chunks that become complete in
   this step are reserved on the gateway (first writer wins) and handed to workers.
4. Workers report finished loads (``update_connector_output``); the lease is released once every
   rank finished, and in any case when the request finishes (unless its asynchronous load is
   still copying: ``load_mode``, ``async_loads.AsyncLoadPlanner``).

Who holds which lease, when, is the :class:`~xkv.connector.ledger.RequestLedger`'s alone: every
event above goes through it and it hands back the leases to release (``_release_all``).

Failure (``session.GatewaySession``): ``MAX_FAILURES`` consecutive calls without an answer
(dead, restarted, or deadlines missed; a single slow answer only costs that request its hit) turn
the connector off: zero hits, no saves, and ``StepMetadata.turned_off`` tells every worker to
turn off too, until a re-probe (with a back-off, at a step with no load pending) finds the
gateway answering again (a restarted one only with ``reattach``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from xkv.connector import compat
from xkv.connector.async_loads import AsyncLoadPlanner
from xkv.connector.checksums import check_words, with_checks
from xkv.connector.config import ConnectorConfig
from xkv.connector.group_rules import rule_of
from xkv.connector.keys import chunk_keys
from xkv.connector.ledger import Lookup, RequestLedger
from xkv.connector.metadata import (
    StepMetadata,
    TransferJob,
    WorkerReport,
)
from xkv.connector.registry import Registry
from xkv.connector.reservations import SavePlanner
from xkv.connector.session import GatewaySession, LayoutSpec, SessionOff
from xkv.connector.states import add_running_blocks, probe_states
from xkv.connector.stats import ConnectorStats
from xkv.gateway.client import GatewayError, GatewayUnavailable
from xkv.layout import kinds

log = logging.getLogger("xkv.connector")


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
        """Once off, the session re-probes the gateway with a back-off, at steps with no load
        pending, and is on again when it answers (``cfg.reattach``: a restarted gateway, another
        epoch, too; the old one's leases are then forgotten, never released on the new one)."""
        self.cfg = cfg
        if cfg.allow_unverified_requests and cfg.verify_checksums:
            log.warning("XKV: allow_unverified_requests is on: a request whose kv_transfer_params "
                        "hold {\"xkv_verify\": false} restores WITHOUT checksum checks (a "
                        "benchmark setting)")
        self.load, self.save = load, save  # kv_role: consumer loads only, producer saves only
        self.registry = registry
        self.chunk_size = registry.groups[0].chunk_size
        # prefix groups need every chunk of a hit; state and window groups the last one only
        self._attn = [g for g, p in enumerate(registry.groups) if not p.at_boundary]
        self._block_size = registry.hit_granularity  # lcm of the groups' block sizes
        # a hit may end inside a block (up to the last prompt token) only for one group of plain
        # per-token pages (attention or an uncompressed MLA latent, one page size: no compressed
        # state spans tokens), restored by the worker's own copies (fan-out has no
        # before-forward fence)
        self._whole_prompt = (
            cfg.full_hit_restore and not registry.multi_group and not cfg.fanout.enabled
            and all(p.group.kind in (kinds.ATTENTION, kinds.MLA) and not p.group.layer_bytes
                    for p in registry.groups))
        self._boundary = [g for g, p in enumerate(registry.groups) if p.at_boundary]
        self._two_from = two_token_restores_from(cfg, registry, self._whole_prompt)
        if self.chunk_size % hash_block_size:
            raise ValueError(
                f"chunk_size={self.chunk_size} is not a multiple of vLLM's hash block size "
                f"{hash_block_size}"
            )
        self.hashes_per_chunk = self.chunk_size // hash_block_size
        self.stats = ConnectorStats()
        self.ledger = RequestLedger(world_size)
        self._next_job = 1
        self._async = AsyncLoadPlanner(cfg.load_mode, sync_only=(
            "recurrent-state groups" if any(p.is_state for p in registry.groups)
            else "sliding-window groups" if self._boundary else None))
        self.session = GatewaySession(
            gateway_factory,
            [LayoutSpec(fp, p.num_shards, p.registered_bytes,
                        check_words(p, cfg.verify_checksums))
             for p, fp in zip(registry.groups, fingerprints, strict=True)],
            namespace=cfg.key_namespace, on_off=self._log_off, reattach=cfg.reattach,
            on_reattach=self._log_reattach, probe_timeout_s=cfg.lookup_timeout_ms / 1000)
        self.session.open()  # dead, or refused our layout (e.g. larger than the card): off
        self._saves = SavePlanner(registry, self.session, self.stats, self.hashes_per_chunk)

    @property
    def turned_off(self) -> bool:
        return self.session.turned_off

    @property
    def layout_ids(self) -> tuple[int, ...]:
        return self.session.layout_ids

    @property
    def epoch(self) -> int:
        return self.session.epoch

    # ------------------------------------------------------------------ lookups

    def _eligible(self, request: Any) -> bool:
        if self.turned_off or compat.request_opted_out(request):
            return False
        # require_cache_salt: an unsalted request never reaches the gateway (no message at all).
        return bool(getattr(request, "cache_salt", None)) or not self.cfg.require_cache_salt

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens loadable past ``num_computed_tokens`` (block-aligned local hit)."""
        if (
            not self.load
            or not self._eligible(request)
            or compat.skips_prefix_read(request)
        ):
            return 0
        req_id = request.request_id
        num_hashes = len(request.block_hashes)
        cached = self.ledger.lookup(req_id)
        if cached and cached.local == num_computed_tokens and cached.num_hashes == num_hashes:
            return cached.ext
        self._release_all(self.ledger.drop_lookup(req_id))
        stop = num_hashes // self.hashes_per_chunk
        if self._boundary:
            # a state is stored at chunk ends only: a hit must end on a chunk vLLM will not compute
            stop = min(stop, (request.num_tokens - 1) // self.chunk_size)
        start = num_computed_tokens // self.chunk_size
        if stop <= start:
            return 0
        keys = chunk_keys(request.block_hashes, self.hashes_per_chunk, start, stop)
        got: dict[str, Any] = {"lease": None, "state_lease": None, "state_slots": {},
                               "state_checks": {}}
        timeout_s = self.cfg.lookup_timeout_ms / 1000

        def ask(gw: Any) -> tuple[Any, int]:
            res = gw.lookup([(self.layout_ids[g], keys) for g in self._attn], lease=True,
                            timeout_s=timeout_s)
            got["lease"] = res.lease_id or None  # the gateway answers 0 when it took no lease
            hits = min(res.num_chunks, stop - start)
            if self._boundary and hits:
                hits, got["state_lease"], got["state_slots"] = probe_states(
                    gw, [self.layout_ids[g] for g in self._boundary], self._boundary, keys, hits,
                    timeout_s, got["state_checks"])
            return res, hits

        try:
            res, hits = self.session.call(f"LOOKUP for request {req_id}", ask)
        except GatewayError as e:
            self._release_all([got["lease"], got["state_lease"]])
            self.stats.add("gateway_errors")
            if not isinstance(e, GatewayUnavailable | SessionOff):
                log.warning("xkv: LOOKUP refused for request %s: %s", req_id, e)
            return 0
        lease, state_lease, state_slots = got["lease"], got["state_lease"], got["state_slots"]
        self.stats.add("lookups")
        ext = max(0, (start + hits) * self.chunk_size - num_computed_tokens)
        # vLLM computes at least the last token. When the stored prefix reaches it, a single
        # attention group restores every token before it (the last block partly: its copy is
        # fenced before the forward, see GroupTransfer.tail), so the step computes one token, a
        # decode-shaped step, as after vLLM's own asynchronous full hits (issue 24). Hybrid and
        # windowed models, and NVLink fan-out, stop at the last whole block before it.
        limit = request.num_tokens - 1
        if not self._whole_prompt:
            limit = limit // self._block_size * self._block_size
        ext = min(ext, max(0, limit - num_computed_tokens))
        if self.registry.multi_group and ext and (
            lease is None or (self._boundary and state_lease is None)
            or (self._boundary and num_computed_tokens + ext != (start + hits) * self.chunk_size)
        ):
            # Never a wrong token: vLLM <= 0.29 cannot take a block load error for a hybrid
            # model, so a hit is promised only when every byte of it is leased (and, with states, when it
            # ends exactly on the stored state's boundary).
            ext = 0
        load_async = self._async.choose(ext, busy=self.ledger.others_admitted(req_id))
        if (self._two_from and not load_async and ext >= self._two_from
                and num_computed_tokens + ext == limit):
            # two tokens computed: a step vLLM never replays as a full graph, so this synchronous
            # restore overlaps the forward (an asynchronous one lands before its step anyway)
            ext -= 1
        if ext == 0:
            self._release_all([lease, state_lease])
            lease = state_lease = None
        self.stats.add("lookup_chunks_hit", hits)
        self._release_all(self.ledger.set_lookup(req_id, Lookup(
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
            checks=({} if self.cfg.allow_unverified_requests and compat.request_skips_checks(
                request) else self._lookup_checks(res, keys, hits, got["state_checks"])),
            load_async=load_async,
        )))
        return ext

    def _lookup_checks(self, res: Any, keys: list[bytes], hits: int,
                       state_checks: dict[int, bytes]) -> dict[int, dict[bytes, bytes]]:
        """{group: {key: words of all shards}} of the hit's chunks (``verify_checksums``):
        from the LOOKUP's ``raw_checksums`` (chunk-major, ``num_shards * check_words`` words per
        chunk) and, for boundary groups, the state probe's. Groups without words: absent."""
        cws = self.session.check_words
        out: dict[int, dict[bytes, bytes]] = {}
        raw = list(getattr(res, "raw_checksums", None) or [])
        for i, g in enumerate(self._attn):
            per = self.registry.groups[g].num_shards * cws[g] * 4 if cws else 0
            if not per or i >= len(raw) or len(raw[i]) < hits * per:
                continue
            b = bytes(raw[i])
            out[g] = {keys[c]: b[c * per:(c + 1) * per] for c in range(hits)}
        for g, b in state_checks.items():
            if hits and b and cws and len(b) == self.registry.groups[g].num_shards * cws[g] * 4:
                out[g] = {keys[hits - 1]: b}
        return out

    def load_async(self, req_id: str) -> bool:
        """Whether the tokens just offered to ``req_id`` are restored asynchronously (vLLM's
        second return value of ``get_num_new_matched_tokens``; async_loads.py)."""
        lk = self.ledger.lookup(req_id)
        return bool(lk is not None and lk.ext and lk.load_async)

    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """After vLLM allocated the request's blocks (all groups); plan the load if any."""
        req_id = request.request_id
        # a parked request scheduled after its async load keeps its state (resumed); one
        # re-admitted after preemption drops its earlier leases
        adm = self.ledger.admit(req_id, request, block_ids, num_external_tokens)
        self._release_all(adm.release)
        lk = adm.lookup
        if adm.resumed or num_external_tokens == 0:
            return
        st = self.ledger.admitted(req_id)
        if lk is None or lk.ext != num_external_tokens:
            # vLLM never admits external tokens we did not offer; refusing beats loading garbage.
            raise RuntimeError(
                f"xkv: request {req_id} admitted with {num_external_tokens} external tokens but "
                f"the connector offered {lk.ext if lk else 'none'}"
            )
        groups = [gt for g, plan in enumerate(self.registry.groups)
                  if (gt := rule_of(plan).load(g, plan, st.block_ids[plan.group.index], lk,
                                               num_external_tokens, req_id)) is not None]
        if lk.checks:
            groups = [with_checks(gt, lk.checks.get(gt.group, {})) for gt in groups]
        job = TransferJob(self._job_id(), req_id, tuple(groups), num_external_tokens)
        self.ledger.add_load(job.job_id, job, is_async=lk.load_async)
        self.stats.add("tokens_promised", num_external_tokens)

    # ------------------------------------------------------------------ per step

    def build_connector_meta(self, so: Any) -> StepMetadata:
        """The step's loads and saves. ``so``: vLLM's SchedulerOutput (duck-typed)."""
        epoch = self.session.epoch
        if not self.ledger.loads_queued and self.session.reattach_due() \
                and self.session.reattach() and self.session.epoch != epoch:
            self.ledger.forget()
        saves: list[TransferJob] = []
        computed: dict[str, int] = {}  # tokens each request had before this step
        # save_mode step: the blocks this step's forward may write, of every request (a block
        # freed since a save was issued and handed out again is among them)
        written: set[int] | None = set() if self.cfg.save_mode == "step" else None
        for req_id, num_computed, blocks, replace in compat.scheduled_blocks(so):
            if written is not None and blocks is not None:
                for b in blocks:
                    written.update(b)
            st = self.ledger.admitted(req_id)
            if st is None:
                continue
            computed[req_id] = num_computed
            if blocks is not None and replace:
                st.block_ids = [list(b) for b in blocks]
            elif blocks is not None:
                for g, b in enumerate(blocks):
                    st.block_ids[g].extend(b)
            if self.save and self._eligible(st.request):
                job = self._saves.plan(self.ledger, st, num_computed,
                                       so.num_scheduled_tokens.get(req_id, 0), self._job_id)
                if job is not None:
                    saves.append(job)
        loads, async_loads = self.ledger.take_loads()
        if self._boundary:
            loads = [
                add_running_blocks(job, self.registry, st.block_ids, computed.get(job.req_id),
                                   so.num_scheduled_tokens.get(job.req_id, 0))
                if (st := self.ledger.admitted(job.req_id)) is not None else job
                for job in loads
            ]
        return StepMetadata(
            loads=tuple(loads),
            async_loads=tuple(async_loads),
            saves=tuple(saves),
            epoch=self.epoch,
            layout_ids=self.layout_ids,
            turned_off=self.turned_off,
            scheduled_tokens=sum(so.num_scheduled_tokens.values()),
            written_blocks=None if written is None else tuple(sorted(written)),
        )

    def update_connector_output(self, report: WorkerReport | None) -> None:
        if report is None:
            return
        for job_id, n in report.loads_done.items():
            self._release_all(self.ledger.load_done(job_id, n))

    def request_finished(self, request: Any) -> None:
        # an async load still copying keeps its lease until every rank finished it
        # (update_connector_output releases it then); vLLM keeps the blocks meanwhile
        self._release_all(self.ledger.finished(request.request_id))

    # ------------------------------------------------------------------ helpers

    def _release_all(self, leases: Iterable[int | None]) -> None:
        for lease in leases:
            if lease is not None:
                self._release(lease)

    def _release(self, lease_id: int) -> None:
        try:
            self.session.call("RELEASE", lambda gw: gw.release(lease_id))
        except SessionOff:
            return
        except GatewayUnavailable:
            self.stats.add("gateway_errors")
        except GatewayError as e:
            self.stats.add("gateway_errors")
            log.debug("xkv: RELEASE %s refused: %s", lease_id, e)

    def _job_id(self) -> int:
        self._next_job += 1
        return self._next_job - 1

    def _log_reattach(self, epoch: int) -> None:
        log.warning("xkv scheduler: re-attached to gateway %s:%d (epoch %d); serving hits again",
                    self.cfg.gateway_host, self.cfg.xkv_gateway_port, epoch)

    def _log_off(self, reason: str) -> None:
        self.stats.add("gateway_errors")
        log.warning(
            "xkv scheduler: gateway %s:%d %s; answering zero hits and saving nothing until it "
            "answers again (probed with a back-off; a restarted gateway only with reattach)",
            self.cfg.gateway_host,
            self.cfg.xkv_gateway_port,
            reason,
        )

    def shutdown(self) -> None:
        self._release_all(self.ledger.close())
        self.session.close()


def two_token_restores_from(cfg: ConnectorConfig, registry: Registry, whole_prompt: bool) -> int:
    """The restored tokens from which a synchronous full hit leaves vLLM two tokens to compute
    instead of one (``piecewise_restores_from``; 0: never; an asynchronous restore lands before
    its step, which then needs no fence). With ``full_cuda_graphs`` vLLM replays a
    decode-shaped step (one token per request) as a full graph, where no per-layer hook runs and
    every restore is fenced before the forward; a step computing two tokens runs with piecewise
    graphs, its restore overlapping the forward layer by layer. Only for whole-prompt restores of
    plain attention pages: MLA computes a two-token request through its prefill path, which
    up-projects the whole cached latent (bench/RESULTS.md, stop 29 on the H200: the MLA model's
    16k restore 57.0 ms computing 16 tokens, 25.7 ms computing one), and other models stop at
    whole blocks anyway."""
    n = cfg.piecewise_restores_from
    if not n:
        return 0
    why = (None if whole_prompt and all(p.group.kind == kinds.ATTENTION for p in registry.groups)
           else "an MLA model" if any(p.group.kind == kinds.MLA for p in registry.groups)
           else "restores here stop at whole blocks")
    if why:
        log.info("XKV: piecewise_restores_from has no effect here (%s): a full hit leaves vLLM "
                 "one token to compute", why)
        return 0
    log.info("XKV: full hits of >= %d restored tokens leave vLLM two tokens to compute "
             "(piecewise graphs, the restore overlapping the forward); shorter ones one (a full "
             "graph after the fenced restore)", n)
    return n
