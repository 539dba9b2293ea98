"""Store a prompt's KV cache on the card with one vLLM engine, restore it into a fresh one.

    PYTHONHASHSEED=0 python examples/store_and_restore.py [--model DIR] [--tokens 1500]

What happens (``make demo`` runs exactly this, on the CPU engine when there is no GPU):

1. ``xkv-gateway`` starts with its embedded card (a shared-memory arena) on a free loopback port.
2. Engine 1 (its own process) runs the prompt: nothing is stored yet, so vLLM computes every
   token and FusIOnXConnector saves the prompt's full chunks to the card.
3. Engine 2 (a fresh process: empty GPU/CPU prefix cache) first warms both paths on another
   prompt (a recompute, a store, a restore), then times the same prompt ``--repeats`` times
   each way, alternating: with ``kv_transfer_params={"xkv_store": false}`` (kept off the card:
   full recompute) and normally (the connector restores the stored chunks, vLLM computes only
   the rest); the local prefix cache is reset before every run.
4. It prints the cached tokens, each way's median prefill time and spread (min-max), the
   saving at the median, and says plainly when the timings overlap (a busy machine: too noisy
   to tell) or when the restore is not faster (and why).

Without ``--model`` a small random-weight Llama-like model is built locally (no download):
~15 M parameters, wide enough that computing a prompt costs far more than copying its KV pages
(``llama_demo`` in tests/models/tiny_models.py). ``chunk_size`` is the connector's default,
derived from the block size vLLM chose (its ``XKV: chunk_size`` start line says which).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def engine(args: argparse.Namespace) -> None:
    """Child process: one engine, one phase; prints one JSON line."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=args.model, dtype=args.dtype, block_size=args.block_size, max_model_len=2048,
        enable_prefix_caching=True, enforce_eager=True, seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="FusIOnXConnector",
            kv_connector_module_path="xkv_vllm_connector.fusionx_connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            # the lookup deadline (50 ms by default, on the scheduler's critical path): a busy
            # 2-core demo box misses it now and then, and a missed lookup is a recompute
            kv_connector_extra_config={"xkv_gateway_port": args.port, "lookup_timeout_ms": 1000,
                                       **({"chunk_size": args.chunk_size}
                                          if args.chunk_size else {})}),
    )
    print("demo: engine built", flush=True)
    prompt = [(7 + 31 * i) % 1000 + 4 for i in range(args.tokens)]
    other = [(11 + 17 * i) % 1000 + 4 for i in range(args.tokens)]  # for the warm-up

    def run(tokens, params=None):
        """One prefill (+1 token) from an empty local prefix cache: (seconds, cached, token)."""
        llm.reset_prefix_cache()
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                            extra_args={"kv_transfer_params": params} if params else None)
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)[0]
        return time.perf_counter() - t0, out.num_cached_tokens, list(out.outputs[0].token_ids)

    off = {"xkv_store": False}
    if args.phase == "store":
        print(f"demo: prefill of the {args.tokens}-token prompt (stores its chunks)", flush=True)
        t, cached, tok = run(prompt)
        print(json.dumps({"seconds": t, "cached": cached, "token": tok}), flush=True)
        os._exit(0)
    # warm both paths on another prompt, so no timing below pays a first call's costs
    print("demo: warm-up on another prompt (recompute, store, restore)", flush=True)
    run(other, off)
    run(other)
    warm = run(other)[1]
    rec: dict = {"recompute_s": [], "restore_s": [], "recompute_cached": [], "cached": [],
                 "tokens": [], "warm_restored": warm}
    print(f"demo: {args.repeats} prefills each way, alternating", flush=True)
    for _ in range(args.repeats):
        for key, cached, params in (("recompute_s", "recompute_cached", off),
                                    ("restore_s", "cached", None)):
            t, c, tok = run(prompt, params)
            rec[key].append(t)
            rec[cached].append(c)
            rec["tokens"].append(tok)
    print(json.dumps(rec), flush=True)
    os._exit(0)


