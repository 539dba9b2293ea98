"""Worker side on real vLLM CPU cache views (allocate_kv_cache), both roles in one process.

Engine 1 computes a prompt (simulated forward writing deterministic page bytes) and saves it
through the fake gateway's card; engine 2, with fresh poisoned caches, restores it: the restored
pages must equal the saved bytes exactly, block for block and layer for layer.
"""

import logging
from unittest import mock

import pytest
import torch
from connector_fakes import Warnings

from xkv.connector import compat

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")  # only vLLM may be missing: a broken harness must fail
import vllm_harness as H  # noqa: E402

CHUNK = 64


def _prompt(n, base=10):
    return [(base + i) % 1000 + 4 for i in range(n)]


def _engine(llama_dir, *, mla=False, extra=None, layout=None):
    bs = 16 if mla else 32
    vc = H.make_vllm_config(llama_dir, policy="recompute", block_size=bs, extra={"chunk_size": CHUNK, **(extra or {})})
    layout = layout or ("LBNHC" if mla else "LBHNC")  # what vLLM's CPU backends resolve
    kcfg = H.attention_cache_config(block_size=bs, mla=mla)
    kcfg.kv_cache_layout = layout
    sched = H.make_scheduler(vc, kcfg)
    wk, caches = H.make_worker_caches(vc, H.attention_cache_config(block_size=bs, mla=mla), layout=layout)
    return sched, wk, caches, bs


def _run(sched, wk, caches, bs, req, **kw):
    sched.add_request(req)
    outs = []
    while sched.has_unfinished_requests():
        outs.append(H.step_with_worker(sched, wk, caches, bs, **kw))
    return outs


def _assert_blocks_hold(p, block_ids, caches, bs):
    """Block ``i`` of ``block_ids`` holds, in every layer, the bytes the simulated forward wrote
    for the prompt ``p``'s first ``(i + 1) * bs`` tokens."""
    for i, bid in enumerate(block_ids):
        for name, kv in caches.items():
            want = H.pattern(p[: (i + 1) * bs], name, H.page(kv, 0).numel())
            assert torch.equal(H.page(kv, bid), want), (name, i)


@pytest.mark.parametrize("save_mode", ["layer", "step"])
@pytest.mark.parametrize("mla", [False, True], ids=["llama", "mla"])
@pytest.mark.parametrize("n", [300, 200])
def test_save_then_restore_bit_exact(fake_gateway, llama_dir, mla, n, save_mode):
    s1, w1, c1, bs = _engine(llama_dir, mla=mla, extra={"save_mode": save_mode})
    p = _prompt(n)
    _run(s1, w1, c1, bs, H.make_request("a", p, block_size=bs))
    assert len(fake_gateway.committed(1)) == n // CHUNK
    s2, w2, c2, _ = _engine(llama_dir, mla=mla)
    r = H.make_request("b", p, block_size=bs)
    s2.add_request(r)
    so, meta, out = H.step_with_worker(s2, w2, c2, bs)
    expect = (n - 1) // CHUNK * CHUNK
    assert so.num_scheduled_tokens["b"] == n - expect and not out.invalid_block_ids
    (gt,) = meta.loads[0].groups
    assert len(gt.block_ids) == expect // bs
    _assert_blocks_hold(p, gt.block_ids, c2, bs)
    st = out.kv_connector_stats.data
    assert st["blocks_restored"] == expect // bs
    assert st["bytes_restored"] == expect // bs * len(c2) * H.page(c2[next(iter(c2))], 0).numel()


