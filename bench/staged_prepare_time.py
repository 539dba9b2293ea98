"""Host time of planning a staged restore (``xkv.kernels.staged_restore.prepare``) against the
Triton restore's prepare, for a 32k-token Llama-3-8B-shaped light step (32 layers x 2048 pages of
64 KiB in two 32 KiB runs, the halving layer groups, verified), on this machine's CPU: no GPU (a
stand-in copy; the tables go to host memory). The staged plan runs before its first copy, so it
adds to the restore (bench/RESULTS.md "stop 40"); since stop 45 the unpack tables are built (and
uploaded) at the first chunk's launch, after its copy was queued: printed apart.

    TRITON_INTERPRET=1 python bench/staged_prepare_time.py [--reps 5] [--layout objects|layers]
        [--shape llama|mla] [--tokens 32768] [--ranges] [--unchecked] [--groups auto|whole]

``--layout objects`` (the default) lays the card out as stored objects are (16 pages per layer,
layer-major, scattered); ``--ranges`` prints how many copy-engine ranges the chunks take.
``--shape mla``: the MLA model's 16 layers of 18 KiB pages (one run) instead. ``--unchecked``:
the plan of an unverified restore (no checksum words), against which the checked plan's extra
host time shows.

Then the CUDA-only part of a staged plan, which the first part (run without CUDA) never reaches:
the copy engine's addresses of that restore's 256 chunks (16 ranges of 1 MiB each, a 12 GiB card registered in 1 GiB pieces),
converted and cut at the pieces' boundaries per chunk twice (at plan and again in each copy call,
as before stop 41) against ``staged_restore.absolute_ranges`` (one pass at plan time).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from xkv.connector.light_steps import load_layer_groups  # noqa: E402
from xkv.kernels import prepared, staged_restore  # noqa: E402
from xkv.kernels.jobs import build_job, offsets_arg  # noqa: E402
from xkv.kernels.ring import Ring  # noqa: E402
from xkv.kernels.verify import Checks  # noqa: E402
from xkv.layout import PagePool  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layout", choices=("objects", "layers"), default="objects",
                    help="card offsets as stored objects lay them out (16 pages per layer, "
                         "layer-major, scattered) or every layer's pages contiguous")
    ap.add_argument("--ranges", action="store_true", help="also issue the chunks' copies "
                    "through the stand-in (no unpack) and count the copy-engine ranges")
    ap.add_argument("--shape", choices=("llama", "mla"), default="llama")
    ap.add_argument("--tokens", type=int, default=32768, help="restored tokens (16 per page)")
    ap.add_argument("--groups", choices=("auto", "whole"), default="auto",
                    help="the light step's layer groups (XKV_LOAD_GROUPS): halving or one")
    ap.add_argument("--unchecked", action="store_true", help="a restore without checksum words "
                    "(an unverified request): the plan's checked share is the difference")
    a = ap.parse_args()
    L, bb = (32, 65536) if a.shape == "llama" else (16, 18432)
    n = a.tokens // 16
    runs = ((0, bb // 2), (bb // 2, bb // 2)) if a.shape == "llama" else ((0, bb),)
    # untouched host allocations stand in for the layers' caches (only addresses are read)
    pools = [PagePool(torch.empty(n * bb + 64, dtype=torch.uint8), n, bb, bb, runs)
             for _ in range(L)]
    if a.layout == "objects":  # as stored: objects of 16 pages per layer, layer-major, scattered
        k, objs = 16, n // 16
        flat = torch.empty(objs * (L * k * bb + bb), dtype=torch.uint8)  # virtual: never touched
        at = np.random.default_rng(1).permutation(objs) * (L * k * bb + bb)
        j = np.arange(n)
        offs = np.stack([at[j // k] + layer * k * bb + (j % k) * bb for layer in range(L)])
    else:  # every layer's pages one after another (wrapped in a smaller buffer)
        flat = torch.empty(L * n * bb // 16, dtype=torch.uint8)
        offs = (np.arange(L * n, dtype=np.int64) * bb % (flat.numel() - bb)).reshape(L, n)
    ids = np.random.default_rng(0).permutation(n)
    C = n // 16
    checks = None if a.unchecked else Checks(np.arange(n) // 16, np.arange(n) % 16, C,
                                             expected=np.zeros((L, C), np.uint32))
    groups = load_layer_groups(L, a.groups)
    ring = Ring(torch.device("cpu"), 16 << 20)
    ranges: list[int] = []  # the stand-in copy's sizes (--ranges)
    built: list[float] = []  # seconds of the unpack tables' build, made at the first launch
    build = staged_restore._unpacks

    def timed_build(*x):
        t = time.perf_counter()
        out = build(*x)
        built.append(time.perf_counter() - t)
        return out

    staged_restore._unpacks = timed_build
    launch = staged_restore._Chunk.launch
    staged_restore._Chunk.launch = lambda self: self.unpack(self.index)  # built, not run
    for rep in range(a.reps + 1):  # the first: imports and caches
        job = build_job(pools, ids, flat, offsets_arg(offs, L, "o"), save=False, checks=checks)
        t0 = time.perf_counter()
        calls = staged_restore.prepare(job, 64, groups, the_ring=ring,
                                       dma=lambda *x: ranges.append(x[-1]))
        t1 = time.perf_counter()
        calls[0]()  # the first group's copies (stand-in) and the tables, at its first launch
        job = build_job(pools, ids, flat, offsets_arg(offs, L, "o"), save=False, checks=checks)
        t2 = time.perf_counter()
        prepared._prepare(job, "triton", 64, groups)
        t3 = time.perf_counter()
        if rep:
            print(f"staged prepare {1e3 * (t1 - t0):.1f} ms (then its unpack tables "
                  f"{1e3 * built[-1]:.1f} ms, after the first copy)   triton prepare "
                  f"{1e3 * (t3 - t2):.1f} ms", flush=True)
    staged_restore._Chunk.launch = launch
    if a.ranges:  # issue every chunk's copies once (counted), its unpack left out
        del ranges[:]
        job = build_job(pools, ids, flat, offsets_arg(offs, L, "o"), save=False, checks=checks)
        calls = staged_restore.prepare(job, 64, groups, the_ring=ring,
                                       dma=lambda *x: ranges.append(x[-1]))
        staged_restore._Chunk.launch = lambda self: None
        for call in calls:
            call()
        print(f"{a.layout} layout: {len(ranges)} copy-engine ranges, "
              f"{sum(ranges) / max(1, len(ranges)) / 1024:.0f} KiB each on average", flush=True)


def ranges_time(reps: int) -> None:
    from xkv.kernels import host

    rng = np.random.default_rng(0)
    ranges = [(np.arange(16, dtype=np.int64) << 20,
               rng.integers(0, 12 << 30, 16).astype(np.int64) >> 16 << 16,
               np.full(16, 1 << 20, np.int64)) for _ in range(256)]
    flat_ptr, ring_ptr = 1 << 32, 1 << 44
    bounds = np.array([flat_ptr + (i << 30) for i in range(1, 12)], np.uint64)

    def per_chunk() -> None:
        for d, f, z in ranges:
            a = host.split_at((d + ring_ptr).astype(np.uint64), (f + flat_ptr).astype(np.uint64),
                              z.astype(np.uint64), bounds)
            host.split_at(*(np.ascontiguousarray(x, dtype=np.uint64) for x in a), bounds)

    for name, go in (("per chunk, twice", per_chunk),
                     ("absolute_ranges", lambda: staged_restore.absolute_ranges(
                         ranges, ring_ptr, flat_ptr, bounds))):
        go()
        t0 = time.perf_counter()
        for _ in range(reps * 4):
            go()
        print(f"copy-engine addresses of 256 chunks, {name}: "
              f"{1e3 * (time.perf_counter() - t0) / (reps * 4):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
    ranges_time(5)
