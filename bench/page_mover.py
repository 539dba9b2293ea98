"""Page-mover benchmark (one H200): xkv restore/save GB/s against the same run's copy engine.

    python bench/page_mover.py --out out/          # full table + page_mover.json + page_mover.png
    python bench/page_mover.py --sweep --out out/  # also: tile-size sweep at 4 and 16 KiB
    python bench/page_mover.py --checksums --out out/  # only: with vs without checksums

The Triton and batched copy-engine copies are timed with their descriptors prepared beforehand (the
GPU work, and for the copy engine the driver call); "public call" rows time the whole public path
(validation is done once); "staged" restores are the serving path (``staged_restore``: planned
once, then every chunk's copy and unpack issued per run, its host work included), staged saves
the per-launch engine.

Workload: a paged GPU cache of fragments of F bytes (F = 4, 8, 16, 64, 256 KiB), 1 GiB of pinned host
memory holding the stored objects contiguously (the card), random block ids. Restore = host -> cache
(``xkv.kernels.restore``), save = cache -> host (``xkv.kernels.save``), for SM budgets 2..all. Beside
them, in the same process: one large pinned ``cudaMemcpy`` each way and both at once (the
denominators), ``cuMemcpyBatchAsync`` on the same fragments, the staged engine (contiguous
copy-engine transfers + pack/unpack on the GPU), both directions at once, a naive per-page ``copy_``
loop, torch ``index_copy_``/``index_select``, and the slowdown of a bf16 8192^3 matmul loop beside a
full-rate restore (all on non-default streams). Benchmarks never assert; correctness is in tests/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import xkv.kernels as K  # noqa: E402
from xkv.kernels import _launch, copy_engine, staged, staged_restore  # noqa: E402
from xkv.kernels.hashing import build_hash_job  # noqa: E402
from xkv.kernels.jobs import build_job, offsets_arg  # noqa: E402
from xkv.layout import describe_cache  # noqa: E402

KIB = 1024
SIZES = [4 * KIB, 8 * KIB, 16 * KIB, 64 * KIB, 256 * KIB]


def timed(fn, *, reps: int = 5, warmup: int = 1) -> float:
    """Median seconds of ``fn`` (CUDA events on the current stream)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(out)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def machine_line() -> dict:
    p = torch.cuda.get_device_properties(0)
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = "?"
    import triton

    return {
        "gpu": p.name,
        "sms": p.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": commit or os.environ.get("XKV_COMMIT", "?"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cmd": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }


class Case:
    """One fragment size: cache, host card, ids, offsets, validated jobs."""

    def __init__(self, frag: int, host: torch.Tensor, host_out: torch.Tensor, total: int):
        self.frag = frag
        self.n = total // frag
        self.bytes = self.n * frag
        self.cache = torch.empty((self.n * 2, frag), dtype=torch.uint8, device="cuda")
        self.pool = describe_cache(self.cache)
        g = torch.Generator().manual_seed(frag)
        self.ids = torch.randperm(self.n * 2, generator=g)[: self.n]
        self.ids_gpu = self.ids.cuda()
        self.offs = np.arange(self.n, dtype=np.int64) * frag
        self.host = host[: self.bytes]
        self.host_out = host_out[: self.bytes]
        self.restore_job = build_job(
            [self.pool], self.ids, self.host, offsets_arg(self.offs, 1, "src_offsets"), save=False
        )
        self.save_job = build_job(
            [self.pool],
            self.ids,
            self.host_out,
            offsets_arg(self.offs, 1, "dst_offsets"),
            save=True,
        )

    def restore(self, budget: int, engine: str = "triton", tile: int | None = None):
        return _prepared(self.restore_job, budget, engine, tile)

    def save(self, budget: int, engine: str = "triton", tile: int | None = None):
        return _prepared(self.save_job, budget, engine, tile)


def guarded(fn) -> float:
    """A measurement that must not cost the rest of the table: NaN (and the traceback) on error."""
    try:
        return fn()
    except Exception:
        traceback.print_exc()
        return float("nan")


