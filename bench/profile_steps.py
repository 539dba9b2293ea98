"""Where the milliseconds of a restore step and of a store step go, on a real GPU vLLM engine
(issue 13, point 1).

One child process per (mode, connector): the engine runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the connector's hooks can be timed where vLLM calls them.
Every connector hook (``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``,
``wait_for_save``, ``get_finished``, the scheduler's ``get_num_new_matched_tokens`` — which holds
the gateway LOOKUP — ``build_connector_meta`` …) is wrapped: host time per call, summed per
request, and a ``torch.profiler.record_function`` range named ``xkv::<hook>`` so the trace shows it.
Then one restore and one cold prefill per length run under ``torch.profiler``; from the trace:
the GPU span of the request, the busy time of the compute stream and of the other streams, and
the compute stream's idle gaps (the time the forward waited, e.g. for copies or for the host).

Usage (GPU machine, vLLM 0.26 importable, repo on PYTHONPATH):
  python bench/profile_steps.py --model bench/models/llama8b --out $OUT --lens 4096,16384 \
      --modes eager,graphs --kinds xkv,offload
Writes ``$OUT/profile.json`` (every figure) and ``$OUT/profile.md`` (the tables); ``--traces``
also keeps gzipped chrome traces in ``$OUT/traces.tar.gz``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import os
import random
import sys
import tarfile
import time
from pathlib import Path

import e2e_kinds  # bench/, beside this file
import engine_children

HOOKS = ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
         "bind_connector_metadata", "clear_connector_metadata", "get_num_new_matched_tokens",
         "update_state_after_alloc", "build_connector_meta", "update_connector_output",
         "request_finished", "get_block_ids_with_load_errors", "build_connector_worker_meta")


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench/models/llama8b")
    ap.add_argument("--out", default="out/profile")
    ap.add_argument("--lens", default="4096,16384")
    ap.add_argument("--modes", default="eager,graphs")
    ap.add_argument("--kinds", default="none,xkv,offload",
                    help="none, xkv, offload; xkv@MODE: xkv with save_mode MODE (layer, step), so "
                         "one call compares store modes; xkv@KEY=VALUE[+KEY=VALUE]: other options "
                         "(bench/e2e_kinds.py)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--multi", type=int, default=0,
                    help="also profile N prompts of --multi-len tokens restored at once beside 4 "
                         "decoding requests (e2e_ttft.py's multi case; 0: skip)")
    ap.add_argument("--multi-len", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=100000, help="token ids are drawn below this")
    ap.add_argument("--backend", default="FLASH_ATTN")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--max-batched", type=int, default=16384)
    ap.add_argument("--gpu-util", type=float, default=0.6)
    ap.add_argument("--card-gib", type=float, default=16.0)
    ap.add_argument("--offload-gib", type=float, default=16.0)
    ap.add_argument("--port", type=int, default=5611)
    ap.add_argument("--runner", choices=("v1", "v2", "default"), default="default",
                    help="VLLM_USE_V2_MODEL_RUNNER in the children (default: unset, vLLM's choice)")
    ap.add_argument("--xkv-extra", default="{}",
                    help="JSON merged into xkv's kv_connector_extra_config (e.g. load_mode)")
    ap.add_argument("--tag", default="", help="label of this run in the report (e.g. before/after)")
    ap.add_argument("--traces", action="store_true", help="keep gzipped chrome traces")
    ap.add_argument("--child-timeout", type=float, default=300.0)
    engine_children.add_args(ap)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------------------- child
class HookClock:
    """Host time per hook, accumulated until :meth:`take`; with CUDA, a pair of CUDA events on
    the current (compute) stream around every call (not while a graph is being captured): the
    entry event says when the compute stream reached the hook, the exit event when it got past
    it, so ``exit - entry`` of ``wait_for_layer_load`` is the GPU time the forward stalled on
    that layer's copy (the host wait is separate: ``ms``)."""

    def __init__(self):
        self.t = collections.defaultdict(float)
        self.n = collections.Counter()
        self.ev: list = []  # (name, host t0, host t1, entry event, exit event)

    def wrap(self, cls):
        import torch

        cuda = torch.cuda.is_available()

        def mark():
            if not cuda or torch.cuda.is_current_stream_capturing():
                return None
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e

        for name in HOOKS:
            fn = cls.__dict__.get(name)
            if fn is None:
                for base in cls.__mro__[1:]:
                    if name in base.__dict__:
                        fn = base.__dict__[name]
                        break
            if fn is None or isinstance(fn, (classmethod, staticmethod)):
                continue

            def make(fn=fn, name=name):
                @functools.wraps(fn)
                def timed(*a, **k):
                    e0 = mark()
                    t0 = time.perf_counter()
                    with torch.profiler.record_function(f"xkv::{name}"):
                        r = fn(*a, **k)
                    t1 = time.perf_counter()
                    e1 = mark()
                    self.t[name] += t1 - t0
                    self.n[name] += 1
                    if e0 is not None and e1 is not None:
                        self.ev.append((name, t0, t1, e0, e1))
                    return r
                return timed

            setattr(cls, name, make())

    def take(self):
        out = {k: {"ms": round(v * 1e3, 3), "calls": self.n[k]} for k, v in self.t.items()}
        if self.ev:
            import torch

            torch.cuda.synchronize()
            _, h0, _, g0, _ = self.ev[0]
            per: dict = {}
            for name, t0, t1, e0, e1 in self.ev:
                d = per.setdefault(name, {"gpu_stall_ms": 0.0, "host_first_ms": None,
                                          "gpu_first_ms": None})
                d["gpu_stall_ms"] += e0.elapsed_time(e1)
                if d["host_first_ms"] is None:
                    d["host_first_ms"] = (t0 - h0) * 1e3
                    d["gpu_first_ms"] = g0.elapsed_time(e0)
                d["host_last_ms"] = (t1 - h0) * 1e3
                d["gpu_last_ms"] = g0.elapsed_time(e1)
            for name, d in per.items():
                if name in out:
                    out[name].update({k: round(v, 3) for k, v in d.items()})
        self.t.clear(), self.n.clear(), self.ev.clear()
        return out


