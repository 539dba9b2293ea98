"""``xkv.layout.kinds`` (one vocabulary for registry and fan-out) and DeepSeek-V4's
block-outermost packed block, without vLLM.

The packed block is the one vLLM 0.29 / 0.33 allocate for DeepSeek-V4's compressed-MLA group with
``BLNHC`` (read from ``allocate_kv_cache`` on four layers, ratios 4/128/4/128, block 256 tokens):
one 152,576-byte block holding, side by side, the C4 latents (64 states x 512 bf16), the indexer
caches (64 x 132 bytes, page padded to 8,704) and the C128 latents (2 states x 512 bf16). Every
layer is one view over the shared buffer with ``stride(0)`` = the packed block.
"""

import pytest
import torch

from xkv.kernels import restore, save
from xkv.layout import describe_cache, kinds

BLOCK = 152576
# (name, byte offset of block 0, states per block, content per state, dtype)
LAYERS = [("l0.attn", 0, 64, 512, torch.bfloat16), ("l2.attn", 65536, 64, 512, torch.bfloat16),
          ("l0.indexer", 131072, 64, 132, torch.uint8), ("l2.indexer", 139776, 64, 132, torch.uint8),
          ("l1.attn", 148480, 2, 512, torch.bfloat16), ("l3.attn", 150528, 2, 512, torch.bfloat16)]


def _views(nb, fill=None):
    raw = torch.zeros(nb * BLOCK, dtype=torch.uint8)
    if fill is not None:
        raw.copy_(fill)
    out = {}
    for name, off, n, c, dt in LAYERS:
        e = torch.empty((), dtype=dt).element_size()
        t = torch.as_strided(raw.view(dt), (nb, 1, n, c),
                             (BLOCK // e, n * c, c, 1), off // e)
        out[name] = t
    return raw, out


def test_one_vocabulary():
    """The names both the registry and fan-out use (reading vLLM's specs into them:
    tests/connector/test_vllm_specs.py::test_one_classification)."""
    assert kinds.group_kind([kinds.MLA, kinds.MLA]) == kinds.MLA
    assert kinds.group_kind([kinds.MLA, kinds.MLA_COMPRESSED]) == kinds.MLA_COMPRESSED
    assert kinds.group_kind([kinds.MLA, kinds.ATTENTION]) == kinds.OTHER
    assert set(kinds.REPLICATED) == {kinds.MLA, kinds.MLA_COMPRESSED}
    assert kinds.FANOUT == (kinds.MLA,)  # fan-out never takes compressed or sliding caches


@pytest.mark.parametrize("name,off,n,c,dt", LAYERS)
def test_each_layer_is_one_run_per_packed_block(name, off, n, c, dt):
    _, views = _views(8)
    e = torch.empty((), dtype=dt).element_size()
    pool = describe_cache(views[name], num_blocks=8, layout="BLNHC", kind="mla")
    assert pool.block_bytes == n * c * e and pool.block_stride == BLOCK
    assert pool.runs == ((0, n * c * e),)


def test_restore_writes_one_layer_and_nothing_else_of_the_block():
    nb = 6
    g = torch.Generator().manual_seed(1)
    src_raw, src = _views(nb, torch.randint(0, 256, (nb * BLOCK,), dtype=torch.uint8, generator=g))
    dst_raw, dst = _views(nb, torch.full((nb * BLOCK,), 0xA5, dtype=torch.uint8))
    ids_s, ids_d = torch.tensor([4, 1, 3]), torch.tensor([0, 5, 2])
    touched = torch.zeros(nb * BLOCK, dtype=torch.bool)
    for name, off, *_ in LAYERS[2:5]:  # an indexer, a C4 and a C128 layer
        sp = describe_cache(src[name], num_blocks=nb, layout="BLNHC")
        dp = describe_cache(dst[name], num_blocks=nb, layout="BLNHC")
        card = torch.zeros(len(ids_s) * sp.block_bytes + 7, dtype=torch.uint8)  # odd tail
        offs = torch.arange(len(ids_s), dtype=torch.int64) * sp.block_bytes
        save(sp, ids_s, card, offs)
        restore(card, offs, dp, ids_d)
        for s_, d_ in zip(ids_s.tolist(), ids_d.tolist(), strict=True):
            a = src_raw[s_ * BLOCK + off: s_ * BLOCK + off + sp.block_bytes]
            b = dst_raw[d_ * BLOCK + off: d_ * BLOCK + off + dp.block_bytes]
            assert torch.equal(a, b), (name, s_)
            touched[d_ * BLOCK + off: d_ * BLOCK + off + dp.block_bytes] = True
    assert (dst_raw[~touched] == 0xA5).all()  # padding and the other layers stay poisoned
