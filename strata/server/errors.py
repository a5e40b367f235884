"""Every failure a client can cause, answered with OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` and a 4xx status (5xx for the server's own).

Route code raises `APIError`; `add_error_handlers` turns it, FastAPI's own validation and HTTP errors,
and any other exception into that body, so nothing a request carries can stop the server.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata.server import protocol as P


class APIError(Exception):
    """`extra`: fields the error object carries beside OpenAI's four (llama-server's `n_ctx`, ...)."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None,
                 extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers, self.extra = headers, extra

    def body(self) -> dict[str, Any]:
        detail = P.ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return {"error": {**detail.model_dump(), **(self.extra or {})}}

    def response(self) -> Response:
        return Response(json.dumps(self.body(), separators=(",", ":"), ensure_ascii=False), status_code=self.status,
                        media_type="application/json", headers=self.headers)


def validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """A 400 naming the first few fields pydantic rejected; `param` is the first one's top-level field."""
    errors = e.errors()
    parts, param = [], None
    for err in errors[:3]:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
        if param is None and loc:
            param = loc[0]
    return APIError(400, "; ".join(parts) or "invalid request", param=param)


def add_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, e: Exception) -> Response:
        assert isinstance(e, APIError)
        return e.response()

    async def http_error(_: Request, e: Exception) -> Response:
        assert isinstance(e, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return APIError(e.status_code, str(e.detail), code=code, headers=getattr(e, "headers", None)).response()

    async def request_validation_error(_: Request, e: Exception) -> Response:
        assert isinstance(e, RequestValidationError)
        return validation_error(e).response()

    async def server_error(_: Request, e: Exception) -> Response:
        return APIError(500, f"internal server error: {type(e).__name__}: {e}", type_="server_error").response()

    handlers: dict[Any, Callable[..., Any]] = {
        APIError: api_error, StarletteHTTPException: http_error, RequestValidationError: request_validation_error,
        Exception: server_error,
    }
    for exc, fn in handlers.items():
        app.add_exception_handler(exc, fn)
