"""NVLink fan-out benchmark: per-layer MLA restore time with and without fan-out.

DeepSeek-V3 bf16 layers (1152 B/token/layer, 64-token blocks of 72 KiB, 256-token stored chunks)
restored from a pinned host card laid out as xkv stores objects (chunk-major, then layer, then
block) into a vLLM-shaped cache ``[blocks, 1, 64, 576]`` per layer. For every TP size (1 = the
degenerate group of one, then each GPU count available) and token count it measures, on every rank
at once (the figure is the slowest rank, median over iterations):

- ``base``: each rank restores the whole layer (``xkv.kernels.restore``), as without fan-out;
- ``fan``: each rank copies 1/N, in-place NCCL all-gather, scatter (``xkv.fanout``);
- ``*_layer``: one layer alone (serial); ``*_pipe``: ``--layers`` layers back to back, per layer
  (double-buffered staging: copies overlap the exchange of the previous layer);
- ``h2d_one``: one rank's plain pinned host->GPU copy of the layer, others idle (one PCIe link);
  ``h2d_all``: every rank copies at once, aggregate bytes/s (host-memory contention);
- ``ag``: the in-place all-gather of one layer alone, bus bandwidth;
- the build-time probe (fan-out refuses when the exchange is < 2x one PCIe link);
- a break-even sweep over small layers (``--sweep-tokens``).

Usage: python bench/fanout.py --out OUT [--tp 1 2] [--tokens 4096 32768 131072]
Writes OUT/fanout.json and OUT/fanout.csv and prints a table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BYTES_PER_TOKEN = 1152  # DeepSeek-V3 MLA latent, bf16: (512 + 64) x 2
BLOCK_TOKENS = 64
WIDTH = 576
NVLS_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _card(nbytes: int, seed: int) -> torch.Tensor:
    """Pinned host bytes: a random pattern of prime length tiled (misplaced blocks show)."""
    g = torch.Generator().manual_seed(seed)
    pat = torch.randint(0, 256, (1_000_003,), dtype=torch.uint8, generator=g)
    card = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    for a in range(0, nbytes, pat.numel()):
        b = min(a + pat.numel(), nbytes)
        card[a:b] = pat[: b - a]
    return card


def _setup(tokens: int, layers: int, chunk_blocks: int, dev: torch.device, seed: int = 0):
    """Card, two sets of caches (fan-out / baseline) and the per-layer loads."""
    from xkv.fanout import LayerLoad
    from xkv.layout import describe_cache

    n = tokens // BLOCK_TOKENS
    bb = BLOCK_TOKENS * BYTES_PER_TOKEN
    n_chunks = -(-n // chunk_blocks)
    slot = layers * chunk_blocks * bb
    card = _card(n_chunks * slot, seed)
    g = torch.Generator().manual_seed(seed + 1)
    total_blocks = n + n // 4 + 8
    bids = torch.randperm(total_blocks, generator=g)[:n].to(torch.int64)
    blk = torch.arange(n, dtype=torch.int64)
    sets = []
    for _ in range(2):
        loads = []
        for layer in range(layers):
            cache = torch.zeros(
                total_blocks, 1, BLOCK_TOKENS, WIDTH, dtype=torch.bfloat16, device=dev
            )
            offs = (blk // chunk_blocks) * slot + (layer * chunk_blocks + blk % chunk_blocks) * bb
            loads.append(
                LayerLoad(f"model.layers.{layer}.self_attn.attn", offs, describe_cache(cache), bids)
            )
        sets.append(loads)
    return card, sets[0], sets[1]


def _timed(fn, iters: int, warmup: int, world: int, per: int = 1) -> float:
    """Median over iterations of the slowest rank's time (us) of fn(), divided by ``per``.
    CUDA events on GPUs; wall clock in the CPU dry run."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    times = []
    for it in range(warmup + iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            us = e0.elapsed_time(e1) * 1e3
        else:
            t0 = time.perf_counter()
            fn()
            us = (time.perf_counter() - t0) * 1e6
        t = torch.tensor([us / per])
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if it >= warmup:
            times.append(float(t))
    return statistics.median(times)


def _make_restorer(args, rank: int, world: int):
    """(restorer, device, info) of this rank: build_restorer's decision and probe on GPUs."""
    from xkv.fanout import (
        CacheFacts,
        FanoutConfig,
        FanoutRestorer,
        LocalExchanger,
        NcclExchanger,
        TorchExchanger,
        build_restorer,
        probe_exchange,
    )

    cfg = FanoutConfig(enabled=True, min_layer_bytes=0, staging_bytes=args.staging_mib << 20)
    if args.dry_run_cpu:  # the flow on CPU tensors over gloo (CI smoke test; figures meaningless)
        dev = torch.device("cpu")
        ex = TorchExchanger(None, world, rank) if world > 1 else LocalExchanger(1)
        info = {
            "tp": world,
            "gpu": "none (CPU dry run)",
            "torch": torch.__version__,
            "decision": "dry run",
        }
        return FanoutRestorer(cfg, ex, dev, share_copy=args.share_copy), dev, info
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    info = {"tp": world, "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    if world == 1:
        info["decision"] = "TP1 (degenerate group of one: staging path, no exchange)"
        return FanoutRestorer(cfg, LocalExchanger(1), dev, share_copy=args.share_copy), dev, info
    facts = CacheFacts(use_mla=True, tp_size=world, spec_kinds=("mla",) * args.layers)
    t0 = time.monotonic()
    restorer, decision = build_restorer(cfg, facts, rank, world, dev, share_copy=args.share_copy)
    info.update(
        build_s=round(time.monotonic() - t0, 3),
        decision=decision.reason.name,
        detail=decision.detail,
    )
    if restorer is None:  # measure anyway, and say it was refused
        ex = NcclExchanger.create((tuple(range(world)),), rank, world, dev)
        restorer = FanoutRestorer(cfg, ex, dev, share_copy=args.share_copy)
    host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    bus, h2d = probe_exchange(restorer.exchanger, restorer.staging[: cfg.slot_bytes], host)
    info.update(
        probe_ag_busbw_GBs=round(bus / 1e9, 1),
        probe_h2d_GBs=round(h2d / 1e9, 1),
        probe_ratio=round(bus / h2d, 2),
    )
    from xkv.fanout.comm import NcclLib

    info["nccl_version"] = NcclLib().version
    return restorer, dev, info


def _worker(rank: int, world: int, init_file: str, q, args) -> None:
    import torch.distributed as dist

    from xkv.kernels import restore

    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        restorer, dev, info = _make_restorer(args, rank, world)
        rows = []
        for tokens in args.tokens:
            rows.append(_measure(tokens, args.layers, args, restorer, restore, dev, rank, world))
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
        sweep = []
        for tokens in args.sweep_tokens if world > 1 else []:
            sweep.append(
                _measure(tokens, args.layers, args, restorer, restore, dev, rank, world, light=True)
            )
        restorer.close()
        dist.barrier()
        if rank == 0:
            q.put({"info": info, "rows": rows, "sweep": sweep})
        dist.destroy_process_group()
    except Exception as e:  # report, then fail the run
        import traceback

        q.put({"error": f"rank {rank}: {e}", "trace": traceback.format_exc()})
        raise


def _measure(tokens, layers, args, restorer, restore, dev, rank, world, light=False):
    card, fan_loads, base_loads = _setup(tokens, layers, args.chunk_blocks, dev)
    S = tokens * BYTES_PER_TOKEN
    it, wu = (args.iters, args.warmup) if not light else (max(args.iters // 2, 3), 2)

    def base_layer():
        ld = base_loads[0]
        restore(card, ld.src_offsets, ld.dst, ld.block_ids)

    def base_pipe():
        for ld in base_loads:
            restore(card, ld.src_offsets, ld.dst, ld.block_ids)

    def fan_layer():
        if not restorer.begin(card, fan_loads[:1]):
            raise RuntimeError("fan-out refused the batch")
        restorer.finish()

    def fan_pipe():
        if not restorer.begin(card, fan_loads):
            raise RuntimeError("fan-out refused the batch")
        for ld in fan_loads:
            restorer.wait_layer(ld.layer)
        restorer.finish()

    row = {
        "tp": world,
        "tokens": tokens,
        "layer_bytes": S,
        "layers": layers,
        "base_layer_us": _timed(base_layer, it, wu, world),
        "fan_layer_us": _timed(fan_layer, it, wu, world),
    }
    row["speedup_layer"] = round(row["base_layer_us"] / row["fan_layer_us"], 3)
    if not light:
        row["base_pipe_us"] = _timed(base_pipe, it, wu, world, per=layers)
        row["fan_pipe_us"] = _timed(fan_pipe, it, wu, world, per=layers)
        row["speedup_pipe"] = round(row["base_pipe_us"] / row["fan_pipe_us"], 3)
        exact = all(
            torch.equal(a.dst.base, b.dst.base) for a, b in zip(fan_loads, base_loads, strict=True)
        )
        flag = torch.tensor([1 if exact else 0])
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        row["bit_exact"] = bool(flag)
        gpu_buf = torch.empty(S, dtype=torch.uint8, device=dev)
        nb_ag = min(S, restorer.slot_bytes)
        host = card[:S]
        one = (lambda: gpu_buf.copy_(host, non_blocking=True)) if rank == 0 else (lambda: None)
        row["h2d_one_GBs"] = round(S / _timed(one, it, wu, world) / 1e3, 1)
        t_all = _timed(lambda: gpu_buf.copy_(host, non_blocking=True), it, wu, world)
        row["h2d_all_aggregate_GBs"] = round(world * S / t_all / 1e3, 1)
        if world > 1:
            share = nb_ag // world // 256 * 256
            slot = restorer.staging[: share * world]
            t_ag = _timed(lambda: restorer.exchanger.all_gather_inplace(slot, share), it, wu, world)
            row["ag_bytes"], row["ag_us"] = share * world, round(t_ag, 1)
            row["ag_busbw_GBs"] = round((world - 1) * share / t_ag / 1e3, 1)
        del gpu_buf
    for k in list(row):
        if k.endswith("_us"):
            row[k] = round(row[k], 1)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def _run_tp(tp: int, args) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_worker, args=(r, tp, f"{d}/init", q, args)) for r in range(tp)]
        for p in procs:
            p.start()
        out = q.get(timeout=args.timeout)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if "error" in out:
        raise RuntimeError(out["error"] + "\n" + out.get("trace", ""))
    return out


def _table(results: list[dict]) -> str:
    cols = [
        "tp",
        "tokens",
        "layer_bytes",
        "base_layer_us",
        "fan_layer_us",
        "speedup_layer",
        "base_pipe_us",
        "fan_pipe_us",
        "speedup_pipe",
        "ag_busbw_GBs",
        "h2d_one_GBs",
        "h2d_all_aggregate_GBs",
        "bit_exact",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines)


def _break_even(rows: list[dict]) -> dict[int, int | None]:
    """Per TP > 1: the smallest measured layer size from which fan-out (one layer, serial) is
    faster than every rank copying the whole layer, at that size and every larger one."""
    out: dict[int, int | None] = {}
    for tp in sorted({r["tp"] for r in rows if r["tp"] > 1}):
        pts = sorted({r["layer_bytes"]: r["speedup_layer"] for r in rows if r["tp"] == tp}.items())
        out[tp] = next(
            (size for size, _ in pts if all(sp >= 1.0 for s2, sp in pts if s2 >= size)), None
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument(
        "--tp", type=int, nargs="*", help="TP sizes (default 1 and 2/4/8 up to the GPU count)"
    )
    p.add_argument("--tokens", type=int, nargs="*", default=[4096, 32768, 131072])
    p.add_argument(
        "--sweep-tokens", type=int, nargs="*", default=[256, 512, 1024, 2048, 4096, 8192]
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--chunk-blocks", type=int, default=4, help="blocks per stored chunk (256 tokens)"
    )
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--staging-mib", type=int, default=128)
    p.add_argument("--share-copy", default="auto", choices=["auto", "kernel", "dma"])
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--dry-run-cpu", action="store_true", help="run the flow on CPU (smoke test)")
    args = p.parse_args(argv)
    os.environ.update(NVLS_OFF)
    n_gpu = torch.cuda.device_count() if not args.dry_run_cpu else max(args.tp or [1])
    if n_gpu == 0:
        print("no CUDA device (use --dry-run-cpu for a smoke test)", file=sys.stderr)
        return 2
    tps = args.tp or sorted({1, *[k for k in (2, 4, 8) if k <= n_gpu], n_gpu})
    args.out.mkdir(parents=True, exist_ok=True)
    results, sweeps, infos = [], [], []
    for tp in tps:
        if tp > n_gpu:
            print(f"TP={tp}: only {n_gpu} GPUs, skipped", file=sys.stderr)
            continue
        out = _run_tp(tp, args)
        infos.append(out["info"])
        results += out["rows"]
        sweeps += out["sweep"]
        print(json.dumps(out["info"]), flush=True)
    doc = {
        "gpus": n_gpu,
        "args": {k: str(v) for k, v in vars(args).items()},
        "info": infos,
        "rows": results,
        "sweep": sweeps,
        "break_even_bytes": _break_even(results + sweeps),
    }
    (args.out / "fanout.json").write_text(json.dumps(doc, indent=1))
    with open(args.out / "fanout.csv", "w", newline="") as f:
        keys = sorted({k for r in results + sweeps for k in r} | {"sweep"})
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in results + [dict(s, sweep=True) for s in sweeps]:
            w.writerow({k: r.get(k, "") for k in keys})
    print(_table(results))
    if sweeps:
        print("\nbreak-even sweep (serial, one layer):")
        print(_table(sweeps))
    print("break-even layer bytes per TP:", doc["break_even_bytes"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
