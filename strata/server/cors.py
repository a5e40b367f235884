"""Cross-origin reads (CORS), only for the origins `--cors-origins` names.

Off by default: a browser lets any web page send requests to a server on localhost, and only CORS
decides whether that page may read the answer. Without an API key, answering every origin (as
llama-server does by default) would let any site a user visits drive and read their local model.
A preflight (`OPTIONS` with `Access-Control-Request-Method`) is answered 200 either way; the allowing
headers come only for a listed origin, so a browser refuses the others.
"""

from __future__ import annotations

from typing import Any, Callable

from strata.server.config import ServerConfig

ALLOW_METHODS = b"GET, POST, DELETE, OPTIONS"


class CORSGuard:
    """ASGI middleware: preflights answered here; responses to a listed origin carry its headers."""

    def __init__(self, app: Any, cfg: ServerConfig):
        self.app, self.cfg = app, cfg

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        origin = headers.get(b"origin", b"").decode("latin-1")
        allowed = self.cfg.cors_allows(origin)
        # Spelled as llama-server spells them: HTTP names are case-blind, but some clients read them from
        # a plain dict.
        extra = [(b"Access-Control-Allow-Origin", origin.encode("latin-1")),
                 (b"Access-Control-Allow-Credentials", b"true"), (b"Vary", b"Origin")] if allowed else []
        if scope.get("method") == "OPTIONS" and b"access-control-request-method" in headers:
            if allowed:
                extra += [(b"Access-Control-Allow-Methods", ALLOW_METHODS), (b"Access-Control-Allow-Headers", b"*"),
                          (b"Access-Control-Max-Age", b"600")]
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"0"), *extra]})
            await send({"type": "http.response.body", "body": b""})
            return
        if not allowed:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors)
