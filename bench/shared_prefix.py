"""Shared-prefix workload (issue 24 point 5): prefixes that keep falling out of a small GPU KV cache,
served with no connector, xkv and vLLM's OffloadingConnector, every kind in the same call.

Workload (defaults = the issue's): ``--prefixes`` 16 prefixes of ``--prefix-len`` 8192 tokens, a GPU
KV cache of ``--gpu-blocks`` 2048 blocks (so at most a few prefixes stay on the GPU), ``--rounds``
rounds of ``--batch`` 16 requests, each one prefix (a fixed shuffled order per round) plus a fresh
``--suffix`` 256-token suffix, ``--out-tokens`` 16 greedy output tokens. Round 0 prefills every
prefix once (stores for the connectors) and is not timed. Reported per kind: mean and median
round time (wall time of one ``LLM.generate`` of the whole batch), and whether every request's
output tokens equal the no-connector run's (the same prompts in the same batches).

One child process per kind (each owns the GPU; ``--start-together --kv-gib G``: started at once,
measured one at a time), a fresh ``xkv-gateway`` for xkv, as in ``bench/e2e_ttft.py``
(``bench/engine_children.py``); results in ``OUT/shared_prefix.json`` and a table on stdout.

  python bench/shared_prefix.py --model bench/models/llama8b --out $OUT [--mode eager|graphs]
      [--kinds none,xkv,xkv@load_mode=auto,offload] [--load-mode sync|async|auto]

``--kinds`` takes ``bench/e2e_kinds.py``'s variant kinds (``xkv@KEY=VALUE[+KEY=VALUE...]``: an
xkv engine with those connector options or environment variables, its own gateway), so two
settings (e.g. ``load_mode`` sync and auto) run on the same workload in one call; every xkv kind
is reported against Offloading.

With dummy weights the logits are nearly uniform, so a numerically different but equally correct
computation (a restored prefix against a recomputed one) can flip a greedy tie: the report counts
equal outputs per request instead of a single yes/no, and a mismatch is evidence to look at, not
proof of a wrong byte (``e2e_ttft.py``'s ``verify`` kind is the byte check).

With ``XKV_TIMING=1`` in the environment (``bench/gpu_issue24.sh`` sets it) every xkv kind's
restored bytes and GPU copy time are summed per timed round (``round_stats.RoundCopies``, into
``shared_prefix.json``'s ``copies``), and the report adds the ratio to Offloading that xkv could
not beat even with every copy hidden (``round_stats.hidden_floor``: a round takes at least its time
minus its copy time; stop 49: 0.76 against the target's 0.80). ``--engine-stats`` turns vLLM's
stats on in every kind's engine and reports, per kind, the mean engine steps, preemptions and
prefix-cache hits (GPU and connector) of a timed round (``round_stats.ENGINE_METRICS``): whether a
``load_mode`` costs steps or preempts requests; and per finished request its mean time queued,
in prefill and in decode (``round_stats.ENGINE_TIMES``): where a longer round's time went.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import e2e_kinds
import e2e_models
import engine_children
from round_stats import RoundCopies, engine_counts, engine_line, hidden_floor

KINDS = ("none", "xkv", "offload")


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench/models/llama8b")
    ap.add_argument("--out", default="out/shared_prefix")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--mode", choices=("eager", "graphs"), default="eager")
    ap.add_argument("--backend", default="FLASH_ATTN")
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=8192)
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out-tokens", type=int, default=16)
    ap.add_argument("--gpu-blocks", type=int, default=2048,
                    help="num_gpu_blocks_override (0: none; --kv-gib then sizes the cache)")
    ap.add_argument("--gpu-util", type=float, default=0.6)
    ap.add_argument("--max-batched", type=int, default=16384)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--load-mode", choices=("sync", "async", "auto"), default="sync")
    ap.add_argument("--card-gib", type=float, default=24.0)
    ap.add_argument("--offload-gib", type=float, default=24.0)
    ap.add_argument("--port", type=int, default=5598)
    ap.add_argument("--vocab", type=int, default=120000)
    ap.add_argument("--child-timeout", type=float, default=400.0)
    ap.add_argument("--engine-stats", action="store_true",
                    help="vLLM's stats on (disable_log_stats=False) and, per round and kind, its "
                         "engine steps, preemptions and prefix-cache hits (ENGINE_METRICS), "
                         "and each request's time queued / in prefill / in decode (ENGINE_TIMES)")
    e2e_models.add_args(ap)
    engine_children.add_args(ap)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # a kind of --kinds
    return ap.parse_args(argv)


def workload(a) -> list[list[list[int]]]:
    """``rounds + 1`` batches of prompts (round 0: every prefix once, untimed), deterministic."""
    rng = random.Random(4321)
    tok = lambda n: [rng.randrange(1000, a.vocab) for _ in range(n)]  # noqa: E731
    prefixes = [tok(a.prefix_len) for _ in range(a.prefixes)]
    rounds = [[p + tok(8) for p in prefixes]]
    for _ in range(a.rounds):
        order = [rng.randrange(a.prefixes) for _ in range(a.batch)]
        rounds.append([prefixes[i] + tok(a.suffix) for i in order])
    return rounds


def _engine(a, kind):
    from vllm import LLM

    kw = dict(model=a.model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              enforce_eager=(a.mode == "eager"), gpu_memory_utilization=a.gpu_util,
              max_model_len=a.prefix_len + a.suffix + a.out_tokens + 64,
              max_num_batched_tokens=a.max_batched, max_num_seqs=max(a.batch, 16),
              enable_prefix_caching=True, seed=0, num_gpu_blocks_override=a.gpu_blocks or None,
              disable_log_stats=not a.engine_stats,
              **e2e_models.engine_kwargs(a))
    if a.backend:  # "" (a CPU dry run): the platform's own
        kw["attention_backend"] = a.backend
    kw.update(engine_children.engine_kwargs(a))
    if e2e_kinds.base(kind) == "xkv":
        kw["kv_transfer_config"] = {
            "kv_connector": "FusIOnXConnector",
            "kv_connector_module_path": "xkv_vllm_connector.fusionx_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"xkv_gateway_port": a.port,
                                          "chunk_size": e2e_models.chunk_tokens(a),
                                          "load_mode": a.load_mode,
                                          **e2e_models.connector_extra(a),
                                          **e2e_kinds.options(kind)}}
    elif kind == "offload":
        kw["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": int(a.offload_gib * 2**30)}}
    return LLM(**kw)


def _child(a):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=a.out_tokens, temperature=0.0, detokenize=False,
                        ignore_eos=True)
    llm = _engine(a, a.child)
    if a.hold:  # started beside the other kinds (--start-together)
        engine_children.wait_for_go(lambda tag, obj: print(f"{tag} {json.dumps(obj)}", flush=True))
    out = {"kind": a.child, "round_ms": [], "outputs": [], "cached": [], "engine": []}
    counts = (lambda: engine_counts(llm.get_metrics())) if a.engine_stats else dict
    for r, batch in enumerate(workload(a)):
        before = counts()
        t = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
        ms = (time.perf_counter() - t) * 1e3
        engine = {k: round(v - before[k], 3) for k, v in counts().items()}
        if r:
            out["round_ms"].append(round(ms, 2))
            out["outputs"].append([list(o.outputs[0].token_ids) for o in res])
            out["cached"].append([o.num_cached_tokens for o in res])
            if engine:
                out["engine"].append(engine)
        row = {"round": r, "ms": round(ms, 2), "cached": [o.num_cached_tokens for o in res]}
        print(f"SP_ROUND {json.dumps(row | ({'engine': engine} if engine else {}))}", flush=True)
    print("SP_DONE " + json.dumps(out), flush=True)


def _parent(a):
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"args": vars(a), "kinds": {}, "rc": {}}
    kinds = a.kinds.split(",")
    e2e_kinds.check(kinds, KINDS)
    together = engine_children.together(a, len(kinds))
    specs = [engine_children.Spec(
        kind=kind, cmd=[sys.executable, __file__, *sys.argv[1:], "--child", kind],
        env=dict(os.environ, PYTHONHASHSEED="0", XKV_GATEWAY_HOSTNAME="127.0.0.1",
                 **e2e_kinds.env(kind)),
        gateway=e2e_kinds.base(kind) == "xkv", card=f"{int(a.card_gib * 1024)}M", port=a.port,
        pass_pid=False) for kind in kinds]

    copies = RoundCopies()

    def on_line(kind, line):
        copies.line(kind, line)
        tag, _, body = line.partition(" ")
        if tag == "SP_ROUND":
            print(f"  {kind:8s} {body.strip()[:160]}", flush=True)
        elif tag == "SP_DONE":
            res["kinds"][kind] = json.loads(body)

    engine_children.run(specs, out, on_line, a.child_timeout,
                        on_done=lambda kind, rc, times: res["rc"].__setitem__(kind, rc), **together)
    res["copies"] = copies.rounds
    (out / "shared_prefix.json").write_text(json.dumps(res))
    print(report(res), flush=True)


def report(res) -> str:
    """The table: per kind mean / median round time, the mean cached (restored or GPU-hit)
    tokens per request of the timed rounds, and how many output tokens equal the no-connector
    run's; then every xkv kind's mean round time against Offloading's and, where the engine
    logged ``XKV_TIMING`` (``res["copies"]``), its copies per round and ``hidden_floor``."""
    ks = res["kinds"]
    base = ks.get("none", {}).get("outputs")
    lines = ["| kind | mean round ms | median round ms | rounds | mean cached tokens per request "
             "| outputs equal to no connector |", "|---|---|---|---|---|---|"]
    for kind, r in ks.items():
        t = r["round_ms"]
        hits = [c for rnd in r.get("cached", []) for c in rnd]
        cached = f"{statistics.mean(hits):.0f}" if hits else "—"
        if base is None or kind == "none":
            eq = "—"
        else:
            pairs = [(x, y) for bx, by in zip(r["outputs"], base, strict=False)
                     for x, y in zip(bx, by, strict=False)]
            eq = f"{sum(x == y for x, y in pairs)} of {len(pairs)}"
        lines.append(f"| {kind} | {statistics.mean(t):.1f} | {statistics.median(t):.1f} | {len(t)} "
                     f"| {cached} | {eq} |" if t else f"| {kind} | — | — | 0 | — | — |")
    off = ks.get("offload", {}).get("round_ms")
    for kind in (k for k in ks if e2e_kinds.base(k) == "xkv"):
        if off and ks[kind]["round_ms"]:
            q = statistics.mean(ks[kind]["round_ms"]) / statistics.mean(off)
            lines.append(f"{kind} / Offloading mean round time: {q:.3f} (target <= 0.80)")
            floor = hidden_floor(ks[kind]["round_ms"], res.get("copies", {}).get(kind, []),
                                 statistics.mean(off))
            if floor:
                lines.append(f"{kind}: {floor}")
    for kind, r in ks.items():
        eng = engine_line(r.get("engine", []))
        if eng:
            lines.append(f"{kind}: {eng}")
    lines.append(f"child exit codes: {res.get('rc')}")
    return "\n".join(lines)


if __name__ == "__main__":
    args = _args()
    _child(args) if args.child else _parent(args)
