"""Buffers for the ``gpu`` tests: a cache on the GPU with its CPU twin, flat buffers of each kind.

Sources and destinations: GPU memory, pinned host memory, and plain host memory registered with
``register_host`` (what the gateway's shared-memory card is). Expected bytes come from the oracle
(``pools.oracle``) run on the CPU twin.
"""

from __future__ import annotations

import torch
from pools import Geometry, pool_over, random_bytes

import xkv.kernels as K

GEOMS = {
    "4k": Geometry(64, 4096, ((0, 4096),)),
    "16k-padded": Geometry(40, 16384 + 512, ((0, 16384),)),
    "kv-first": Geometry(32, 2048, ((0, 2048), (32 * 2048, 2048))),
    "odd": Geometry(33, 1003, ((3, 997),)),
    "mla-656": Geometry(20, 64 * 656, ((0, 64 * 656),)),
    "256k": Geometry(6, 262144, ((0, 262144),)),
}
SOURCES = ["gpu", "pinned", "registered"]
GPU_ENGINES = ["triton", "copy_engine", "staged"]

_KEEP: list[torch.Tensor] = []  # registered buffers stay alive: freed memory must not stay registered


def flat_of(kind: str, data: torch.Tensor) -> torch.Tensor:
    """``data`` copied into a flat buffer of ``kind`` (one of ``SOURCES``)."""
    if kind == "gpu":
        return data.cuda()
    if kind == "pinned":
        return data.pin_memory()
    t = torch.empty(data.numel() + 4096, dtype=torch.uint8)  # plain malloc'd memory, registered
    t = t[: data.numel()]
    t.copy_(data)
    _KEEP.append(t)
    return K.register_host(t)


def gpu_and_cpu(g: Geometry, seed: int, fill: int | None = None, base_off: int = 0):
    """(CPU buffer, pool over it, GPU copy, pool over the copy): random bytes, or ``fill``."""
    size = base_off + g.extent + 7
    raw_cpu = random_bytes(size, seed) if fill is None else torch.full((size,), fill, dtype=torch.uint8)
    raw_gpu = raw_cpu.cuda()
    return raw_cpu, pool_over(raw_cpu, base_off, g), raw_gpu, pool_over(raw_gpu, base_off, g)
