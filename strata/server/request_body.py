"""A request's JSON body, read no further than the server's `max_body_bytes` (413 beyond), parsed (400
unless it is a JSON object nested at most MAX_JSON_DEPTH deep whose strings are valid Unicode) and
validated against a `strata.server.protocol` model (400 naming the field, or the unsupported
parameter). A large body is parsed off the event loop."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from strata.server import protocol as P
from strata.server.errors import APIError, validation_error

# Deeper than any schema or tool definition needs; deep nesting costs recursion everywhere it is read.
MAX_JSON_DEPTH = 64
PARSE_INLINE_BYTES = 1 << 16  # smaller bodies are parsed on the event loop


def check_json(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raises APIError (400) if `value` nests deeper than `max_depth` or holds a lone surrogate (a
    JSON `\\ud800` escape is valid JSON but not text: no tokenizer or encoder takes it)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            items = list(v.keys()) + list(v.values())
        elif isinstance(v, list):
            items = v
        else:
            continue
        if depth > max_depth:
            raise APIError(400, f"the request body nests deeper than {max_depth} levels", code="invalid_json")
        for x in items:
            if isinstance(x, str):
                if not x.isascii():
                    try:
                        x.encode("utf-8")
                    except UnicodeEncodeError:
                        raise APIError(400, "the request body holds a lone surrogate (a \\ud800-\\udfff escape "
                                            "without its pair): not valid Unicode text", code="invalid_json") from None
            elif isinstance(x, (dict, list)):
                stack.append((x, depth + 1))


def parse_json(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    check_json(data)
    return data


async def read_body(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The body, at most `limit` bytes (413 beyond), within `timeout` seconds (408 beyond)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    parts, size = [], 0

    async def read() -> None:
        nonlocal size
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
            parts.append(part)

    try:
        async with asyncio.timeout(timeout or None):
            await read()
    except TimeoutError:
        raise APIError(408, f"the request body took longer than {timeout:g} s to arrive (--body-timeout)",
                       code="request_timeout", headers={"Connection": "close"}) from None
    return b"".join(parts)


async def read_json(request: Request, limit: int, timeout: float | None = None) -> dict:
    raw = await read_body(request, limit, timeout)
    return parse_json(raw) if len(raw) <= PARSE_INLINE_BYTES else await run_in_threadpool(parse_json, raw)


def validate_body(model: type[P.RequestModel], data: dict) -> Any:
    try:
        body = model.model_validate(data)
        body.check_supported()
    except ValidationError as e:
        raise validation_error(e) from None
    except P.Unsupported as e:
        raise APIError(400, str(e), param=e.param, code="unsupported_parameter") from None
    return body


async def parse_body(request: Request, model: type[P.RequestModel], limit: int, timeout: float | None = None) -> Any:
    return validate_body(model, await read_json(request, limit, timeout))