#: vLLM log lines that mark an engine's start-up steps -> what the demo prints
MILESTONES = (
    ("Initializing a V1 LLM engine", "initializing vLLM"),
    ("Loading weights took", "weights loaded"),
    ("XKV:", None),  # the connector's own lines, printed as they are
    ("KV cache registry", None),
    ("init engine", "engine ready"),
    ("turned off", None),
    ("demo: ", None),  # the child's own steps (engine())
)


def child(args: argparse.Namespace, phase: str, port: int, title: str) -> dict:
    """Run one engine phase in a child process, printing its start-up steps as they happen
    (and a heartbeat while it is silent); returns its JSON result."""
    env = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, __file__, "--phase", phase, "--port", str(port), "--model", args.model,
           "--tokens", str(args.tokens), "--chunk-size", str(args.chunk_size),
           "--block-size", str(args.block_size), "--dtype", args.dtype,
           "--repeats", str(args.repeats)]
    print(f"{title} ...", flush=True)
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for ln in p.stdout:
            lines.put(ln)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    log, last = [], t0
    while reader.is_alive() or not lines.empty():
        try:
            ln = lines.get(timeout=1.0).rstrip("\n")
        except queue.Empty:
            if time.monotonic() - last >= 10:
                print(f"    ... still working ({time.monotonic() - t0:.0f} s)", flush=True)
                last = time.monotonic()
            continue
        log.append(ln)
        for pattern, say in MILESTONES:
            if pattern in ln:
                text = say or ln.split("] ", 1)[-1]
                print(f"    [{time.monotonic() - t0:5.1f} s] {text}", flush=True)
                last = time.monotonic()
                break
    p.wait()
    results = [ln for ln in log if ln.startswith("{")]
    if p.returncode != 0 or not results:
        sys.stderr.write("\n".join(log[-80:]) + "\n")
        raise SystemExit(f"engine ({phase}) failed with exit code {p.returncode}")
    print(f"    done in {time.monotonic() - t0:.1f} s", flush=True)
    return json.loads(results[-1])


def table(rows: list[tuple[str, ...]]) -> str:
    """Left-aligned first column, right-aligned others."""
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w[0]) if i == 0 else c.rjust(w[i])
                               for i, c in enumerate(r)) for r in rows)


def verdict(recompute_s: list[float], restore_s: list[float]) -> tuple[float, list[str]]:
    """The saving at the medians (ms) and what can honestly be said of it: the two ways' ranges
    (min-max) apart = a clear result; overlapping = too noisy to tell; restore slower = said
    so, with why. Never a bare negative saving."""
    re_ms, hit_ms = sorted(t * 1000 for t in recompute_s), sorted(t * 1000 for t in restore_s)
    med_re, med_hit = statistics.median(re_ms), statistics.median(hit_ms)
    saved = med_re - med_hit
    n = len(re_ms)
    wins = sum(h < r for r, h in zip(recompute_s, restore_s, strict=True))
    if hit_ms[-1] < re_ms[0]:
        return saved, [f"the restore was faster in every run: its slowest ({hit_ms[-1]:.1f} ms) "
                       f"beat the fastest recompute ({re_ms[0]:.1f} ms); saved {saved:.1f} ms "
                       f"({saved / med_re:.0%}) at the medians"]
    if re_ms[-1] < hit_ms[0]:
        return saved, [f"the restore was SLOWER in every run, by {-saved:.1f} ms at the medians: "
                       "for this model and prompt, copying the KV pages costs more than computing "
                       "them (a tiny model, or a prompt shorter than a few chunks); try a larger "
                       "--model or more --tokens"]
    lines = [f"too noisy to tell: the two ways' timings overlap (recompute {re_ms[0]:.1f}-"
             f"{re_ms[-1]:.1f} ms, restore {hit_ms[0]:.1f}-{hit_ms[-1]:.1f} ms); the restore was "
             f"faster in {wins} of {n} alternating pairs. The machine is busy (other processes "
             "share its cores): run it again on a quieter one, or with more --repeats"]
    if saved < 0:
        lines.append(f"(its median was {-saved:.1f} ms slower here, within that noise)")
    return saved, lines


