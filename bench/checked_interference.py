"""How much a restore slows a one-token forward running beside it, checked and unchecked (one GPU).

    python bench/checked_interference.py --out out/ [--mib 512] [--frag-kib 64]

Why: issue 25's same-engine A/B on an H100 (stop 43) had the checked 4k restore of the Llama shape
3 ms (11 %) slower than the unchecked one with the same copy time (``copy_ms`` 14.2 / 14.5): a light
step's verified restore ran at 64 programs (``LIGHT_VERIFIED_RESTORE_PROGRAMS`` then), the
unchecked one at 4, and each program's 128 KiB tile held most of an SM's registers, so the forward
beside it had fewer SMs (now 32 programs of 32 KiB: ``_launch.checked_restore_tile``). This measures exactly that, on the kernels serving launches: a stand-in forward
(32 layers of the Llama-3-8B shape's four bf16 matrix-vector products, one CUDA graph: weight
reads at HBM rate, as a one-token step's) alone and beside a restore of ``--mib`` of
``--frag-kib`` pages from pinned host memory, for each (checked, programs, tile) variant; per
variant the forward's slowdown (beside / alone, median of rounds) and the copy's GB/s beside the
forward. Also each compiled copy kernel variant's registers per thread, spills and warps.
Benchmarks never assert; correctness is in tests/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from page_mover import _checked_jobs, _prepared, machine_line  # noqa: E402

from xkv.kernels import _triton  # noqa: E402

KIB, MIB = 1024, 1 << 20
#: (name, checked, programs, tile bytes or None: what serving launches, ``_launch.plan``'s:
#: 4 unchecked programs of 128 KiB; verified restores ``checked_restore_tile``, 1 MiB in flight
#: over the programs). ``_t128k``: the tiles verified restores had before stop 43; the unchecked
#: 8 x 128 KiB and 32 x 32 KiB: the same 1 MiB for unchecked restores (not yet measured).
VARIANTS = [("unchecked_4", False, 4, None), ("unchecked_16", False, 16, None),
            ("unchecked_8", False, 8, None), ("unchecked_32_t32k", False, 32, 32 * KIB),
            ("checked_64_t128k", True, 64, 128 * KIB), ("checked_16_t128k", True, 16, 128 * KIB),
            ("checked_32", True, 32, None), ("checked_16", True, 16, None),
            ("checked_64", True, 64, None), ("checked_32_t64k", True, 32, 64 * KIB),
            ("checked_64_t32k", True, 64, 32 * KIB)]


def forward_graph(layers: int = 32) -> torch.cuda.CUDAGraph:
    """A one-token forward's weight reads: per layer x @ W for the Llama-3-8B shape's qkv (4096 x
    6144), o (4096 x 4096), gate_up (4096 x 28672) and down (14336 x 4096), bf16, captured once."""
    shapes = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
    ws = [[torch.randn(k, n, dtype=torch.bfloat16, device="cuda") * 0.01 for k, n in shapes]
          for _ in range(layers)]
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16, device="cuda") for k, _ in shapes}
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for w in ws[0]:
            xs[w.shape[0]] @ w  # warm cuBLAS outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for lw in ws:
            for w in lw:
                xs[w.shape[0]] @ w
    g._keep = (ws, xs)  # the graph reads these
    return g


def timed_pair(graph, copy, compute: torch.cuda.Stream, side: torch.cuda.Stream):
    """(forward ms, copy ms) with both issued at once (copy first, on ``side``); either None."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    torch.cuda.synchronize()
    if copy is not None:
        with torch.cuda.stream(side):
            ev[2].record()
            copy()
            ev[3].record()
    if graph is not None:
        with torch.cuda.stream(compute):
            ev[0].record()
            graph.replay()
            ev[1].record()
    torch.cuda.synchronize()
    f = ev[0].elapsed_time(ev[1]) if graph is not None else None
    c = ev[2].elapsed_time(ev[3]) if copy is not None else None
    return f, c


def kernel_variants() -> list[dict]:
    """Registers, spills, warps and shared memory of every compiled page-copy variant."""
    out = []
    try:
        for cache in _triton.page_copy_kernel.device_caches.values():
            for key, k in cache[0].items():
                out.append({"key": str(key)[:160], "n_regs": getattr(k, "n_regs", None),
                            "n_spills": getattr(k, "n_spills", None),
                            "num_warps": k.metadata.num_warps, "shared": k.metadata.shared})
    except Exception as e:  # Triton internals differ by version: the numbers are an extra
        out.append({"error": repr(e)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/checked_interference")
    ap.add_argument("--mib", type=int, default=512, help="bytes one restore moves")
    ap.add_argument("--frag-kib", type=int, default=64, help="page (fragment) size")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    total = a.mib * MIB
    host = torch.empty(total, dtype=torch.uint8).pin_memory()
    host.random_(0, 256)
    host_out = torch.empty(total, dtype=torch.uint8).pin_memory()
    nbytes, make = _checked_jobs(a.frag_kib * KIB, host, host_out, total)
    graph = forward_graph()
    compute, side = torch.cuda.Stream(), torch.cuda.Stream()
    copies = {name: _prepared(make("restore_checked" if ck else "restore"), p, "triton", t)
              for name, ck, p, t in VARIANTS}
    for c in copies.values():  # compile every variant before anything is timed
        timed_pair(None, c, compute, side)
    for _ in range(3):
        timed_pair(graph, None, compute, side)
    res = {"machine": machine_line(), "bytes": nbytes, "frag": a.frag_kib * KIB, "variants": {}}
    rows = {name: {"alone_fwd": [], "beside_fwd": [], "alone_copy": [], "beside_copy": []}
            for name in copies}
    for _ in range(a.rounds):  # variants interleaved per round: drift falls on all of them
        for name, c in copies.items():
            r = rows[name]
            r["alone_fwd"].append(timed_pair(graph, None, compute, side)[0])
            r["alone_copy"].append(timed_pair(None, c, compute, side)[1])
            f, cp = timed_pair(graph, c, compute, side)
            r["beside_fwd"].append(f)
            r["beside_copy"].append(cp)
    for name, r in rows.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        med["fwd_slowdown"] = statistics.median(b / f for b, f in zip(r["beside_fwd"],
                                                                        r["alone_fwd"], strict=True))
        med["copy_gbps_alone"] = nbytes / med["alone_copy"] / 1e6
        med["copy_gbps_beside"] = nbytes / med["beside_copy"] / 1e6
        res["variants"][name] = med
        print(f"{name:>18}: forward {med['alone_fwd']:.2f} -> {med['beside_fwd']:.2f} ms "
              f"(x{med['fwd_slowdown']:.3f}); copy {med['copy_gbps_alone']:.1f} GB/s alone, "
              f"{med['copy_gbps_beside']:.1f} beside ({med['beside_copy']:.2f} ms)", flush=True)
    res["kernels"] = kernel_variants()
    for k in res["kernels"]:
        print("kernel", json.dumps(k))
    with open(os.path.join(a.out, "checked_interference.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
