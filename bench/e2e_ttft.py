"""Time to first token on a real GPU vLLM engine: recompute, GPU prefix hit, xkv restore, and vLLM's
OffloadingConnector restore, measured in one call (issue 9).

The parent process starts ``xkv-gateway`` and runs one child process per engine kind, one after the
other, so each child owns the whole GPU:

  none     no connector: cold prefill (recompute) and a GPU prefix hit, plus the reference first-token
           logprobs of a fixed prompt
  xkv      FusIOnXConnector: cold prefill with stores (overhead), then restore after
           ``reset_prefix_cache()``; 8 x 16k restores while other requests decode; the gateway killed
           mid-run (outputs must still equal the reference)
  offload  vLLM's in-tree OffloadingConnector: restore from CPU after ``reset_prefix_cache()``

Prompts are random token ids (max_tokens 1, median of ``--reps``). TTFT is the engine's
scheduled-to-first-token time when vLLM reports it, else the wall time of ``LLM.generate``.

Usage (on the GPU machine, vLLM importable):
  python bench/e2e_ttft.py --model bench/models/llama8b --out $OUT [--lens 4096,8192,16384,32768]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

KINDS = ("none", "xkv", "offload")


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model dir (config.json; dummy weights)")
    ap.add_argument("--out", default="out/e2e", help="output dir for JSON, table and plot")
    ap.add_argument("--lens", default="4096,8192,16384,32768")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--backend", default="FLASH_ATTN")
    ap.add_argument("--gpu-util", type=float, default=0.6)
    ap.add_argument("--max-batched", type=int, default=16384)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--card-gib", type=float, default=40.0)
    ap.add_argument("--offload-gib", type=float, default=24.0)
    ap.add_argument("--port", type=int, default=5599)
    ap.add_argument("--multi", type=int, default=8, help="concurrent 16k restores (0: skip)")
    ap.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--gateway-pid", type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------------------- child
def _engine(a, kind):
    from vllm import LLM

    lens = [int(x) for x in a.lens.split(",")]
    kw = dict(model=a.model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              enforce_eager=True, gpu_memory_utilization=a.gpu_util, max_model_len=max(lens) + 64,
              max_num_batched_tokens=a.max_batched, enable_prefix_caching=True, seed=0,
              attention_backend=a.backend)
    if kind == "xkv":
        kw["kv_transfer_config"] = {
            "kv_connector": "FusIOnXConnector",
            "kv_connector_module_path": "xkv_vllm_connector.fusionx_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"xkv_gateway_port": a.port, "chunk_size": a.chunk_size,
                                          "verify_restores": os.environ.get("XKV_VERIFY", "0") == "1"},
        }
    elif kind == "offload":
        kw["kv_transfer_config"] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"cpu_bytes_to_use": int(a.offload_gib * 2**30)}}
    return LLM(**kw)


def _run(llm, prompts, max_tokens=1, logprobs=None):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True,
                        logprobs=logprobs)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    wall = (time.perf_counter() - t) * 1e3
    recs = []
    for o in outs:
        m = getattr(o, "metrics", None)
        eng = None
        if m is not None and getattr(m, "scheduled_ts", 0) and getattr(m, "first_token_ts", 0):
            eng = (m.first_token_ts - m.scheduled_ts) * 1e3
        lp = None
        if logprobs is not None and o.outputs[0].logprobs:
            lp = sorted((int(k), float(v.logprob)) for k, v in o.outputs[0].logprobs[0].items())
        recs.append(dict(ttft_ms=round(eng if eng is not None else wall, 2), wall_ms=round(wall, 2),
                         cached=o.num_cached_tokens, tokens=list(o.outputs[0].token_ids), logprobs=lp))
    return recs


def _child(a):
    kind = a.child
    lens = [int(x) for x in a.lens.split(",")]
    rng = random.Random(1234)
    prompt = lambda n: [rng.randrange(1000, 120000) for _ in range(n)]
    ref_prompt = random.Random(99).choices(range(1000, 120000), k=3000)
    t0 = time.perf_counter()
    llm = _engine(a, kind)
    res = dict(kind=kind, engine_start_s=round(time.perf_counter() - t0, 1), rows=[])
    row = lambda phase, n, r: res["rows"].append(dict(phase=phase, tokens=n, **r))

    # warm-up: compile kernels for short and long shapes and the hit / restore path
    for n in (512, max(lens)):
        p = prompt(n)
        _run(llm, [p]), _run(llm, [p])
        if kind != "none":
            llm.reset_prefix_cache(), time.sleep(0.2), _run(llm, [p])
    for n in lens:
        p = None
        for _ in range(a.reps):
            p = prompt(n)
            row("cold", n, _run(llm, [p])[0])
        if kind == "none":
            for _ in range(a.reps):
                row("gpu_hit", n, _run(llm, [p])[0])
        else:
            for _ in range(a.reps):
                ok = llm.reset_prefix_cache()
                time.sleep(0.2)
                r = _run(llm, [p])[0]
                r["reset_ok"] = bool(ok)
                row("restore", n, r)
    if kind != "offload" and a.multi:
        # a restored 16k prompt costs most when other requests decode beside it
        ps = [prompt(16384) for _ in range(a.multi)]
        _run(llm, ps)
        llm.reset_prefix_cache()
        time.sleep(0.2)
        from vllm import SamplingParams

        dec = SamplingParams(max_tokens=64, temperature=0.0, detokenize=False, ignore_eos=True)
        sp1 = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": prompt(256)} for _ in range(4)] +
                            [{"prompt_token_ids": p} for p in ps],
                            [dec] * 4 + [sp1] * len(ps), use_tqdm=False)
        wall = (time.perf_counter() - t) * 1e3
        for o in outs[4:]:
            m = o.metrics
            ttft = (m.first_token_ts - m.scheduled_ts) * 1e3 if getattr(m, "scheduled_ts", 0) else wall
            row("multi_restore" if kind == "xkv" else "multi_cold", 16384,
                dict(ttft_ms=round(ttft, 2), wall_ms=round(wall, 2), cached=o.num_cached_tokens))
    # reference logprobs of the first token; for xkv: stored, restored, and with the gateway killed
    res["ref"] = _run(llm, [ref_prompt], logprobs=5)[0]
    if kind == "xkv":
        llm.reset_prefix_cache()
        res["ref_restored"] = _run(llm, [ref_prompt], logprobs=5)[0]
        if a.gateway_pid:
            os.kill(a.gateway_pid, signal.SIGKILL)
            time.sleep(0.5)
            llm.reset_prefix_cache()
            res["ref_gateway_killed"] = _run(llm, [ref_prompt], logprobs=5)[0]
            res["after_kill_new"] = _run(llm, [prompt(4096)])[0]
    print("CHILD_RESULT " + json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------- parent
def _median(rows, phase, n):
    v = [r["ttft_ms"] for r in rows if r["phase"] == phase and r["tokens"] == n]
    return statistics.median(v) if v else None


def _start_gateway(a):
    cap = f"{int(a.card_gib * 1024)}M"
    gw = subprocess.Popen([sys.executable, "-m", "xkv.gateway", "--capacity", cap, "--port", str(a.port),
                           "--log-level", "INFO"], stdout=sys.stdout, stderr=sys.stderr)
    time.sleep(3.0)
    if gw.poll() is not None:
        raise SystemExit(f"xkv-gateway exited with {gw.returncode}")
    return gw


def _parent(a):
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lens = [int(x) for x in a.lens.split(",")]
    results = {}
    for kind in a.kinds.split(","):
        gw = _start_gateway(a) if kind == "xkv" else None
        cmd = [sys.executable, __file__, *sys.argv[1:], "--child", kind]
        if gw is not None:
            cmd += ["--gateway-pid", str(gw.pid)]
        env = dict(os.environ, PYTHONHASHSEED="0", VLLM_USE_V2_MODEL_RUNNER="0")
        t = time.perf_counter()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        (out / f"{kind}.log").write_text(p.stdout + "\n" + p.stderr)
        line = [x for x in p.stdout.splitlines() if x.startswith("CHILD_RESULT ")]
        print(f"[{kind}] rc={p.returncode} in {time.perf_counter() - t:.0f} s", flush=True)
        if line:
            results[kind] = json.loads(line[-1][len("CHILD_RESULT "):])
        else:
            print(p.stderr[-4000:], flush=True)
        if gw is not None and gw.poll() is None:
            gw.send_signal(signal.SIGTERM)
            gw.wait(timeout=30)
    (out / "e2e_ttft.json").write_text(json.dumps(results, indent=1))
    _report(results, lens, out)


def _report(results, lens, out):
    none, xkv, off = (results.get(k, {}).get("rows", []) for k in KINDS)
    hdr = "| tokens | recompute | GPU hit | xkv restore | Offloading restore | xkv/recompute | xkv/Offloading | xkv cold | cold overhead |"
    lines = [hdr, "|" + "---|" * 9]
    for n in lens:
        rc, hit, rs, of = _median(none, "cold", n), _median(none, "gpu_hit", n), _median(xkv, "restore", n), _median(off, "restore", n)
        xc = _median(xkv, "cold", n)
        f = lambda v: "—" if v is None else f"{v:.1f}"
        r = lambda x, y: "—" if x is None or not y else f"{x / y:.3f}"
        lines.append(f"| {n} | {f(rc)} | {f(hit)} | {f(rs)} | {f(of)} | {r(rs, rc)} | {r(rs, of)} | {f(xc)} | "
                     f"{'—' if xc is None or not rc else f'{(xc / rc - 1) * 100:+.1f}%'} |")
    for kind, rows in (("none", none), ("xkv", xkv)):
        m = [r["ttft_ms"] for r in rows if r["phase"].startswith("multi")]
        if m:
            lines.append(f"\n{kind}: {len(m)} x 16k prompts beside 4 decoding requests: median TTFT "
                         f"{statistics.median(m):.1f} ms, max {max(m):.1f} ms, cached {[r['cached'] for r in rows if r['phase'].startswith('multi')]}")
    x = results.get("xkv", {})
    ref = results.get("none", {}).get("ref")
    for key in ("ref", "ref_restored", "ref_gateway_killed"):
        if key in x and ref:
            same = x[key]["logprobs"] == ref["logprobs"] and x[key]["tokens"] == ref["tokens"]
            lines.append(f"xkv {key}: cached={x[key]['cached']} first-token logprobs equal to no-connector run: {same}")
    table = "\n".join(lines)
    print(table, flush=True)
    (out / "table.md").write_text(table + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, rows, phase in (("recompute", none, "cold"), ("GPU prefix hit", none, "gpu_hit"),
                                   ("xkv restore", xkv, "restore"), ("OffloadingConnector restore", off, "restore")):
            ys = [_median(rows, phase, n) for n in lens]
            if any(y is not None for y in ys):
                ax.plot(lens, ys, marker="o", label=label)
        ax.set_xscale("log", base=2), ax.set_yscale("log")
        ax.set_xlabel("prompt tokens"), ax.set_ylabel("TTFT (ms)"), ax.legend(), ax.grid(alpha=0.3)
        ax.set_title("TTFT, Llama-3-8B shape, H200, vLLM 0.26")
        fig.tight_layout()
        fig.savefig(out / "e2e_ttft.png", dpi=120)
    except ImportError:
        print("matplotlib missing: no plot", flush=True)


if __name__ == "__main__":
    args = _args()
    _child(args) if args.child else _parent(args)
