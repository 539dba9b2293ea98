"""DeepSeek-V4's compressed MLA caches on the installed vLLM's own grouping and allocation.

DeepSeek-V4 layers keep a compressed latent (``MLAAttentionSpec``, ``tokens_per_state`` 4 or 128,
``model_version="deepseek_v4"``) and, on C4 layers, an indexer cache (``tokens_per_state`` 4);
vLLM packs them block-outermost (``BLNHC``: every layer's page of one block side by side inside
the block) in one ``UniformTypeKVCacheSpecs`` group of mixed page sizes. Specs as
``vllm/models/deepseek_v4/attention.py`` builds them (bf16 latent, head 512; indexer head 132,
uint8), grouped by ``get_kv_cache_groups`` and allocated by ``allocate_kv_cache``.

The same save/restore also runs on a GLM-5.x / DeepSeek-V3.2 (DSA) group: a 576-wide latent and a
132-byte indexer cache per layer, layer-outermost, one group of mixed page sizes.

Checked: one classification (``xkv.layout.kinds``) for registry and fan-out; the group registers
(replicated, per-layer page sizes); a save then a restore into a fresh poisoned allocation is
byte-exact for every layer and block, and no byte outside the restored pages changes (padding
and the other layers of a packed block); fan-out declines with one warning; the SWA groups
register (the whole model: test_dsv4_windows.py), a window that cannot be read is refused.
"""

import logging
from dataclasses import replace

import pytest
import torch
from connector_fakes import SO, FakeGateway, New, Req, Warnings, dsv4_specs_or_skip

from xkv.connector.config import ConnectorConfig
from xkv.connector.registry import RegistryError, build_registry
from xkv.connector.scheduler import SchedulerSide
from xkv.connector.worker import WorkerSide
from xkv.layout import kinds

pytestmark = pytest.mark.vllm

kvi = dsv4_specs_or_skip()

from xkv.connector import vllm_specs  # noqa: E402

BS, POISON = 256, 0xA5
RATIOS = (4, 128, 4, 128)


def _vllm_config(layout="BLNHC", bs=BS):
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig

    cc = CacheConfig(block_size=bs)
    cc.kv_cache_layout = layout
    vc = VllmConfig(cache_config=cc, device_config=DeviceConfig("cpu"))
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False  # DeepSeek-V4 runs with HMA
    return vc


def _specs(with_windows=False):
    M, W = kvi.MLAAttentionSpec, kvi.SlidingWindowMLASpec
    out = {}
    for i, r in enumerate(RATIOS):
        if with_windows:
            out[f"l{i}.swa"] = W(block_size=64, num_kv_heads=1, head_size=512,
                                 dtype=torch.bfloat16, sliding_window=128, alignment=512,
                                 model_version="deepseek_v4")
        out[f"l{i}.attn"] = M(block_size=BS, num_kv_heads=1, head_size=512, dtype=torch.bfloat16,
                              tokens_per_state=r, alignment=512, model_version="deepseek_v4")
        if r == 4:
            out[f"l{i}.indexer"] = M(block_size=BS, num_kv_heads=1, head_size=132,
                                     dtype=torch.uint8, tokens_per_state=4, alignment=512)
    return out


def _glm5_specs():
    """GLM-5.x / DeepSeek-V3.2 (DSA): per layer a 576-wide bf16 latent and a 132-byte uint8
    indexer cache, both plain ``MLAAttentionSpec`` (block 64): one group, mixed page sizes,
    layer-outermost."""
    M = kvi.MLAAttentionSpec
    out = {}
    for i in range(2):
        out[f"l{i}.attn"] = M(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
        out[f"l{i}.indexer"] = M(block_size=64, num_kv_heads=1, head_size=132, dtype=torch.uint8)
    return out


CASES = {"dsv4": (_specs, "BLNHC", BS, kinds.MLA_COMPRESSED),
         "glm5": (_glm5_specs, "LBNHC", 64, kinds.MLA)}


def _kv_cache_config(vc, specs, layout="BLNHC"):
    try:
        from vllm.v1.core import kv_cache_planning as P
    except ImportError:
        from vllm.v1.core import kv_cache_utils as P
    groups = P.get_kv_cache_groups(vc, specs)
    kvc = P.get_kv_cache_config_from_groups(vc, groups, 8 << 20)
    kvc.kv_cache_layout = layout
    return kvc


def _allocate(kvc, layout="BLNHC", bs=BS):
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    t = allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout[layout], [bs])
    buf = torch.empty(0, dtype=torch.uint8).set_(next(iter(t.values())).untyped_storage())
    return t, buf