@pytest.mark.parametrize("mla", [False, True], ids=["llama", "mla"])
def test_full_hit_restores_all_but_the_last_token(fake_gateway, llama_dir, mla):
    """Issue 24: a stored prompt is restored up to its last token (the last block partly, fenced
    before the forward), the step computes one token and is a light step for the handler
    (``full_hit_restore``: on by default since the H200 run of 2026-12-03)."""
    s1, w1, c1, bs = _engine(llama_dir, mla=mla)
    n = 4 * CHUNK
    p = _prompt(n)
    _run(s1, w1, c1, bs, H.make_request("a", p, block_size=bs))
    s2, w2, c2, _ = _engine(llama_dir, mla=mla, extra={"full_hit_restore": True})
    r = H.make_request("b", p, block_size=bs)
    s2.add_request(r)
    so, meta, out = H.step_with_worker(s2, w2, c2, bs)
    assert so.num_scheduled_tokens["b"] == 1 and not out.invalid_block_ids
    assert meta.scheduled_tokens == 1 and w2._worker.handler.light_step
    (gt,) = meta.loads[0].groups
    assert len(gt.block_ids) == n // bs and gt.tail == 1
    _assert_blocks_hold(p, gt.block_ids, c2, bs)


@pytest.mark.parametrize("mla", [False, True], ids=["llama", "mla"])
def test_piecewise_restores_leave_two_tokens_and_stay_exact(fake_gateway, llama_dir, mla, caplog):
    """``piecewise_restores_from`` (with ``full_cuda_graphs``): a full hit of an attention model
    leaves two tokens to compute (a step vLLM does not replay as a full graph), the last block
    restored up to them, byte for byte; an MLA model keeps its one-token step and says so."""
    s1, w1, c1, bs = _engine(llama_dir, mla=mla)
    n = 4 * CHUNK
    p = _prompt(n)
    _run(s1, w1, c1, bs, H.make_request("a", p, block_size=bs))
    with caplog.at_level(logging.INFO, logger="xkv"):
        logging.getLogger("xkv").propagate = True
        s2, w2, c2, _ = _engine(llama_dir, mla=mla, extra={"full_cuda_graphs": True,
                                                           "piecewise_restores_from": 1})
    r = H.make_request("b", p, block_size=bs)
    s2.add_request(r)
    for kv in c2.values():
        kv.fill_(-3)  # poisoned: every restored byte must come from the card
    so, meta, out = H.step_with_worker(s2, w2, c2, bs)
    computed = 1 if mla else 2
    assert so.num_scheduled_tokens["b"] == computed and not out.invalid_block_ids
    assert meta.loads[0].num_tokens == n - computed
    (gt,) = meta.loads[0].groups
    assert len(gt.block_ids) == n // bs and gt.tail == 1
    _assert_blocks_hold(p, gt.block_ids, c2, bs)
    needle = ("piecewise_restores_from has no effect here (an MLA model)" if mla
              else "full hits of >= 1 restored tokens leave vLLM two tokens to compute")
    assert needle in caplog.text


def test_registration_log_lines(fake_gateway, llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="xkv"):
        logging.getLogger("xkv").propagate = True
        _engine(llama_dir)
    text = caplog.text
    assert "XKV: 2 cache tensors registered for exchange" in text
    assert "KV cache registry: 2 cache(s) in 1 group(s); writers: " in text
    assert "KV cache layout: 1 group(s)" in text


def test_evicted_slot_is_a_load_error(fake_gateway, llama_dir):
    s1, w1, c1, bs = _engine(llama_dir, extra={})
    p = _prompt(300)
    _run(s1, w1, c1, bs, H.make_request("a", p))
    s2, w2, c2, _ = _engine(llama_dir, extra={})
    s2.add_request(H.make_request("b", p))
    # the gateway reuses chunk 1's slot between the lookup and the copy
    orig = s2.connector._scheduler.build_connector_meta

    def bump(so):
        m = orig(so)
        off = m.loads[0].groups[0].chunks[1].offsets[0]
        fake_gateway.gens[off] += 1
        return m

    s2.connector._scheduler.build_connector_meta = bump
    so, meta, out = H.step_with_worker(s2, w2, c2, bs)
    gt = meta.loads[0].groups[0]
    assert out.invalid_block_ids == {gt.block_ids[2], gt.block_ids[3]}
    # policy "recompute": vLLM rewinds to the first bad block and computes the rest again
    assert s2.requests["b"].num_computed_tokens == 64


