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

``--cuda`` (a GPU host): the same restore through the real ``CudaTransferHandler`` (GPU pools of
``--page-kib`` pages, a pinned card), checked and unchecked steps alternating as
``e2e_ttft.py --ab-unverified`` does, each step's ``XKV_TIMING restore`` line parsed: the medians
of ``pre_ms`` / ``issue_ms`` / ``copy_ms`` per side and, with ``--profile``, a cProfile of each
side's issue. Stop 43's engines spent 3-9 ms more ``pre_ms`` on unverified requests than on
checked ones; this shows in seconds, without vLLM, whether xkv's own path does (stop 44, H100:
it does not, 0.97 / 0.96 ms at 128 blocks, 1.78 / 1.61 at 2048; bench/RESULTS.md "stop 44").
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import os
import pstats
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

CUDA = "--cuda" in sys.argv
if CUDA:
    os.environ.setdefault("XKV_TIMING", "1")  # the handler's per-step line (read below)
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton planning on CPU tensors (no launch)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from timing_rest import field  # noqa: E402  (bench/, the script's own directory)

from xkv import kernels  # noqa: E402
from xkv.connector import checksums, group_copies, light_steps, loads  # noqa: E402
from xkv.connector.metadata import ChunkRef, load_transfer  # noqa: E402
from xkv.connector.registry import CacheGroup, build_registry  # noqa: E402
from xkv.layout import PagePool  # noqa: E402


class PlanOnly:
    """The handler seam: prepares every copy (as ``CudaTransferHandler.load_group`` does for a
    light step, and its tail's) and "launches" them with the kernel call itself a no-op
    (``Launch.__call__``), so what a launch plans (the launches after the first, planned at
    the second: ``prepare_restore(defer_rest=True)``) is timed apart (``rest_s``)."""

    checksum_pass = "copy"
    tail_last = False

    def __init__(self, light: bool) -> None:
        self.light, self.prepare_s, self.tail_s, self.rest_s = light, 0.0, 0.0, 0.0

    def load_before_forward(self, names, card, offsets, pools, block_ids) -> None:
        """The tail's plan: one launch over every layer, as ``group_copies.restore_all``."""
        t0 = time.perf_counter()
        kernels.prepare_restore(card, offsets, pools, block_ids, engine="triton",
                                layer_groups=[list(range(len(pools)))])
        self.tail_s += time.perf_counter() - t0

    def load_group(self, names, card, offsets, pools, block_ids, checks=None):
        t0 = time.perf_counter()
        groups = light_steps.load_layer_groups(len(pools)) if self.light else None
        prep = group_copies.prepare_group_restore(card, offsets, pools, block_ids, checks,
                                                  engine="triton", layer_groups=groups)
        t1 = time.perf_counter()
        self.prepare_s += t1 - t0
        real, kernels._launch.Launch.__call__ = kernels._launch.Launch.__call__, _no_kernel
        try:
            for g in range(len(prep)):
                prep.launch(g)
        finally:
            kernels._launch.Launch.__call__ = real
        self.rest_s += time.perf_counter() - t1


def _no_kernel(self) -> None:
    """A launch without its kernel (this bench times the host's planning only)."""


_FIELDS = ("pre_ms", "issue_ms", "issue_cpu_ms", "plan_ms", "launch_ms", "tail_ms", "copy_ms")


