"""The HTTP layer: `build_app(engine, server_cfg)` (`strata.server.app`) and `strata serve`
(`strata.server.serve`).

`service` turns a request into engine requests; `jobs` runs them for one response (whole or streamed);
`openai_routes` and `anthropic` speak the two APIs (`protocol` and `responses` are OpenAI's bodies);
`errors` and `request_body` are what every route shares. Importing this package does not import
FastAPI; `strata.server.app` does.
"""

from strata.server.config import ServerConfig

__all__ = ["ServerConfig"]
