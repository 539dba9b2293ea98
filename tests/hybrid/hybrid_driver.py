"""Child-process driver for hybrid models: tests/e2e/engine_driver.py plus state checks.

    python hybrid_driver.py SCENARIO.json RESULT.json

Same steps as engine_driver.py (engine, generate, reset, kill_gateway, expect_error, ...), with:

* a verifier that knows state groups (one block per object): after every load each restored
  page is compared with its card bytes, and every restored STATE page with the bytes that were
  saved for the same key (sha256 taken at save time), so "byte-identical to the saved state"
  is checked across engines; counts go to ``state_loads_*`` / ``state_saves_*``, and the blocks
  written per state load (boundary + running block) to ``state_blocks_per_load``;
* ``"params": {"xkv_test_drop_state": true}`` on a prompt: its state objects are aborted
  instead of committed (the attention chunks are committed), as if dropped on the gateway;
* ``"extra": {"xkv_test_prefix_caching": false}``: the engine is built without prefix caching;
  ``"extra": {"xkv_test_max_batched": n}``: with ``max_num_batched_tokens=n``.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
import engine_driver as E  # noqa: E402

DROP: set[str] = set()


def _install_verifier(res: dict) -> None:
    from xkv.connector import scheduler as S
    from xkv.connector import worker as W

    for k in ("state_loads_checked", "state_loads_equal", "state_loads_match_saved",
              "state_saves_checked", "state_saves_equal"):
        res[k] = 0
    res["state_blocks_per_load"] = []
    saved: dict[bytes, str] = {}  # state key + group + layer -> sha256 of the saved page
    orig_load, orig_save = W.WorkerSide.start_load_kv, W.WorkerSide.save_kv_layer
    orig_finish, orig_plan = W.WorkerSide._finish_save, S.SchedulerSide._plan_save

    def pages(self, jobs, layer_filter=None):
        for job in jobs:
            for gt in job.groups:
                plan = self.registry.groups[gt.group]
                shard, bb = plan.shard_of(self.tp_rank), plan.group.block_bytes
                for li, name in enumerate(plan.group.layer_names):
                    if layer_filter is not None and name != layer_filter:
                        continue
                    for b, c, j in zip(gt.block_ids, gt.chunk_of, gt.block_in_chunk, strict=True):
                        off = gt.chunks[c].offsets[shard] + (li * plan.blocks_per_object + j) * bb
                        key = gt.chunks[c].key + bytes([gt.group, li])  # one key per group
                        yield plan.is_state, key, self.pools[name].block(b), self.card[off:off + bb]

    def load(self):
        orig_load(self)
        meta = self._meta
        if meta is None or not meta.loads or self.card is None:
            return
        self.handler.sync_loads()
        for job in meta.loads:
            res["state_blocks_per_load"] += [len(gt.block_ids) for gt in job.groups
                                             if self.registry.groups[gt.group].is_state]
        for state, key, page, card in pages(self, meta.loads):
            eq = int(torch.equal(page, card))
            res["loads_checked"] += 1
            res["loads_equal"] += eq
            if state:
                res["state_loads_checked"] += 1
                res["state_loads_equal"] += eq
                sha = hashlib.sha256(page.cpu().numpy().tobytes()).hexdigest()
                res["state_loads_match_saved"] += int(saved.get(key) == sha)

    def save(self, layer_name):
        orig_save(self, layer_name)
        meta = self._meta
        if meta is None or not meta.saves or self.card is None or self.turned_off:
            return
        self.handler.flush_saves()
        for state, key, page, card in pages(self, meta.saves, layer_name):
            eq = int(torch.equal(page, card))
            res["saves_checked"] += 1
            res["saves_equal"] += eq
            if state:
                res["state_saves_checked"] += 1
                res["state_saves_equal"] += eq
                saved[key] = hashlib.sha256(page.cpu().numpy().tobytes()).hexdigest()

    def finish(self, plan, g, keys, ok, job):
        if plan.is_state and job.req_id in DROP:
            ok = False  # abort: the object never becomes visible
        return orig_finish(self, plan, g, keys, ok, job)

    def plan_save(self, st, computed, scheduled, out):
        params = getattr(st.request, "kv_transfer_params", None) or {}
        if params.get("xkv_test_drop_state"):
            DROP.add(st.request.request_id)
        return orig_plan(self, st, computed, scheduled, out)

    W.WorkerSide.start_load_kv = load
    W.WorkerSide.save_kv_layer = save
    W.WorkerSide._finish_save = finish
    S.SchedulerSide._plan_save = plan_save


def _build(sc, step):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra = {"xkv_gateway_port": sc["port"], **sc.get("extra", {}), **step.get("extra", {})}
    prefix_caching = extra.pop("xkv_test_prefix_caching", True)
    kw = {}
    if "xkv_test_max_batched" in extra:  # a small chunked-prefill budget: several steps
        kw["max_num_batched_tokens"] = extra.pop("xkv_test_max_batched")
    if step.get("connector", True):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="FusIOnXConnector",
            kv_connector_module_path="xkv_vllm_connector.fusionx_connector",
            kv_role="kv_both", kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute")
    return LLM(model=sc["model"], dtype=sc["dtype"], block_size=sc["block_size"],
               max_model_len=1024, enable_prefix_caching=prefix_caching, enforce_eager=True,
               seed=0, disable_log_stats=False, **kw)


if __name__ == "__main__":
    E._install_verifier = _install_verifier
    E._build = _build
    E.main(sys.argv[1], sys.argv[2])
