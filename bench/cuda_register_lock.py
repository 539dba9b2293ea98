"""Does a background thread's cudaHostRegister / cudaHostUnregister / munmap of a card stall the
engine thread's CUDA work? (issue 27 item 1: why the worker lets go of a dead gateway's card only
when the engine is idle, see xkv/connector/turnoff.py)

One process: a populated memfd card of ``--gib`` GiB (MAP_SHARED, like the gateway's card); the
main thread loops a 2048x2048 fp32 matmul + stream synchronize (the "engine") and
records its slowest iteration while another thread (CUDA device set) makes the call. A pure
Python loop stands in for an engine that does no CUDA work (GIL only).

Usage (GPU machine):  python bench/cuda_register_lock.py [--gib 16]
Prints one JSON line per case: seconds the call took, the engine's worst iteration in ms.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=int, default=16)
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
    del t
    out["munmap"] = _beside(m.close, 3.0, x)
    os.close(fd)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