def _prepared(job, budget: int, engine: str, tile: int | None):
    """The copy with its descriptors built and uploaded once: what is timed is the GPU work (and,
    for the copy engine, the driver call, which is part of its cost)."""
    if engine == "triton":
        launches = _launch.launches(job, budget, tile_bytes=tile)

        def run():
            for launch in launches:
                launch()

        return run
    if engine == "staged" and not job.save:  # the serving path: the ring, prepared once
        calls = staged_restore.prepare(job, budget)
        return lambda: [call() for call in calls]
    if engine == "staged":
        return lambda: staged.run(job, budget)
    return copy_engine.runner(job)


def host_overhead(case: Case, budget: int) -> dict:
    """Wall time of the public call (validation + descriptors + launch) vs. its GPU time."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    K.restore(case.host, case.offs, case.pool, case.ids, max_programs=budget, engine="triton")
    host_s = time.perf_counter() - t
    torch.cuda.synchronize()
    return {"fragments": case.n, "host_ms": host_s * 1e3, "us_per_fragment": host_s * 1e6 / case.n}


def copy_engine_peaks(host: torch.Tensor, host_out: torch.Tensor, dev_buf: torch.Tensor) -> dict:
    n = host.numel()
    h2d = timed(lambda: dev_buf[:n].copy_(host, non_blocking=True))
    d2h = timed(lambda: host_out.copy_(dev_buf[:n], non_blocking=True))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def duplex():
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            dev_buf[:n].copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host_out.copy_(dev_buf[n : 2 * n], non_blocking=True)
        cur.wait_stream(s1)
        cur.wait_stream(s2)

    dup = timed(duplex)
    return {"h2d": gbps(n, h2d), "d2h": gbps(n, d2h), "duplex": gbps(2 * n, dup)}


def duplex(case: Case, budget: int, restore_engine: str, save_engine: str) -> float:
    """Restore and save of the same size at once, on two streams: total GB/s."""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    r, w = case.restore(budget, restore_engine), case.save(budget, save_engine)

    def both():
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            r()
        with torch.cuda.stream(s2):
            w()
        cur.wait_stream(s1)
        cur.wait_stream(s2)

    return gbps(2 * case.bytes, timed(both, reps=3))


def naive_per_page(case: Case, max_pages: int = 4096) -> dict:
    n = min(case.n, max_pages)
    ids = case.ids[:n].tolist()

    def restore():
        for i, b in enumerate(ids):
            case.cache[b].copy_(case.host[i * case.frag : (i + 1) * case.frag], non_blocking=True)

    def save():
        for i, b in enumerate(ids):
            case.host_out[i * case.frag : (i + 1) * case.frag].copy_(
                case.cache[b], non_blocking=True
            )

    return {
        "restore": gbps(n * case.frag, timed(restore, reps=3)),
        "save": gbps(n * case.frag, timed(save, reps=3)),
    }


def torch_index(case: Case, staging: torch.Tensor) -> dict:
    view = staging[: case.bytes].view(case.n, case.frag)
    host2d = case.host.view(case.n, case.frag)
    out2d = case.host_out.view(case.n, case.frag)

    def restore():  # what a torch user writes: H2D into a staging buffer, then index_copy_
        view.copy_(host2d, non_blocking=True)
        case.cache.index_copy_(0, case.ids_gpu, view)

    def save():
        torch.index_select(case.cache, 0, case.ids_gpu, out=view)
        out2d.copy_(view, non_blocking=True)

    return {
        "restore": gbps(case.bytes, timed(restore, reps=3)),
        "save": gbps(case.bytes, timed(save, reps=3)),
    }


def interference(case: Case, budgets: list[int], host: torch.Tensor, dev_buf: torch.Tensor) -> dict:
    """Slowdown of a bf16 8192^3 matmul loop beside a full-rate restore on another stream.

    One unbroken stream of matmuls (sustained clocks and power), timed in three back-to-back
    segments A | B | C of equal length; the copy, on its own non-default stream, starts when B
    starts and is sized to end inside B. Slowdown = B / mean(A, C)."""
    compute, side = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(compute):
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        c = torch.empty_like(a)

        def mm(k: int) -> None:
            for _ in range(k):
                torch.matmul(a, b, out=c)

        mm(10)
        t_mm = timed(lambda: mm(10), reps=3) / 10
    out = {"matmul_ms_each": t_mm * 1e3, "matmul_tflops": 2 * 8192**3 / t_mm / 1e12}

    def segments(copy_fn, copy_s: float) -> tuple[float, float, float]:
        reps = max(1, math.floor(0.85 * max(0.04, copy_s) / copy_s))
        iters = max(25, math.ceil(1.25 * reps * copy_s / t_mm))
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        with torch.cuda.stream(compute):
            mm(5)
            ev[0].record()
            mm(iters)
            ev[1].record()
        if copy_fn is not None:
            with torch.cuda.stream(side):
                side.wait_event(ev[1])
                for _ in range(reps):
                    copy_fn()
        with torch.cuda.stream(compute):
            mm(iters)
            ev[2].record()
            mm(iters)
            ev[3].record()
        torch.cuda.synchronize()
        A, B, C = (ev[i].elapsed_time(ev[i + 1]) for i in range(3))
        return A, B, C

    def beside(name: str, copy_fn) -> None:
        with torch.cuda.stream(side):
            copy_s = timed(copy_fn, reps=2)
        runs = [segments(copy_fn, copy_s) for _ in range(3)]
        out[name] = statistics.median(B / ((A + C) / 2) for A, B, C in runs)
        out[name + "_copy_ms"] = copy_s * 1e3

    A, B, C = segments(None, 0.04)
    out["no_copy"] = B / ((A + C) / 2)  # the method's own noise: should be 1.00
    for budget in budgets:
        beside(f"triton_{budget}", case.restore(budget))
    n = host.numel()
    beside("copy_engine_1GiB", lambda: dev_buf[:n].copy_(host, non_blocking=True))
    if copy_engine.available():
        beside("copy_engine_batched", case.restore(0, "copy_engine"))
    for budget in budgets:
        if budget <= 4:
            beside(f"staged_{budget}", case.restore(budget, "staged"))
    return out


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    sizes = [s // KIB for s in SIZES]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, direction, ce_key in ((axes[0], "restore", "h2d"), (axes[1], "save", "d2h")):
        for budget in results["budgets"]:
            ax.plot(
                sizes,
                [results["rows"][str(s)][direction][str(budget)] for s in SIZES],
                marker="o",
                label=f"Triton, {budget} programs",
            )
        ax.plot(
            sizes,
            [results["rows"][str(s)][f"{direction}_batched_ce"] for s in SIZES],
            "k--",
            marker="s",
            label="cuMemcpyBatchAsync",
        )
        ax.plot(
            sizes,
            [results["rows"][str(s)][f"{direction}_staged"] for s in SIZES],
            "b-.",
            marker="D",
            label="staged (CE + GPU pack/unpack)",
        )
        ax.plot(
            sizes,
            [results["rows"][str(s)]["naive"][direction] for s in SIZES],
            ":",
            color="gray",
            marker="x",
            label="per-page copy_",
        )
        ax.axhline(
            results["copy_engine"][ce_key],
            color="red",
            lw=1,
            label=f"copy engine, one 1 GiB copy ({results['copy_engine'][ce_key]:.1f})",
        )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{s} KiB" for s in sizes])
        ax.set_xlabel("fragment size")
        ax.set_title(
            f"{direction} ({'host -> GPU cache' if direction == 'restore' else 'GPU cache -> host'})"
        )
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=7, loc="lower right")
    m = results["machine"]
    fig.suptitle(f"xkv page mover, {m['gpu']}, {m['date']}, commit {m['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument("--budgets", default="2,4,8,16,32,all")
    ap.add_argument("--connector-budget", type=int, default=K.default_programs())
    ap.add_argument("--sweep", action="store_true", help="also sweep tile sizes at 4 and 16 KiB")
    ap.add_argument("--skip-interference", action="store_true")
    ap.add_argument("--checksums", action="store_true",
                    help="only compare restore/save GB/s with and without checksums (issue 25)")
    ap.add_argument("--check-budgets", default="8,16,32",
                    help="--checksums: the SM budgets besides --connector-budget")
    ap.add_argument("--check-sizes", default=",".join(str(s // KIB) for s in CHECK_SIZES),
                    help="--checksums: page sizes in KiB")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.cuda.init()
    if args.checksums:
        checksum_table(args)
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    budgets = [sms if b == "all" else int(b) for b in args.budgets.split(",")]
    total = args.total_mib << 20
    t0 = time.time()
    host = torch.empty(total, dtype=torch.uint8).pin_memory()
    host.random_(0, 256)
    host_out = torch.empty(total, dtype=torch.uint8).pin_memory()
    dev_buf = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    results = {"machine": machine_line(), "budgets": budgets, "rows": {}, "total_bytes": total}
    print(json.dumps(results["machine"]))
    results["copy_engine"] = ce = copy_engine_peaks(host, host_out, dev_buf)
    print(
        f"copy engine: H2D {ce['h2d']:.1f} GB/s  D2H {ce['d2h']:.1f} GB/s  duplex {ce['duplex']:.1f} GB/s"
    )

    staging = dev_buf
    cb = args.connector_budget
    cases = {}
    for frag in SIZES:
        case = cases[frag] = Case(frag, host, host_out, total)
        row = results["rows"][str(frag)] = {"restore": {}, "save": {}}
        for budget in budgets:
            row["restore"][str(budget)] = gbps(case.bytes, timed(case.restore(budget)))
            row["save"][str(budget)] = gbps(case.bytes, timed(case.save(budget)))
        nan = float("nan")
        ce_ok = copy_engine.available()
        row["restore_batched_ce"] = (
            gbps(case.bytes, timed(case.restore(0, "copy_engine"))) if ce_ok else nan
        )
        row["save_batched_ce"] = (
            gbps(case.bytes, timed(case.save(0, "copy_engine"))) if ce_ok else nan
        )
        row["restore_staged"] = guarded(
            lambda c=case: gbps(c.bytes, timed(c.restore(cb, "staged")))
        )
        row["save_staged"] = guarded(lambda c=case: gbps(c.bytes, timed(c.save(cb, "staged"))))
        row["duplex"] = {
            "triton+triton": guarded(lambda c=case: duplex(c, cb, "triton", "triton")),
            "staged+staged": guarded(lambda c=case: duplex(c, cb, "staged", "staged")),
            "triton+staged": guarded(lambda c=case: duplex(c, cb, "triton", "staged")),
            "staged+triton": guarded(lambda c=case: duplex(c, cb, "staged", "triton")),
        }
        if ce_ok:
            row["duplex"]["ce_batch+ce_batch"] = guarded(
                lambda c=case: duplex(c, 0, "copy_engine", "copy_engine")
            )
        row["naive"] = naive_per_page(case)
        row["torch_index"] = torch_index(case, staging)
        print(
            f"{frag // KIB:>4} KiB  restore "
            + " ".join(f"{b}:{row['restore'][str(b)]:.1f}" for b in budgets)
            + f" CE-batch {row['restore_batched_ce']:.1f} staged {row['restore_staged']:.1f} | save "
            + " ".join(f"{b}:{row['save'][str(b)]:.1f}" for b in budgets)
            + f" CE-batch {row['save_batched_ce']:.1f} staged {row['save_staged']:.1f} | duplex "
            + " ".join(f"{k} {v:.1f}" for k, v in row["duplex"].items())
            + f" | naive {row['naive']['restore']:.2f}/{row['naive']['save']:.2f}"
            + f" | torch {row['torch_index']['restore']:.1f}/{row['torch_index']['save']:.1f}",
            flush=True,
        )

    if args.sweep:
        results["sweep"] = {}
        for frag in (4 * KIB, 16 * KIB):
            for tile in (32 * KIB, 64 * KIB, 128 * KIB):
                for budget in (1, 2, 4):
                    c = cases[frag]
                    r = gbps(c.bytes, timed(c.restore(budget, tile=tile), reps=3))
                    w = gbps(c.bytes, timed(c.save(budget, tile=tile), reps=3))
                    results["sweep"][f"{frag // KIB}k_tile{tile // KIB}k_p{budget}"] = {
                        "restore": r,
                        "save": w,
                    }
                    print(
                        f"sweep {frag // KIB} KiB tile {tile // KIB} KiB programs {budget}: "
                        f"restore {r:.1f} save {w:.1f}",
                        flush=True,
                    )

    def section(name, fn):
        try:
            fn()
        except Exception as e:  # a broken extra must not cost the table
            traceback.print_exc()
            results.setdefault("errors", {})[name] = repr(e)

    section("calibration", lambda: calibrated(results, cases, cb))
    if not args.skip_interference:

        def interf():
            results["interference"] = interference(
                cases[16 * KIB], sorted({1, 2, cb, 8}), host, dev_buf
            )
            print("interference:", json.dumps(results["interference"]))

        section("interference", interf)

    results["elapsed_s"] = time.time() - t0
    with open(os.path.join(args.out, "page_mover.json"), "w") as f:
        json.dump(results, f, indent=1)
    section("plot", lambda: plot(results, os.path.join(args.out, "page_mover.png")))
    print_table(results, cb)


CHECK_SIZES = [4 * KIB, 8 * KIB, 16 * KIB, 18 * KIB, 32 * KIB, 64 * KIB, 256 * KIB]  # 18: MLA
PAGES_PER_OBJECT = 16  # k: a 256-token chunk of 16-token blocks


def _checked_jobs(frag: int, host: torch.Tensor, host_out: torch.Tensor, total: int):
    """Restore and save jobs of ``total`` bytes of ``frag``-byte fragments (one layer, as a
    prepared serving step launches per layer), with and without checks: objects of
    ``PAGES_PER_OBJECT`` pages, expected words from a checked save of the same bytes."""
    n = total // frag
    cache = torch.empty((n * 2, frag), dtype=torch.uint8, device="cuda")
    cache.random_(0, 256)
    pool = describe_cache(cache)
    ids = torch.randperm(n * 2, generator=torch.Generator().manual_seed(frag))[:n].numpy()
    offs = np.arange(n, dtype=np.int64) * frag
    objs, pages = np.arange(n) // PAGES_PER_OBJECT, np.arange(n) % PAGES_PER_OBJECT
    C = int(objs.max()) + 1
    src, dst = host[: n * frag], host_out[: n * frag]
    words = K.save(pool, ids, src, offs, engine="triton", checks=K.Checks(objs, pages, C))
    torch.cuda.synchronize()
    exp = words.host_words()
    specs = {"restore": (False, src, None),
             "restore_checked": (False, src, K.Checks(objs, pages, C, expected=exp)),
             "save": (True, dst, None),
             "save_checked": (True, dst, K.Checks(objs, pages, C))}

    def make(name: str):  # a fresh job: a checked job's word buffer adds up over launches
        if name == "hash":  # hash_pages of the restored pages against the same expected words
            return build_hash_job([pool], ids, K.Checks(objs, pages, C, expected=exp))
        save, flat, checks = specs[name]
        return build_job([pool], ids, flat, offsets_arg(offs, 1, "o"), save=save, checks=checks)

    return n * frag, make


def checksum_table(args) -> None:
    """``--checksums``: GB/s of the Triton restore and save with and without the checksum
    variant, at the connector's SM budget (``--connector-budget``, the default
    ``XKV_MAX_PROGRAMS``) and at ``--check-budgets`` programs (default 8, 16, 32), for pages of 4..256 KiB (one prepared
    launch per layer, as serving issues them); the staged restore through the ring (copy engine,
    then unpack and hash from GPU memory: serving's path for restores >= 8 MiB since stop 40)
    at every size and budget; and issue 25's plan: the unchecked restore followed by
    ``hash_pages`` of the restored pages in HBM at the same budget (``restore_hash``, its ratio
    to the unchecked restore alone; ``hash``: the hash alone). Plain and checked runs alternate
    (3 rounds, best median each) so drift hits all. Writes page_mover_checksums.json; the
    issue's target is a ratio >= 0.98 at the serving budget."""
    total = min(args.total_mib, 256) << 20
    host = torch.empty(total, dtype=torch.uint8).pin_memory()
    host.random_(0, 256)
    host_out = torch.empty(total, dtype=torch.uint8).pin_memory()
    budgets = sorted({args.connector_budget, *map(int, args.check_budgets.split(","))})
    out = {"machine": machine_line(), "budgets": budgets, "rows": {}}
    print(json.dumps(out["machine"]))
    for frag in (int(k) * KIB for k in args.check_sizes.split(",")):
        nbytes, make = _checked_jobs(frag, host, host_out, total)
        row = out["rows"][str(frag)] = {}
        for budget in budgets:
            once = make("restore_checked")  # one clean verified restore: no object may flag
            _prepared(once, budget, "triton", None)()
            torch.cuda.synchronize()
            false_alarms = int(once.checks.buf.mismatched().sum())
            plain = make("restore")  # a clean unchecked restore, then hash_pages: no flag either
            _prepared(plain, budget, "triton", None)()
            hashed = make("hash")
            _prepared(hashed, budget, "triton", None)()
            torch.cuda.synchronize()
            false_alarms += int(hashed.checks.buf.mismatched().sum())
            runs = {k: _prepared(make(k), budget, "triton", None)
                    for k in ("restore", "restore_checked", "save", "save_checked", "hash")}
            runs["restore_hash"] = lambda r=runs["restore"], h=runs["hash"]: (r(), h())
            best = {k: 0.0 for k in runs}
            for _ in range(3):
                for k, fn in runs.items():
                    best[k] = max(best[k], gbps(nbytes, timed(fn)))
            cell = dict(best)
            cell["restore_ratio"] = best["restore_checked"] / best["restore"]
            cell["save_ratio"] = best["save_checked"] / best["save"]
            cell["restore_hash_ratio"] = best["restore_hash"] / best["restore"]
            cell["false_alarms"] = false_alarms
            # the staged restore (copy engine into the ring, unpack and hash from HBM: what
            # serving runs for restores >= 8 MiB), checked against unchecked at this budget
            once = make("restore_checked")
            guarded(lambda once=once, b=budget: _prepared(once, b, "staged", None)())
            torch.cuda.synchronize()
            false_alarms += int(once.checks.buf.mismatched().sum())
            st = {f"staged_{k}": guarded(lambda k=k, mk=make, nb=nbytes, b=budget: gbps(
                nb, timed(_prepared(mk(k), b, "staged", None), reps=3)))
                for k in ("restore", "restore_checked")}
            st["staged_restore_ratio"] = st["staged_restore_checked"] / st["staged_restore"]
            cell.update(st)
            print(f"      staged (ring) restore {st['staged_restore']:.1f} -> "
                  f"{st['staged_restore_checked']:.1f} GB/s "
                  f"({st['staged_restore_ratio']:.3f})", flush=True)
            row[str(budget)] = cell
            print(f"{frag // KIB:>4} KiB  {budget:>3} programs  restore {best['restore']:.1f} -> "
                  f"{best['restore_checked']:.1f} GB/s ({cell['restore_ratio']:.3f})  save "
                  f"{best['save']:.1f} -> {best['save_checked']:.1f} GB/s "
                  f"({cell['save_ratio']:.3f})  false alarms {false_alarms}", flush=True)
            print(f"      restore unchecked + hash_pages after ({budget} programs) "
                  f"{best['restore_hash']:.1f} GB/s ({cell['restore_hash_ratio']:.3f} of the "
                  f"unchecked restore; hash alone {best['hash']:.1f} GB/s)", flush=True)
    with open(os.path.join(args.out, "page_mover_checksums.json"), "w") as f:
        json.dump(out, f, indent=1)


def calibrated(results: dict, cases: dict, budget: int) -> None:
    """What engine='auto' picks after calibrate() (128 MiB per size and direction), applied to the
    table's 1 GiB jobs."""
    cal = K.calibrate(max_programs=budget)
    results["calibration"] = {d: {str(z): v for z, v in cal.gbps[d].items()} for d in cal.gbps}
    for frag in SIZES:
        row = results["rows"][str(frag)]
        for d in ("restore", "save"):
            eng = cal.engine_for(d == "save", frag, cases[frag].bytes, True)
            row[f"{d}_auto_engine"] = eng
            row[f"{d}_auto"] = {
                "triton": row[d][str(budget)],
                "copy_engine": row[f"{d}_batched_ce"],
                "staged": row[f"{d}_staged"],
            }[eng]
    print("calibration:", json.dumps(results["calibration"]))
    results["host_overhead"] = {
        str(f): host_overhead(cases[f], budget) for f in (16 * KIB, 256 * KIB)
    }
    print("host overhead of the public call:", json.dumps(results["host_overhead"]))


def print_table(r: dict, cb: int) -> None:
    ce = r["copy_engine"]
    b = r["budgets"]
    print(
        f"\ncopy engine (one 1 GiB pinned copy): H2D {ce['h2d']:.1f}, D2H {ce['d2h']:.1f}, "
        f"duplex {ce['duplex']:.1f} GB/s. Cells: GB/s (ratio to the copy engine).\n"
    )
    for d, key in (("restore", "h2d"), ("save", "d2h")):
        print(f"| {d} | " + " | ".join(f"Triton {x}" for x in b) + " | CE batch | staged | auto |")
        print("|" + "---|" * (len(b) + 4))
        for s in SIZES:
            row = r["rows"][str(s)]

            def cell(v, key=key):
                return f"{v:.1f} ({v / ce[key]:.2f})"

            auto = (
                f"{cell(row[d + '_auto'])} {row[d + '_auto_engine']}" if d + "_auto" in row else "-"
            )
            print(
                f"| {s // KIB} KiB | "
                + " | ".join(cell(row[d][str(x)]) for x in b)
                + f" | {cell(row[d + '_batched_ce'])} | {cell(row[d + '_staged'])} | {auto} |"
            )
        print()
    kinds = list(r["rows"][str(SIZES[0])]["duplex"])
    print(
        "| both at once | "
        + " | ".join(kinds)
        + " | per-page copy_ restore/save | torch index_copy_/index_select |"
    )
    print("|" + "---|" * (len(kinds) + 3))
    for s in SIZES:
        row = r["rows"][str(s)]
        print(
            f"| {s // KIB} KiB | "
            + " | ".join(
                f"{row['duplex'][k]:.1f} ({row['duplex'][k] / ce['duplex']:.2f})" for k in kinds
            )
            + f" | {row['naive']['restore']:.2f} / {row['naive']['save']:.2f}"
            + f" | {row['torch_index']['restore']:.1f} / {row['torch_index']['save']:.1f} |"
        )
    if "interference" in r:
        i = r["interference"]
        print(
            f"\ninterference (bf16 8192^3 matmul {i['matmul_ms_each']:.2f} ms each, "
            f"{i['matmul_tflops']:.0f} TFLOP/s; slowdown beside a restore of 16 KiB fragments): "
            + ", ".join(
                f"{k} {v:.3f}"
                for k, v in i.items()
                if not k.endswith("_ms") and k != "matmul_tflops" and not k.endswith("_each")
            )
        )


if __name__ == "__main__":
    main()
