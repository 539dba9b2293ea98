"""Child-process driver: real vLLM engines on the CPU, with FusIOnXConnector or without.

    python engine_driver.py SCENARIO.json RESULT.json

The scenario is a list of steps run in order in this process (so a crash stays contained and
each test gets a clean environment). Steps:

* ``{"op": "engine", "name": N, "connector": bool, "extra": {...}}`` — build (or replace) an
  engine; the previous one is deleted first (a fresh engine = empty local prefix cache).
* ``{"op": "generate", "name": N, "prompts": [{"tokens": [...], "salt": s, "params": {...}}],
  "max_tokens": k, "kill_after_s": t, "logprobs": bool}`` — greedy generation; records token ids,
  ``num_cached_tokens`` and (``logprobs``) each generated token's logprob per prompt, the gateway's counters before and after, and (``kill_after_s``)
  SIGKILLs the gateway from a timer thread while the batch runs.
* ``{"op": "reset"}`` — ``reset_prefix_cache()``; ``{"op": "kill_gateway"}``;
  ``{"op": "restart_gateway"}`` — SIGKILL the gateway, start a new one on the same port (an
  empty card, a new epoch; stopped when the driver ends); ``{"op": "sleep", "s": t}``;
  ``{"op": "log_stats"}`` — print vLLM's periodic stats line now; ``{"op": "corrupt_card",
  "stride": k}`` — flip one bit in every k-th byte of the gateway's card (verified restores);
  ``{"op": "fault", "kind": K, "object": i}`` — damage one committed object (``card_faults.py``,
  which the scenario imports; recorded in ``faults``).
* ``{"op": "wait_file", "path": P}`` — create ``P.waiting``, then wait until the test creates
  ``P`` (the test changes the world between steps: kills or restarts a process).
* ``{"op": "expect_error", "extra": {...}, "env": {...}}`` — building an engine must raise;
  records the message.

A scenario's ``imports`` (module names next to this file) are imported before the first engine
is built: patches of the engine process (``hook_skipping.py``).

Extra-config keys for the driver only (removed before the engine sees them):
``xkv_test_prefix_caching: false`` builds the engine without prefix caching,
``xkv_test_max_batched: n`` with ``max_num_batched_tokens=n``; a prompt's
``"params": {"xkv_test_drop_state": true}`` has its state objects aborted instead of committed
(its attention chunks are committed), as if dropped on the gateway.

Block sizes are vLLM's choice, which depends on the CPU (AVX512-BF16 keeps Mamba states in fp32,
so hybrid blocks grow; AMX picks another MLA backend): every engine built is recorded in
``engines`` (``block_size`` = ``cache_config.block_size`` after the engine started, ``cpu`` =
the CPU features vLLM saw), and any extra value written ``{"blocks": k}`` (``chunk_size``,
``xkv_test_max_batched``) means k times the block size vLLM chose for this model: learned from
the last engine this scenario built, or from a probe engine without the connector built first.
The engine built with such a value must have that same block size (checked).

With ``verify`` in the scenario, every copy is checked in-process (:class:`_Checks`): after each
load the destination pages are compared with the card bytes they came from, and after each save
the card bytes with the source pages (bit-exact), so E2's restored pages equal E1's computed
ones; for state groups (one block per object) every restored STATE page is also compared with
the bytes saved for the same key (sha256 taken at save time), across engines (``state_*``
counts; ``state_blocks_per_load``: blocks written per state load, boundary + running block);
``load_jobs`` / ``async_load_jobs`` count the synchronous / asynchronous restores workers got.
"""

from __future__ import annotations

import gc
import hashlib
import importlib
import json
import os
import signal
import sys
import threading
import time

import numpy as np
import torch


