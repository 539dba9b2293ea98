"""A small in-process stand-in for ``xkv.gateway.client.GatewayClient`` (unit tests only).

Same methods and semantics as the contract in docs/internal-api.md: layouts per (namespace,
fingerprint), objects visible once every shard committed, first writer wins, leases, slot
generations, a card (bytearray), checksum words per (object, shard) as briefs/checksum-api.md
(HELLO ``check_words``, COMMIT ``checksums``, LOOKUP ``raw_checksums``, CORRUPT
``report_corrupt``: ``corrupt_reports``, ``corrupt_removed``). ``messages`` logs every call; ``dead = True`` makes every call
raise GatewayUnavailable, as a killed gateway would.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from xkv.gateway.client import ChunkRef, GatewayError, GatewayUnavailable


@dataclass(frozen=True)
class LayoutInfo:
    layout_id: int
    slot_bytes: int
    epoch: int


@dataclass(frozen=True)
class ChunkSlots:
    offsets: tuple[int, ...]
    generations: tuple[int, ...]


@dataclass(frozen=True)
class LookupResult:
    num_chunks: int
    lease_id: int
    slots: list
    raw_checksums: list = ()  # per group: num_chunks * num_shards * check_words LE uint32


class FakeGateway:
    """Shared state; ``client()`` returns a connection (what gateway_factory must return)."""

    def __init__(self, capacity: int = 1 << 22, alignment: int = 4096, epoch: int = 7):
        self.card = bytearray(capacity)
        self.alignment = alignment
        self.epoch = epoch
        self.layouts: dict[tuple[str, str], tuple[int, int, int]] = {}  # -> id, shards, slot
        self.objects: dict[tuple[int, bytes], dict] = {}
        self.gens: dict[int, int] = {}
        self.leases: dict[int, list] = {}
        self.messages: list[tuple] = []
        self.dead = False
        self._next_slot = 0
        self._next_id = 1
        self.check_words: dict[int, int] = {}  # layout id -> words per shard
        self.corrupt_reports = 0
        self.corrupt_removed = 0

    def client(self) -> FakeClient:
        return FakeClient(self)

    def restart(self) -> None:
        """A new gateway process on the same port: new epoch, empty index and card."""
        self.epoch += 1
        self.card[:] = bytes(len(self.card))
        self.layouts.clear()
        self.objects.clear()
        self.gens.clear()
        self.leases.clear()
        self._next_slot, self._next_id = 0, 1
        self.dead = False

    def _check(self, name, *args):
        if self.dead:
            raise GatewayUnavailable(f"fake gateway dead ({name})")
        self.messages.append((name, *args))

    def committed(self, layout_id: int) -> set[bytes]:
        return {k for (lid, k), o in self.objects.items()
                if lid == layout_id and o["committed"] == set(range(o["shards"]))}


def _tokens(refs) -> list[bytes]:
    """The keys of COMMIT/ABORT's ChunkRefs (the connector's); tests that store objects
    themselves may pass bare keys (the real client refuses those: tests/gateway)."""
    return [r.key if isinstance(r, ChunkRef) else bytes(r) for r in refs]


class FakeClient:
    events_enabled = False  # as a GatewayClient whose gateway publishes no KV events

    def __init__(self, gw: FakeGateway):
        self.gw = gw
        self.epoch = gw.epoch
        self.deadline_cap_s: float | None = None  # as GatewayClient's (the session sets it)

    def register_layout(self, namespace, fingerprint, num_shards, shard_bytes, *,
                        check_words=0, timeout_s=None):
        g = self.gw
        g._check("hello", namespace, fingerprint)
        slot = -(-shard_bytes // g.alignment) * g.alignment
        key = (namespace, fingerprint)
        if key not in g.layouts:
            g.layouts[key] = (g._next_id, num_shards, slot)
            g.check_words[g._next_id] = check_words
            g._next_id += 1
        lid, shards, s = g.layouts[key]
        if (shards, s) != (num_shards, slot) or g.check_words[lid] != check_words:
            raise GatewayError("LAYOUT_MISMATCH")
        return LayoutInfo(lid, slot, g.epoch)

    def _layout(self, lid):
        for (_, _), (i, shards, slot) in self.gw.layouts.items():
            if i == lid:
                return shards, slot
        raise GatewayError(f"UNKNOWN_LAYOUT {lid}")

    def lookup(self, groups, *, lease=True, timeout_s=None):
        g = self.gw
        g._check("lookup", [list(k) for _, k in groups])
        n = min(len(k) for _, k in groups)
        hits = 0
        for c in range(n):
            if all(k[c] in g.committed(lid) for lid, k in groups):
                hits += 1
            else:
                break
        slots = [[ChunkSlots(tuple(g.objects[(lid, k[c])]["offsets"]),
                             tuple(g.gens[o] for o in g.objects[(lid, k[c])]["offsets"]))
                  for c in range(hits)] for lid, k in groups]
        # a test that committed objects itself without words (see commit) gets none back
        sums = [b"".join(g.objects[(lid, k[c])]["sums"].get(s, b"")
                         for c in range(hits) for s in range(g.objects[(lid, k[c])]["shards"]))
                if g.check_words.get(lid) else b"" for lid, k in groups]
        sums = [b if len(b) == sum(g.objects[(lid, k[c])]["shards"] for c in range(hits))
                * g.check_words.get(lid, 0) * 4 else b""
                for b, (lid, k) in zip(sums, groups, strict=True)]
        lease_id = 0
        if lease and hits:
            lease_id = g._next_id
            g._next_id += 1
            g.leases[lease_id] = slots
        return LookupResult(hits, lease_id, slots, sums)

    def reserve(self, layout_id, keys):
        g = self.gw
        g._check("reserve", layout_id, list(keys))
        shards, slot = self._layout(layout_id)
        out = []
        for k in keys:
            if (layout_id, k) in g.objects:
                out.append(None)
                continue
            offs = []
            for _ in range(shards):
                if g._next_slot + slot > len(g.card):
                    raise GatewayError("NO_SPACE")
                offs.append(g._next_slot)
                g.gens[g._next_slot] = g.gens.get(g._next_slot, 0) + 1
                g._next_slot += slot
            g.objects[(layout_id, k)] = {"offsets": offs, "shards": shards, "committed": set(),
                                         "sums": {}}
            out.append(ChunkRef(k, tuple(offs), tuple(g.gens[o] for o in offs)))
        return out

    def commit(self, layout_id, shard, refs, *, checksums=None, timeout_s=None):
        g = self.gw
        keys = _tokens(refs)
        g._check("commit", layout_id, shard, keys)
        cw = g.check_words.get(layout_id, 0)
        # tests that store objects themselves may omit the words (the real client refuses
        # that for a layout with check_words): such objects come back without any
        sums = list(checksums) if checksums is not None else [b""] * len(keys)
        if checksums is not None and ((cw and (len(sums) != len(keys) or any(
                len(b) != cw * 4 for b in sums))) or (not cw and any(sums))):
            raise GatewayError(f"BAD_REQUEST checksums for {len(keys)} keys x {cw} words")
        for i, k in enumerate(keys):
            g.objects[(layout_id, k)]["committed"].add(shard)
            if cw and sums[i]:
                g.objects[(layout_id, k)]["sums"][shard] = bytes(sums[i])
        return len(keys)

    def report_corrupt(self, layout_id, shard, refs, *, timeout_s=None):
        """Remove each object whose (offset, generation) of ``shard`` is the live one."""
        g = self.gw
        g._check("corrupt", layout_id, shard, _tokens(refs))
        removed = 0
        for r in refs:
            g.corrupt_reports += 1
            o = g.objects.get((layout_id, r.key))
            if o is not None and o["offsets"][shard] == r.offsets[shard] and \
                    g.gens[o["offsets"][shard]] == r.generations[shard]:
                del g.objects[(layout_id, r.key)]
                removed += 1
        g.corrupt_removed += removed
        return removed

    def abort(self, layout_id, shard, refs):
        g = self.gw
        keys = _tokens(refs)
        g._check("abort", layout_id, shard, keys)
        for k in keys:
            g.objects.pop((layout_id, k), None)
        return len(keys)

    def release(self, lease_id):
        self.gw._check("release", lease_id)
        return int(self.gw.leases.pop(lease_id, None) is not None)

    def ping(self, *, timeout_s=None):
        self.gw._check("ping")
        return LayoutInfo(0, 0, self.gw.epoch)  # only .epoch is read

    def map_card(self):
        self.gw._check("card")
        return memoryview(self.gw.card)

    def slot_generation(self, offset):
        return self.gw.gens.get(offset, 0)

    def close(self):
        return None


def written_part(block_ids, offsets, checks):
    """``(block_ids, offsets)`` of the fragments a (verified) ``load_group`` call writes: its
    ``checks.hash_only`` fragments are only read and hashed (block id -1 or a block the step's
    tail copy writes). For handler doubles that copy by themselves."""
    import numpy as np
    import torch

    if checks is None or checks.hash_only is None:
        return block_ids, offsets
    w = torch.from_numpy(~np.asarray(checks.hash_only))
    return block_ids[w], offsets[:, w]


class Warnings(logging.Handler):
    """The xkv connector's warnings, each record once (whatever other handlers exist, and
    whatever level an earlier test or vLLM's set-up left on the root logger: the connector's
    logger is set to WARNING for the block)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []
        self._level = logging.NOTSET

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        logger = logging.getLogger("xkv.connector")
        self._level = logger.level
        logger.setLevel(logging.WARNING)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        logger = logging.getLogger("xkv.connector")
        logger.removeHandler(self)
        logger.setLevel(self._level)

    def count(self, text):
        return sum(text in line for line in self.lines)


