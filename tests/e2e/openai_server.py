"""vLLM's OpenAI server (multi-process engine, CPU) with FusIOnXConnector, for the server tests:
started as the README's quick start says, waited for, stopped with its whole process group."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from e2e_harness import ROOT, VLLM_CACHE


def post(url: str, body=None, *, tenant: str | None = None, timeout: float = 60):
    """POST JSON (``tenant``: the x-tenant-id header), return the decoded answer."""
    data = json.dumps(body).encode() if body is not None else b""
    headers = {"Content-Type": "application/json", **({"x-tenant-id": tenant} if tenant else {})}
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def openai_server(model: str, gw_port: int, log_path: Path, *, extra_config: dict | None = None,
                  args: tuple[str, ...] = (), env: dict | None = None, drop_env: tuple = ()):
    """Yield the server's base URL once ``/health`` answers (300 s at most); ``extra_config``
    adds to ``kv_connector_extra_config``, ``args`` to the command line, ``env`` to (and
    ``drop_env`` from) the environment. The server's output goes to ``log_path``."""
    port = _free_port()
    ktc = {"kv_connector": "FusIOnXConnector",
           "kv_connector_module_path": "xkv_vllm_connector.fusionx_connector",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"xkv_gateway_port": gw_port, "chunk_size": 64,
                                         "lookup_timeout_ms": 2000, **(extra_config or {})}}
    e = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
             VLLM_SERVER_DEV_MODE="1", VLLM_CACHE_ROOT=VLLM_CACHE,
             PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    e.pop("VLLM_USE_V2_MODEL_RUNNER", None)  # the quick start sets no runner: vLLM picks one
    e.update(env or {})
    for k in drop_env:
        e.pop(k, None)
    with open(log_path, "w") as log:
        srv = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
             "--block-size", "32", "--max-model-len", "1024", "--enforce-eager",
             "--enable-prefix-caching", "--enable-prompt-tokens-details", *args,
             "--kv-transfer-config", json.dumps(ktc)],
            env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                assert srv.poll() is None, Path(log_path).read_text()[-5000:]
                assert time.monotonic() < deadline, "server did not come up in 300 s"
                time.sleep(1)
        yield base
    finally:
        os.killpg(srv.pid, signal.SIGTERM)
        try:
            srv.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(srv.pid, signal.SIGKILL)
            srv.wait()