class _Checks:
    """In-process checks through public seams only: ``WorkerSide.bind`` (the step's metadata),
    the transfer handler the worker gets from ``xkv.connector.setup.make_handler``, and, for
    ``xkv_test_drop_state``, ``SchedulerSide.update_state_after_alloc`` and the gateway
    client's ``commit``. Card offsets come from ``GroupPlan.card_offsets`` (the one home of the
    stored-object layout)."""

    def __init__(self, res: dict) -> None:
        self.res = res
        for k in ("state_loads_checked", "state_loads_equal", "state_loads_match_saved",
                  "state_saves_checked", "state_saves_equal"):
            res[k] = 0
        res["state_blocks_per_load"] = []
        self.saved: dict[bytes, str] = {}  # state key + group + layer -> sha256 of the saved page
        self.where: dict[str, dict[int, tuple[bytes, bool]]] = {"load": {}, "save": {}}
        self.drop_reqs: set[str] = set()
        self.drop_keys: set[tuple[int, bytes]] = set()  # (layout id, key) aborted, not committed

    def bind(self, worker, meta) -> None:
        """Where every block of this step's loads and saves lives: card offset -> (key, state?)."""
        reg = worker.registry
        self.res["load_jobs"] = self.res.get("load_jobs", 0) + len(meta.loads)
        self.res["async_load_jobs"] = self.res.get("async_load_jobs", 0) + len(meta.async_loads)
        for kind, jobs in (("load", meta.loads), ("save", meta.saves)):
            where = self.where[kind] = {}
            for job in jobs:
                for gt in job.groups:
                    plan = reg.groups[gt.group]
                    if kind == "load" and plan.is_state:
                        self.res["state_blocks_per_load"].append(len(gt.block_ids))
                    if kind == "save" and plan.is_state and job.req_id in self.drop_reqs:
                        self.drop_keys.update((worker.layout_ids[gt.group], c.key)
                                              for c in gt.chunks)
                    for li in range(len(plan.group.layer_names)):
                        offs = plan.card_offsets(worker.tp_rank, [gt], layer=li)
                        for off, c in zip(offs, gt.chunk_of, strict=True):
                            where[off] = (gt.chunks[c].key + bytes([gt.group, li]), plan.is_state)

    def compare(self, kind: str, card, offsets, pool, block_ids) -> None:
        """Every block of one layer copy: its page against its card bytes (after the copy)."""
        r = self.res
        for off, b in zip(offsets.tolist(), block_ids.tolist(), strict=True):
            page = pool.block(b)
            eq = int(torch.equal(page, card[off:off + pool.block_bytes]))
            r[f"{kind}s_checked"] += 1
            r[f"{kind}s_equal"] += eq
            key, state = self.where[kind].get(off, (None, False))
            if not state:
                continue
            r[f"state_{kind}s_checked"] += 1
            r[f"state_{kind}s_equal"] += eq
            sha = hashlib.sha256(page.cpu().numpy().tobytes()).hexdigest()
            if kind == "save":
                self.saved[key] = sha
            else:
                r["state_loads_match_saved"] += int(self.saved.get(key) == sha)


def _install_checks(res: dict) -> None:
    from xkv.connector import setup
    from xkv.connector.scheduler import SchedulerSide
    from xkv.connector.worker import WorkerSide
    from xkv.gateway.client import GatewayClient

    checks = _Checks(res)
    bind, admit, commit = WorkerSide.bind, SchedulerSide.update_state_after_alloc, GatewayClient.commit
    make_handler = setup.make_handler

    def checked_bind(self, meta):
        checks.bind(self, meta)
        bind(self, meta)

    def checked_admit(self, request, block_ids, num_external_tokens):
        if (getattr(request, "kv_transfer_params", None) or {}).get("xkv_test_drop_state"):
            checks.drop_reqs.add(request.request_id)
        admit(self, request, block_ids, num_external_tokens)

    def dropping_commit(self, layout_id, shard, keys, *, checksums=None, **kw):
        # keys: the reservations' ChunkRefs (one type from lookup to commit); dropped by key
        # (with their checksum words, which go with their keys)
        drop = [k for k in keys if (layout_id, k.key) in checks.drop_keys]
        if drop:  # as if the state object were dropped on the gateway: never visible
            self.abort(layout_id, shard, drop, **kw)
        keep = [i for i, k in enumerate(keys) if (layout_id, k.key) not in checks.drop_keys]
        if checksums is not None:
            kw["checksums"] = [checksums[i] for i in keep]
        return commit(self, layout_id, shard, [keys[i] for i in keep], **kw) if keep else 0

    def checked_handler(device, verify=False):
        return _CheckedHandler(make_handler(device, verify=verify), checks)

    WorkerSide.bind = checked_bind
    SchedulerSide.update_state_after_alloc = checked_admit
    GatewayClient.commit = dropping_commit
    setup.make_handler = checked_handler