class _Lines(logging.Handler):
    """Keeps the ``XKV_TIMING restore`` lines the CUDA handler logs (one per step)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("XKV_TIMING restore"):
            self.lines.append(msg)


def _fields(line: str) -> dict[str, float]:
    return {k: v for k in _FIELDS if (v := field(line, k)) is not None}


def _layout(L: int, n: int, run: int, dev: str, pin: bool):
    """``L`` K/V-first pools of ``n + 8`` blocks (``2 * run`` bytes each) on ``dev``, their
    group plan and a card of one object per 256-token chunk (``pin``: page-locked)."""
    tok, k = 16, 16
    nb = n + 8
    stride = run  # K/V-first: block b's K run at b * run, its V run at nb * run + b * run
    extent = (nb - 1) * stride + nb * run + run
    raw = torch.zeros(L * (extent + 64), dtype=torch.uint8, device=dev)
    pools = [PagePool(base=raw[i * (extent + 64):i * (extent + 64) + extent], num_blocks=nb,
                      block_bytes=2 * run, block_stride=stride, runs=((0, run), (nb * run, run)))
             for i in range(L)]
    names = tuple(f"l{i}" for i in range(L))
    plan = build_registry([CacheGroup(0, "attention", names, tok, 2 * run)], tp_size=1,
                          pp_size=1, chunk_size=k * tok).groups[0]
    obj = L * k * 2 * run
    card = torch.zeros(obj * (-(-n // k) + 1), dtype=torch.uint8, pin_memory=pin)
    ids = np.random.default_rng(0).permutation(nb)[:n].tolist()
    gt = load_transfer(0, ids, 0, n, k, lambda c: ChunkRef(b"k%d" % c, (c * obj,), (0,)),
                       tail=1)
    return plan, pools, names, card, gt


def _cuda(a) -> None:
    """``--cuda``: checked and unchecked restores alternating on the real CUDA handler."""
    from xkv.connector.cuda_transfer import CudaTransferHandler

    dev = torch.device("cuda", torch.cuda.current_device())
    plan, pools, _, card, gt = _layout(a.layers, a.blocks, a.page_kib * 512, "cuda", True)
    cw = checksums.check_words(plan)
    sides = {"checked": (replace(gt, checks=tuple(np.zeros(cw, "<u4").tobytes()
                                                  for _ in gt.chunks)), cw),
             "unchecked": (gt, cw)}  # an unverified request: words on, none for its chunks
    h = CudaTransferHandler(dev)
    lines = _Lines()
    logging.getLogger("xkv.connector").addHandler(lines)
    logging.getLogger("xkv.connector").setLevel(logging.INFO)
    profs = {k: cProfile.Profile() for k in sides}
    got: dict[str, list[dict[str, float]]] = {k: [] for k in sides}

    def step(side: str, prof: bool) -> None:
        t, words = sides[side]
        h.set_light_step(not a.per_layer)
        if prof:
            profs[side].enable()
        h.begin_loads()
        loads.load_transfers(h, plan, 0, card, [t], pools, fence_tail=True, check_words=words)
        if prof:
            profs[side].disable()
        torch.cuda.current_stream(dev).wait_stream(h.load_stream)  # the forward's waits
        h.sync_loads()

    for i in range(a.reps + 3):  # 3 warm rounds (compiles), then the timed ones
        for side in (("checked", "unchecked") if i % 2 == 0 else ("unchecked", "checked")):
            del lines.lines[:]
            step(side, False)
            if i >= 3 and lines.lines:
                got[side].append(_fields(lines.lines[-1]))
    for i in range(a.reps if a.profile else 0):  # profiled apart: cProfile slows every call
        for side in (("checked", "unchecked") if i % 2 == 0 else ("unchecked", "checked")):
            step(side, True)
    torch.cuda.synchronize()
    print(f"{a.blocks} blocks x {a.layers} layers of {a.page_kib} KiB pages on "
          f"{torch.cuda.get_device_name(dev)}, {'per layer' if a.per_layer else 'light step'}, "
          f"engine {h.load_engine} (XKV_LOAD_ENGINE; no start-up probe here: `auto` takes the "
          f"ring), {a.reps} steps a side (medians, ms):")
    for side, rows in got.items():
        print(f"  {side:9s} " + " ".join(
            f"{k}={statistics.median(r[k] for r in rows):.2f}" for k in _FIELDS
            if rows and all(k in r for r in rows)))
    if a.profile:
        for side, pr in profs.items():
            print(f"--- {side}: issue (begin_loads + load_transfers), by tottime")
            pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=1024, help="blocks restored (16 tokens each)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--unchecked", action="store_true", help="no checksum words")
    ap.add_argument("--per-layer", action="store_true", help="not a light step: one launch per "
                    "layer")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cuda", action="store_true", help="the real CUDA handler, checked and "
                    "unchecked alternating (a GPU host)")
    ap.add_argument("--page-kib", type=int, default=64, help="--cuda: page (block) size in KiB "
                    "(64: the Llama-3-8B shape's 16 tokens x 8 heads x 128 x bf16, K and V)")
    a = ap.parse_args()
    if a.cuda:
        _cuda(a)
        return
    L, n = a.layers, a.blocks
    plan, pools, _, card, gt = _layout(L, n, 512, "cpu", False)  # only counts matter here
    cw = 0 if a.unchecked else checksums.check_words(plan)
    if cw:
        gt = replace(gt, checks=tuple(np.zeros(cw, "<u4").tobytes() for _ in gt.chunks))
    h = PlanOnly(not a.per_layer)

    def once() -> float:
        t0 = time.perf_counter()
        loads.load_transfers(h, plan, 0, card, [gt], pools, fence_tail=True, check_words=cw)
        return time.perf_counter() - t0

    for _ in range(3):
        once()
    h.prepare_s = h.tail_s = h.rest_s = 0.0
    ts = [once() for _ in range(a.reps)]
    print(f"{n} blocks x {L} layers, {'unchecked' if not cw else 'checked'}, "
          f"{'per layer' if a.per_layer else 'light step'}: load_transfers median "
          f"{statistics.median(ts) * 1e3:.2f} ms (min {min(ts) * 1e3:.2f}), of it preparing the "
          f"group's copies up to the first launch {h.prepare_s / a.reps * 1e3:.2f} ms, planning "
          f"the other launches (inside the second) {h.rest_s / a.reps * 1e3:.2f} ms and the "
          f"tail's {h.tail_s / a.reps * 1e3:.2f} ms on average; {os.cpu_count()} CPUs")
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.reps):
            once()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