def _ms_range(ts: list[float]) -> str:
    return f"{min(ts) * 1000:.1f}-{max(ts) * 1000:.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: build a small local Llama)")
    ap.add_argument("--tokens", type=int, default=1300, help="prompt length in tokens")
    ap.add_argument("--chunk-size", type=int, default=0,
                    help="tokens per stored object (default: the connector's, from the block size)")
    ap.add_argument("--repeats", type=int, default=5, help="timed prefills each way (median)")
    ap.add_argument("--json", help="also write every timing and the verdict to this file")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--phase", choices=["store", "restore"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: expected at least 1")
    if os.environ.get("PYTHONHASHSEED") != "0":
        raise SystemExit("run with PYTHONHASHSEED=0 (vLLM's block hashes are the card's keys)")
    if args.phase:
        return engine(args)
    if args.model is None:
        sys.path.insert(0, str(ROOT / "tests" / "models"))
        from tiny_models import ensure_model

        print("building the small local model (cached after the first run) ...", flush=True)
        args.model = str(ensure_model("llama_demo"))

    from xkv.gateway.client import GatewayClient
    from xkv.gateway.testing import spawn_gateway, stop_gateway

    print("starting xkv-gateway ...", flush=True)
    proc, port = spawn_gateway("1G")
    print(f"    xkv-gateway on 127.0.0.1:{port} (pid {proc.pid}), card 1 GiB")
    try:
        s = child(args, "store", port, "engine 1: starting, then computing and storing the prompt")
        r = child(args, "restore", port,
                  "engine 2 (a fresh process): starting, then recompute and restore")
        with GatewayClient("127.0.0.1", port, timeout_s=1.0) as c:
            st = c.stats()
    finally:
        stop_gateway(proc)
    n = len(r["restore_s"])
    print()
    print(f"prompt: {args.tokens} tokens; engine 1 cached {s['cached']} tokens (nothing stored "
          f"yet); on the card: {st['ready_objects']} chunk object(s), "
          f"{st['ready_bytes'] / 2**20:.1f} MiB (this prompt's and the warm-up prompt's)")
    print()
    med = {k: statistics.median(r[k]) * 1000 for k in ("recompute_s", "restore_s")}
    print(table([
        ("engine 2, same prompt", "cached tokens", f"prefill, median of {n}", "spread (min-max)"),
        ("without the restore (recompute)", str(r["recompute_cached"][0]),
         f"{med['recompute_s']:.1f} ms", _ms_range(r["recompute_s"])),
        ("with the restore from the card", str(r["cached"][0]), f"{med['restore_s']:.1f} ms",
         _ms_range(r["restore_s"])),
    ]))
    saved, lines = verdict(r["recompute_s"], r["restore_s"])
    for line in lines:
        print(line)
    same = all(t == r["tokens"][0] for t in r["tokens"])
    print(f"same first token: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": {k: v for k, v in vars(args).items() if k not in ("phase", "port", "json")},
             "store": s, "restore": r, "saved_ms_at_medians": saved, "verdict": lines,
             "card": {k: st[k] for k in ("ready_objects", "ready_bytes")}}, indent=1))
    if (not r["cached"][0] or len(set(r["cached"])) != 1 or any(r["recompute_cached"])
            or not r["warm_restored"] or not same):
        raise SystemExit(f"the restore did not happen as expected (cached tokens per run: "
                         f"{r['cached']}, recompute runs: {r['recompute_cached']}, warm-up "
                         f"restored {r['warm_restored']}, same first token: {same})")


if __name__ == "__main__":
    main()