class _CheckedHandler:
    """A transfer handler that checks each copy once it is done and before the forward can
    change the pages: a layer's loads when the worker waits for that layer (state layers: inside
    ``start_load_kv``; the forward updates a running state block in place), the rest when the
    loads are synced; each save right after it was issued (CPU engine: inline copies)."""

    def __init__(self, inner, checks: _Checks) -> None:
        self.inner, self.checks, self.loads = inner, checks, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def load_group(self, names, card, offsets, pools, block_ids, checks=None):
        flags = self.inner.load_group(names, card, offsets, pools, block_ids, checks=checks)
        if checks is not None and checks.hash_only is not None:  # only read, never written
            w = torch.from_numpy(~np.asarray(checks.hash_only))
            block_ids, offsets = block_ids[w], offsets[:, w]
        for name, offs, pool in zip(names, offsets, pools, strict=True):
            self.loads.setdefault(name, []).append((card, offs.clone(), pool, block_ids.clone()))
        return flags

    def load_before_forward(self, names, card, offsets, pools, block_ids):
        # blocks the step also writes (a partly restored last block): checked now, before the
        # forward rewrites part of them
        self.inner.load_before_forward(names, card, offsets, pools, block_ids)
        for offs, pool in zip(offsets, pools, strict=True):
            self.checks.compare("load", card, offs.clone(), pool, block_ids.clone())

    def wait_layer(self, name):
        self.inner.wait_layer(name)
        for args in self.loads.pop(name, ()):
            self.checks.compare("load", *args)

    def sync_loads(self):
        self.inner.sync_loads()
        for name in list(self.loads):
            for args in self.loads.pop(name):
                self.checks.compare("load", *args)

    def save_prepared(self, prep, layer, name, pool, block_ids, card, offsets):
        self.inner.save_prepared(prep, layer, name, pool, block_ids, card, offsets)
        self.inner.flush_saves()
        self.checks.res["prepared_saves"] = self.checks.res.get("prepared_saves", 0) + 1
        self.checks.compare("save", card, offsets, pool, block_ids)

    def save_group(self, names, pools, block_ids, card, offsets, checks=None):
        # save_mode step: the inner handler's one launch per page size, every layer checked
        prep = self.inner.save_group(names, pools, block_ids, card, offsets, checks=checks)
        self.inner.flush_saves()
        self.checks.res["group_saves"] = self.checks.res.get("group_saves", 0) + 1
        if checks is not None:  # verified: the words computed by the same launches
            self.checks.res["group_saves_checked"] = self.checks.res.get("group_saves_checked",
                                                                         0) + 1
        for offs, pool in zip(offsets, pools, strict=True):
            self.checks.compare("save", card, offs.clone(), pool, block_ids.clone())
        return prep


def _gateway_stats(port):
    from xkv.gateway.client import GatewayClient, GatewayError

    try:
        with GatewayClient("127.0.0.1", port, timeout_s=0.5) as c:
            s = c.stats()
        return {k: s[k] for k in ("lookups", "reserved", "committed", "hit_chunks", "exists", "leases")}
    except GatewayError:
        return None


def _block_size(llm) -> int:
    """The KV cache block size (tokens) vLLM chose for this engine (hybrids: after its
    attention/state page alignment, which the executor makes in place on this config: true of
    the in-process engine the driver runs by default, not of a multi-process one)."""
    return int(llm.llm_engine.vllm_config.cache_config.block_size)


def _cpu_features() -> dict:
    """The CPU features vLLM's CPU platform reads (tests/e2e/cpu_kind.py may hide some)."""
    return {"avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
            "amx": bool(torch.cpu._is_amx_tile_supported())}


def _in_blocks(extra: dict, block: int | None) -> tuple[dict, bool]:
    """``extra`` with every ``{"blocks": k}`` value replaced by ``k * block``; and whether any was."""
    out, used = {}, False
    for k, v in extra.items():
        if isinstance(v, dict) and set(v) == {"blocks"}:
            if block is None:
                raise ValueError(f"{k}={v}: no block size known yet")
            out[k], used = v["blocks"] * block, True
        else:
            out[k] = v
    return out, used


