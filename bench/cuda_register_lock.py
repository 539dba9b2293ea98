"""Does a background thread's cudaHostRegister / cudaHostUnregister / munmap of a card stall the
engine thread's CUDA work? (issue 27 item 1: why the worker lets go of a dead gateway's card only
when the engine is idle, see xkv/connector/turnoff.py)

One process: a populated memfd card of ``--gib`` GiB (MAP_SHARED, like the gateway's card); the
main thread loops a 2048x2048 fp32 matmul + stream synchronize (the "engine") and
records its slowest iteration while another thread (CUDA device set) makes the call. A pure
Python loop stands in for an engine that does no CUDA work (GIL only).

With ``--segment-mib N`` (N > 0) it also measures the fix (xkv/connector/card_pin.py): the card
registered in N MiB segments (``register_segmented``: one per call with the attach's pause
between) and let go of one segment per step with the OffPath's gap between two
(``unregister_segmented``); the engine's worst iteration should then be about one segment's call.

Usage (GPU machine):  PYTHONPATH=. python bench/cuda_register_lock.py [--gib 16] [--segment-mib 1024]
Prints one JSON line: per case the seconds the call took and the engine's worst iteration in ms.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import threading
import time

import torch

MADV_POPULATE_WRITE = 23


def _loop(dur: float, x: torch.Tensor | None) -> tuple[float, int]:
    """The engine: worst iteration (ms) and iterations in ``dur`` seconds."""
    end, worst, n = time.perf_counter() + dur, 0.0, 0
    while time.perf_counter() < end:
        t = time.perf_counter()
        if x is not None:
            _ = x @ x
            torch.cuda.current_stream().synchronize()
        else:
            sum(range(2000))
        worst, n = max(worst, time.perf_counter() - t), n + 1
    return round(worst * 1e3, 1), n


def _beside(fn, dur: float, x) -> dict:
    r: dict = {}

    def body():
        torch.cuda.set_device(0)
        t = time.perf_counter()
        fn()
        r["call_s"] = round(time.perf_counter() - t, 3)

    th = threading.Thread(target=body)
    th.start()
    r["engine_worst_ms"], r["iterations"] = _loop(dur, x)
    th.join()
    return r


def _segmented(card: torch.Tensor, seg: int, x: torch.Tensor) -> dict:
    """The card pinned in ``seg``-byte segments beside the engine, then let go of one segment
    per step with OffPath's gap (max(STEP_GAP_S, the step's duration)) between steps."""
    from xkv.connector import card_pin
    from xkv.connector.turnoff import STEP_GAP_S

    n_seg = len(card_pin.segments(card.numel(), card.data_ptr(), seg))
    out = {"segment_mib": seg >> 20, "segments": n_seg}
    out["register_segmented"] = _beside(
        lambda: card_pin.pin(card, seg, pause=lambda: time.sleep(card_pin.REGISTER_PAUSE_S)),
        n_seg * 0.1 + 2.0, x)
    steps: list[float] = []

    def release() -> None:
        while True:
            t = time.perf_counter()
            left = card_pin.unpin(card, 1)
            steps.append(time.perf_counter() - t)
            if not left:
                return
            time.sleep(max(STEP_GAP_S, steps[-1]))

    out["unregister_segmented"] = _beside(release, n_seg * 0.1 + 2.0, x)
    out["unregister_segmented"]["worst_step_ms"] = round(max(steps) * 1e3, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--segment-mib", type=int, default=0,
                    help="also the segmented register / one-segment-per-step unregister")
    a = ap.parse_args()
    torch.cuda.set_device(0)
    rt, n = torch.cuda.cudart(), a.gib << 30
    fd = os.memfd_create("card")
    os.ftruncate(fd, n)
    m = mmap.mmap(fd, n)
    m.madvise(MADV_POPULATE_WRITE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    p = t.data_ptr()
    x = torch.randn(2048, 2048, device="cuda")
    _ = x @ x
    torch.cuda.synchronize()
    worst, iters = _loop(1.0, x)
    out = {"gib": a.gib, "baseline": {"engine_worst_ms": worst, "iterations": iters}}
    out["register"] = _beside(lambda: rt.cudaHostRegister(p, n, 0), 4.0, x)
    out["unregister"] = _beside(lambda: rt.cudaHostUnregister(p), 3.0, x)
    rt.cudaHostRegister(p, n, 0)
    out["unregister_python_engine"] = _beside(lambda: rt.cudaHostUnregister(p), 2.0, None)
    if a.segment_mib > 0:
        out.update(_segmented(t, a.segment_mib << 20, x))
    del t
    out["munmap"] = _beside(m.close, 3.0, x)
    os.close(fd)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
