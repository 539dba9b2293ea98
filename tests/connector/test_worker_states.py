"""Worker side of a state group on vLLM-0.29-shaped CPU tensors (no engine): state pages saved
in ``wait_for_save`` (state layers have no save hook), restored into the boundary and the running
block bit-exactly without touching page padding, and a promised load that cannot complete
stops with a clear error (multi-group models cannot take block load errors)."""

from __future__ import annotations

import pytest
import torch
from connector_fakes import FakeGateway

from xkv.connector.metadata import ChunkRef, GroupTransfer, StepMetadata, TransferJob
from xkv.connector.registry import CacheGroup, build_registry, state_group
from xkv.connector.worker import WorkerSide

NB, BS, H, D = 12, 32, 2, 16  # blocks, tokens per block, KV heads, head dim (fp32)
PAGE = H * BS * 2 * D * 4  # attention page bytes = the padded state page
STATE = 1000  # state content bytes (conv + SSM), less than the page: padded stride


def _caches():
    """One int8 buffer, overlaid as vLLM 0.29 does: attention [B, H, N, 2D] fp32 (LBHNC) and
    the state layer [B, 1, 1, STATE] int8 with a padded block stride."""
    buf = torch.zeros(2 * NB * PAGE, dtype=torch.int8)
    attn = buf[: NB * PAGE].view(torch.float32).view(NB, H, BS, 2 * D)
    state = torch.as_strided(buf[NB * PAGE:], (NB, 1, 1, STATE), (PAGE, STATE, STATE, 1))
    return {"l1.attn": attn, "l0.mixer": state}, buf


def _worker(gw):
    att = CacheGroup(1, "attention", ("l1.attn",), BS, PAGE, "FullAttentionSpec")
    st = state_group(CacheGroup(0, "MambaSpec", ("l0.mixer",), BS, PAGE, "MambaSpec"), STATE)
    reg = build_registry([st, att], tp_size=1, pp_size=1, chunk_size=BS)
    w = WorkerSide(reg, ["fp-state", "fp-attn"], namespace="t", tp_rank=0,
                   gateway_factory=gw.client)
    caches, buf = _caches()
    w.register_kv_caches(caches, num_blocks=NB, layout="LBHNC")
    return w, caches, buf


def _state_page(buf, b):
    return buf[NB * PAGE + b * PAGE: NB * PAGE + (b + 1) * PAGE]


def test_state_save_then_restore_boundary_and_running(monkeypatch):
    gw = FakeGateway()
    w, caches, buf = _worker(gw)
    lid = w.layout_ids[0]
    torch.manual_seed(0)
    _state_page(buf, 5)[:STATE] = torch.randint(-128, 127, (STATE,), dtype=torch.int8)
    want = _state_page(buf, 5)[:STATE].clone()
    (r,) = gw.client().reserve(lid, [b"k" * 32])
    ref = ChunkRef(r.key, r.offsets, r.generations)
    save = TransferJob(1, "a", (GroupTransfer(0, (5,), (0,), (0,), (ref,)),), BS)
    w.bind(StepMetadata(saves=(save,), epoch=gw.epoch, layout_ids=w.layout_ids))
    w.wait_for_save()  # no save_kv_layer call: vLLM never calls it for state layers
    assert r.key in gw.committed(lid)
    card = torch.frombuffer(gw.card, dtype=torch.int8)
    assert torch.equal(card[r.offsets[0]: r.offsets[0] + STATE], want)

    for b in (7, 9):  # poison the destinations, padding included
        _state_page(buf, b).fill_(-91)
    load = TransferJob(2, "b", (GroupTransfer(0, (7, 9), (0, 0), (0, 0), (ref,)),), BS)
    w.bind(StepMetadata(loads=(load,), epoch=gw.epoch, layout_ids=w.layout_ids))
    w.start_load_kv()
    w.get_finished()
    for b in (7, 9):  # boundary block and running block both hold the stored state
        assert torch.equal(_state_page(buf, b)[:STATE], want)
        assert bool((_state_page(buf, b)[STATE:] == -91).all())  # padding untouched
    assert not w.take_load_errors()
    assert w.take_report().loads_done == {2: 1}


