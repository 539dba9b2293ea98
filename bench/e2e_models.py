"""bench/e2e_ttft.py's per-model engine options (fp8 KV cache, hybrid Mamba cache mode) and the
verify child's state-page check. Split from e2e_ttft.py (its line budget); no vLLM import here.

* ``add_args`` / ``engine_kwargs``: ``--kv-cache-dtype`` (passed to the engine),
  ``--calculate-kv-scales`` (run-time fp8 scales: the connector must refuse the engine at start
  with its message), ``--mamba-cache-mode`` (hybrids: force ``align`` or ``all``; default: vLLM's
  choice, which on 0.26 is ``all`` for Nemotron-H).
* ``chunk_tokens``: ``--chunk-size 0`` = one attention block of the model as vLLM 0.26 sizes it
  for a hybrid on the GPU (an attention page must hold a Mamba state page, see
  ``hybrid_block_size``), else 256 (the connector's default).
* ``fresh_engine`` (``--verify-fresh-engine``): the verify child restores its ref prompt in a
  second engine, so the restored objects were written by another engine (a restart).
* ``StateCheck`` (a ``TransferHandler``): wraps the worker's transfer handler in the verify child (engine in-process):
  every restored STATE page is compared with its card bytes right after its copy, before the
  forward (which advances an ``align``-mode running block in place, so the handler's own
  ``verify_restores`` check, which runs after the forward, must not see state pages), and every
  saved state page right after its copy. Counts come back as ``E2E_INFO verify_states``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from pathlib import Path
from typing import Any

STATE_KIND = "mamba"  # the PagePool label of a state group (xkv.connector.registry.STATE_KINDS)
COUNTS: dict[str, int] = {"state_restores": 0, "state_restores_differ": 0,
                          "state_saves": 0, "state_saves_differ": 0}


def add_args(ap) -> None:
    ap.add_argument("--kv-cache-dtype", default="auto", help="engine KV cache dtype (e.g. fp8)")
    ap.add_argument("--calculate-kv-scales", action="store_true",
                    help="fp8 scales computed at run time (the connector refuses this at start)")
    ap.add_argument("--mamba-cache-mode", choices=("align", "all"), default=None,
                    help="hybrid models: force vLLM's Mamba cache mode (default: vLLM's choice)")
    ap.add_argument("--lookup-timeout-ms", type=int, default=None,
                    help="connector LOOKUP deadline (default: the connector's; a loaded CPU box "
                         "needs more)")
    ap.add_argument("--xkv-extra", default="",
                    help='JSON object of extra kv_connector_extra_config keys for xkv, e.g. '
                         '\'{"full_hit_restore": true}\'')
    ap.add_argument("--verify-checksums", choices=("on", "off"), default=None,
                    help="connector verify_checksums (issue 25; default: the connector's, on): "
                         "run once with each to measure its cost")
    ap.add_argument("--verify-fresh-engine", action="store_true",
                    help="verify: restore the ref prompt in a second engine of the same child "
                         "(objects written by the first: an engine restart)")


def engine_kwargs(a) -> dict[str, Any]:
    """Extra ``LLM(...)`` arguments of these options (none when left at their defaults)."""
    kw: dict[str, Any] = {}
    if a.kv_cache_dtype != "auto":
        kw["kv_cache_dtype"] = a.kv_cache_dtype
    if a.calculate_kv_scales:
        kw["calculate_kv_scales"] = True
    if a.mamba_cache_mode:
        kw["mamba_cache_mode"] = a.mamba_cache_mode
    return kw


def _layer_types(c: dict) -> list[str] | None:
    """Nemotron-H layer kinds as "M"/"*"/"-"/"E" (``hybrid_override_pattern``, or transformers 5's
    ``layers_block_type`` names), None for other models."""
    if c.get("hybrid_override_pattern"):
        return list(c["hybrid_override_pattern"])
    names = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*",
             "mlp": "-", "moe": "E"}
    types = c.get("layers_block_type")
    return [names.get(t, "?") for t in types] if isinstance(types, list) else None


def connector_extra(a) -> dict[str, Any]:
    """Extra ``kv_connector_extra_config`` keys of these options."""
    out: dict[str, Any] = {} if a.lookup_timeout_ms is None else {"lookup_timeout_ms": a.lookup_timeout_ms}
    if getattr(a, "verify_checksums", None) is not None:
        out["verify_checksums"] = a.verify_checksums == "on"
    if getattr(a, "xkv_extra", ""):
        extra = json.loads(a.xkv_extra)
        if not isinstance(extra, dict):
            raise SystemExit(f"--xkv-extra must be a JSON object, got {a.xkv_extra!r}")
        out.update(extra)
    return out


def is_hybrid(model_dir: str) -> bool:
    t = _layer_types(json.loads((Path(model_dir) / "config.json").read_text()))
    return bool(t) and "M" in t


def attention_layers(c: dict) -> int:
    """Layers with a KV cache page per token (a hybrid's attention layers; else all layers)."""
    t = _layer_types(c)
    return t.count("*") if t else c["num_hidden_layers"]


def hybrid_block_size(model_dir: str, mode: str, kernel_alignment: int = 16) -> int:
    """Tokens per block vLLM 0.26-0.29 gives a Nemotron-H-style hybrid (``Platform.
    update_block_size_for_backend``): an attention page must hold one Mamba2 state page (conv
    state in the model dtype + SSM state in fp32, Nemotron-H's default). ``all``: a multiple of
    lcm(Mamba chunk size, kernel alignment); ``align``: of the kernel alignment (FlashAttention:
    16 on CUDA; the CPU engine's attention: 32)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    inner = c["mamba_num_heads"] * c["mamba_head_dim"]
    conv = (c.get("conv_kernel", 4) - 1) * (inner + 2 * c["n_groups"] * c["ssm_state_size"]) * 2
    ssm = c["mamba_num_heads"] * c["mamba_head_dim"] * c["ssm_state_size"] * 4
    per_token = 2 * c["num_key_value_heads"] * c["head_dim"] * 2  # K and V, bf16, one layer
    tokens = _cdiv(conv + ssm, per_token)  # attention tokens one state page needs
    step = math.lcm(c.get("chunk_size", 128), kernel_alignment) if mode == "all" else kernel_alignment
    return step * _cdiv(tokens, step)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_tokens(a) -> int:
    """xkv chunk size for this run: ``--chunk-size``, or (0) one block of a hybrid model in the
    Mamba mode vLLM 0.26 uses (``all`` unless forced), else 256."""
    if a.chunk_size:
        return a.chunk_size
    if is_hybrid(a.model):
        return hybrid_block_size(a.model, a.mamba_cache_mode or "all")
    return 256


def fresh_engine(box: list, build):
    """Shut the in-process engine in ``box`` (its only reference) down, free what it held, and
    return ``build()``."""
    import gc

    llm = box.pop()
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm, core
    gc.collect()
    with contextlib.suppress(ImportError):  # a vLLM without the helper frees on its own
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    return build()


def _compare(kind: str, card, offsets, pool, block_ids) -> None:
    for off, b in zip(offsets.tolist(), block_ids.tolist(), strict=True):
        page = pool.block(b).cpu()
        COUNTS[kind] += 1
        COUNTS[kind + "_differ"] += int(not bool((page == card[off:off + page.numel()].cpu()).all()))


def _land(fence) -> None:
    if fence is not None:  # None: the copies ran inline
        fence.synchronize()


def __getattr__(name: str):
    if name == "StateCheck":  # built on first use: the connector's handler base imports torch
        return state_check_class()
    raise AttributeError(name)


@functools.cache
def state_check_class():
    """``StateCheck``'s class (see the module docstring)."""
    from xkv.connector.transfer import TransferHandler

    class StateCheck(TransferHandler):
        """A transfer handler wrapping the connector's own (``inner``) that also checks state
        pages (above); every other call is the inner handler's."""

        def __init__(self, inner: TransferHandler) -> None:
            self.inner, self.loads = inner, {}
            self.verifier = inner.verifier

        def set_light_step(self, light):
            self.inner.set_light_step(light)

        def begin_loads(self):
            self.inner.begin_loads()

        def load_group(self, names, card, offsets, pools, block_ids, checks=None):
            flags = self.inner.load_group(names, card, offsets, pools, block_ids, checks=checks)
            if checks is not None and checks.hash_only is not None:  # read, never written
                import numpy as np
                import torch

                w = torch.from_numpy(~np.asarray(checks.hash_only))
                block_ids, offsets = block_ids[w], offsets[:, w]
            for name, offs, pool in zip(names, offsets, pools, strict=True):
                if pool.kind == STATE_KIND:
                    self.loads[name] = (card, offs.clone(), pool, block_ids.clone())
            v = self.inner.verifier
            if v is not None:  # checked here, before the forward, not after it
                v.pending["restore"] = [x for x in v.pending["restore"]
                                        if x[2].kind != STATE_KIND]
            return flags

        def load_before_forward(self, names, card, offsets, pools, block_ids):
            # blocks the step also writes (one attention/MLA group: no state pages among them)
            self.inner.load_before_forward(names, card, offsets, pools, block_ids)

        def wait_layer(self, name):
            self.inner.wait_layer(name)
            if name in self.loads:
                _land(self.inner.load_fence())
                _compare("state_restores", *self.loads.pop(name))

        def pending_layers(self):
            return self.inner.pending_layers()

        def fence_loads(self):
            self.inner.fence_loads()

        def sync_loads(self):
            self.inner.sync_loads()

        def load_fence(self):
            return self.inner.load_fence()

        def verify_layers(self, names):
            self.inner.verify_layers(names)

        def prepare_saves(self, pools, block_ids, card, offsets, checks=None):
            return self.inner.prepare_saves(pools, block_ids, card, offsets, checks=checks)

        def save_words(self, prep, num_layers):
            return self.inner.save_words(prep, num_layers)

        def save_prepared(self, prep, layer, name, pool, block_ids, card, offsets):
            self.inner.save_prepared(prep, layer, name, pool, block_ids, card, offsets)
            if pool.kind == STATE_KIND:
                self.inner.flush_saves()  # the save copies landed (and the verifier's checked)
                _compare("state_saves", card, offsets, pool, block_ids)

        def save_group(self, names, pools, block_ids, card, offsets, checks=None):
            prep = self.inner.save_group(names, pools, block_ids, card, offsets, checks=checks)
            for offs, pool in zip(offsets, pools, strict=True):
                if pool.kind == STATE_KIND:  # save_mode step keeps state groups on 'layer'
                    self.inner.flush_saves()
                    _compare("state_saves", card, offs, pool, block_ids)
            return prep

        def flush_saves(self):
            self.inner.flush_saves()

        def fence_saves(self):
            return self.inner.fence_saves()

        def fence_saves_deferred(self):
            return self.inner.fence_saves_deferred()

        def order_after_saves(self):
            self.inner.order_after_saves()

    return StateCheck


def install_state_check() -> None:
    """Wrap every transfer handler this process's connector creates (call before the engine)."""
    from xkv.connector import setup

    make = setup.make_handler

    cls = state_check_class()

    def checked(device, verify=False):
        return cls(make(device, verify=verify))

    setup.make_handler = checked


def report_lines(res: dict) -> list[str]:
    s = res.get("info", {}).get("verify_states")
    if not s:
        return []
    return [f"byte-exact check (state pages, before the forward): {s['state_restores']} restored "
            f"block-layers compared with the card, {s['state_restores_differ']} differ; "
            f"{s['state_saves']} saved, {s['state_saves_differ']} differ"]