def _engine(a, kind, mode, max_len):
    from vllm import LLM

    kw = dict(model=a.model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              enforce_eager=(mode == "eager"), gpu_memory_utilization=a.gpu_util,
              max_model_len=max_len + 64, max_num_batched_tokens=a.max_batched,
              enable_prefix_caching=True, seed=0)
    kw.update(engine_children.engine_kwargs(a))
    if a.backend:
        kw["attention_backend"] = a.backend
    if kind.split("@")[0] == "xkv":
        variant = kind.split("@", 1)[1] if "@" in kind else ""
        # xkv@MODE: save_mode MODE (layer, step); xkv@KEY=VALUE[+...]: e2e_kinds' options
        save = (e2e_kinds.options(kind) if "=" in variant
                else {"save_mode": variant} if variant else {})
        kw["kv_transfer_config"] = {
            "kv_connector": "FusIOnXConnector",
            "kv_connector_module_path": "xkv_vllm_connector.fusionx_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"xkv_gateway_port": a.port, "chunk_size": a.chunk_size,
                                          **json.loads(a.xkv_extra), **save}}
    elif kind == "offload":
        kw["kv_transfer_config"] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"cpu_bytes_to_use": int(a.offload_gib * 2**30)}}
    return LLM(**kw)


def _gpu_view(trace_path: str) -> dict:
    """GPU span, per-stream busy time and the compute stream's idle gaps from a chrome trace."""
    ev = json.loads(Path(trace_path).read_text())
    ev = ev.get("traceEvents", ev)
    gpu = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host = [e for e in ev if e.get("ph") == "X" and str(e.get("name", "")).startswith("xkv::")]
    if not gpu:
        return {"gpu_events": 0}
    by_stream = collections.defaultdict(list)
    for e in gpu:
        by_stream[e.get("args", {}).get("stream", e.get("tid"))].append((e["ts"], e["ts"] + e["dur"]))

    def union(iv):
        iv = sorted(iv)
        busy, gaps, cur = 0.0, [], list(iv[0])
        for s, t in iv[1:]:
            if s > cur[1]:
                busy += cur[1] - cur[0]
                gaps.append(s - cur[1])
                cur = [s, t]
            else:
                cur[1] = max(cur[1], t)
        busy += cur[1] - cur[0]
        return busy, gaps

    # the compute stream: the one with the most kernels
    main = max(by_stream, key=lambda s: len(by_stream[s]))
    start = min(s for s, _ in sum(by_stream.values(), []))
    end = max(t for _, t in sum(by_stream.values(), []))
    main_iv = _merge(by_stream[main])
    streams = {}
    for s, iv in by_stream.items():
        busy, gaps = union(iv)
        st = {"events": len(iv), "busy_ms": round(busy / 1e3, 3),
              "first_ms": round((min(a for a, _ in iv) - start) / 1e3, 3),
              "last_ms": round((max(b for _, b in iv) - start) / 1e3, 3),
              "idle_ms": round(sum(gaps) / 1e3, 3)}
        gaps = sorted(gaps, reverse=True)
        st.update(gaps_over_100us=sum(1 for g in gaps if g > 100),
                  largest_gaps_ms=[round(g / 1e3, 3) for g in gaps[:6]])
        if s == main:
            st["compute"] = True
        else:  # how much of this stream's work ran while the compute stream was busy
            st["overlap_with_compute_ms"] = round(_overlap(_merge(iv), main_iv) / 1e3, 3)
        streams[str(s)] = st
    # copies: xkv's Triton page copies (kernels) and copy-engine transfers (memcpy events)
    copies = collections.defaultdict(lambda: {"n": 0, "ms": 0.0, "bytes": 0})
    for e in gpu:
        name, args = str(e.get("name", "")), e.get("args", {})
        if e.get("cat") == "gpu_memcpy":
            key = "memcpy " + (name.split()[1] if len(name.split()) > 1 else name)
        elif "page_copy" in name or "swap_blocks" in name or "copy_kernel" in name:
            key = "kernel " + name[:40]
        else:
            continue
        c = copies[key]
        c["n"] += 1
        c["ms"] += e["dur"] / 1e3
        c["bytes"] += int(args.get("bytes", 0) or 0)
    for c in copies.values():
        c["ms"] = round(c["ms"], 3)
        if c["bytes"] and c["ms"]:
            c["GBps_busy"] = round(c["bytes"] / c["ms"] / 1e6, 1)
    hooks = collections.defaultdict(float)
    for e in host:
        hooks[e["name"][5:]] += e["dur"] / 1e3
    return {"gpu_span_ms": round((end - start) / 1e3, 3), "streams": streams,
            "copies": dict(copies),
            "hook_host_ms_in_trace": {k: round(v, 3) for k, v in hooks.items()}}


