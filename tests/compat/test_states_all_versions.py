"""vLLM's ``all`` Mamba cache mode against this vLLM's own ``Scheduler`` (its ``MambaManager``
and hybrid coordinator; no forward) and a fake gateway: the connector's state saves and restores
land exactly where vLLM keeps those states. Runs on every version of scripts/matrix.sh; 0.33 has
no ``all`` mode (its ``MambaCacheMode`` is ``align``/``none``), so only the ``align`` cases run.

Oracles from vLLM itself, not from xkv's formulas:

* a saved state block is the block vLLM's own prefix cache holds the state of that boundary in
  (its ``block_hash`` is the request's hash of the boundary's block, group-tagged);
* the restore block is the block the Mamba kernels read the step's initial state from: index
  ``block_idx_last_computed_token`` (vLLM's ``_compute_prefix_caching_block_indices`` formula,
  ``cdiv(num_computed, block_size) - 1``) of the request's block table as vLLM allocated it;
* with ``align`` on the same scheduler, only step-end states are saved and the running block is
  written too (the behaviour the CPU engine tests check end to end).
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path

import pytest
import vllm_harness as H
from vllm.config.cache import MambaCacheMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connector"))
from connector_fakes import FakeGateway  # noqa: E402

pytestmark = pytest.mark.vllm
HAS_ALL = "all" in typing.get_args(MambaCacheMode)
needs_all = pytest.mark.skipif(not HAS_ALL, reason="this vLLM has no 'all' Mamba cache mode")

BS = 16
NB = 200
MAMBA_G, ATTN_G = 0, 1  # make_hybrid's group order


def _prompt(n, base=10):
    return [(base + 3 * i) % 1000 + 4 for i in range(n)]


@pytest.fixture
def fake_gateway(monkeypatch):
    """A FakeGateway that every FusIOnXConnector built in this test talks to."""
    import xkv.connector.setup as setup

    gw = FakeGateway()
    monkeypatch.setattr(setup, "gateway_factory", lambda cfg, timeout_s: gw.client)
    return gw


def test_all_mode_exists_up_to_029():
    """The versions whose MambaCacheMode has 'all' (where the cases below run) are 0.26-0.29."""
    import vllm

    minor = tuple(int(x) for x in vllm.__version__.split(".")[:2])
    assert (minor <= (0, 29)) == HAS_ALL  # 0.32 (matrix) and 0.33 have align and none only


def _sched(llama_dir, mode, chunk, budget):
    kvc, _, _, _, _ = H.make_hybrid(BS, NB, mode=mode)
    vc = H.make_vllm_config(llama_dir, block_size=BS, policy="recompute",
                            max_num_batched_tokens=budget,
                            extra={"chunk_size": chunk, "lookup_timeout_ms": 1000})
    vc.cache_config.mamba_cache_mode = mode
    return H.make_scheduler(vc, kvc)


def _group_hash(block_hash, group):
    from vllm.v1.core import kv_cache_utils as ku

    make = getattr(ku, "make_block_hash_with_group_id", None)
    return make(block_hash, group) if make else (block_hash, group)


def _run_store(s, gw, req):
    """Run ``req`` to completion, committing every save; returns [(state chunk, block id,
    block hash vLLM gave that block after the step)]."""
    s.add_request(req)
    saved = []
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        so, meta = H.step(s)
        c = gw.client()
        for job in meta.saves:
            for gt in job.groups:
                c.commit(meta.layout_ids[gt.group], 0, [r.key for r in gt.chunks])
                if s.connector._scheduler.registry.groups[gt.group].is_state:
                    for b, ref in zip(gt.block_ids, gt.chunks, strict=True):
                        blk = s.kv_cache_manager.block_pool.blocks[b]
                        saved.append((ref.key, b, blk.block_hash))
    assert not s.has_unfinished_requests()
    return saved


@needs_all
@pytest.mark.parametrize("n,chunk,budget", [(300, 16, 2048), (300, 32, 64), (161, 48, 80),
                                            (97, 16, 40)])
def test_all_mode_saves_every_crossed_boundary_and_restores_the_read_block(
        llama_dir, fake_gateway, n, chunk, budget):
    s = _sched(llama_dir, "all", chunk, budget)
    req = H.make_request("a", _prompt(n), block_size=BS)
    saved = _run_store(s, fake_gateway, req)
    k = chunk // BS
    n_chunks = n // chunk  # every chunk boundary inside the prompt, whatever the step split
    assert len(saved) == n_chunks
    for c, (_key, b, bh) in enumerate(saved):
        # vLLM's prefix cache keeps the state after (c + 1) * chunk tokens in exactly this block
        assert bh == _group_hash(req.block_hashes[(c + 1) * k - 1], MAMBA_G), (c, b)

    s.reset_prefix_cache()
    r = H.make_request("b", _prompt(n), block_size=BS)
    s.add_request(r)
    so, meta = H.step(s)
    hit = min(n_chunks, (n - 1) // chunk) * chunk
    assert so.num_scheduled_tokens["b"] == n - hit or (hit == 0 and not meta.loads)
    if not hit:
        return
    (job,) = meta.loads
    by = {gt.group: gt for gt in job.groups}
    mamba_ids = s.kv_cache_manager.get_block_ids("b")[MAMBA_G]
    read = -(-hit // BS) - 1  # block_idx_last_computed_token of this step
    assert by[MAMBA_G].block_ids == (mamba_ids[read],)  # that block only: no pre-copy in 'all'
    assert by[MAMBA_G].chunks[0].key == saved[hit // chunk - 1][0]
    assert by[ATTN_G].block_ids == tuple(s.kv_cache_manager.get_block_ids("b")[ATTN_G][:hit // BS])


def test_align_mode_on_the_same_scheduler_saves_step_ends_only(llama_dir, fake_gateway):
    """The contrast: 'align' saves the state of the step end only (a budget of 64 tokens ends
    steps at 64, 128, ...; chunk 32 -> the odd chunks have no state) and restores into the
    boundary AND the running block."""
    s = _sched(llama_dir, "align", 32, 64)
    req = H.make_request("a", _prompt(300), block_size=BS)
    saved = _run_store(s, fake_gateway, req)
    assert len(saved) < 300 // 32
    s.reset_prefix_cache()
    r = H.make_request("b", _prompt(300), block_size=BS)
    s.add_request(r)
    so, meta = H.step(s)
    (job,) = meta.loads
    by = {gt.group: gt for gt in job.groups}
    assert len(by[MAMBA_G].block_ids) == 2  # boundary + running block


@needs_all
def test_fingerprints_differ_between_modes(llama_dir, monkeypatch):
    """Objects stored by an engine in one Mamba cache mode are never read by one in the other:
    every group's layout fingerprint (state and attention) carries the mode."""
    from xkv.connector import setup

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    fps = {}
    for mode in ("align", "all", "all"):
        kvc, _, _, _, _ = H.make_hybrid(BS, NB, mode=mode)
        vc = H.make_vllm_config(llama_dir, block_size=BS, extra={"chunk_size": BS})
        vc.cache_config.mamba_cache_mode = mode
        got = setup.build(vc, kvc, vc.kv_transfer_config)
        assert [p.group.state_mode for p in got.registry.groups] == [mode, ""]
        assert fps.setdefault(mode, got.fingerprints) == got.fingerprints  # deterministic
    assert len(fps["all"]) == 2
    for a, b in zip(fps["align"], fps["all"], strict=True):
        assert a != b


