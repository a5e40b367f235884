"""`/health` (503 `{"status": "draining"}` once shutdown begins), `/metrics` (Prometheus) and `/slots`
(JSON): open to whoever can reach the server, with no API key, so /slots answers exactly whoever may
read /metrics."""

from __future__ import annotations

import json

from fastapi import APIRouter
from fastapi.responses import Response

from strata.server.errors import APIError
from strata.server.metrics import CONTENT_TYPE, slots_json
from strata.server.service import ModelService


def monitoring_router(s: ModelService) -> APIRouter:
    async def health() -> Response:
        if s.draining:
            return Response('{"status":"draining"}', status_code=503, media_type="application/json",
                            headers={"Retry-After": "5", "Connection": "close"})
        try:
            s.engine.stats()
        except Exception as e:
            return APIError(503, f"the engine is not healthy: {e}", type_="server_error").response()
        return Response('{"status":"ok"}', media_type="application/json")

    async def metrics() -> Response:
        return Response(s.metrics.render(), media_type=CONTENT_TYPE)

    async def slots() -> Response:
        return Response(json.dumps(slots_json(s.engine.stats(), s.model_name, rejected=s.rejected_total)),
                        media_type="application/json")

    router = APIRouter()
    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/metrics", metrics, methods=["GET"])
    router.add_api_route("/slots", slots, methods=["GET"])
    return router
