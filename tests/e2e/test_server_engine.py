"""The README quick start as written: vLLM's OpenAI server (default multi-process engine) with
FusIOnXConnector from --kv-transfer-config, a real xkv-gateway, and cached_tokens in responses."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from e2e_harness import ROOT, VLLM_CACHE

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url, body=None, timeout=60):
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def test_openai_server_quick_start(models, gateway, tmp_path):
    _, gw_port = gateway
    port = _free_port()
    ktc = {"kv_connector": "FusIOnXConnector",
           "kv_connector_module_path": "xkv_vllm_connector.fusionx_connector",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"xkv_gateway_port": gw_port, "chunk_size": 64,
                                         "lookup_timeout_ms": 2000}}
    env = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_SERVER_DEV_MODE="1", VLLM_LOG_STATS_INTERVAL="1", VLLM_CACHE_ROOT=VLLM_CACHE,
               VLLM_USE_V2_MODEL_RUNNER="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    log_path = Path(tmp_path, "server.log")
    with open(log_path, "w") as log:
        srv = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
             models["llama"], "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
             "--block-size", "32", "--max-model-len", "1024", "--enforce-eager",
             "--enable-prefix-caching", "--enable-prompt-tokens-details",
             "--kv-transfer-config", json.dumps(ktc)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                assert srv.poll() is None, log_path.read_text()[-5000:]
                assert time.monotonic() < deadline, "server did not come up in 300 s"
                time.sleep(1)
        prompt = [(3 + 23 * i) % 1000 + 4 for i in range(290)]
        body = {"model": models["llama"], "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}

        def complete(**extra):
            r = _post(base + "/v1/completions", {**body, **extra})
            return r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]["cached_tokens"]

        t1, c1 = complete()
        _post(base + "/reset_prefix_cache")
        t_opt, c_opt = complete(kv_transfer_params={"xkv_store": False})
        _post(base + "/reset_prefix_cache")
        t2, c2 = complete()
        time.sleep(2.5)  # one periodic stats line
        assert c1 == 0 and c2 == 256 and t2 == t1
        assert c_opt == 0 and t_opt == t1  # opted out: no restore, same text
    finally:
        os.killpg(srv.pid, signal.SIGTERM)
        try:
            srv.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(srv.pid, signal.SIGKILL)
            srv.wait()
    text = log_path.read_text()
    assert "XKV: 2 cache tensors registered for exchange" in text
    assert "KV cache registry: 2 cache(s) in 1 group(s)" in text
    assert "External prefix cache hit rate:" in text