@pytest.mark.parametrize("mode,prefix,block,match", [
    ("none", True, BS, "prefix caching is off"),
    ("align", False, BS, "prefix caching is off"),
    pytest.param("all", True, 2 * BS, "Mamba block size 16 but attention block size 32",
                 marks=needs_all),
])
def test_refusals(llama_dir, mode, prefix, block, match):
    from xkv.connector import setup
    from xkv.connector.config import ConfigError

    kvc, _, _, _, _ = H.make_hybrid(BS, NB, mode=mode)
    vc = H.make_vllm_config(llama_dir, block_size=block, extra={"chunk_size": 2 * BS})
    vc.cache_config.mamba_cache_mode = mode
    vc.cache_config.enable_prefix_caching = prefix
    with pytest.raises(ConfigError, match=match):
        setup.build(vc, kvc, vc.kv_transfer_config)


def test_state_pages_move_with_the_gpu_kernel():
    """State pages in this vLLM's register form (26: a list of typed states; 28: an int8 padded
    page; 29+: an int8 content view) move bit-exactly through the Triton page-copy kernel, the
    one the CUDA handler runs (here under TRITON_INTERPRET), via the prepared entry points the
    worker uses; the page padding is never touched."""
    import torch

    import xkv.kernels as K
    from xkv.connector import compat
    from xkv.layout import describe_cache

    nb = 8
    _, caches, buf, page, state = H.make_hybrid(BS, nb, mode="align")
    mamba, _ = H.HYBRID_LAYERS
    pool = describe_cache(compat.state_views(caches, {mamba: state})[mamba], num_blocks=nb,
                          kind="mamba")
    assert pool.block_bytes == state
    g = torch.Generator().manual_seed(5)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))
    card = torch.full((4 * state,), 0x5A, dtype=torch.uint8)
    offs = torch.tensor([[state, 3 * state]])
    K.prepare_save([pool], torch.tensor([5, 2]), card, offs, engine="triton").launch(0)
    for b, o in ((5, state), (2, 3 * state)):
        assert card[o:o + state].equal(buf[b * page:b * page + state])
    assert (card[:state] == 0x5A).all() and (card[2 * state:3 * state] == 0x5A).all()
    before = buf.clone()
    for b in (1, 6):
        buf[b * page:(b + 1) * page] = 0xA5
    K.prepare_restore(card, offs, [pool], torch.tensor([1, 6]), engine="triton").launch(0)
    for b, src in ((1, 5), (6, 2)):
        assert buf[b * page:b * page + state].equal(before[src * page:src * page + state])
        assert (buf[b * page + state:(b + 1) * page] == 0xA5).all()  # padding untouched
    others = [b for b in range(nb) if b not in (1, 6)]
    for b in others:
        assert buf[b * page:(b + 1) * page].equal(before[b * page:(b + 1) * page])