# ----------------------------------------------------------------- vLLM scheduler-side stand-ins


class Req:
    """A vLLM ``Request`` as the scheduler side reads it: ``n`` prompt tokens, one block hash per
    full block of ``bs`` tokens (``salt`` makes prompts differ)."""

    def __init__(self, rid: str, n: int, salt: int = 7, bs: int = 16):
        self.request_id, self.num_tokens, self.num_prompt_tokens = rid, n, n
        self.block_hashes = [bytes([salt, i]) * 16 for i in range(n // bs)]
        self.kv_transfer_params = self.cache_salt = None


class New:
    """One ``scheduled_new_reqs`` entry (one KV cache group)."""

    def __init__(self, rid, ids, computed):
        self.req_id, self.block_ids, self.num_computed_tokens = rid, (ids,), computed


class SO:
    """A ``SchedulerOutput`` with new requests only (``sched``: req id -> scheduled tokens)."""

    def __init__(self, new, sched):
        self.scheduled_new_reqs, self.num_scheduled_tokens = new, sched

        class C:
            req_ids, resumed_req_ids, new_block_ids, num_computed_tokens = [], set(), [], []

        self.scheduled_cached_reqs = C


def dsv4_specs_or_skip() -> Any:
    """``vllm.v1.kv_cache_interface`` where it has DeepSeek-V4's cache specs
    (``SlidingWindowMLASpec``, ``MLAAttentionSpec.model_version`` / ``tokens_per_state``: 0.29 and
    0.33); else the calling test module is skipped, naming why."""
    import pytest

    pytest.importorskip("vllm")
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    if not hasattr(kvi, "SlidingWindowMLASpec") or not {"model_version", "tokens_per_state"} <= set(
            getattr(kvi.MLAAttentionSpec, "__dataclass_fields__", {})):
        pytest.skip("this vLLM has no DeepSeek-V4 cache specs", allow_module_level=True)
    return kvi