def _merge(iv):
    out = []
    for s, t in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], t)
        else:
            out.append([s, t])
    return out


def _overlap(a, b) -> float:
    """Length of the intersection of two sorted, merged interval lists."""
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        tot += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def _child(a):
    kind, mode = a.child.split(":")
    import torch
    from vllm import SamplingParams

    clock = HookClock()
    if kind.split("@")[0] == "xkv":
        from xkv_vllm_connector.fusionx_connector import FusIOnXConnector

        clock.wrap(FusIOnXConnector)
    elif kind == "offload":
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )

        clock.wrap(OffloadingConnector)
    lens = [int(x) for x in a.lens.split(",")]
    rng = random.Random(7)
    prompt = lambda n: [rng.randrange(1000, a.vocab) for _ in range(n)]  # noqa: E731
    t0 = time.perf_counter()
    llm = _engine(a, kind, mode, max(lens + ([a.multi_len] if a.multi else [])))
    start_s = time.perf_counter() - t0
    if a.hold:  # started beside the other engines (--start-together)
        engine_children.wait_for_go(lambda tag, obj: print(f"{tag} {json.dumps(obj)}", flush=True))
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)

    def gen(p):
        t = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        return (time.perf_counter() - t) * 1e3, o.num_cached_tokens

    def reset():
        llm.reset_prefix_cache()
        time.sleep(0.2)

    rows = []
    out = Path(a.out)
    first = {}
    for n in [min(lens)] + lens:  # the first length twice: the first restore after start, then warm
        p = prompt(n)
        ms, _ = gen(p)
        if kind != "none":
            reset()
            ms_r, cached = gen(p)
            first.setdefault(n, {"first_cold_ms": round(ms, 2), "first_restore_ms": round(ms_r, 2)})
        clock.take()
    for n in lens:
        for rep in range(a.reps):
            p = prompt(n)
            clock.take()
            ms, cached = gen(p)
            rows.append(dict(phase="cold", tokens=n, rep=rep, ms=round(ms, 2), cached=cached, hooks=clock.take()))
            if kind == "none":
                ms, cached = gen(p)
                rows.append(dict(phase="gpu_hit", tokens=n, rep=rep, ms=round(ms, 2), cached=cached, hooks=clock.take()))
            else:
                reset()
                clock.take()
                ms, cached = gen(p)
                rows.append(dict(phase="restore", tokens=n, rep=rep, ms=round(ms, 2), cached=cached, hooks=clock.take()))
        # one of each under the profiler
        for phase in ("cold", "restore" if kind != "none" else "gpu_hit"):
            p = prompt(n) if phase == "cold" else p
            if phase == "restore":
                reset()
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                ms, cached = gen(p)
            path = out / f"trace_{kind}_{mode}_{phase}_{n}.json"
            prof.export_chrome_trace(str(path))
            view = _gpu_view(str(path))
            rows.append(dict(phase=f"{phase}_profiled", tokens=n, ms=round(ms, 2), cached=cached,
                             gpu=view, hooks=clock.take()))
            if a.traces:
                with open(path, "rb") as f, gzip.open(str(path) + ".gz", "wb") as g:
                    g.write(f.read())
            path.unlink()
    if a.multi:
        rows.append(_multi(a, llm, kind, mode, prompt, clock, reset, out))
    print("PROFILE_RESULT " + json.dumps(dict(kind=kind, mode=mode, engine_start_s=round(start_s, 1),
                                              first=first, rows=rows)), flush=True)


