"""Store a prompt's KV cache on the card with one vLLM engine, restore it into a fresh one.

    PYTHONHASHSEED=0 python examples/store_and_restore.py [--model DIR] [--tokens 1500]

What happens (``make demo`` runs exactly this, on the CPU engine when there is no GPU):

1. ``xkv-gateway`` starts with its embedded card (a shared-memory arena) on a free loopback port.
2. Engine 1 (its own process) runs the prompt: nothing is stored yet, so vLLM computes every
   token and FusIOnXConnector saves the prompt's full chunks to the card.
3. Engine 2 (a fresh process: empty GPU/CPU prefix cache) runs the same prompt twice: once with
   ``kv_transfer_params={"xkv_store": false}`` (kept off the card: full recompute), then normally:
   the connector restores the stored chunks and vLLM computes only the rest.
4. It prints the cached tokens and the prefill time saved against the recompute.

Without ``--model`` a tiny random-weight Llama-like model is built locally (no download).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
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
            kv_connector_extra_config={"xkv_gateway_port": args.port,
                                       "chunk_size": args.chunk_size}),
    )
    print("demo: engine built", flush=True)
    prompt = {"prompt_token_ids": [(7 + 31 * i) % 1000 + 4 for i in range(args.tokens)]}

    def run(params=None):
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                            extra_args={"kv_transfer_params": params} if params else None)
        t0 = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        return time.perf_counter() - t0, out.num_cached_tokens, list(out.outputs[0].token_ids)

    if args.phase == "store":
        print(f"demo: prefill of the {args.tokens}-token prompt (stores its chunks)", flush=True)
        t, cached, tok = run()
        print(json.dumps({"seconds": t, "cached": cached, "token": tok}), flush=True)
    else:
        # warm-up on another prompt (off the card), so neither timing pays first-call costs
        sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"xkv_store": False}})
        print("demo: warm-up on another prompt", flush=True)
        llm.generate([{"prompt_token_ids": [5] * 64}], sp, use_tqdm=False)
        print("demo: prefill without the restore (recompute)", flush=True)
        t_re, c_re, tok_re = run({"xkv_store": False})
        llm.reset_prefix_cache()
        print("demo: prefill with the restore from the card", flush=True)
        t_hit, c_hit, tok_hit = run()
        print(json.dumps({"recompute_s": t_re, "recompute_cached": c_re, "restore_s": t_hit,
                          "cached": c_hit, "same_token": tok_re == tok_hit}), flush=True)
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
           "--block-size", str(args.block_size), "--dtype", args.dtype]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: build a tiny local Llama)")
    ap.add_argument("--tokens", type=int, default=1500, help="prompt length in tokens")
    ap.add_argument("--chunk-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--phase", choices=["store", "restore"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if os.environ.get("PYTHONHASHSEED") != "0":
        raise SystemExit("run with PYTHONHASHSEED=0 (vLLM's block hashes are the card's keys)")
    if args.phase:
        return engine(args)
    if args.model is None:
        sys.path.insert(0, str(ROOT / "tests" / "models"))
        from tiny_models import ensure_model

        print("building the tiny local model (cached after the first run) ...", flush=True)
        args.model = str(ensure_model("llama"))

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
    saved_ms = (r["recompute_s"] - r["restore_s"]) * 1000
    print()
    print(f"prompt: {args.tokens} tokens; on the card: {st['ready_objects']} chunk object(s), "
          f"{st['ready_bytes'] / 2**20:.1f} MiB; engine 1 cached {s['cached']} tokens (nothing "
          f"stored yet)")
    print()
    print(table([
        ("engine 2, same prompt", "cached tokens", "prefill time"),
        ("without the restore (recompute)", str(r["recompute_cached"]),
         f"{r['recompute_s'] * 1000:.1f} ms"),
        ("with the restore from the card", str(r["cached"]), f"{r['restore_s'] * 1000:.1f} ms"),
        ("saved", "", f"{saved_ms:.1f} ms "
                      f"({saved_ms / max(r['recompute_s'] * 1000, 1e-9):.0%})"),
    ]))
    print(f"same first token: {r['same_token']}")
    if not r["cached"] or not r["same_token"]:
        raise SystemExit("the restore did not happen as expected")


if __name__ == "__main__":
    main()
