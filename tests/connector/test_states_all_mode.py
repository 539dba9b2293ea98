"""vLLM's ``all`` Mamba cache mode on the scheduler side, without vLLM (hypothesis).

The oracle is a model of what vLLM 0.26-0.29 does in ``all`` mode, written from its Mamba2
mixer and metadata builder (``_compute_prefix_caching_block_indices``), not from
``xkv.connector.states``: a prefill step computing ``[C, E)`` writes, into the request's state
block list, the state after ``(j + 1) * block_size`` tokens at every index ``j`` from
``C // block_size`` to ``cdiv(E, block_size) - 2`` and its final state (after ``E``) at
``cdiv(E, block_size) - 1``; it reads its initial state from ``cdiv(C, block_size) - 1``. Block
lists are vLLM-shaped for ``all``: one real block per index (null padding only before a hit).
tests/connector/test_states_all_vllm.py checks the same against a real vLLM scheduler.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
from connector_fakes import FakeGateway
from hypothesis import given
from hypothesis import strategies as st

from xkv.connector.config import ConnectorConfig
from xkv.connector.registry import CacheGroup, RegistryError, build_registry, state_group
from xkv.connector.scheduler import SchedulerSide
from xkv.connector.states import saved_boundaries, saved_boundary


def cdiv(a, b):
    return -(-a // b)


def vllm_all_writes(c0: int, end: int, bs: int) -> dict[int, int]:
    """{block index: tokens its state stands for} written by a prefill step [c0, end)."""
    first, last = c0 // bs, cdiv(end, bs) - 1
    out = {j: (j + 1) * bs for j in range(first, last)}
    out[last] = end
    return out


def splits(draw_sizes, n, start):
    """Step boundaries [start, ..., n] from a list of step sizes (the last step takes the rest)."""
    ends, c = [], start
    for s in draw_sizes:
        if c >= n:
            break
        c = min(n, c + s)
        ends.append(c)
    if not ends or ends[-1] < n:
        ends.append(n)
    return ends


def test_saved_boundaries_examples():
    # one step over 300 tokens, chunk 96: 'all' has the states after 96, 192, 288
    assert saved_boundaries("all", 0, 300, 300, 96, 3) == [0, 1, 2]
    assert saved_boundaries("align", 0, 300, 300, 96, 3) == []  # the step ends mid-chunk
    assert saved_boundaries("all", 96, 100, 300, 96, 3) == [1]  # 96 itself was saved before
    assert saved_boundaries("all", 100, 200, 300, 96, 3) == [1, 2]
    assert saved_boundaries("all", 0, 300, 300, 96, 2) == [0, 1]  # chunk 2 has no key
    assert saved_boundaries("all", 288, 1, 300, 96, 3) == []
    assert saved_boundaries("all", 300, 1, 300, 96, 3) == []  # decode: past the prompt
    assert saved_boundaries("all", 0, 0, 300, 96, 3) == []
    for args in [(0, 288, 300, 96, 3), (288, 12, 300, 96, 3), (0, 288, 300, 192, 1)]:
        c = saved_boundary(*args)
        assert saved_boundaries("align", *args) == ([] if c is None else [c])
    with pytest.raises(ValueError, match="'none'"):
        saved_boundaries("none", 0, 96, 300, 96, 3)
    with pytest.raises(RegistryError, match="Mamba cache mode 'none'"):
        state_group(CacheGroup(0, "MambaSpec", ("m",), 16, 64), 10, "none")


@given(bs=st.sampled_from([1, 16, 96]), k=st.integers(1, 4), n=st.integers(1, 900),
       start_chunks=st.integers(0, 3), sizes=st.lists(st.integers(1, 400), max_size=12),
       hashed_cut=st.integers(0, 3))
def test_all_mode_saves_where_vllm_wrote_each_boundary(bs, k, n, start_chunks, sizes, hashed_cut):
    """Over any chunked-prefill split (and a restored start): every chunk boundary inside the
    prompt with a key is saved exactly once, in the step that crossed it, from a block vLLM
    wrote that boundary's state into in that step."""
    chunk = bs * k
    start = min(start_chunks * chunk, (n - 1) // chunk * chunk)  # a restored prefix (chunk end)
    hashed = max(0, n // chunk - hashed_cut)
    seen: list[int] = []
    c0 = start
    for end in splits(sizes, n, start):
        wrote = vllm_all_writes(c0, end, bs)
        for c in saved_boundaries("all", c0, end - c0, n, chunk, hashed):
            i = (c + 1) * k - 1
            assert wrote.get(i) == (c + 1) * chunk, (c0, end, c)
            seen.append(c)
        c0 = end
    assert seen == list(range(start // chunk, hashed))


# ------------------------------------------------------------------ the scheduler side, 'all'

def _sched(gw, bs, chunk, mode="all"):
    cfg = ConnectorConfig.from_extra({"chunk_size": chunk, "lookup_timeout_ms": 1000},
                                     {"PYTHONHASHSEED": "0"})
    groups = [state_group(CacheGroup(0, "MambaSpec", ("l0.mixer",), bs, 4096, "MambaSpec"),
                          1000, mode),
              CacheGroup(1, "attention", ("l1.attn",), bs, 4096, "FullAttentionSpec")]
    reg = build_registry(groups, tp_size=1, pp_size=1, chunk_size=chunk)
    return SchedulerSide(cfg, reg, [f"fp-state-{mode}", "fp-attn"], hash_block_size=bs,
                         world_size=1, gateway_factory=gw.client)


def _req(rid, hashes, n):
    return NS(request_id=rid, block_hashes=list(hashes), num_tokens=n, num_prompt_tokens=n,
              kv_transfer_params=None, cache_salt=None)


def _so(new=(), cached=(), sched=None):
    c = NS(req_ids=[r[0] for r in cached], resumed_req_ids=set(),
           new_block_ids=[r[1] for r in cached], num_computed_tokens=[r[2] for r in cached])
    return NS(scheduled_new_reqs=list(new), scheduled_cached_reqs=c,
              num_scheduled_tokens=dict(sched or {}))


def _store(s, gw, req, n, bs, ends, ids0):
    """Run ``req`` through steps ending at ``ends`` with 'all'-shaped block lists (a new real
    block per block index, per group); commit every save. Returns the state saves
    [(chunk key, block id)] and the block lists."""
    nxt = [ids0]
    lists = ([], [])

    def grow(upto):
        out = ([], [])
        for g in (0, 1):
            while len(lists[g]) < cdiv(upto, bs):
                lists[g].append(nxt[0])
                out[g].append(nxt[0])
                nxt[0] += 1
        return out

    grow(ends[0])
    s.update_state_after_alloc(req, [list(x) for x in lists], 0)
    saved, c0 = [], 0
    for i, end in enumerate(ends):
        if i == 0:
            so = _so([NS(req_id=req.request_id, block_ids=[list(x) for x in lists],
                         num_computed_tokens=0)], sched={req.request_id: end})
        else:
            so = _so(cached=[(req.request_id, grow(end), c0)], sched={req.request_id: end - c0})
        meta = s.build_connector_meta(so)
        cl = gw.client()
        for job in meta.saves:
            for gt in job.groups:
                cl.commit(meta.layout_ids[gt.group], 0, [r.key for r in gt.chunks])
                if gt.group == 0:
                    saved += [(r.key, b) for r, b in zip(gt.chunks, gt.block_ids, strict=True)]
        c0 = end
    s.request_finished(req)
    return saved, lists


@given(bs=st.sampled_from([16, 32]), k=st.integers(1, 3), n=st.integers(2, 500),
       sizes=st.lists(st.integers(1, 300), max_size=6), seed=st.integers(0, 2**16))
def test_all_mode_store_then_restore_boundary_block_only(bs, k, n, sizes, seed):
    chunk = bs * k
    gw = FakeGateway(capacity=1 << 24)
    s = _sched(gw, bs, chunk)
    hashes = [seed.to_bytes(4, "little") + i.to_bytes(4, "little") for i in range(n // bs)]
    ends = splits(sizes, n, 0)
    saved, lists = _store(s, gw, _req("a", hashes, n), n, bs, ends, 1)
    keys = [hashes[(c + 1) * k - 1] for c in range(n // chunk)]
    assert [key for key, _ in saved] == keys  # every boundary's state, in order, once
    for c, (_, b) in enumerate(saved):
        assert b == lists[0][(c + 1) * k - 1]
    # a fresh request: hit at the last chunk boundary before the last token; its state goes to
    # the block vLLM reads the step's initial state from, and nowhere else
    r = _req("b", hashes, n)
    hit = (n - 1) // chunk * chunk
    assert s.get_num_new_matched_tokens(r, 0) == hit
    if not hit:
        return
    nb = cdiv(n, bs)
    state_ids = [0] * (hit // bs - 1) + list(range(9000, 9000 + nb - hit // bs + 1))
    attn_ids = list(range(5000, 5000 + nb))
    s.update_state_after_alloc(r, [state_ids, attn_ids], hit)
    meta = s.build_connector_meta(_so([NS(req_id="b", block_ids=[state_ids, attn_ids],
                                          num_computed_tokens=hit)], sched={"b": n - hit}))
    (job,) = meta.loads
    by = {gt.group: gt for gt in job.groups}
    assert by[0].block_ids == (state_ids[cdiv(hit, bs) - 1],)
    assert [c.key for c in by[0].chunks] == [keys[hit // chunk - 1]]
    assert by[1].block_ids == tuple(attn_ids[:hit // bs])
    s.request_finished(r)
    assert gw.leases == {}


def test_align_mode_keeps_the_running_block():
    """Same plan in 'align' mode: the running block is written too (preprocess_mamba copied
    the boundary block into it before start_load_kv)."""
    bs, chunk, n = 16, 32, 100
    gw = FakeGateway(capacity=1 << 24)
    s = _sched(gw, bs, chunk, mode="align")
    hashes = [bytes([7, i]) * 8 for i in range(n // bs)]
    _store(s, gw, _req("a", hashes, n), n, bs, [32, 64, 96, 100], 1)
    r = _req("b", hashes, n)
    assert s.get_num_new_matched_tokens(r, 0) == 96
    state_ids = [0, 0, 0, 0, 0, 41, 42]  # boundary at index 5, running block at index 6
    attn = list(range(60, 67))
    s.update_state_after_alloc(r, [state_ids, attn], 96)
    meta = s.build_connector_meta(_so([NS(req_id="b", block_ids=[state_ids, attn],
                                          num_computed_tokens=96)], sched={"b": 4}))
    assert {gt.group: gt.block_ids for gt in meta.loads[0].groups}[0] == (41, 42)
