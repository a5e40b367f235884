"""The OpenAI-compatible HTTP layer: `build_app(engine, server_cfg)` and `strata serve`.

Importing this package does not import FastAPI; `strata.server.app` does.
"""

from strata.server.config import ServerConfig

__all__ = ["ServerConfig"]
