"""Runs engine_driver.py scenarios in a child process (see its docstring for the steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("engine_driver.py")
# vLLM caches model-class inspection here (~25 s per process otherwise); shared across tests.
VLLM_CACHE = os.environ.get("XKV_TEST_VLLM_CACHE", str(Path.home() / ".cache" / "xkv" / "vllm-cache"))

MODEL_ARGS = {
    "llama": {"dtype": "float32", "block_size": 32},
    "deepseek_v2": {"dtype": "bfloat16", "block_size": 16},
    "gemma3": {"dtype": "float32", "block_size": 32},  # sliding window 64 = 2 blocks
    # hybrid models (tests/hybrid): vLLM raises block_size 32 so an attention page holds a state
    **{k: {"dtype": "bfloat16", "block_size": 32}
       for k in ("nemotron_h", "granitemoehybrid", "qwen3_next")},
}


def run_engine(models, kind, gateway, steps, *, extra=None, multiprocess=False, verify=True,
               env=None, timeout=420, imports=()):
    """Run ``steps`` (see engine_driver.py) in a child process; returns (result, log text).
    ``imports``: modules of tests/e2e the driver imports first (engine-process patches)."""
    proc, port = gateway
    sc = {"model": models[kind], **MODEL_ARGS[kind], "port": port, "gateway_pid": proc.pid,
          # a loaded 2-core CI box can miss the 50 ms production default now and then
          "extra": {"lookup_timeout_ms": 2000, **(extra or {})}, "steps": steps, "verify": verify and not multiprocess, "imports": list(imports)}
    with tempfile.TemporaryDirectory() as d:
        scp, rp = Path(d, "scenario.json"), Path(d, "result.json")
        scp.write_text(json.dumps(sc))
        e = dict(os.environ)
        e.update(PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                 VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=VLLM_CACHE,
                 PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")])),
                 VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0")
        e.pop("XKV_GATEWAY_HOSTNAME", None)
        e.update(env or {})
        p = subprocess.run([sys.executable, str(DRIVER), str(scp), str(rp)], env=e,
                           capture_output=True, text=True, timeout=timeout)
        log = p.stdout + p.stderr
        if p.returncode != 0 or not rp.exists():
            raise AssertionError(f"engine driver failed ({p.returncode}):\n{log[-6000:]}")
        return json.loads(rp.read_text()), log
