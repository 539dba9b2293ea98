"""Tenant isolation end to end (issue 14): vLLM's OpenAI server with TenantSaltMiddleware and
FusIOnXConnector on the CPU engine. A tenant that forges another tenant's salt — on the classic
path or on one the old allow-list missed (/invocations) — gets no cached tokens from the card;
the owner gets its prefix back from the card after vLLM's own prefix cache was reset."""

from pathlib import Path

import pytest
from openai_server import openai_server, post

from xkv_vllm_connector.tenant_middleware import tenant_salt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
SECRET = "e2e-tenant-secret-0123456789abcdef"


def test_forged_salts_get_nothing_from_the_card(models, gateway, tmp_path):
    _, gw_port = gateway
    log_path = Path(tmp_path, "server.log")
    with openai_server(models["llama"], gw_port, log_path,
                       extra_config={"require_cache_salt": True},
                       args=("--middleware",
                             "xkv_vllm_connector.tenant_middleware.TenantSaltMiddleware"),
                       env={"XKV_TENANT_SECRET": SECRET},
                       drop_env=("XKV_GATEWAY_HOSTNAME",)) as base:
        prompt = [(5 + 29 * i) % 1000 + 4 for i in range(290)]
        body = {"model": models["llama"], "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}

        def cached(r):
            return r["usage"]["prompt_tokens_details"]["cached_tokens"]

        first = post(base + "/v1/completions", body, tenant="acme")
        post(base + "/reset_prefix_cache")
        forged = {**body, "cache_salt": tenant_salt(SECRET.encode(), "acme"),
                  "kv_transfer_params": {"xkv_store": True}}
        # a fresh tenant per path: a hit could then only be acme's objects
        for path, tenant in (("/v1/completions", "globex"), ("/invocations", "initech")):
            got = post(base + path, forged, tenant=tenant)
            assert cached(got) == 0, (path, got["usage"])
            post(base + "/reset_prefix_cache")
        again = post(base + "/v1/completions", body, tenant="acme")
        assert cached(first) == 0 and cached(again) == 256  # from the card: caching works
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
