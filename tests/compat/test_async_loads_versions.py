"""Asynchronous restores (``load_mode``) against a real vLLM ``Scheduler`` on the CPU, a worker
connector over vLLM's own cache allocation and the fake gateway.

Engine 1 computes and saves a prompt (synchronous mode); engine 2, with poisoned caches and
``load_mode: "async"``, must park the request (no token scheduled), restore it whole, report it
in ``finished_recving``, and only then compute the rest; restored pages equal the saved bytes.
Copies on the CPU run inline, so a fence that stays pending (``_Fences``) stands in for a GPU
copy still in flight (abort mid-load, empty steps). Runs unchanged on vLLM 0.26, 0.28, 0.29 and
0.33 (scripts/matrix.sh): the parking, ``finished_recving`` and abort rules are each version's own
scheduler code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connector"))
from connector_fakes import FakeGateway  # noqa: E402

from xkv.connector import async_loads
from xkv.connector.async_loads import AsyncLoadPlanner
from xkv.connector.config import ConfigError, ConnectorConfig

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")  # only vLLM may be missing: a broken harness must fail
import vllm_harness as H  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

CHUNK = 64
BS = 32


@pytest.fixture
def fake_gateway(monkeypatch):
    """A FakeGateway that every FusIOnXConnector built in this test talks to."""
    gw = FakeGateway()
    import xkv.connector.setup as setup

    monkeypatch.setattr(setup, "gateway_factory", lambda cfg, timeout_s: gw.client)
    return gw


def _prompt(n, base=10):
    return [(base + i) % 1000 + 4 for i in range(n)]


def _engine(llama_dir, mode="sync"):
    vc = H.make_vllm_config(llama_dir, policy="recompute", block_size=BS,
                            extra={"chunk_size": CHUNK, "load_mode": mode})
    layout = H.layout_name("HND")
    kcfg = H.attention_cache_config(block_size=BS)
    kcfg.kv_cache_layout = layout
    sched = H.make_scheduler(vc, kcfg)
    wk, caches = H.make_worker_caches(vc, H.attention_cache_config(block_size=BS), layout=layout)
    return sched, wk, caches


def _run(eng, req):
    sched, wk, caches = eng
    sched.add_request(req)
    while sched.has_unfinished_requests():
        H.step_with_worker(sched, wk, caches, BS)


def _stored(llama_dir, fake_gateway, *prompts):
    eng = _engine(llama_dir)
    for i, p in enumerate(prompts):
        _run(eng, H.make_request(f"store{i}", p))
    assert fake_gateway.leases == {}


def _assert_restored(caches, gt, tokens):
    for i, bid in enumerate(gt.block_ids):
        for name, kv in caches.items():
            want = H.pattern(tokens[: (i + 1) * BS], name, H.page(kv, 0).numel())
            assert torch.equal(H.page(kv, bid), want), (name, i)


class _Fences:
    """Stand-in for CUDA events of copies still running: pending until ``land()``."""

    def __init__(self, monkeypatch):
        self.landed = False
        self.made = 0
        monkeypatch.setattr(async_loads, "load_fence", self._make)

    def _make(self, handler):
        self.made += 1
        return NS(query=lambda: self.landed, synchronize=self.land)

    def land(self):
        self.landed = True


def test_load_mode_setting():
    assert ConnectorConfig.from_extra({}, env={"PYTHONHASHSEED": "0"}).load_mode == "sync"
    for mode in ("sync", "async", "auto"):
        cfg = ConnectorConfig.from_extra({"load_mode": mode}, env={"PYTHONHASHSEED": "0"})
        assert cfg.load_mode == mode
    with pytest.raises(ConfigError, match=r"load_mode='background': expected one of 'sync', "
                                          r"'async', 'auto'"):
        ConnectorConfig.from_extra({"load_mode": "background"}, env={"PYTHONHASHSEED": "0"})
    with pytest.raises(ConfigError, match=r"\['load_mode'\] = True \(bool\): expected str"):
        ConnectorConfig.from_extra({"load_mode": True}, env={"PYTHONHASHSEED": "0"})


@pytest.mark.parametrize("n", [300, 200])
def test_async_restore_parks_then_runs_bit_exact(fake_gateway, llama_dir, n):
    p = _prompt(n)
    _stored(llama_dir, fake_gateway, p)
    sched, wk, caches = _engine(llama_dir, "async")
    r = H.make_request("b", p)
    expect = (n - 1) // CHUNK * CHUNK
    assert sched.connector.get_num_new_matched_tokens(r, 0) == (expect, True)
    assert sched.connector.get_num_new_matched_tokens(r, 0) == (expect, True)  # asked again
    sched.add_request(r)
    # step 1: parked, nothing of it scheduled; the whole restore issued and (CPU) done
    so, meta, out = H.step_with_worker(sched, wk, caches, BS)
    assert "b" not in so.num_scheduled_tokens and so.total_num_scheduled_tokens == 0
    assert not meta.loads and len(meta.async_loads) == 1
    (gt,) = meta.async_loads[0].groups
    assert len(gt.block_ids) == expect // BS
    assert out.finished_recving == {"b"} and not out.invalid_block_ids
    _assert_restored(caches, gt, p)
    assert fake_gateway.leases == {}  # every rank finished: released at once
    st = H.LAST_STATS.connector_prefix_cache_stats
    assert st.hits == expect and st.queries == n
    reserves = sum(m[0] == "reserve" for m in fake_gateway.messages)
    # step 2: scheduled with the restored tokens computed; the rest is computed
    so, meta, out = H.step_with_worker(sched, wk, caches, BS)
    assert so.num_scheduled_tokens["b"] == n - expect
    assert not meta.loads and not meta.async_loads and not out.invalid_block_ids
    _assert_restored(caches, gt, p)  # the forward did not touch the restored blocks
    while sched.has_unfinished_requests():
        H.step_with_worker(sched, wk, caches, BS)
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(r.output_token_ids) == 4
    assert fake_gateway.leases == {}
    # the request kept its state across the park: the restored chunks were known present, so
    # none is RESERVEd again (n=300: no chunk left to save; n=200: none either, 192..200 partial)
    assert sum(m[0] == "reserve" for m in fake_gateway.messages) == reserves


def test_reused_slot_is_a_load_error(fake_gateway, llama_dir):
    p = _prompt(300)
    _stored(llama_dir, fake_gateway, p)
    sched, wk, caches = _engine(llama_dir, "async")
    sched.add_request(H.make_request("b", p))
    orig = sched.connector._scheduler.build_connector_meta

    def bump(so):  # the gateway reuses chunk 1's slot between the lookup and the copy
        m = orig(so)
        if m.async_loads:
            fake_gateway.gens[m.async_loads[0].groups[0].chunks[1].offsets[0]] += 1
        return m

    sched.connector._scheduler.build_connector_meta = bump
    so, meta, out = H.step_with_worker(sched, wk, caches, BS)
    gt = meta.async_loads[0].groups[0]
    # reported in the step that finishes the receive, with the same request id
    assert out.finished_recving == {"b"}
    assert out.invalid_block_ids == {gt.block_ids[2], gt.block_ids[3]}
    assert out.kv_connector_stats.data["load_errors"] == 2
    # policy "recompute": vLLM keeps the valid prefix (chunk 0) and computes the rest
    b = sched.requests["b"]
    assert b.num_computed_tokens == 64
    so, _, _ = H.step_with_worker(sched, wk, caches, BS)
    assert so.num_scheduled_tokens["b"] == 300 - 64
    _assert_restored(caches, NS(block_ids=gt.block_ids[:2]), p)


def test_abort_mid_load_keeps_lease_and_blocks_until_copied(fake_gateway, llama_dir,
                                                            monkeypatch):
    p = _prompt(300)
    _stored(llama_dir, fake_gateway, p)
    fences = _Fences(monkeypatch)
    sched, wk, caches = _engine(llama_dir, "async")
    sched.add_request(H.make_request("b", p))
    so, meta, out = H.step_with_worker(sched, wk, caches, BS)
    assert meta.async_loads and fences.made == 1 and not out.finished_recving
    assert len(fake_gateway.leases) == 1
    # empty steps while the copy runs: nothing scheduled, nothing reported, no new copy
    for _ in range(2):
        so, meta, out = H.step_with_worker(sched, wk, caches, BS)
        assert so.total_num_scheduled_tokens == 0 and not meta.async_loads
        assert not out.finished_recving and not out.invalid_block_ids
        assert sched.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    # aborted mid-load: vLLM holds the blocks, the connector holds the lease
    assert "b" in sched.requests and len(fake_gateway.leases) == 1
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() < pool.num_gpu_blocks - 1  # the null block is never free
    so, meta, out = H.step_with_worker(sched, wk, caches, BS)
    assert not out.finished_recving and len(fake_gateway.leases) == 1
    fences.land()
    so, meta, out = H.step_with_worker(sched, wk, caches, BS)
    assert out.finished_recving == {"b"}
    # reported once: vLLM freed the blocks and forgot the request; the lease went with it
    assert "b" not in sched.requests and fake_gateway.leases == {}
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert not sched.has_unfinished_requests()
    so, meta, out = H.step_with_worker(sched, wk, caches, BS)
    assert not out.finished_recving


def test_batch_decodes_while_a_request_restores(fake_gateway, llama_dir, monkeypatch):
    """A running request keeps decoding every step while another one's restore is in flight;
    ``auto`` restores a lone request synchronously and one beside running ones asynchronously."""
    p, q = _prompt(300), _prompt(200, base=400)
    _stored(llama_dir, fake_gateway, p, q)
    fences = _Fences(monkeypatch)
    sched, wk, caches = _engine(llama_dir, "auto")
    a = H.make_request("a", q, max_tokens=8)
    sched.add_request(a)
    so, meta, _ = H.step_with_worker(sched, wk, caches, BS)
    assert meta.loads and not meta.async_loads  # alone: synchronous, in this step
    assert so.num_scheduled_tokens["a"] == 200 - 192
    sched.add_request(H.make_request("b", p))
    so, meta, out = H.step_with_worker(sched, wk, caches, BS)
    assert so.num_scheduled_tokens == {"a": 1} and meta.async_loads and not meta.loads
    for _ in range(2):  # b's copy in flight: a decodes on
        so, _, out = H.step_with_worker(sched, wk, caches, BS)
        assert so.num_scheduled_tokens == {"a": 1} and not out.finished_recving
    fences.land()
    so, _, out = H.step_with_worker(sched, wk, caches, BS)
    assert so.num_scheduled_tokens == {"a": 1} and out.finished_recving == {"b"}
    so, _, _ = H.step_with_worker(sched, wk, caches, BS)
    assert so.num_scheduled_tokens == {"a": 1, "b": 300 - 256}
    while sched.has_unfinished_requests():
        H.step_with_worker(sched, wk, caches, BS)
    assert len(a.output_token_ids) == 8 and fake_gateway.leases == {}


def test_lease_released_only_when_every_rank_finished(fake_gateway, llama_dir):
    p = _prompt(300)
    _stored(llama_dir, fake_gateway, p)
    sched, _, _ = _engine(llama_dir, "async")
    side = sched.connector._scheduler
    side.ledger.world_size = 2  # two TP ranks (every load job needs both reports)
    r = H.make_request("b", p)
    sched.add_request(r)
    so, meta = H.step(sched)
    (job,) = meta.async_loads
    from collections import Counter

    from xkv.connector.metadata import WorkerReport

    side.request_finished(r)  # aborted while both ranks copy: nothing released yet
    assert len(fake_gateway.leases) == 1
    side.update_connector_output(WorkerReport(Counter({job.job_id: 1})))
    assert len(fake_gateway.leases) == 1
    side.update_connector_output(WorkerReport(Counter({job.job_id: 1})))
    assert fake_gateway.leases == {}


def test_models_with_state_groups_stay_synchronous(monkeypatch):
    from xkv.connector.registry import CacheGroup, build_registry, state_group
    from xkv.connector.scheduler import SchedulerSide

    p = AsyncLoadPlanner("async", sync_only="recurrent-state groups")
    assert not p.enabled and not p.choose(96, busy=True)
    assert AsyncLoadPlanner("auto").choose(96, busy=True)
    assert not AsyncLoadPlanner("auto").choose(96, busy=False)
    assert not AsyncLoadPlanner("async").choose(0, busy=True)
    with pytest.raises(ValueError, match="load_mode='x'"):
        AsyncLoadPlanner("x")
    # a hybrid scheduler side in async mode plans an ordinary synchronous load
    gw = FakeGateway()
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    bs = 96
    att = CacheGroup(index=1, kind="attention", layer_names=("l1.attn",), block_size=bs,
                     block_bytes=24576, spec="FullAttentionSpec")
    m = state_group(CacheGroup(0, "MambaSpec", ("l0.mixer",), bs, 24576, "MambaSpec"), 18112)
    cfg = ConnectorConfig.from_extra({"chunk_size": bs, "load_mode": "async"})
    s = SchedulerSide(cfg, build_registry([m, att], tp_size=1, pp_size=1, chunk_size=bs),
                      ["fp0", "fp1"], hash_block_size=bs, world_size=1,
                      gateway_factory=gw.client)
    hashes = [bytes([i]) * 32 for i in range(3)]
    req = NS(request_id="a", block_hashes=hashes, num_tokens=300, num_prompt_tokens=300,
             kv_transfer_params=None, cache_salt=None)
    ids = ([0, 0, 11, 12], [31, 32, 33, 34])
    s.update_state_after_alloc(req, ids, 0)
    cached = NS(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    new = NS(req_id="a", block_ids=ids, num_computed_tokens=0)
    meta = s.build_connector_meta(NS(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                                     num_scheduled_tokens={"a": 288}))
    c = gw.client()
    for job in meta.saves:
        for gt in job.groups:
            c.commit(meta.layout_ids[gt.group], 0, [x.key for x in gt.chunks])
    s.request_finished(req)
    r = NS(**{**vars(req), "request_id": "b"})
    s.update_state_after_alloc(NS(request_id="busy"), ids, 0)  # another request is admitted
    assert s.get_num_new_matched_tokens(r, 0) == 288 and not s.load_async("b")
    s.update_state_after_alloc(r, ([0, 0, 41, 42], [61, 62, 63, 64]), 288)
    new = NS(req_id="b", block_ids=([0, 0, 41, 42], [61, 62, 63, 64]), num_computed_tokens=288)
    meta = s.build_connector_meta(NS(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                                     num_scheduled_tokens={"b": 12}))
    assert len(meta.loads) == 1 and not meta.async_loads
