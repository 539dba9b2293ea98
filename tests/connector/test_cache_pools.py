"""The worker's page pools (xkv/connector/cache_pools.py): every registered tensor becomes a
byte-page pool of its group's layer; a tensor of no group, a group layer without a tensor, or a
page of another size than the spec's is refused, naming the layers, before anything starts."""

import pytest
import torch

from xkv.connector.cache_pools import cache_pools, pool_kind
from xkv.connector.registry import CacheGroup, build_registry

NB, BS = 7, 16  # an odd block count
LAYERS, STATE = ("a0", "a1", "a2"), ("m0",)


def _registry():
    return build_registry([CacheGroup(0, "attention", LAYERS, BS, 2 * BS * 8),
                           CacheGroup(1, "mamba", STATE, BS, 96)],
                          tp_size=1, pp_size=1, chunk_size=BS * 2)


def _caches():
    kv = {n: torch.zeros(NB, 2, BS, 8, dtype=torch.uint8) for n in LAYERS}
    kv["m0"] = torch.zeros(NB, 96, dtype=torch.uint8)
    return kv


def test_every_layer_has_its_pool_and_place():
    pools, where = cache_pools(_registry(), _caches(), num_blocks=NB, layout=None)
    assert where == {"a0": (0, 0), "a1": (0, 1), "a2": (0, 2), "m0": (1, 0)}
    assert sorted(pools) == sorted(where)
    assert {n: (p.num_blocks, p.block_bytes) for n, p in pools.items()} == {
        **{n: (NB, 2 * BS * 8) for n in LAYERS}, "m0": (NB, 96)}


@pytest.mark.parametrize("change, message", [
    (lambda kv: kv.update(x9=kv["a0"].clone()), r"tensors \['x9'\] belong to no KV cache group"),
    (lambda kv: kv.pop("a1"), r"layers \['a1'\] have no registered tensor"),
    (lambda kv: kv.update(a2=torch.zeros(NB, 2, BS, 4, dtype=torch.uint8)),
     r"layer a2: 128 bytes per block in memory, 256 expected"),
])
def test_refused_with_the_layer_named(change, message):
    kv = _caches()
    change(kv)
    with pytest.raises(ValueError, match=message):
        cache_pools(_registry(), kv, num_blocks=NB, layout=None)


def test_pool_labels():
    assert pool_kind("attention") == "attention" and pool_kind("mamba") == "mamba"
    assert pool_kind("sliding_window") == "attention"
    assert pool_kind("sliding_window", replicated=True) == "mla"