def _multi(a, llm, kind, mode, prompt, clock, reset, out) -> dict:
    """e2e_ttft.py's multi case under the profiler: ``--multi`` prompts of ``--multi-len``
    tokens (stored first, then the prefix cache reset) submitted in one ``generate`` with 4
    requests of 256 tokens that decode 16 each (so the restore step also prefills those 4); the
    row holds the wall time of the whole batch, each prompt's cached
    tokens, the hooks' host and GPU positions and the trace's GPU view (where stop 46's 8 x 16k
    step spent ~100 ms beyond its 360 ms copy)."""
    import torch
    from vllm import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
    dec = SamplingParams(max_tokens=16, temperature=0.0, detokenize=False, ignore_eos=True)
    ps = [prompt(a.multi_len) for _ in range(a.multi)]
    if kind != "none":
        llm.generate([{"prompt_token_ids": p} for p in ps], one, use_tqdm=False)
        reset()
    batch = ([{"prompt_token_ids": prompt(256)} for _ in range(4)]
             + [{"prompt_token_ids": p} for p in ps])
    clock.take()
    acts = [torch.profiler.ProfilerActivity.CPU]
    cuda = torch.cuda.is_available()
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    # the engine runs in this process: the caching allocator's retries during the batch (each
    # released its cache with a device-synchronising cudaFree)
    retries = lambda: torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0  # noqa: E731
    r0 = retries()
    with torch.profiler.profile(activities=acts) as prof:
        t = time.perf_counter()
        outs = llm.generate(batch, [dec] * 4 + [one] * len(ps), use_tqdm=False)
        ms = (time.perf_counter() - t) * 1e3
    path = out / f"trace_{kind}_{mode}_multi_{a.multi_len}.json"
    prof.export_chrome_trace(str(path))
    row = dict(phase="multi_profiled", tokens=a.multi_len, ms=round(ms, 2),
               cached=[o.num_cached_tokens for o in outs[4:]], gpu=_gpu_view(str(path)),
               hooks=clock.take(), alloc_retries=retries() - r0)
    if a.traces:
        with open(path, "rb") as f, gzip.open(str(path) + ".gz", "wb") as g:
            g.write(f.read())
    path.unlink()
    return row


