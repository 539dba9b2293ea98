"""Host time of one group's restore issue path (``loads.load_transfers``), no GPU: what a
restore step costs the engine thread before its copy can start.

    python bench/host_issue.py --blocks 1024 --layers 32          # a 16k-token Llama restore
    python bench/host_issue.py --blocks 128 --profile              # cProfile of a 2k one

Builds a Llama-shaped group (K/V-first pages: two runs per block, 16-token blocks, 256-token
chunks) over small CPU pools (only the counts matter to the host path), the transfers of one
full-hit restore ending inside its last block (the tail), with checksum words (``--unchecked``:
without), and times ``load_transfers`` with a handler that prepares the copies as the CUDA
handler does (``group_copies.prepare_group_restore``, Triton planning, light-step layer groups)
but launches nothing. On a GPU host the engine adds the tables' upload and the launches
(``XKV_TIMING``'s ``plan_ms`` / ``launch_ms``).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton planning on CPU tensors (no launch)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from xkv import kernels  # noqa: E402
from xkv.connector import checksums, group_copies, light_steps, loads  # noqa: E402
from xkv.connector.metadata import ChunkRef, load_transfer  # noqa: E402
from xkv.connector.registry import CacheGroup, build_registry  # noqa: E402
from xkv.layout import PagePool  # noqa: E402


class PlanOnly:
    """The handler seam: prepares every copy (as ``CudaTransferHandler.load_group`` does for a
    light step, and its tail's) and launches nothing."""

    checksum_pass = "copy"
    tail_last = False

    def __init__(self, light: bool) -> None:
        self.light, self.prepare_s, self.tail_s = light, 0.0, 0.0

    def load_before_forward(self, names, card, offsets, pools, block_ids) -> None:
        """The tail's plan: one launch over every layer, as ``group_copies.restore_all``."""
        t0 = time.perf_counter()
        kernels.prepare_restore(card, offsets, pools, block_ids, engine="triton",
                                layer_groups=[list(range(len(pools)))])
        self.tail_s += time.perf_counter() - t0

    def load_group(self, names, card, offsets, pools, block_ids, checks=None):
        t0 = time.perf_counter()
        groups = light_steps.load_layer_groups(len(pools)) if self.light else None
        group_copies.prepare_group_restore(card, offsets, pools, block_ids, checks,
                                           engine="triton", layer_groups=groups)
        self.prepare_s += time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=1024, help="blocks restored (16 tokens each)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--unchecked", action="store_true", help="no checksum words")
    ap.add_argument("--per-layer", action="store_true", help="not a light step: one launch per "
                    "layer")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    L, n, tok, k, run = a.layers, a.blocks, 16, 16, 512
    nb = n + 8
    stride = run  # K/V-first: block b's K run at b * run, its V run at nb * run + b * run
    extent = (nb - 1) * stride + nb * run + run
    raw = torch.zeros(L * (extent + 64), dtype=torch.uint8)
    pools = [PagePool(base=raw[i * (extent + 64):i * (extent + 64) + extent], num_blocks=nb,
                      block_bytes=2 * run, block_stride=stride, runs=((0, run), (nb * run, run)))
             for i in range(L)]
    names = tuple(f"l{i}" for i in range(L))
    plan = build_registry([CacheGroup(0, "attention", names, tok, 2 * run)], tp_size=1,
                          pp_size=1, chunk_size=k * tok).groups[0]
    obj = L * k * 2 * run
    chunks = -(-n // k)
    card = torch.zeros(obj * (chunks + 1), dtype=torch.uint8)
    cw = 0 if a.unchecked else checksums.check_words(plan)
    ids = np.random.default_rng(0).permutation(nb)[:n].tolist()
    gt = load_transfer(0, ids, 0, n, k, lambda c: ChunkRef(b"k%d" % c, (c * obj,), (0,)),
                       tail=1)
    if cw:
        gt = replace(gt, checks=tuple(np.zeros(cw, "<u4").tobytes() for _ in gt.chunks))
    h = PlanOnly(not a.per_layer)

    def once() -> float:
        t0 = time.perf_counter()
        loads.load_transfers(h, plan, 0, card, [gt], pools, fence_tail=True, check_words=cw)
        return time.perf_counter() - t0

    for _ in range(3):
        once()
    h.prepare_s = h.tail_s = 0.0
    ts = [once() for _ in range(a.reps)]
    print(f"{n} blocks x {L} layers, {'unchecked' if not cw else 'checked'}, "
          f"{'per layer' if a.per_layer else 'light step'}: load_transfers median "
          f"{statistics.median(ts) * 1e3:.2f} ms (min {min(ts) * 1e3:.2f}), of it preparing the "
          f"group's copies {h.prepare_s / a.reps * 1e3:.2f} ms and the tail's "
          f"{h.tail_s / a.reps * 1e3:.2f} ms on average; {os.cpu_count()} CPUs")
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.reps):
            once()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
