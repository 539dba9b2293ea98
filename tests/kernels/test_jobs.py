"""Validation (``xkv.kernels.jobs``): every kind of bad input is a ValueError, with nothing written.

Each case runs through a public launcher with the torch engine and the Triton kernel (interpreted
on CPU); the cache and the flat buffer are compared byte for byte before and after.
"""

from __future__ import annotations

import pytest
import torch
from gpu_buffers import GEOMS, gpu_and_cpu
from pools import POISON, Geometry, pool_over, random_bytes, refused_and_untouched

import xkv.kernels as K

ENGINES = ["reference", "triton"]


def _bad_cases():
    g = Geometry(4, 24, ((0, 10), (12, 6)))  # 16 bytes a block
    inter = Geometry(4, 48, ((0, 16),))  # two layers interleaved: offsets 0 and 16

    def setup():
        raw = torch.full((300,), POISON, dtype=torch.uint8)
        flat = random_bytes(100, 1)
        return raw, flat, pool_over(raw, 0, g)

    def two(raw, second=16):
        return [pool_over(raw, 0, inter), pool_over(raw, second, inter)]

    R, S, RL, SL = K.restore, K.save, K.restore_layers, K.save_layers
    u8 = torch.uint8
    return {
        "id too large": lambda raw, flat, p, e: R(flat, [0], p, [4], engine=e),
        "id negative": lambda raw, flat, p, e: R(flat, [0], p, [-1], engine=e),
        "duplicate destination": lambda raw, flat, p, e: R(flat, [0, 16], p, [1, 1], engine=e),
        "offset past the end": lambda raw, flat, p, e: R(flat, [85], p, [1], engine=e),
        "negative offset": lambda raw, flat, p, e: R(flat, [-1], p, [1], engine=e),
        "offsets/ids length": lambda raw, flat, p, e: R(flat, [0, 16], p, [1], engine=e),
        "float ids": lambda raw, flat, p, e: R(flat, [0], p, torch.tensor([1.0]), engine=e),
        "bool ids": lambda raw, flat, p, e: R(flat, [0], p, torch.tensor([True]), engine=e),
        "2-D ids": lambda raw, flat, p, e: R(flat, [0], p, [[1]], engine=e),
        "float offsets": lambda raw, flat, p, e: R(flat, [0.5], p, [1], engine=e),
        "wrong flat dtype": lambda raw, flat, p, e: R(flat.float(), [0], p, [1], engine=e),
        "2-D flat": lambda raw, flat, p, e: R(flat.view(10, 10), [0], p, [1], engine=e),
        "strided flat": lambda raw, flat, p, e: R(flat[::2], [0], p, [1], engine=e),
        "flat is the cache": lambda raw, flat, p, e: R(raw, [10], p, [0], engine=e),
        "flat on another device": lambda raw, flat, p, e: R(flat.to("meta"), [0], p, [1], engine=e),
        "save overlap": lambda raw, flat, p, e: S(p, [0, 1], flat, [0, 8], engine=e),
        "save past the end": lambda raw, flat, p, e: S(p, [0], flat, [90], engine=e),
        "save into the cache": lambda raw, flat, p, e: S(p, [0], raw, [0], engine=e),
        "slice lo > hi": lambda raw, flat, p, e: K.restore_slice(flat, [0], p, [1], 9, 3, engine=e),
        "slice past the end": lambda raw, flat, p, e: K.restore_slice(
            flat, [0], p, [1], 0, 17, engine=e
        ),
        "slice negative": lambda raw, flat, p, e: K.restore_slice(
            flat, [0], p, [1], -1, 3, engine=e
        ),
        "slice float bounds": lambda raw, flat, p, e: K.restore_slice(
            flat, [0], p, [1], 0.0, 3, engine=e
        ),
        "staging too small": lambda raw, flat, p, e: K.pack(
            p, [0, 1], torch.zeros(31, dtype=u8), engine=e
        ),
        "unpack too small": lambda raw, flat, p, e: K.unpack(
            torch.zeros(31, dtype=u8), p, [0, 1], engine=e
        ),
        "unpack duplicates": lambda raw, flat, p, e: K.unpack(
            torch.zeros(32, dtype=u8), p, [0, 0], engine=e
        ),
        "layers offsets shape": lambda raw, flat, p, e: RL(flat, [0, 16], two(raw), [1], engine=e),
        "same layer twice": lambda raw, flat, p, e: RL(flat, [[0], [16]], [p, p], [1], engine=e),
        "layers overlap": lambda raw, flat, p, e: RL(flat, [[0], [16]], two(raw, 8), [1], engine=e),
        "layers block bytes": lambda raw, flat, p, e: RL(
            flat, [[0], [20]], [p, pool_over(raw, 200, Geometry(2, 20, ((0, 20),)))], [1], engine=e
        ),
        "not a pool": lambda raw, flat, p, e: RL(flat, [[0]], [raw], [1], engine=e),
        "pool not a sequence": lambda raw, flat, p, e: SL(p, [1], flat, [[0]], engine=e),
        "save layers overlap": lambda raw, flat, p, e: SL(
            two(raw), [1], flat, [[0], [8]], engine=e
        ),
        "bad engine": lambda raw, flat, p, e: R(flat, [0], p, [1], engine="dma"),
        "bad max_programs": lambda raw, flat, p, e: R(flat, [0], p, [1], engine=e, max_programs=0),
    }, setup


BAD, _SETUP = _bad_cases()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_rejected_nothing_written(case, engine):
    assert refused_and_untouched(BAD[case], _SETUP, engine)


@pytest.mark.gpu
def test_rejects_unpinned_host_and_wrong_device():
    g = GEOMS["4k"]
    _, _, raw_gpu, pool_gpu = gpu_and_cpu(g, 7)
    before = raw_gpu.clone()
    with pytest.raises(ValueError, match="pinned"):
        K.restore(torch.zeros(4096, dtype=torch.uint8), [0], pool_gpu, [1])
    with pytest.raises(ValueError):
        K.save(pool_gpu, [1], torch.zeros(4096, dtype=torch.uint8), [0])
    cpu_pool = pool_over(torch.zeros(g.extent, dtype=torch.uint8), 0, g)
    with pytest.raises(ValueError):
        K.restore(torch.zeros(4096, dtype=torch.uint8, device="cuda"), [0], cpu_pool, [1])
    torch.cuda.synchronize()
    assert torch.equal(raw_gpu, before)