def test_layers_without_a_save_hook_are_saved_after_the_forward(fake_gateway, llama_dir):
    """Only the first layer's save_kv_layer comes (the other's class bypasses vLLM's decorated
    op): the other layer is saved in wait_for_save, every chunk is committed, a fresh engine
    restores both layers bit-exact, and the miss is warned about once, not every step."""
    # both layers known to call the hooks: the miss is unexpected
    with mock.patch.object(compat, "layer_hooks",
                           lambda vc, kv: {n: (True, "Attention") for n in kv}):
        # layer mode: a layer whose hook never came is caught up after the forward (step mode
        # saves every layer there anyway: test_step_saves.py)
        s1, w1, c1, bs = _engine(llama_dir, extra={"save_mode": "layer"})
    p = _prompt(300)
    with Warnings() as warned:
        _run(s1, w1, c1, bs, H.make_request("a", p), layers_saved=1)
        _run(s1, w1, c1, bs, H.make_request("a2", _prompt(300, base=500)), layers_saved=1)
    assert len(fake_gateway.committed(1)) == 2 * (300 // CHUNK)
    assert not any(m[0] == "abort" for m in fake_gateway.messages)
    assert warned.count("did not call save_kv_layer") == 1
    s2, w2, c2, _ = _engine(llama_dir)
    s2.add_request(H.make_request("b", p, block_size=bs))
    so, meta, out = H.step_with_worker(s2, w2, c2, bs)
    (gt,) = meta.loads[0].groups
    assert not out.invalid_block_ids and len(gt.block_ids) == 256 // bs
    _assert_blocks_hold(p, gt.block_ids, c2, bs)


def test_worker_turns_off_once(fake_gateway, llama_dir, caplog):
    s1, w1, c1, bs = _engine(llama_dir)
    p = _prompt(300)
    _run(s1, w1, c1, bs, H.make_request("a", p))
    logging.getLogger("xkv").propagate = True
    with caplog.at_level(logging.WARNING, logger="xkv"):
        s2, w2, c2, _ = _engine(llama_dir)
        r = H.make_request("b", p)
        s2.add_request(r)
        assert s2.connector.get_num_new_matched_tokens(r, 0) == (256, False)
        fake_gateway.dead = True  # dies after the lookup was answered
        so, meta, out = H.step_with_worker(s2, w2, c2, bs)
        # the promised load still runs from the mapped card: no error, right bytes
        assert meta.loads and not out.invalid_block_ids
        gt = meta.loads[0].groups[0]
        name = next(iter(c2))
        want = H.pattern(p[:32], name, H.page(c2[name], 0).numel())
        assert torch.equal(H.page(c2[name], gt.block_ids[0]), want)
        n0 = len(fake_gateway.messages)
        _run(s2, w2, c2, bs, H.make_request("c", _prompt(300, base=77)))
        _run(s2, w2, c2, bs, H.make_request("d", _prompt(300, base=99)))
        assert len(fake_gateway.messages) == n0
    assert caplog.text.count("External KV cache turned off on this rank") == 1


def test_loads_from_another_gateway_are_errors(fake_gateway, llama_dir):
    s1, w1, c1, bs = _engine(llama_dir)
    p = _prompt(300)
    _run(s1, w1, c1, bs, H.make_request("a", p))
    s2, w2, c2, _ = _engine(llama_dir)
    w2._worker.session.epoch = 12345  # the worker mapped another gateway process's card
    s2.add_request(H.make_request("b", p))
    so, meta, out = H.step_with_worker(s2, w2, c2, bs)
    assert out.invalid_block_ids == set(meta.loads[0].groups[0].block_ids)
    assert w2._worker.turned_off
    # recompute policy: the request is rewound to token 0 and recomputed
    assert s2.requests["b"].num_computed_tokens == 0
