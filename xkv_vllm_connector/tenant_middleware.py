"""A working front end for tenant isolation: an ASGI middleware for vLLM's OpenAI server.

    XKV_TENANT_SECRET=$(openssl rand -hex 32) \\
    python -m vllm.entrypoints.openai.api_server ... \\
        --middleware xkv_vllm_connector.tenant_middleware.TenantSaltMiddleware

It denies by default: it does not know (or trust) vLLM's route table, so for every request that
can carry a body — any HTTP method but GET/HEAD/OPTIONS, whatever the path and ``root_path`` —

* a JSON object body is rewritten: ``cache_salt`` and ``kv_transfer_params`` are removed at every
  depth (vLLM also reads them from ``vllm_xargs`` and ``sampling_params.extra_args``), then
  ``cache_salt`` is set to ``base64url(HMAC-SHA256(secret, tenant))`` (43 characters) when the
  ``x-tenant-id`` header names a tenant (``XKV_TENANT_HEADER`` to rename), and the allow-listed
  opt-out ``{"kv_transfer_params": {"xkv_store": false}}`` is kept at the top level; the body is
  handed on as ``application/json``;
* an empty body is handed on unchanged (nothing in it to forge);
* anything else — not JSON, not an object, multipart forms (audio uploads), bodies over 64 MiB —
  is refused (400/413/415) before it reaches vLLM; WebSocket connections are closed (1008).

The tenant header must come from an authenticating proxy in front of vLLM, which removes any
client-supplied copy: this middleware trusts it. A request without it loses its salt (with
``require_cache_salt`` it then stays off the card). See docs/tenant-isolation.md.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os

MAX_BODY = 64 << 20
#: Deepest JSON nesting accepted (objects and arrays); deeper bodies get a 400 before anything
#: recurses over them (Python's recursion limit is ~1000 frames, and the server's own frames
#: come first). Real request bodies (messages, tool schemas) nest a few tens deep.
MAX_JSON_DEPTH = 128
#: Methods that carry no body; everything else is inspected.
_BODILESS = frozenset({"GET", "HEAD", "OPTIONS"})
_STRIP = frozenset({"cache_salt", "kv_transfer_params"})


def tenant_salt(secret: bytes, tenant: str) -> str:
    """43-character URL-safe salt (vLLM rejects '/' in cache_salt, so not standard base64)."""
    mac = hmac.new(secret, tenant.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def _depth_ok(value, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests at most ``limit`` objects/arrays deep; iterative,
    O(values)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        if d > limit:
            return False
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return True


def _strip(value):
    """``value`` with every ``cache_salt`` / ``kv_transfer_params`` key removed, at any depth."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in _STRIP}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def rewrite(body: dict, tenant: str | None, secret: bytes) -> dict:
    """The request body as vLLM must see it (pure function, tested on its own)."""
    ktp = body.get("kv_transfer_params")
    out = _strip(body)
    if tenant:
        out["cache_salt"] = tenant_salt(secret, tenant)
    if isinstance(ktp, dict) and ktp.get("xkv_store") is False:
        out["kv_transfer_params"] = {"xkv_store": False}
    return out


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
        kind = scope.get("type")
        if kind == "websocket":  # messages we cannot vet: refuse the connection
            await receive()  # websocket.connect
            return await send({"type": "websocket.close", "code": 1008})
        if kind != "http" or scope.get("method", "GET").upper() in _BODILESS:
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # client went away before the body was complete
                return await self.app(scope, _replay([msg], receive), send)
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > MAX_BODY:
                return await _reject(send, 413, "request body too large")
            if not msg.get("more_body"):
                break
        raw = b"".join(chunks)
        if not raw.strip():
            first = {"type": "http.request", "body": raw, "more_body": False}
            return await self.app(scope, _replay([first], receive), send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if headers.get("content-type", "").lower().startswith("multipart/"):
            return await _reject(send, 415, "multipart bodies are refused by the tenant "
                                            "middleware (it cannot vet them)")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return await _reject(send, 400, "body is not JSON")
        except RecursionError:
            return await _reject(send, 400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        if not isinstance(body, dict):
            return await _reject(send, 400, "body is not a JSON object")
        if not _depth_ok(body, MAX_JSON_DEPTH):
            return await _reject(send, 400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        data = json.dumps(rewrite(body, headers.get(self.header), self.secret)).encode()
        hdrs = [(k, v) for k, v in scope["headers"]
                if k.lower() not in (b"content-length", b"content-type", b"transfer-encoding")]
        hdrs += [(b"content-type", b"application/json"),
                 (b"content-length", str(len(data)).encode())]
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