def _build(sc, step, res=None, probe=False):
    """Build one engine; ``res`` (when given) records its block size and the CPU features."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra = {"xkv_gateway_port": sc["port"], **sc.get("extra", {}), **step.get("extra", {})}
    blocky = {k for k in extra if _in_blocks({k: extra[k]}, 0)[1]}
    if probe:  # learns the block size: nothing of the step that needs it
        extra = {k: v for k, v in extra.items() if k not in blocky}
    elif not step.get("connector", True):  # the connector's keys do not matter here
        extra = {k: v for k, v in extra.items() if k not in blocky or k.startswith("xkv_test_")}
    known = res["engines"][-1]["block_size"] if res and res["engines"] else None
    if known is None and res is not None and _in_blocks(extra, 0)[1]:
        _drop(_build(sc, {"connector": False}, res, probe=True))  # learn vLLM's block size
        known = res["engines"][-1]["block_size"]
    extra, derived = _in_blocks(extra, known)
    kw = {"enable_prefix_caching": extra.pop("xkv_test_prefix_caching", True)}
    if "xkv_test_max_batched" in extra:  # a small chunked-prefill budget: several steps
        kw["max_num_batched_tokens"] = extra.pop("xkv_test_max_batched")
    if step.get("connector", True):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="FusIOnXConnector",
            kv_connector_module_path="xkv_vllm_connector.fusionx_connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        )
    llm = LLM(model=sc["model"], dtype=sc["dtype"], block_size=sc["block_size"],
              max_model_len=1024, enforce_eager=True, seed=0, disable_log_stats=False, **kw)
    if res is not None:
        res["engines"].append({"name": step.get("name"), "block_size": _block_size(llm),
                               "connector": step.get("connector", True), "cpu": _cpu_features()})
        if derived and _block_size(llm) != known:
            raise AssertionError(f"this engine's block size {_block_size(llm)} differs from the "
                                 f"{known} its {{'blocks': k}} values were computed from")
    return llm


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
                 "saves_checked": 0, "saves_equal": 0, "timings": [], "engines": []}
    if sc.get("verify"):
        _install_checks(res)
    for mod in sc.get("imports", ()):
        importlib.import_module(mod)
    from vllm import SamplingParams

    llm = None
    restarted: list = []  # gateways this driver started (stopped at the end)
    for step in sc["steps"]:
        op = step["op"]
        if op == "engine":
            _drop(llm)
            llm = None
            t0 = time.perf_counter()
            llm = _build(sc, step, res)
            res["timings"].append(("engine", time.perf_counter() - t0))
        elif op == "generate":
            prompts = []
            for p in step["prompts"]:
                d = {"prompt_token_ids": p["tokens"]}
                if p.get("salt"):
                    d["cache_salt"] = p["salt"]
                prompts.append(d)
            sps = [SamplingParams(temperature=0, max_tokens=step.get("max_tokens", 8),
                                  ignore_eos=True, logprobs=1 if step.get("logprobs") else None,
                                  extra_args={"kv_transfer_params": p["params"]}
                                  if p.get("params") is not None else None)
                   for p in step["prompts"]]
            before = _gateway_stats(sc["port"])
            timer = None
            if step.get("kill_after_s") is not None:
                timer = threading.Timer(step["kill_after_s"],
                                        lambda: os.kill(sc["gateway_pid"], signal.SIGKILL))
                timer.start()
            mods = set(sys.modules)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sps, use_tqdm=False)
            dt = time.perf_counter() - t0
            imported = sorted(set(sys.modules) - mods)
            if timer:
                timer.join()
            res["runs"].append({
                "name": step.get("name"),
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [o.num_cached_tokens for o in outs],
                "logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                             o.outputs[0].logprobs, strict=True)]
                             for o in outs] if step.get("logprobs") else None,
                "seconds": dt,
                "imported": imported,  # modules first imported during this batch (in-process)
                "gw_before": before,
                "gw_after": _gateway_stats(sc["port"]),
                # cumulative counts, for per-run deltas
                "loads_checked_after": res["loads_checked"],
                "saves_checked_after": res["saves_checked"],
            })
        elif op == "reset":
            llm.reset_prefix_cache()
        elif op == "kill_gateway":
            os.kill(sc["gateway_pid"], signal.SIGKILL)
            time.sleep(0.2)
        elif op == "restart_gateway":  # SIGKILL, then a new gateway process on the same port
            from xkv.gateway.testing import spawn_gateway

            os.kill(sc["gateway_pid"], signal.SIGKILL)
            time.sleep(0.2)
            proc, _ = spawn_gateway(step.get("capacity", "256M"), port=sc["port"])
            restarted.append(proc)
            sc["gateway_pid"] = proc.pid
        elif op == "corrupt_card":  # flip bit 0 of every `stride`-th byte of the card
            from xkv.gateway.client import GatewayClient

            with GatewayClient("127.0.0.1", sc["port"], timeout_s=2.0) as c:
                mv = c.map_card()
                card = np.frombuffer(mv, dtype=np.uint8)
                card[:: step.get("stride", 509)] ^= 1
                del card
                mv.release()
        elif op == "fault":  # damage recorded objects (card_faults.py, in the scenario's imports)
            import card_faults

            from xkv.gateway.client import GatewayClient

            with GatewayClient("127.0.0.1", sc["port"], timeout_s=2.0) as c:
                mv = c.map_card()
                card = np.frombuffer(mv, dtype=np.uint8)
                res.setdefault("faults", []).append(card_faults.apply(step, card))
                del card
                mv.release()
        elif op == "sleep":  # let wall-clock time pass (the connector's re-probe back-off)
            time.sleep(step["s"])
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
                _build(sc, {"extra": step.get("extra", {})}, res)
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
    from xkv.gateway.testing import stop_gateway

    for proc in restarted:
        stop_gateway(proc)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
