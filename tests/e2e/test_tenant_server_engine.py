"""Tenant isolation end to end (issue 14): vLLM's OpenAI server with TenantSaltMiddleware and
FusIOnXConnector on the CPU engine. A tenant that forges another tenant's salt — on the classic
path or on one the old allow-list missed (/invocations) — gets no cached tokens from the card;
the owner gets its prefix back from the card after vLLM's own prefix cache was reset."""

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

from xkv_vllm_connector.tenant_middleware import tenant_salt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
SECRET = "e2e-tenant-secret-0123456789abcdef"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url, body=None, tenant=None, timeout=60):
    data = json.dumps(body).encode() if body is not None else b""
    headers = {"Content-Type": "application/json", **({"x-tenant-id": tenant} if tenant else {})}
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def test_forged_salts_get_nothing_from_the_card(models, gateway, tmp_path):
    _, gw_port = gateway
    port = _free_port()
    ktc = {"kv_connector": "FusIOnXConnector",
           "kv_connector_module_path": "xkv_vllm_connector.fusionx_connector",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"xkv_gateway_port": gw_port, "chunk_size": 64,
                                         "lookup_timeout_ms": 2000, "require_cache_salt": True}}
    env = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_SERVER_DEV_MODE="1", VLLM_CACHE_ROOT=VLLM_CACHE, VLLM_USE_V2_MODEL_RUNNER="0",
               XKV_TENANT_SECRET=SECRET,
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("XKV_GATEWAY_HOSTNAME", None)
    log_path = Path(tmp_path, "server.log")
    with open(log_path, "w") as log:
        srv = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
             models["llama"], "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
             "--block-size", "32", "--max-model-len", "1024", "--enforce-eager",
             "--enable-prefix-caching", "--enable-prompt-tokens-details",
             "--middleware", "xkv_vllm_connector.tenant_middleware.TenantSaltMiddleware",
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
        prompt = [(5 + 29 * i) % 1000 + 4 for i in range(290)]
        body = {"model": models["llama"], "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}

        def cached(r):
            return r["usage"]["prompt_tokens_details"]["cached_tokens"]

        first = _post(base + "/v1/completions", body, tenant="acme")
        _post(base + "/reset_prefix_cache")
        forged = {**body, "cache_salt": tenant_salt(SECRET.encode(), "acme"),
                  "kv_transfer_params": {"xkv_store": True}}
        # a fresh tenant per path: a hit could then only be acme's objects
        for path, tenant in (("/v1/completions", "globex"), ("/invocations", "initech")):
            got = _post(base + path, forged, tenant=tenant)
            assert cached(got) == 0, (path, got["usage"])
            _post(base + "/reset_prefix_cache")
        again = _post(base + "/v1/completions", body, tenant="acme")
        assert cached(first) == 0 and cached(again) == 256  # from the card: caching works
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        os.killpg(srv.pid, signal.SIGTERM)
        try:
            srv.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(srv.pid, signal.SIGKILL)
            srv.wait()
