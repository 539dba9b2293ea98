"""Two tensor-parallel ranks on CPU tensors: attention shards per rank, MLA written once.

Scheduler and both workers talk to one fake gateway. Attention: each rank saves and restores its
own shard (different bytes per rank) and an object is visible only once both shards committed.
MLA (replicated latent): only TP rank 0 writes and commits; both ranks restore the same bytes.
"""

import pytest
import torch
from connector_fakes import SO, FakeGateway, New, Req

from xkv.connector.config import ConnectorConfig
from xkv.connector.registry import CacheGroup, build_registry
from xkv.connector.scheduler import SchedulerSide
from xkv.connector.worker import WorkerSide

BS, K, NB = 16, 2, 24  # block size, blocks per chunk, blocks per cache
LAYERS = ("l0", "l1", "l2")





def caches(kind, rank, poison=None):
    """[B, H, N, C] per layer; content depends on (rank, layer) for attention, only on the layer
    for MLA (the latent is replicated)."""
    h, c = (1, 576) if kind == "mla" else (2, 8)
    out = {}
    for li, name in enumerate(LAYERS):
        g = torch.Generator().manual_seed(100 * li + (0 if kind == "mla" else rank))
        t = torch.randint(0, 256, (NB, h, BS, c), dtype=torch.uint8, generator=g)
        out[name] = t.fill_(poison) if poison is not None else t
    return out


def side(kind, tp, gw, mode="layer"):
    bb = (576 if kind == "mla" else 2 * 8) * BS
    reg = build_registry([CacheGroup(0, kind, LAYERS, BS, bb)], tp_size=tp, pp_size=1,
                         chunk_size=BS * K)
    cfg = ConnectorConfig.from_extra({"chunk_size": BS * K, "save_mode": mode},
                                     {"PYTHONHASHSEED": "0"})
    sched = SchedulerSide(cfg, reg, ["fp-" + kind], hash_block_size=BS, world_size=tp,
                          gateway_factory=gw.client)
    return reg, sched


def worker(reg, rank, gw, kv, mode="layer"):
    w = WorkerSide(reg, ["fp-" + reg.groups[0].group.kind], namespace="default", tp_rank=rank,
                   gateway_factory=gw.client, save_mode=mode)
    w.register_kv_caches(kv, num_blocks=NB)
    return w


@pytest.mark.parametrize("mode", ["layer", "step"])
@pytest.mark.parametrize("kind", ["attention", "mla"])
def test_two_ranks(kind, mode):
    gw, n = FakeGateway(capacity=1 << 22), 5 * BS  # 2 full chunks (4 blocks) + 1 block
    reg, s = side(kind, 2, gw, mode)
    src = [caches(kind, r) for r in (0, 1)]
    ws = [worker(reg, r, gw, src[r], mode) for r in (0, 1)]
    assert all(w.saver.mode == mode for w in ws)
    req = Req("a", n)
    assert s.get_num_new_matched_tokens(req, 0) == 0
    ids = list(range(3, 8))
    s.update_state_after_alloc(req, [ids], 0)
    meta = s.build_connector_meta(SO([New("a", ids, 0)], {"a": n}))
    assert sum(len(gt.chunks) for j in meta.saves for gt in j.groups) == 2
    for r, w in enumerate(ws):
        w.bind(meta)
        for name in LAYERS:
            w.save_kv_layer(name)
        w.wait_for_save()
        committed = gw.committed(1)
        if kind == "attention" and r == 0:
            assert not committed  # shard 1 still missing: not visible yet
    assert len(gw.committed(1)) == 2
    commits = [m for m in gw.messages if m[0] == "commit"]
    assert [m[2] for m in commits] == ([0, 1] if kind == "attention" else [0])

    # fresh engine: both ranks restore
    reg2, s2 = side(kind, 2, gw)
    dst = [caches(kind, r, poison=0xA5) for r in (0, 1)]
    ws2 = [worker(reg2, r, gw, dst[r]) for r in (0, 1)]
    req2 = Req("b", n)
    assert s2.get_num_new_matched_tokens(req2, 0) == 4 * BS
    ids2 = [9, 4, 17, 11, 2]
    s2.update_state_after_alloc(req2, [ids2], 4 * BS)
    meta2 = s2.build_connector_meta(SO([New("b", ids2, 4 * BS)], {"b": BS}))
    for w in ws2:
        w.bind(meta2)
        w.start_load_kv()
        w.get_finished()
        assert not w.take_load_errors()
    for r in (0, 1):
        for name in LAYERS:
            for i in range(4):
                assert torch.equal(dst[r][name][ids2[i]], src[r][name][ids[i]]), (r, name, i)
            assert (dst[r][name][ids2[4]] == 0xA5).all()  # the 5th block was not restored
    # the lease is released once both readers finished
    s2.update_connector_output(ws2[0].take_report())
    assert gw.leases  # rank 1 may still be reading
    s2.update_connector_output(ws2[1].take_report())
    assert not gw.leases
