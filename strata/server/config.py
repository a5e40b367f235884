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
    # When set, every API route, /metrics and /slots need it, as `Authorization: Bearer <key>` or
    # `X-Api-Key: <key>`; /health and the web page's files stay open.
    api_key: str | None = None
    metrics_public: bool = False  # /metrics answers without the key even when one is set
    model_name: str | None = None  # the name clients send as `model`; None: the model's file or directory name
    log_level: str = "info"
    # On SIGTERM or SIGINT, seconds requests in service may take to finish; then each ends with an error.
    shutdown_timeout: float = 30.0
    # Largest request body read; a context's worth of token ids as JSON is a few MiB.
    max_body_bytes: int = 32 * 2**20
    webui: bool = True  # serve the web page at / (--no-webui turns it off)
    # Engine requests that may wait for a slot; more are refused with 429 and Retry-After.
    max_queue: int = 256
    # Open connections; beyond, the oldest idle one is closed for a new one, or the new one gets 503.
    # Also kept below the process's open-file limit.
    max_connections: int = 1000
    header_timeout: float = 10.0  # seconds a connection may take to send a request's headers
    body_timeout: float = 60.0  # seconds a request may take to send its body
    keep_alive_timeout: float = 5.0  # seconds an idle connection is kept open between requests
    # Host header values accepted (comma-separated; "*": any). None: the bound address and the
    # localhost names, or any when bound to all addresses. Guards a keyless local server against
    # DNS rebinding.
    allowed_hosts: str | None = None
    # Origins whose web pages may read this server's answers (CORS), comma-separated: full origins
    # (`https://app.example`), `localhost` (any port of localhost, 127.0.0.1 or [::1]) or `*`. None:
    # no CORS headers, so no page on another origin can read a keyless server on localhost.
    cors_origins: str | None = None
    slots: bool = True  # llama-server's GET /slots (--no-slots: 501)
    # A chat template to use instead of the model's: a built-in name (chatml, llama3, ...), a file, or
    # the template's text.
    chat_template: str | None = None
    chat_template_file: str | None = None  # a Jinja file with the chat template to use instead of the model's
    # The most tokens a request may generate (-1: no limit beyond the context); a request asking for
    # more gets this many, as llama-server's --n-predict.
    n_predict: int = -1

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to turn authentication off)")
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError(f"unknown log_level {self.log_level!r}")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        for name in ("shutdown_timeout", "header_timeout", "body_timeout", "keep_alive_timeout"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 (seconds)")
        if self.chat_template is not None and self.chat_template_file is not None:
            raise ValueError("give chat_template or chat_template_file, not both")
        if self.n_predict < -1 or self.n_predict == 0:
            raise ValueError("n_predict must be -1 (no limit) or >= 1")
        if self.max_queue < 0 or self.max_connections < 1:
            raise ValueError("max_queue must be >= 0 and max_connections >= 1")

    def cors_allows(self, origin: str) -> bool:
        """Whether a page from `origin` may read this server's answers (see `cors_origins`)."""
        if not self.cors_origins or not origin:
            return False
        allowed = {o.strip().rstrip("/").lower() for o in self.cors_origins.split(",") if o.strip()}
        origin = origin.strip().rstrip("/").lower()
        if "*" in allowed or origin in allowed:
            return True
        if "localhost" in allowed:
            scheme, sep, rest = origin.partition("://")
            if sep and scheme in ("http", "https"):
                host = rest[1:].partition("]")[0] if rest.startswith("[") else rest.partition(":")[0]
                port = rest.partition("]")[2] if rest.startswith("[") else rest.partition(host)[2]
                return host in ("localhost", "127.0.0.1", "::1") and (not port or port[1:].isdigit() and port[0] == ":")
        return False

    def host_allowed(self, host: str) -> bool:
        """Whether a request's Host header (name or address, with or without a port) is one this server
        answers to."""
        if self.allowed_hosts is not None:
            allowed = {h.strip().lower() for h in self.allowed_hosts.split(",") if h.strip()}
        elif self.host in ("0.0.0.0", "::", ""):
            return True
        else:
            allowed = {self.host.lower(), "localhost", "127.0.0.1", "::1", "[::1]"}
        host = host.strip().lower()
        if "*" in allowed or not host:  # no Host at all (HTTP/1.0) names no other site either
            return True
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 or host.startswith("[") and "]:" in host else host
        return host in allowed or name in allowed or name.strip("[]") in allowed
