"""The HTTP server over an `AsyncEngine`: `build_app(engine, server_cfg)` is the FastAPI app serving
OpenAI's API (`strata.server.openai_routes`, `strata.server.responses_api`), llama-server's native API
(`strata.server.llama_routes`), Anthropic's Messages API (`strata.server.anthropic`), monitoring
(`strata.server.monitoring_routes`) and the web page (`strata.web`).

Every failure a client can cause is answered with an error body and a 4xx status
(`strata.server.errors`); nothing a request carries can stop the server. Every request first passes
`strata.server.guard` (Host header, JSON content type, shutdown); CORS headers only for the origins
`--cors-origins` names (`strata.server.cors`).
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from strata.version import __version__
from strata.server.anthropic import anthropic_router
from strata.server.config import ServerConfig
from strata.server.cors import CORSGuard
from strata.server.errors import add_error_handlers
from strata.server.guard import RequestGuard
from strata.server.llama_routes import native_routers
from strata.server.metrics import RequestCounter
from strata.server.monitoring_routes import monitoring_router
from strata.server.openai_routes import openai_routers
from strata.server.responses_api import responses_routers
from strata.server.service import ModelService
from strata.web import mount_webui


def build_app(engine: Any, server_cfg: ServerConfig | None = None, *, own_engine: bool = False) -> FastAPI:
    """The FastAPI app for `engine` (an `AsyncEngine`, or anything with its attributes and methods);
    `app.state.strata` is its `ModelService`.

    With `own_engine`, the app shuts the engine down when the server stops: uvicorn re-raises the
    stopping signal on its way out, so code after `uvicorn.Server.run()` may never get to.
    """
    s = ModelService(engine, server_cfg or ServerConfig())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        s.close()
        if own_engine:
            await run_in_threadpool(engine.shutdown)

    app = FastAPI(title="Strata", version=__version__, openapi_url=None, docs_url=None, redoc_url=None,
                  lifespan=lifespan)
    app.state.strata = s
    add_error_handlers(app)
    app.include_router(anthropic_router(s))
    for router in [*openai_routers(s), *native_routers(s), *responses_routers(s)]:
        app.include_router(router)
    app.include_router(monitoring_router(s))
    if s.cfg.webui:
        mount_webui(app)
    app.add_middleware(RequestGuard, cfg=s.cfg, draining=lambda: s.draining)
    app.add_middleware(RequestCounter, metrics=s.metrics)
    app.add_middleware(CORSGuard, cfg=s.cfg)  # outermost: refusals by the guard carry CORS headers too
    return app