def _bytes(t):
    """A block's page as bytes (random bytes are NaNs in bf16: compare bits, not values)."""
    return t.contiguous().view(-1).view(torch.uint8)





def _sides(reg, gw, kv, num_blocks, layout="BLNHC", bs=BS):
    cfg = ConnectorConfig.from_extra({"chunk_size": bs})
    s = SchedulerSide(cfg, reg, ["fp-dsv4"], hash_block_size=bs, world_size=1,
                      gateway_factory=gw.client)
    w = WorkerSide(reg, ["fp-dsv4"], namespace="default", tp_rank=0, gateway_factory=gw.client)
    # DeepSeek-V4's and DSA's attention classes never call the per-layer hooks: all bulk
    w.register_kv_caches(kv, num_blocks=num_blocks, layout=layout,
                         hooks={n: (False, "DeepseekV4FlashMLAAttention") for n in kv})
    return s, w


def test_one_classification_for_registry_and_fanout():
    vc = _vllm_config()
    kvc = _kv_cache_config(vc, _specs())
    (g,) = vllm_specs.cache_groups(kvc)
    inner = kvc.kv_cache_groups[0].kv_cache_spec.kv_cache_specs
    assert g.kind == kinds.MLA_COMPRESSED
    assert {vllm_specs.fanout_spec_kind(s) for s in inner.values()} == {kinds.MLA_COMPRESSED}
    assert {vllm_specs.layer_kind(s) for s in inner.values()} == {kinds.MLA_COMPRESSED}
    # per-layer page sizes: latent C4 64 states x 1024 B, C128 2 states, indexer 64 x 132 B
    want = {"l0.attn": 65536, "l1.attn": 2048, "l0.indexer": 8448}
    for name, size in want.items():
        assert g.bytes_of(g.layer_names.index(name)) == size
    reg = build_registry([g], tp_size=2, pp_size=1, chunk_size=BS)
    (plan,) = reg.groups
    assert plan.num_shards == 1 and plan.writer_ranks == (0,) and plan.reader_ranks == (0, 1)
    assert plan.shard_bytes == sum(want.get(n, 0) or g.bytes_of(i)
                                   for i, n in enumerate(g.layer_names))
    offs = [plan.object_offset(i, 0) for i in range(len(g.layer_names))]
    assert offs == sorted(offs) and offs[0] == 0 and offs[-1] + g.bytes_of(5) == plan.shard_bytes


