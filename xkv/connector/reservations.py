"""Scheduler side of saves: which prompt chunks become complete in a step, and their RESERVEs.

A chunk is saved once, by the first request that computes it (the gateway's RESERVE is first
writer wins: a key stored already, being written by another engine, or without room answers no
slot). Attention groups save every chunk completed in the step; a window group the window's
tail at every chunk end the step reached whose blocks are all still held
(``windows.saved_tail``); a state group saves the states vLLM left at chunk boundaries in this
step (``states.saved_boundaries``: ``align`` mode the boundary the step ended on, if any; ``all``
mode every boundary the step crossed). No vLLM types; only :meth:`SavePlanner._reserve` talks to
the gateway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from xkv.connector.group_rules import rule_of
from xkv.connector.keys import chunk_keys, event_fields
from xkv.connector.ledger import Admitted, RequestLedger
from xkv.connector.metadata import GroupTransfer, TransferJob
from xkv.connector.registry import Registry
from xkv.connector.session import GatewaySession, SessionOff
from xkv.connector.stats import ConnectorStats
from xkv.gateway.client import GatewayError, GatewayUnavailable

log = logging.getLogger("xkv.connector")


class SavePlanner:
    """Plans one request's saves per step (``plan``); RESERVEs through ``session``."""

    def __init__(self, registry: Registry, session: GatewaySession, stats: ConnectorStats,
                 hashes_per_chunk: int):
        self.registry, self.session, self.stats = registry, session, stats
        self.hashes_per_chunk = hashes_per_chunk
        self.chunk_size = registry.groups[0].chunk_size
        # prefix groups first, then window, then state groups (each kind's rule: group_rules)
        self._save_order = sorted(range(len(registry.groups)),
                                  key=lambda g: rule_of(registry.groups[g]).save_order)

    def plan(self, ledger: RequestLedger, st: Admitted, computed: int, n_sched: int,
             job_id: Callable[[], int]) -> TransferJob | None:
        """The save job of ``st``'s request for a step computing ``[computed, computed +
        n_sched)``, or None (the chunks it covers are claimed in ``ledger``). Stops at the
        first unanswered RESERVE (a later one would be refused the same way)."""
        req = st.request
        end = min(computed + n_sched, req.num_prompt_tokens)
        hashed = len(req.block_hashes) // self.hashes_per_chunk
        c_end = min(end // self.chunk_size, hashed)
        new, cands = ledger.claim_saves(req.request_id, c_end)
        groups: list[GroupTransfer] = []
        for g in self._save_order:
            plan = self.registry.groups[g]
            todo, blocks_of, positions_of = rule_of(plan).saves(
                plan, st.block_ids[plan.group.index], new, cands, computed, n_sched,
                req.num_prompt_tokens, hashed)
            if todo and not self._reserve(req, g, todo, blocks_of, groups, positions_of):
                return None
        if not groups:
            return None
        return TransferJob(job_id(), req.request_id, tuple(groups), len(cands) * self.chunk_size)

    def _reserve(self, req: Any, g: int, chunks: list[int], blocks_of, out: list,
                 positions_of=None) -> bool:
        """RESERVE ``chunks`` of group ``g``; a GroupTransfer of the reserved ones goes to
        ``out`` (``blocks_of(c)``: the blocks of chunk c, at object positions
        ``positions_of(c)``, default ``0, 1, ...``). False when the gateway is unavailable (the
        caller stops planning this request's saves)."""
        keys = [chunk_keys(req.block_hashes, self.hashes_per_chunk, c, c + 1)[0] for c in chunks]

        def reserve(gw: Any) -> Any:
            kw = (event_fields(req.block_hashes, self.hashes_per_chunk, chunks,  # KV events
                               self.chunk_size // self.hashes_per_chunk,
                               self.registry.groups[g].group.index)
                  if gw.events_enabled else {})
            return gw.reserve(self.session.layout_ids[g], keys, **kw)

        try:
            res = self.session.call(f"RESERVE for request {req.request_id}", reserve)
        except (GatewayUnavailable, SessionOff):
            self.stats.add("gateway_errors")
            return False
        except GatewayError as e:
            self.stats.add("gateway_errors")
            log.warning("xkv: RESERVE refused for request %s: %s", req.request_id, e)
            return True
        refs, blocks, chunk_of, pos = [], [], [], []
        for c, r in zip(chunks, res, strict=True):
            if r is None:  # stored already, being written elsewhere, or no space
                continue
            b = list(blocks_of(c))
            chunk_of.extend([len(refs)] * len(b))
            refs.append(r)  # the object RESERVE answered: key and COMMIT token
            blocks.extend(b)
            pos.extend(positions_of(c) if positions_of else range(len(b)))
        if refs:
            self.stats.add("chunks_reserved", len(refs))
            out.append(GroupTransfer(g, tuple(blocks), tuple(chunk_of), tuple(pos), tuple(refs)))
        return True
