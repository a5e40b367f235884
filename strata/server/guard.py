"""What every HTTP request passes before a route sees it (an ASGI middleware):

- its `Host` header must name this server (`ServerConfig.host_allowed`): a web page on another site
  cannot reach a keyless server on localhost through DNS rebinding (400);
- a POST (every POST route takes JSON) must say `Content-Type: application/json`: a cross-site form or
  `text/plain` POST, which a browser sends without asking, never starts generation (415);
- while the server drains for shutdown, API requests are answered 503 at once (with `Retry-After`
  and `Connection: close`); /health, /metrics and /slots still answer.

Errors have OpenAI's shape, or Anthropic's on `/v1/messages`.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from strata.server.config import ServerConfig

# Every POST route takes JSON; these are the API's routes (llama-server's unprefixed ones included).
API_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/completion", "/chat/completions", "/apply-template",
                "/props", "/models", "/infill", "/embedding", "/responses")


def _error_body(path: str, status: int, message: str, code: str) -> bytes:
    if path == "/v1/messages":
        kind = {400: "invalid_request_error", 415: "invalid_request_error", 503: "overloaded_error"}[status]
        return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


class RequestGuard:
    """ASGI middleware applying the checks above; `draining()` says whether shutdown has begun."""

    def __init__(self, app: Any, cfg: ServerConfig, draining: Callable[[], bool]):
        self.app, self.cfg, self.draining = app, cfg, draining

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        path, method = scope.get("path", ""), scope.get("method", "")
        refusal = None
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.cfg.host_allowed(host):
            refusal = (400, f"the Host header {host[:100]!r} does not name this server (--allowed-hosts)",
                       "invalid_host", {})
        elif self.draining() and path.startswith(API_PREFIXES):
            refusal = (503, "the server is shutting down", "server_shutting_down",
                       {b"retry-after": b"5", b"connection": b"close"})
        elif method == "POST":
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind != b"application/json":
                refusal = (415, "send the request body as JSON with `Content-Type: application/json`",
                           "unsupported_media_type", {})
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, message, code, extra = refusal
        body = _error_body(path, status, message, code)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *extra.items()]})
        await send({"type": "http.response.body", "body": body})
