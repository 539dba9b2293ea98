"""The engine in one process (CPU, the kernels' torch reference): virtual ranks bit-exact for odd
sizes, several caches per layer, skips, and bad input refused before any byte moves."""

import torch
from fanout_helpers import POISON, cache_bytes, make_case, mla_pool
from hypothesis import given
from hypothesis import strategies as st

from xkv.fanout import FanoutConfig, FanoutRestorer, LayerLoad, LocalExchanger

MiB = 1 << 20


def _restorer(n=1, share_copy="auto", staging=2 * MiB, min_layer=0):
    cfg = FanoutConfig(enabled=True, staging_bytes=staging, min_layer_bytes=min_layer)
    return FanoutRestorer(cfg, LocalExchanger(n, virtual=n > 1), "cpu", share_copy=share_copy)


@given(layers=st.integers(1, 3), num_blocks=st.integers(1, 40), block_size=st.sampled_from([1, 3, 16, 64]),
       width=st.sampled_from([576, 656, 132]), chunk_blocks=st.integers(1, 5), n=st.integers(1, 8),
       share_copy=st.sampled_from(["kernel", "dma"]), seed=st.integers(0, 2**16), data=st.data())
def test_virtual_ranks_odd_sizes(layers, num_blocks, block_size, width, chunk_blocks, n, share_copy, seed, data):
    chunks = data.draw(st.integers(0, num_blocks // chunk_blocks))
    case = make_case(layers=layers, num_blocks=num_blocks, block_size=block_size, width=width,
                     dtype=torch.uint8, chunk_blocks=chunk_blocks, chunks=chunks, seed=seed)
    r = _restorer(n, share_copy)
    started = r.begin(case.card, case.loads)
    assert started == (chunks > 0)
    for ld in case.loads:
        r.wait_layer(ld.layer)
    r.finish()
    for c, e in zip(case.caches, case.expected, strict=True):
        assert torch.equal(cache_bytes(c), e)


def test_two_caches_per_layer_glm5_style():
    """Latent (656-B fp8_ds_mla rows) and DSA indexer (132-B rows) of one layer, one name."""
    lat = make_case(layers=2, num_blocks=20, block_size=64, width=656, dtype=torch.uint8, chunk_blocks=2,
                    chunks=4, seed=1)
    idx = make_case(layers=2, num_blocks=20, block_size=64, width=132, dtype=torch.uint8, chunk_blocks=2,
                    chunks=4, seed=2)
    card = torch.cat([lat.card, idx.card])
    loads = []
    for a, b in zip(lat.loads, idx.loads, strict=True):
        loads += [a, LayerLoad(a.layer, b.src_offsets + lat.card.numel(), b.dst, b.block_ids)]
    r = _restorer(4, staging=2 * MiB)
    assert r.begin(card, loads)
    r.wait_layer(loads[0].layer)  # both caches of layer 0, nothing of layer 1 yet
    assert torch.equal(cache_bytes(lat.caches[0]), lat.expected[0])
    assert torch.equal(cache_bytes(idx.caches[0]), idx.expected[0])
    assert bool((cache_bytes(idx.caches[1]) == POISON).all())
    r.wait_layer(loads[-1].layer)
    for case in (lat, idx):
        assert all(torch.equal(cache_bytes(c), e) for c, e in zip(case.caches, case.expected, strict=True))


def test_small_layers_and_empty_batches_skip():
    case = make_case(layers=2, num_blocks=10, seed=4)  # 2 x 10 blocks x 18 KiB per layer
    r = _restorer(min_layer=4 * MiB)
    assert not r.begin(case.card, case.loads) and r.stats["skipped_small"] == 1
    assert not _restorer().begin(case.card, []) and not _restorer().begin(case.card, [
        LayerLoad("x", torch.zeros(0, dtype=torch.int64), case.loads[0].dst, torch.zeros(0, dtype=torch.int64))])
    assert all(bool((cache_bytes(c) == POISON).all()) for c in case.caches)


def test_next_begin_drains_the_previous_batch():
    a, b = make_case(layers=2, seed=5), make_case(layers=2, seed=6)
    r = _restorer(2)
    assert r.begin(a.card, a.loads)
    r.wait_layer("no.such.layer")
    assert r.begin(b.card, b.loads)  # a's layers were never waited for: drained here
    r.finish()
    r.finish()
    for case in (a, b):
        assert all(torch.equal(cache_bytes(c), e) for c, e in zip(case.caches, case.expected, strict=True))


def _bad_inputs():
    c = make_case(layers=1, num_blocks=12, seed=9)
    ld = c.loads[0]
    yield "outside the card", c.card, [LayerLoad(ld.layer, ld.src_offsets + c.card.numel(), ld.dst, ld.block_ids)]
    yield "src_offsets span [-", c.card, [LayerLoad(ld.layer, ld.src_offsets - 10**7, ld.dst, ld.block_ids)]
    yield "outside the cache of 12 blocks", c.card, [LayerLoad(ld.layer, ld.src_offsets, ld.dst, ld.block_ids + 12)]
    dup = ld.block_ids.clone()
    dup[1] = dup[0]
    yield "duplicates", c.card, [LayerLoad(ld.layer, ld.src_offsets, ld.dst, dup)]
    yield "must be int64", c.card, [LayerLoad(ld.layer, ld.src_offsets.int(), ld.dst, ld.block_ids)]
    yield "src_offsets for", c.card, [LayerLoad(ld.layer, ld.src_offsets[:-1], ld.dst, ld.block_ids)]
    yield "1-D uint8 tensor", c.card.view(torch.int8), c.loads


def test_bad_input_refused_before_any_byte_moves():
    for match, card, loads in _bad_inputs():
        r = _restorer(2)
        assert not r.begin(card, loads), match
        assert match in (r.last_error or ""), (match, r.last_error)
        assert r.stats["disagreed"] == 1 and r.stats["bytes_copied"] == 0
        for ld in loads:
            assert bool((ld.dst.base == POISON).all())


def test_block_larger_than_a_slot_is_refused_by_the_plan():
    cache = torch.full((4, 1, 1, 2 * MiB), POISON, dtype=torch.uint8)  # 2 MiB pages, 1 MiB slots
    card = torch.zeros(4 * 2 * MiB, dtype=torch.uint8)
    ld = LayerLoad("l0", torch.tensor([0, 2 * MiB]), mla_pool(cache), torch.tensor([0, 1]))
    r = _restorer(2)
    assert not r.begin(card, [ld]) and "raise nvlink_fanout_staging_bytes" in r.last_error
    assert bool((cache == POISON).all())
