"""State groups without an engine: registry, state positions, and the scheduler side's plan
(saves at step-end boundaries, probe for the longest stored state, leases, hybrid hits promised
only when leased) against the in-process fake gateway of tests/connector."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
from connector_fakes import FakeGateway

from xkv.connector.config import ConnectorConfig
from xkv.connector.metadata import ChunkRef, GroupTransfer
from xkv.connector.registry import (
    CacheGroup,
    RegistryError,
    build_registry,
    state_group,
)
from xkv.connector.scheduler import SchedulerSide
from xkv.connector.states import (
    MAX_STATE_PROBES,
    boundary_index,
    running_index,
    saved_boundary,
    with_running_block,
)

BS = 96  # tokens per block (= chunk here, as the engine tests use)
ATT = CacheGroup(index=2, kind="attention", layer_names=("l1.attn",), block_size=BS,
                 block_bytes=24576, spec="FullAttentionSpec")
M0 = state_group(CacheGroup(0, "MambaSpec", ("l0.mixer",), BS, 24576, "MambaSpec"), 18112)
M1 = state_group(CacheGroup(1, "MambaSpec", ("l2.mixer",), BS, 24576, "MambaSpec"), 18112)


def test_registry_state_groups():
    reg = build_registry([M0, M1, ATT], tp_size=2, pp_size=1, chunk_size=2 * BS)
    m, a = reg.groups[0], reg.groups[2]
    assert m.is_state and m.num_shards == 2 and m.writer_ranks == (0, 1)
    assert m.blocks_per_object == 1 and m.shard_bytes == 18112  # one state block per object
    assert a.blocks_per_object == 2 and a.shard_bytes == 2 * 24576
    assert reg.multi_group and any(p.is_state for p in reg.groups)
    assert "g0[mamba]=all 2 rank(s) (own shard)" in reg.log_lines()[0]
    with pytest.raises(RegistryError, match="pure state-space"):
        build_registry([M0], tp_size=1, pp_size=1, chunk_size=BS)
    with pytest.raises(RegistryError, match="has no writer"):  # raw spec names stay refused
        build_registry([CacheGroup(0, "MambaSpec", ("x",), BS, 1), ATT], tp_size=1, pp_size=1,
                       chunk_size=BS)
    with pytest.raises(RegistryError, match="state content of 0 bytes"):
        state_group(ATT, 0)


def test_state_positions():
    assert boundary_index(96, 96) == 0 and boundary_index(288, 96) == 2
    for bad in (0, 95, 100):
        with pytest.raises(ValueError, match="multiple of the block size 96"):
            boundary_index(bad, 96)
    assert running_index(288, 12, 96) == 3 and running_index(96, 96, 96) == 1
    # a step that ends on a chunk boundary inside the prompt materialises that chunk's state
    assert saved_boundary(0, 288, 300, 96, 3) == 2
    assert saved_boundary(0, 288, 300, 192, 1) is None  # 288 is not a 192-token boundary
    assert saved_boundary(288, 12, 300, 96, 3) is None  # ends mid-block
    assert saved_boundary(0, 288, 300, 96, 2) is None  # chunk 2 has no key yet
    assert saved_boundary(288, 96, 300, 96, 9) is None  # past the prompt (decode)
    assert saved_boundary(96, 0, 300, 96, 3) is None  # nothing scheduled
    gt = GroupTransfer(0, (7,), (0,), (0,), (ChunkRef(b"k", (0,), (1,)),))
    assert with_running_block(gt, [0, 0, 7, 9], 288, 12, 96).block_ids == (7, 9)
    assert with_running_block(gt, [0, 0, 7, 0], 288, 12, 96) is gt  # null: nothing to add
    assert with_running_block(gt, [0, 0, 7], 288, 12, 96) is gt


def _sched(gw, monkeypatch, **extra):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    cfg = ConnectorConfig.from_extra({"chunk_size": BS, "lookup_timeout_ms": 1000, **extra})
    reg = build_registry([M0, M1, ATT], tp_size=1, pp_size=1, chunk_size=BS)
    return SchedulerSide(cfg, reg, ["fp0", "fp1", "fp2"], hash_block_size=BS, world_size=1,
                         gateway_factory=gw.client)


def _req(rid, hashes, n=300):
    return NS(request_id=rid, block_hashes=list(hashes), num_tokens=n, num_prompt_tokens=n,
              kv_transfer_params=None, cache_salt=None)


def _so(new=(), sched=None):
    cached = NS(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return NS(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
              num_scheduled_tokens=dict(sched or {}))


# vLLM's block lists for a 300-token prompt, groups in vLLM order (M0, M1, ATT): align-mode
# state lists are position-indexed with null blocks; index 2 holds the state after 288 tokens.
STORE_IDS = ([0, 0, 11, 12], [0, 0, 21, 22], [31, 32, 33, 34])
H3 = [b"h0" * 16, b"h1" * 16, b"h2" * 16]


def _store(s, gw, req, ids, computed, scheduled, commit_state=True):
    s.update_state_after_alloc(req, ids, 0)
    new = NS(req_id=req.request_id, block_ids=ids, num_computed_tokens=computed)
    meta = s.build_connector_meta(_so([new], {req.request_id: scheduled}))
    c = gw.client()
    for job in meta.saves:
        for gt in job.groups:
            if commit_state or not s.registry.groups[gt.group].is_state:
                c.commit(meta.layout_ids[gt.group], 0, [r.key for r in gt.chunks])
    s.request_finished(req)
    return meta


def test_state_saved_at_step_end_and_restored_into_boundary_and_running(monkeypatch):
    gw = FakeGateway()
    s = _sched(gw, monkeypatch)
    meta = _store(s, gw, _req("a", H3), STORE_IDS, 0, 288)
    (job,) = meta.saves
    by = {gt.group: gt for gt in job.groups}
    assert by[2].block_ids == (31, 32, 33) and len(by[2].chunks) == 3  # every attention chunk
    # one state per state group: the state after 288 tokens, from block index 2 only
    assert by[0].block_ids == (11,) and by[1].block_ids == (21,)
    assert [r.key for r in by[0].chunks] == [H3[2]]

    r = _req("b", H3)
    assert s.get_num_new_matched_tokens(r, 0) == 288
    assert len(gw.leases) == 2  # attention prefix + the boundary state, both leased
    load_ids = ([0, 0, 41, 42], [0, 0, 51, 52], [61, 62, 63, 64])
    s.update_state_after_alloc(r, load_ids, 288)
    new = NS(req_id="b", block_ids=load_ids, num_computed_tokens=288)
    meta = s.build_connector_meta(_so([new], {"b": 12}))
    (load,) = meta.loads
    by = {gt.group: gt for gt in load.groups}
    assert by[2].block_ids == (61, 62, 63)
    assert by[0].block_ids == (41, 42) and by[1].block_ids == (51, 52)  # boundary + running
    assert by[0].block_in_chunk == (0, 0) and [c.key for c in by[0].chunks] == [H3[2]]
    s.request_finished(r)
    assert gw.leases == {}


def test_no_state_no_hit_and_earlier_boundary(monkeypatch):
    gw = FakeGateway()
    s = _sched(gw, monkeypatch)
    # attention chunks 0..2 stored, their state dropped: no hit at all, nothing stays leased
    _store(s, gw, _req("a", H3), STORE_IDS, 0, 288, commit_state=False)
    r = _req("b", H3)
    assert s.get_num_new_matched_tokens(r, 0) == 0
    s.update_state_after_alloc(r, STORE_IDS, 0)
    assert gw.leases == {}
    # a shorter prompt stored its state at 96: the longer one falls back to that boundary
    _store(s, gw, _req("c", H3[:1], n=100), ([11, 12], [21, 22], [31, 32]), 0, 96)
    r = _req("d", H3)
    assert s.get_num_new_matched_tokens(r, 0) == 96
    probes = [m for m in gw.messages if m[0] == "lookup"]
    assert len(probes) >= 1 + 3  # attention lookup, then states at 288, 192, 96
    s.request_finished(r)
    assert gw.leases == {}


def test_probes_are_bounded(monkeypatch):
    """Only the last MAX_STATE_PROBES boundaries of the attention prefix are tried."""
    gw = FakeGateway()
    s = _sched(gw, monkeypatch)
    n = MAX_STATE_PROBES + 3
    hashes = [bytes([i]) * 32 for i in range(n)]
    _store(s, gw, _req("a", hashes[:1], n=100), ([11, 12], [21, 22], [31, 32]), 0, 96)
    ids = ([0] * n, [0] * n, list(range(100, 100 + n)))  # null state blocks: no state saved
    _store(s, gw, _req("a2", hashes, n=n * BS + 5), ids, 0, n * BS)
    before = len(gw.messages)
    assert s.get_num_new_matched_tokens(_req("b", hashes, n=n * BS + 5), 0) == 0
    assert sum(m[0] == "lookup" for m in gw.messages[before:]) == 1 + MAX_STATE_PROBES
    assert gw.leases == {}
    # within reach of the probes the stored state at 96 is found
    assert s.get_num_new_matched_tokens(_req("c", hashes[:3], n=3 * BS + 5), 0) == 96


def test_unleased_hit_never_promised_for_hybrid(monkeypatch):
    gw = FakeGateway()
    s = _sched(gw, monkeypatch)
    _store(s, gw, _req("a", H3), STORE_IDS, 0, 288)
    real = gw.client().lookup

    def no_lease(groups, *, lease=True, timeout_s=None):
        res = real(groups, lease=lease, timeout_s=timeout_s)
        gw.leases.pop(res.lease_id, None)
        return type(res)(res.num_chunks, 0, res.slots)  # hits, but no lease taken

    monkeypatch.setattr(s.session.client, "lookup", no_lease)
    assert s.get_num_new_matched_tokens(_req("b", H3), 0) == 0
