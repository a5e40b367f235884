"""A request's JSON body, read no further than the server's `max_body_bytes` (413 beyond), parsed (400
unless it is a JSON object) and validated against a `strata.server.protocol` model (400 naming the
field, or the unsupported parameter)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from strata.server import protocol as P
from strata.server.errors import APIError, validation_error


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        parts.append(part)
    return b"".join(parts)


async def read_json(request: Request, limit: int) -> dict:
    raw = await read_body(request, limit)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return data


def validate_body(model: type[P.RequestModel], data: dict) -> Any:
    try:
        body = model.model_validate(data)
        body.check_supported()
    except ValidationError as e:
        raise validation_error(e) from None
    except P.Unsupported as e:
        raise APIError(400, str(e), param=e.param, code="unsupported_parameter") from None
    return body


async def parse_body(request: Request, model: type[P.RequestModel], limit: int) -> Any:
    return validate_body(model, await read_json(request, limit))