@pytest.mark.parametrize("case", sorted(CASES))
def test_save_then_restore_is_byte_exact_and_touches_nothing_else(case):
    make, layout, bs, kind = CASES[case]
    vc = _vllm_config(layout, bs)
    kvc = _kv_cache_config(vc, make(), layout)
    groups = vllm_specs.cache_groups(kvc)
    assert [g.kind for g in groups] == [kind] and groups[0].layer_bytes
    reg = build_registry(groups, tp_size=1, pp_size=1, chunk_size=bs)
    gw = FakeGateway(capacity=1 << 24)
    src, sbuf = _allocate(kvc, layout, bs)
    g = torch.Generator().manual_seed(3)
    sbuf.copy_(torch.randint(0, 256, sbuf.shape, dtype=torch.uint8, generator=g))
    s1, w1 = _sides(reg, gw, src, kvc.num_blocks, layout, bs)
    ids = [5, 9, 2, 7]  # 4 full blocks, one chunk each
    req = Req("a", 4 * bs, salt=4, bs=bs)
    assert s1.get_num_new_matched_tokens(req, 0) == 0
    s1.update_state_after_alloc(req, [ids], 0)
    w1.bind(s1.build_connector_meta(SO([New("a", ids, 0)], {"a": 4 * bs})))
    w1.start_load_kv()
    w1.wait_for_save()  # no save_kv_layer: every layer is saved here, after the forward
    w1.get_finished()
    w1.clear()
    assert len(gw.committed(1)) == 4

    dst, dbuf = _allocate(kvc, layout, bs)
    dbuf.fill_(POISON)
    s2, w2 = _sides(reg, gw, dst, kvc.num_blocks, layout, bs)
    req2 = Req("b", 4 * bs, salt=4, bs=bs)  # vLLM computes at least the last token: 3 blocks restored
    assert s2.get_num_new_matched_tokens(req2, 0) == 3 * bs
    ids2 = [11, 3, 40, 17]
    s2.update_state_after_alloc(req2, [ids2], 3 * bs)
    w2.bind(s2.build_connector_meta(SO([New("b", ids2, 3 * bs)], {"b": bs})))
    w2.start_load_kv()  # bulk: every layer landed before the forward
    w2.wait_for_save()
    w2.get_finished()
    assert not w2.take_load_errors()
    restored = torch.zeros_like(dbuf, dtype=torch.bool)
    for name, t in dst.items():
        for i in range(3):
            assert torch.equal(_bytes(dst[name][ids2[i]]), _bytes(src[name][ids[i]])), (name, i)
            v = t[ids2[i]]
            o, n = v.storage_offset() * v.element_size(), v.numel() * v.element_size()
            restored[o:o + n] = True
    assert (dbuf[~restored] == POISON).all()  # padding, other blocks, the 4th block untouched


def test_fanout_declines_once():
    from xkv.fanout import eligibility as el
    from xkv.fanout.config import FanoutConfig

    vc = _vllm_config()
    vc.model_config = type("MC", (), {"use_mla": True, "is_hybrid": False})()
    vc.parallel_config.tensor_parallel_size = 8
    kvc = _kv_cache_config(_vllm_config(), _specs())
    facts = vllm_specs.fanout_facts(vc, kvc, cuda=True, layerwise_hook=False)
    assert facts.block_outermost and set(facts.spec_kinds) == {kinds.MLA_COMPRESSED}
    d = el.decide(FanoutConfig(enabled=True), facts)
    assert not d.on and d.reason is el.Reason.BLOCK_OUTERMOST
    el._reset_report_for_tests()
    with Warnings() as _w:
        logging.getLogger("xkv.fanout").addHandler(_w)
        try:
            assert el.report(d) and not el.report(d)
        finally:
            logging.getLogger("xkv.fanout").removeHandler(_w)
    assert _w.count("NVLink fan-out off: block-outermost") == 1
    el._reset_report_for_tests()


def test_sliding_window_caches_register_and_an_unknown_window_is_refused_naming_it():
    """Since issue 18 the SWA groups are stored (their window's tail, tests/connector/
    test_dsv4_windows.py); a sliding-window group whose window cannot be read stays refused."""
    vc = _vllm_config()
    kvc = _kv_cache_config(vc, _specs(with_windows=True))
    groups = vllm_specs.cache_groups(kvc)
    assert {g.kind for g in groups} == {kinds.MLA_COMPRESSED, kinds.SLIDING_WINDOW}
    reg = build_registry(groups, tp_size=2, pp_size=1, chunk_size=BS)
    windows = [p for p in reg.groups if p.is_window]
    assert windows and all(p.blocks_per_object == 2 and p.num_shards == 1 for p in windows)
    unknown = [replace(g, sliding_window=0) if g.kind == kinds.SLIDING_WINDOW else g
               for g in groups]
    with pytest.raises(RegistryError, match="SlidingWindowMLASpec.*sliding window"):
        build_registry(unknown, tp_size=1, pp_size=1, chunk_size=BS)