# ---------------------------------------------------------------------------------------- parent
def _parent(a):
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    together = engine_children.together(a, len(a.kinds.split(",")) * len(a.modes.split(",")))
    results, logs, texts = [], [], {}
    specs = []
    for mode in a.modes.split(","):
        for kind in a.kinds.split(","):
            env = dict(os.environ, PYTHONHASHSEED="0", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                       XKV_GATEWAY_HOSTNAME="127.0.0.1", XKV_TIMING="1",
                       **(e2e_kinds.env(kind) if "=" in kind else {}))
            env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
            if a.runner != "default":
                env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if a.runner == "v2" else "0"
            label = f"{kind}:{mode}"
            specs.append(engine_children.Spec(
                kind=label, cmd=[sys.executable, __file__, *sys.argv[1:], "--child", label],
                env=env, gateway=kind.split("@")[0] == "xkv", card=f"{int(a.card_gib * 1024)}M",
                port=a.port, pass_pid=False))

    def on_line(label, line):
        texts.setdefault(label, []).append(line)

    def done(label, rc, times):
        lines = texts.pop(label, [])
        text = "".join(lines) + ("" if rc == 0 else f"\nrc={rc}")
        logs.append(f"===== {label} ({times['end'] - times['spawn']:.0f} s)\n" + text[-20000:])
        timing = [ln.split("XKV_TIMING", 1)[1].strip() for ln in lines if "XKV_TIMING" in ln]
        for line in lines:
            if line.startswith("PROFILE_RESULT "):
                r = json.loads(line.split(" ", 1)[1])
                r.update(tag=a.tag, model=a.model, backend=a.backend, runner=a.runner,
                         xkv_timing=timing,
                         stores=[ln.split("XKV: stores:", 1)[1].strip()
                                 for ln in lines if "XKV: stores:" in ln][:1])
                results.append(r)
        print(f"[{label}] results {len(results)}", flush=True)
        (out / "profile.json").write_text(json.dumps(results, indent=1))
        (out / "children.log").write_text("\n".join(logs))

    engine_children.run(specs, out, on_line, a.child_timeout, on_done=done, **together)
    if a.traces:
        with tarfile.open(out / "traces.tar.gz", "w") as tf:
            for f in sorted(out.glob("trace_*.json.gz")):
                tf.add(f, arcname=f.name)
                f.unlink()
    _report(results, out)


