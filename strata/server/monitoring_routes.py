"""`/health` (503 `{"status": "draining"}` once shutdown begins; open to all), `/metrics` (Prometheus,
Strata's `strata_*` families and llama-server's `llamacpp:*` ones; 501 with `--no-metrics`),
`/strata/slots` (Strata's slot document, read by the TUI and the web page) and `/slots` (llama-server's
shape; 501 with `--no-slots`). With an API key set, all but /health need it (`--metrics-public` opens
/metrics), since they show what clients are doing."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from strata.server.errors import APIError
from strata.server.metrics import CONTENT_TYPE, llama_slots_json, slots_json
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
        if not s.cfg.metrics:
            raise APIError(501, "This server does not serve metrics (--no-metrics).", type_="not_supported_error",
                           code="not_supported")
        response = Response(s.metrics.render(), media_type=CONTENT_TYPE)
        # llama-server's header, spelled as it spells it (Starlette would lower-case a name given in `headers`).
        response.raw_headers.append((b"Process-Start-Time-Unix", str(s.metrics.start_time).encode()))
        return response

    async def strata_slots() -> Response:
        return Response(json.dumps(slots_json(s.engine.stats(), s.model_name, rejected=s.rejected_total)),
                        media_type="application/json")

    async def slots() -> Response:
        if not s.cfg.slots:
            raise APIError(501, "This server does not support slots endpoint (--no-slots).",
                           type_="not_supported_error", code="not_supported")
        body = llama_slots_json(s.engine.stats(), s.max_model_len, s.speculative)
        return Response(json.dumps(body), media_type="application/json")

    async def metrics_auth(request: Request) -> None:
        if not s.cfg.metrics_public:
            await s.authorize(request)

    router = APIRouter()
    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/metrics", metrics, methods=["GET"], dependencies=[Depends(metrics_auth)])
    keyed = [Depends(s.authorize)]
    router.add_api_route("/strata/slots", strata_slots, methods=["GET"], dependencies=keyed)
    router.add_api_route("/slots", slots, methods=["GET"], dependencies=keyed)
    return router
