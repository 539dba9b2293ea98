"""A working front end for tenant isolation: an ASGI middleware for vLLM's OpenAI server.

    XKV_TENANT_SECRET=$(openssl rand -hex 32) \\
    python -m vllm.entrypoints.openai.api_server ... \\
        --middleware xkv_vllm_connector.tenant_middleware.TenantSaltMiddleware

For every JSON POST to the generation endpoints it

* sets ``cache_salt`` to ``base64url(HMAC-SHA256(secret, tenant))`` (43 characters), where the
  tenant is the ``x-tenant-id`` header (``XKV_TENANT_HEADER`` to rename) — a client-supplied
  ``cache_salt`` is always overwritten, and a request without the header loses its salt (with
  ``require_cache_salt`` it then stays off the card);
* keeps ``kv_transfer_params`` only as the allow-listed opt-out ``{"xkv_store": false}`` and
  drops every other client-supplied key (also from ``vllm_xargs``).

The tenant header must come from an authenticating proxy in front of vLLM, which removes any
client-supplied copy: this middleware trusts it. See docs/tenant-isolation.md.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os

PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
MAX_BODY = 64 << 20


def tenant_salt(secret: bytes, tenant: str) -> str:
    """43-character URL-safe salt (vLLM rejects '/' in cache_salt, so not standard base64)."""
    mac = hmac.new(secret, tenant.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def rewrite(body: dict, tenant: str | None, secret: bytes) -> dict:
    """The request body as vLLM must see it (pure function, tested on its own)."""
    body = dict(body)
    body.pop("cache_salt", None)
    if tenant:
        body["cache_salt"] = tenant_salt(secret, tenant)
    ktp = body.pop("kv_transfer_params", None)
    if isinstance(ktp, dict) and ktp.get("xkv_store") is False:
        body["kv_transfer_params"] = {"xkv_store": False}
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and "kv_transfer_params" in xargs:
        body["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_transfer_params"}
    return body


class TenantSaltMiddleware:
    def __init__(self, app, secret: bytes | None = None, header: str | None = None):
        self.app = app
        raw = secret if secret is not None else os.environ.get("XKV_TENANT_SECRET", "").encode()
        if len(raw) < 16:
            raise ValueError(
                "TenantSaltMiddleware needs a server secret of >= 16 bytes in XKV_TENANT_SECRET "
                "(e.g. `openssl rand -hex 32`); salts derived from a guessable secret can be forged"
            )
        self.secret = raw
        self.header = (header or os.environ.get("XKV_TENANT_HEADER", "x-tenant-id")).lower()

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get(
            "path"
        ) not in PATHS:
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return await self.app(scope, _replay([msg], receive), send)
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > MAX_BODY:
                return await _reject(send, 413, "request body too large")
            if not msg.get("more_body"):
                break
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            body = json.loads(b"".join(chunks) or b"{}")
        except ValueError:
            return await _reject(send, 400, "body is not JSON")
        if not isinstance(body, dict):
            return await _reject(send, 400, "body is not a JSON object")
        data = json.dumps(rewrite(body, headers.get(self.header), self.secret)).encode()
        hdrs = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        hdrs.append((b"content-length", str(len(data)).encode()))
        scope = dict(scope, headers=hdrs)
        first = {"type": "http.request", "body": data, "more_body": False}
        await self.app(scope, _replay([first], receive), send)


def _replay(messages, then):
    """Hand out ``messages``, then the real ``receive`` (so disconnects are still seen)."""
    it = iter(messages)

    async def receive():
        for msg in it:
            return msg
        return await then()

    return receive


async def _reject(send, status: int, text: str) -> None:
    body = json.dumps({"error": text}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
