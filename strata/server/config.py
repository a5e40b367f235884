"""How the HTTP layer runs: where it listens, who may call it, what it calls the model.

Kept apart from `strata.config.EngineConfig` so that one JSON file can hold both kinds of option and
`strata serve` can tell them apart by field name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless the user asks for more
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <api_key>`
    model_name: str | None = None  # the name clients send as `model`; None: the engine's own name
    log_level: str = "info"
    # Seconds uvicorn waits for open streams on shutdown before dropping them.
    graceful_shutdown_s: float = 5.0
    # Largest request body read; a context's worth of token ids as JSON is a few MiB.
    max_body_bytes: int = 32 * 2**20
    webui: bool = True  # serve the web page at / (--no-webui turns it off)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to turn authentication off)")
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError(f"unknown log_level {self.log_level!r}")
        if self.graceful_shutdown_s < 0:
            raise ValueError("graceful_shutdown_s must be >= 0")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
