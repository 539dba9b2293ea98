"""The V2 model runner, around what tests/compat/test_v2_runner.py drives: the call order of
the runners themselves (read from the installed vLLM's source: they need CUDA), and the bench
option that picks the runner of the GPU runs."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


def _calls_in(module: str, cls: str, fn: str) -> dict[str, list[int]]:
    """Source lines of every call in ``cls.fn`` of ``module`` (read, not imported: the runners
    need CUDA), by callee text (``self.kv_connector.pre_forward``)."""
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    body = next(f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls
                for f in c.body if isinstance(f, ast.FunctionDef) and f.name == fn)
    out: dict[str, list[int]] = {}
    for node in ast.walk(body):
        if isinstance(node, ast.Call):
            out.setdefault(ast.unparse(node.func), []).append(node.lineno)
    return out


def test_runners_precopy_before_start_load_kv():
    """What the state restores rely on and no CPU engine can run: in both runners the Mamba
    'align' pre-copy comes before the step's start_load_kv, so the restore (boundary and
    running block, waited for inside start_load_kv) overwrites what the pre-copy moved.
    V2: preprocess_state, then ActiveKVConnector.pre_forward; V1: preprocess_mamba, then the
    connector context (bind + start_load_kv)."""
    v2_calls = _calls_in("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model")
    pre = v2_calls["self.kv_connector.pre_forward"]
    assert max(v2_calls["self.model_state.preprocess_state"]) < min(pre)
    v1_calls = _calls_in("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model")
    assert max(v1_calls["mamba_utils.preprocess_mamba"]) < min(
        v1_calls["self.maybe_get_kv_connector_output"])
    # V1 calls handle_preemptions before its state updates; V2 inside pre_forward, after them:
    # the reason xkv implements none (test_v2_wrapper_detected_and_required)
    assert min(v1_calls["get_kv_transfer_group().handle_preemptions"]) < min(
        v1_calls["self._update_states"])


def test_bench_runner_option(monkeypatch):
    """``bench/e2e_ttft.py --runner`` (the GPU runs on both runners) sets the engine children's
    ``VLLM_USE_V2_MODEL_RUNNER``."""
    path = Path(__file__).resolve().parents[2] / "bench" / "e2e_ttft.py"
    monkeypatch.syspath_prepend(str(path.parent))  # its sibling bench/e2e_models.py, as when run
    spec = importlib.util.spec_from_file_location("e2e_ttft", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0", "PYTHONHASHSEED": "0"}
    assert bench._runner_env(env, "v2") == {**env, "VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert bench._runner_env(env, "v1") == env
    assert bench._runner_env(env, "default") == {"PYTHONHASHSEED": "0"}
    assert bench._args(["--runner", "v2"]).runner == "v2"
    assert bench._args([]).runner == "v1"  # as before the option: results stay comparable
