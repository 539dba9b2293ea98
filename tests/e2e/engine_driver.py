"""Child-process driver: real vLLM engines on the CPU, with FusIOnXConnector or without.

    python engine_driver.py SCENARIO.json RESULT.json

The scenario is a list of steps run in order in this process (so a crash stays contained and
each test gets a clean environment). Steps:

* ``{"op": "engine", "name": N, "connector": bool, "extra": {...}}`` — build (or replace) an
  engine; the previous one is deleted first (a fresh engine = empty local prefix cache).
* ``{"op": "generate", "name": N, "prompts": [{"tokens": [...], "salt": s, "params": {...}}],
  "max_tokens": k, "kill_after_s": t}`` — greedy generation; records token ids and
  ``num_cached_tokens`` per prompt, the gateway's counters before and after, and (``kill_after_s``)
  SIGKILLs the gateway from a timer thread while the batch runs.
* ``{"op": "reset"}`` — ``reset_prefix_cache()``; ``{"op": "kill_gateway"}``;
  ``{"op": "log_stats"}`` — print vLLM's periodic stats line now.
* ``{"op": "wait_file", "path": P}`` — create ``P.waiting``, then wait until the test creates
  ``P`` (the test changes the world between steps: kills or restarts a process).
* ``{"op": "expect_error", "extra": {...}, "env": {...}}`` — building an engine must raise;
  records the message.

With ``verify`` in the scenario, every restore is checked in-process: after each load the
destination pages are compared with the card bytes they came from, and after each save the card
bytes with the source pages (bit-exact), so E2's restored pages equal E1's computed ones.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time

import torch


def _install_verifier(results: dict) -> None:
    from xkv.connector import worker as W

    orig_load, orig_save = W.WorkerSide.start_load_kv, W.WorkerSide.save_kv_layer

    def _pages(self, jobs, layer_filter=None):
        for job in jobs:
            for gt in job.groups:
                plan = self.registry.groups[gt.group]
                shard = plan.shard_of(self.tp_rank)
                k, bb = plan.blocks_per_chunk, plan.group.block_bytes
                for li, name in enumerate(plan.group.layer_names):
                    if layer_filter is not None and name != layer_filter:
                        continue
                    pool = self.pools[name]
                    for b, c, j in zip(gt.block_ids, gt.chunk_of, gt.block_in_chunk, strict=True):
                        off = gt.chunks[c].offsets[shard] + (li * k + j) * bb
                        yield pool.block(b), self.card[off : off + bb]

    def load(self):
        orig_load(self)
        meta = self._meta
        if meta is None or not meta.loads or self.card is None:
            return
        self.handler.sync_loads()
        for page, card in _pages(self, meta.loads):
            results["loads_checked"] += 1
            results["loads_equal"] += int(torch.equal(page, card))

    def save(self, layer_name):
        orig_save(self, layer_name)
        meta = self._meta
        if meta is None or not meta.saves or self.card is None or self.turned_off:
            return
        self.handler.flush_saves()
        for page, card in _pages(self, meta.saves, layer_name):
            results["saves_checked"] += 1
            results["saves_equal"] += int(torch.equal(page, card))

    W.WorkerSide.start_load_kv = load
    W.WorkerSide.save_kv_layer = save


def _gateway_stats(port):
    from xkv.gateway.client import GatewayClient, GatewayError

    try:
        with GatewayClient("127.0.0.1", port, timeout_s=0.5) as c:
            s = c.stats()
        return {k: s[k] for k in ("lookups", "reserved", "committed", "hit_chunks", "exists", "leases")}
    except GatewayError:
        return None


def _build(sc, step):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if step.get("connector", True):
        extra = {"xkv_gateway_port": sc["port"], **sc.get("extra", {}), **step.get("extra", {})}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="FusIOnXConnector",
            kv_connector_module_path="xkv_vllm_connector.fusionx_connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        )
    return LLM(model=sc["model"], dtype=sc["dtype"], block_size=sc["block_size"],
               max_model_len=1024, enable_prefix_caching=True, enforce_eager=True, seed=0,
               disable_log_stats=False, **kw)


def _drop(llm) -> None:
    """Shut an engine down for real (the multi-process engine keeps child processes)."""
    if llm is None:
        return
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    gc.collect()


def main(scenario_path: str, result_path: str) -> None:
    with open(scenario_path) as f:
        sc = json.load(f)
    res: dict = {"runs": [], "errors": [], "loads_checked": 0, "loads_equal": 0,
                 "saves_checked": 0, "saves_equal": 0, "timings": []}
    if sc.get("verify"):
        _install_verifier(res)
    from vllm import SamplingParams

    llm = None
    for step in sc["steps"]:
        op = step["op"]
        if op == "engine":
            _drop(llm)
            llm = None
            t0 = time.perf_counter()
            llm = _build(sc, step)
            res["timings"].append(("engine", time.perf_counter() - t0))
        elif op == "generate":
            prompts = []
            for p in step["prompts"]:
                d = {"prompt_token_ids": p["tokens"]}
                if p.get("salt"):
                    d["cache_salt"] = p["salt"]
                prompts.append(d)
            sps = [SamplingParams(temperature=0, max_tokens=step.get("max_tokens", 8),
                                  ignore_eos=True,
                                  extra_args={"kv_transfer_params": p["params"]}
                                  if p.get("params") is not None else None)
                   for p in step["prompts"]]
            before = _gateway_stats(sc["port"])
            timer = None
            if step.get("kill_after_s") is not None:
                timer = threading.Timer(step["kill_after_s"],
                                        lambda: os.kill(sc["gateway_pid"], signal.SIGKILL))
                timer.start()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sps, use_tqdm=False)
            dt = time.perf_counter() - t0
            if timer:
                timer.join()
            res["runs"].append({
                "name": step.get("name"),
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [o.num_cached_tokens for o in outs],
                "seconds": dt,
                "gw_before": before,
                "gw_after": _gateway_stats(sc["port"]),
            })
        elif op == "reset":
            llm.reset_prefix_cache()
        elif op == "kill_gateway":
            os.kill(sc["gateway_pid"], signal.SIGKILL)
            time.sleep(0.2)
        elif op == "log_stats":
            llm.llm_engine.do_log_stats()
        elif op == "wait_file":
            open(step["path"] + ".waiting", "w").close()
            deadline = time.monotonic() + step.get("timeout_s", 300)
            while not os.path.exists(step["path"]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the test never created {step['path']}")
                time.sleep(0.05)
        elif op == "expect_error":
            saved = dict(os.environ)
            for k, v in step.get("env", {}).items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            try:
                _drop(llm)
                llm = None
                _build(sc, {"extra": step.get("extra", {})})
                res["errors"].append(None)
            except Exception as e:  # the message is what the test checks
                res["errors"].append(f"{type(e).__name__}: {e}")
            finally:
                os.environ.clear()
                os.environ.update(saved)
        else:
            raise ValueError(f"unknown op {op!r}")
        with open(result_path, "w") as f:
            json.dump(res, f)
    _drop(llm)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