def test_unloadable_promise_stops_multi_group(monkeypatch):
    gw = FakeGateway()
    w, _, _ = _worker(gw)
    (r,) = gw.client().reserve(w.layout_ids[0], [b"q" * 32])
    gw.client().commit(w.layout_ids[0], 0, [r.key])
    ref = ChunkRef(r.key, r.offsets, r.generations)
    load = TransferJob(3, "c", (GroupTransfer(0, (4,), (0,), (0,), (ref,)),), BS)
    w.bind(StepMetadata(loads=(load,), epoch=gw.epoch + 1, layout_ids=w.layout_ids))
    with pytest.raises(RuntimeError, match="cannot recompute blocks of a model with several"):
        w.start_load_kv()
    # a slot reused between lookup and copy (lease outlived): same stop, never wrong bytes
    stale = ChunkRef(r.key, r.offsets, tuple(g - 1 for g in r.generations))
    load = TransferJob(4, "d", (GroupTransfer(0, (4,), (0,), (0,), (stale,)),), BS)
    w.bind(StepMetadata(loads=(load,), epoch=gw.epoch, layout_ids=w.layout_ids))
    w.start_load_kv()
    with pytest.raises(RuntimeError, match="was reused"):
        w.get_finished()


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_cuda_shaped_state_tensors_register_under_either_attention_layout(layout):
    """vLLM 0.26 on CUDA hands a Mamba2 layer over as [conv (B, K-1, conv_dim) bf16, SSM
    (B, heads, head_dim, state) fp32] views of one padded page; the attention layout (NHD on
    the H200: LBNHC) describes attention pages, not the 4-D SSM view, so it must not be checked
    against it (the H200 run of 2026-12-01 refused to start on exactly that). Saved and restored
    byte-exact into a poisoned page, padding untouched."""
    heads, hd, ss, conv_dim, k1 = 4, 8, 16, 40, 3
    conv_b, ssm_b = k1 * conv_dim * 2, heads * hd * ss * 4
    buf = torch.zeros(2 * NB * PAGE, dtype=torch.int8)
    attn = buf[: NB * PAGE].view(torch.float32).view(NB, H, BS, 2 * D)
    if layout == "LBNHC":
        attn = buf[: NB * PAGE].view(torch.float32).view(NB, BS, H, 2 * D).transpose(1, 2)
    sbuf = buf[NB * PAGE:]
    conv = torch.as_strided(sbuf.view(torch.bfloat16), (NB, k1, conv_dim), (PAGE // 2, conv_dim, 1))
    ssm = torch.as_strided(sbuf.view(torch.float32), (NB, heads, hd, ss),
                           (PAGE // 4, hd * ss, ss, 1), (NB * PAGE + conv_b) // 4)
    gw = FakeGateway()
    att = CacheGroup(1, "attention", ("l1.attn",), BS, PAGE, "FullAttentionSpec")
    st = state_group(CacheGroup(0, "MambaSpec", ("l0.mixer",), BS, PAGE, "MambaSpec"),
                     conv_b + ssm_b)
    reg = build_registry([st, att], tp_size=1, pp_size=1, chunk_size=BS)
    w = WorkerSide(reg, ["fp-state", "fp-attn"], namespace="t", tp_rank=0,
                   gateway_factory=gw.client)
    w.register_kv_caches({"l1.attn": attn, "l0.mixer": [conv, ssm]}, num_blocks=NB, layout=layout)
    lid = w.layout_ids[0]
    g = torch.Generator().manual_seed(3)
    page = _state_page(buf, 4)
    page[: conv_b + ssm_b] = torch.randint(-128, 127, (conv_b + ssm_b,), dtype=torch.int8,
                                           generator=g)
    want = page[: conv_b + ssm_b].clone()
    (r,) = gw.client().reserve(lid, [b"c" * 32])
    ref = ChunkRef(r.key, r.offsets, r.generations)
    w.bind(StepMetadata(saves=(TransferJob(1, "a", (GroupTransfer(0, (4,), (0,), (0,), (ref,)),),
                                           BS),), epoch=gw.epoch, layout_ids=w.layout_ids))
    w.wait_for_save()
    _state_page(buf, 10).fill_(-77)
    w.bind(StepMetadata(loads=(TransferJob(2, "b", (GroupTransfer(0, (10,), (0,), (0,), (ref,)),),
                                           BS),), epoch=gw.epoch, layout_ids=w.layout_ids))
    w.start_load_kv()
    w.get_finished()
    assert torch.equal(_state_page(buf, 10)[: conv_b + ssm_b], want)
    assert bool((_state_page(buf, 10)[conv_b + ssm_b:] == -77).all())
    assert not w.take_load_errors()
