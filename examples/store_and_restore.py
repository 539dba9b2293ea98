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
import subprocess
import sys
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
    prompt = {"prompt_token_ids": [(7 + 31 * i) % 1000 + 4 for i in range(args.tokens)]}

    def run(params=None):
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                            extra_args={"kv_transfer_params": params} if params else None)
        t0 = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        return time.perf_counter() - t0, out.num_cached_tokens, list(out.outputs[0].token_ids)

    if args.phase == "store":
        t, cached, tok = run()
        print(json.dumps({"seconds": t, "cached": cached, "token": tok}), flush=True)
    else:
        # warm-up on another prompt (off the card), so neither timing pays first-call costs
        sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"xkv_store": False}})
        llm.generate([{"prompt_token_ids": [5] * 64}], sp, use_tqdm=False)
        t_re, c_re, tok_re = run({"xkv_store": False})
        llm.reset_prefix_cache()
        t_hit, c_hit, tok_hit = run()
        print(json.dumps({"recompute_s": t_re, "recompute_cached": c_re, "restore_s": t_hit,
                          "cached": c_hit, "same_token": tok_re == tok_hit}), flush=True)
    os._exit(0)


def child(args: argparse.Namespace, phase: str, port: int) -> dict:
    env = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, __file__, "--phase", phase, "--port", str(port), "--model", args.model,
           "--tokens", str(args.tokens), "--chunk-size", str(args.chunk_size),
           "--block-size", str(args.block_size), "--dtype", args.dtype]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-6000:])
        raise SystemExit(f"engine ({phase}) failed with exit code {p.returncode}")
    for ln in (p.stdout + p.stderr).splitlines():
        if "XKV:" in ln or "KV cache registry" in ln or "turned off" in ln:
            print("   ", ln.split("] ", 1)[-1])
    return json.loads(lines[-1])


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

        print("building the tiny local model (cached after the first run) ...")
        args.model = str(ensure_model("llama"))

    from xkv.gateway.client import GatewayClient
    from xkv.gateway.testing import spawn_gateway, stop_gateway

    proc, port = spawn_gateway("1G")
    print(f"xkv-gateway running on 127.0.0.1:{port} (pid {proc.pid}), card 1 GiB")
    try:
        print("engine 1: computing and storing the prompt ...")
        s = child(args, "store", port)
        print("engine 2 (fresh process): recompute, then restore ...")
        r = child(args, "restore", port)
        with GatewayClient("127.0.0.1", port, timeout_s=1.0) as c:
            st = c.stats()
    finally:
        stop_gateway(proc)
    saved_ms = (r["recompute_s"] - r["restore_s"]) * 1000
    print()
    print(f"prompt tokens              : {args.tokens}")
    print(f"stored on the card         : {st['ready_objects']} chunk object(s), "
          f"{st['ready_bytes'] / 2**20:.1f} MiB")
    print(f"engine 1 cached tokens     : {s['cached']} (nothing stored yet)")
    print(f"engine 2 cached tokens     : {r['cached']} (restored from the card)")
    print(f"prefill, recompute         : {r['recompute_s'] * 1000:.1f} ms")
    print(f"prefill, with restore      : {r['restore_s'] * 1000:.1f} ms")
    print(f"time saved vs recompute    : {saved_ms:.1f} ms "
          f"({saved_ms / max(r['recompute_s'] * 1000, 1e-9):.0%})")
    print(f"same first token           : {r['same_token']}")
    if not r["cached"] or not r["same_token"]:
        raise SystemExit("the restore did not happen as expected")


if __name__ == "__main__":
    main()