def _report(results, out):
    import statistics

    lines = []
    for r in results:
        lines.append(f"### {r.get('tag', '')} {Path(r.get('model', '?')).name} {r.get('backend', '')} "
                     f"runner {r.get('runner', '?')}: {r['kind']} / {r['mode']} (engine start {r['engine_start_s']} s; first run after start: {r['first']})")
        if r.get("stores"):
            lines.append(f"- stores: {r['stores'][0]}")
        lines.append("| phase | tokens | ms (median) | cached | host ms per request in hooks (median) |")
        lines.append("|---|---|---|---|---|")
        groups = collections.defaultdict(list)
        for row in r["rows"]:
            if "profiled" not in row["phase"]:
                groups[(row["phase"], row["tokens"])].append(row)
        for (phase, n), rs in groups.items():
            hooks = collections.defaultdict(list)
            for row in rs:
                for k, v in row["hooks"].items():
                    hooks[k].append(v["ms"])
            hk = ", ".join(f"{k} {statistics.median(v):.2f} ({rs[0]['hooks'].get(k, {}).get('calls', 0)} calls)"
                           for k, v in sorted(hooks.items(), key=lambda kv: -statistics.median(kv[1])) if statistics.median(v) >= 0.05)
            lines.append(f"| {phase} | {n} | {statistics.median(x['ms'] for x in rs):.1f} | {rs[0]['cached']} | {hk} |")
            gp = []  # GPU-side position of the hooks (first rep): when the compute stream got there
            for k, v in sorted(rs[0]["hooks"].items(), key=lambda kv: kv[1].get("gpu_first_ms") or 0):
                if "gpu_first_ms" in v:
                    gp.append(f"{k}: host {v['host_first_ms']:.2f}-{v['host_last_ms']:.2f}, GPU "
                              f"{v['gpu_first_ms']:.2f}-{v['gpu_last_ms']:.2f}, stall {v['gpu_stall_ms']:.2f}")
            if gp:
                lines.append(f"|  | {n} | hooks, ms from the first hook (rep 0) | | {'; '.join(gp)} |")
        for row in r["rows"]:
            if "profiled" in row["phase"]:
                g = row.get("gpu", {})
                comp = next((s for s in g.get("streams", {}).values() if s.get("compute")), {})
                other = [(k, s["busy_ms"], s["events"]) for k, s in g.get("streams", {}).items() if not s.get("compute")]
                lines.append(f"- profiled {row['phase']} {row['tokens']}: wall {row['ms']} ms, GPU span {g.get('gpu_span_ms')} ms, "
                             f"compute stream busy {comp.get('busy_ms')} idle {comp.get('idle_ms')} ms "
                             f"(gaps>100us {comp.get('gaps_over_100us')}, largest {comp.get('largest_gaps_ms')}), "
                             f"other streams (id, busy ms, events) {other}, hook host ms {g.get('hook_host_ms_in_trace')}")
                for k, st in g.get("streams", {}).items():
                    if not st.get("compute"):
                        lines.append(f"  - stream {k}: busy {st['busy_ms']} ms, first {st['first_ms']} last "
                                     f"{st['last_ms']}, overlap with compute {st.get('overlap_with_compute_ms')} ms, "
                                     f"largest gaps {st['largest_gaps_ms']}")
                if g.get("copies"):
                    lines.append(f"  - copies: {g['copies']}")
                if row["phase"] == "multi_profiled":  # where the batch's hooks ran, host and GPU
                    lines.append(f"  - cached tokens per prompt {row['cached']}; allocator retries "
                                 f"{row.get('alloc_retries', '—')}; hooks: " + "; ".join(
                        f"{k} {v['ms']:.2f} ms host ({v['calls']} calls)"
                        + (f", GPU {v['gpu_first_ms']:.2f}-{v['gpu_last_ms']:.2f} from the first "
                           f"hook, stall {v['gpu_stall_ms']:.2f}" if "gpu_first_ms" in v else "")
                        for k, v in sorted(row["hooks"].items(), key=lambda kv: -kv[1]["ms"])))
        if r.get("xkv_timing"):
            lines.append("- XKV_TIMING (last 8): " + " | ".join(r["xkv_timing"][-8:]))
        lines.append("")
    text = "\n".join(lines)
    (out / "profile.md").write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    args = _args()
    if args.child:
        _child(args)
    else:
        _parent(args)
