"""Shared builders for the fan-out tests: a card laid out as the stored-object format says, a
vLLM-shaped MLA cache per layer ([num_blocks, 1, block_size, 576] bf16), and an independent oracle."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from xkv.fanout import LayerLoad

POISON = 0xA5


def mla_pool(cache: torch.Tensor, num_blocks: int | None = None):
    """PagePool of a vLLM MLA cache view [kernel_blocks, 1, block_size, C] (xkv.layout)."""
    from xkv.layout import describe_cache

    return describe_cache(cache, num_blocks=num_blocks)


@dataclass
class MlaCase:
    card: torch.Tensor
    caches: list[torch.Tensor]
    loads: list[LayerLoad]
    expected: list[torch.Tensor]  # oracle result per layer (uint8 bytes of the whole cache)


def make_case(*, layers: int = 3, num_blocks: int = 40, block_size: int = 16, width: int = 576,
              dtype: torch.dtype = torch.bfloat16, ratio: int = 1, chunk_blocks: int = 2,
              chunks: int = 5, seed: int = 0, device: str | torch.device = "cpu",
              card: torch.Tensor | None = None, pin: bool = False) -> MlaCase:
    """Restore ``chunks * chunk_blocks`` scheduler blocks into random blocks of each layer's cache.

    Cache per layer: ``[num_blocks * ratio, 1, block_size, width]`` of ``dtype`` (vLLM 0.29's 4-D
    MLA view; ``ratio`` kernel blocks per scheduler block). Card in the stored-object layout
    (docs/internal-api.md): chunk c's slot at a random slot offset; layer l, block j of the chunk at
    ``slot + (l * k + j) * block_bytes``. Identical on every rank for a given seed."""
    g = torch.Generator().manual_seed(seed)
    bb = ratio * block_size * width * torch.empty(0, dtype=dtype).element_size()
    slot = -(-layers * chunk_blocks * bb // 4096) * 4096
    n_slots = chunks + 3
    fresh = torch.randint(0, 256, (n_slots * slot,), dtype=torch.uint8, generator=g)
    card = fresh if card is None else card  # same generator draws either way: same offsets
    if pin:
        card = card.pin_memory()
    slot_of = torch.randperm(n_slots, generator=g)[:chunks] * slot
    n = chunks * chunk_blocks
    block_ids = torch.randperm(num_blocks, generator=g)[:n].to(torch.int64)
    caches, loads, expected = [], [], []
    for layer in range(layers):
        offs = torch.tensor([int(slot_of[c]) + (layer * chunk_blocks + j) * bb
                             for c in range(chunks) for j in range(chunk_blocks)], dtype=torch.int64)
        cache = torch.empty(num_blocks * ratio, 1, block_size, width, dtype=dtype, device=device)
        cache.view(torch.uint8).fill_(POISON)
        exp = torch.full((num_blocks, bb), POISON, dtype=torch.uint8)
        for i in range(n):
            exp[block_ids[i]] = card[offs[i]:offs[i] + bb].cpu()
        pool = mla_pool(cache, num_blocks)
        assert pool.block_bytes == bb and pool.num_blocks == num_blocks
        caches.append(cache)
        loads.append(LayerLoad(f"model.layers.{layer}.self_attn.attn", offs, pool, block_ids.clone()))
        expected.append(exp.reshape(-1))
    return MlaCase(card, caches, loads, expected)


def cache_bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8).reshape(-1).cpu()


# ---------------------------------------------------------------- multi-process workers
def run_workers(target, world: int, *args, method: str = "forkserver", timeout: float = 120.0) -> list:
    """Run ``target(rank, world, init_file, queue, *args)`` in ``world`` processes; return every
    item the workers put on the queue (a worker that dies or hangs fails the test).

    Not ``fork``: a child forked after torch ran a parallel CPU op can hang in OpenMP. The fork
    server is a fresh interpreter that imports torch once; children fork from it."""
    import multiprocessing as mp
    import queue as _queue
    import tempfile
    import time

    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "xkv.fanout", "fanout_helpers"])
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init_file = f"{d}/init"
        procs = [ctx.Process(target=target, args=(r, world, init_file, q, *args)) for r in range(world)]
        for p in procs:
            p.start()
        out, deadline = [], time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in procs) or not q.empty():
                with contextlib.suppress(_queue.Empty):
                    out.append(q.get(timeout=0.2))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers still running after {timeout} s; got {out}")
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"worker exit codes {codes}; messages {out}"
    return out


# ---------------------------------------------------------------- a fake NVML
class FakeNvml:
    """GPUs in physical order with UUIDs GPU-0000..; ``links``: set of NVLinked physical pairs."""

    def __init__(self, n, links=(), fail=None):
        self.uuids = [f"GPU-{i:04d}aaaa-0000-0000-0000-{i:012d}" for i in range(n)]
        self.links = {frozenset(p) for p in links}
        self.fail = fail

    def device_count(self):
        return len(self.uuids)

    def handle_by_index(self, i):
        if i >= len(self.uuids):
            raise RuntimeError(f"no GPU {i}")
        return i

    def handle_by_uuid(self, u):
        if self.fail == "uuid":
            raise RuntimeError("NVML_ERROR_UNKNOWN")
        return self.uuids.index(u)

    def uuid(self, h):
        return self.uuids[h]

    def nvlink_ok(self, a, b):
        if self.fail == "p2p":
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return frozenset((a, b)) in self.links


def nvswitch(n):
    return FakeNvml(n, [(i, j) for i in range(n) for j in range(i + 1, n)])


def bridged(n):
    return FakeNvml(n, [(i, i + 1) for i in range(0, n, 2)])
