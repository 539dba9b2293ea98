"""The tenant front end: salts from the authenticated tenant, client values never trusted."""

import asyncio
import json

import pytest

from xkv_vllm_connector.tenant_middleware import TenantSaltMiddleware, rewrite, tenant_salt

SECRET = b"0123456789abcdef0123456789abcdef"


def test_salt_shape_and_separation():
    a, b = tenant_salt(SECRET, "acme"), tenant_salt(SECRET, "globex")
    assert len(a) == 43 and a != b and "/" not in a and "=" not in a
    assert tenant_salt(SECRET, "acme") == a and tenant_salt(b"x" * 32, "acme") != a


def test_rewrite_overwrites_and_strips():
    body = {"prompt": "hi", "cache_salt": "victim-salt",
            "kv_transfer_params": {"xkv_store": False, "remote_host": "evil"},
            "vllm_xargs": {"kv_transfer_params": "x", "k": 1}}
    out = rewrite(body, "acme", SECRET)
    assert out["cache_salt"] == tenant_salt(SECRET, "acme")
    assert out["kv_transfer_params"] == {"xkv_store": False}
    assert out["vllm_xargs"] == {"k": 1}
    out = rewrite({"cache_salt": "x", "kv_transfer_params": {"xkv_store": True}}, None, SECRET)
    assert "cache_salt" not in out and "kv_transfer_params" not in out


def _call(mw, path, body, headers):
    seen = {}

    async def app(scope, receive, send):
        msg = await receive()
        seen["body"] = json.loads(msg["body"])
        seen["headers"] = dict(scope["headers"])

    async def run():
        msgs = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

        async def receive():
            return msgs.pop(0) if msgs else {"type": "http.disconnect"}

        scope = {"type": "http", "method": "POST", "path": path,
                 "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
        await TenantSaltMiddleware(app, secret=SECRET)(scope, receive, lambda m: None)

    asyncio.run(run())
    return seen


def test_middleware_rewrites_generation_requests():
    seen = _call(None, "/v1/completions", {"prompt": "x", "cache_salt": "forged"},
                 {"x-tenant-id": "acme", "content-length": "40"})
    assert seen["body"]["cache_salt"] == tenant_salt(SECRET, "acme")
    assert seen["headers"][b"content-length"] == str(len(json.dumps(seen["body"]))).encode()


def test_weak_secret_refused():
    with pytest.raises(ValueError, match="XKV_TENANT_SECRET"):
        TenantSaltMiddleware(lambda *a: None, secret=b"short")
