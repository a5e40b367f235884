"""How the HTTP layer runs: where it listens, who may call it, what it calls the model.

Kept apart from `strata.config.EngineConfig` so that one JSON file can hold both kinds of option and
`strata serve` can tell them apart by field name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless the user asks for more
    port: int = 8000
    # When set, every API route, /metrics and /slots need it, as `Authorization: Bearer <key>` or
    # `X-Api-Key: <key>`; /health and the web page's files stay open.
    api_key: str | None = None
    metrics_public: bool = False  # /metrics answers without the key even when one is set
    model_name: str | None = None  # the name clients send as `model`; None: the model's file or directory name
    # llama-server's: the model's names, comma-separated; /models lists them as `aliases` and its id is the
    # first in alphabetical order, as llama-server's. An alternative to model_name (not both).
    alias: str | None = None
    tags: str | None = None  # llama-server's: the model's tags, comma-separated (informational, in /models)
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
    # The shortest time between two writes of a streamed response while it decodes, in ms: its first and
    # last tokens go at once, those between arrive together (each still an event of its own). None: 16 for
    # an engine on the CPU, whose cores the server's thread and its clients share, else 0 (every step).
    stream_interval_ms: float | None = None
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
    # The most tokens a request that sets no limit of its own may generate (-1: the rest of the context),
    # as llama-server's --n-predict.
    n_predict: int = -1
    # The temperature of requests that send none, as llama-server's --temp. None: OpenAI's 1.0 on the
    # OpenAI, Anthropic and Responses routes, llama.cpp's 0.8 on the native /completion.
    temp: float | None = None
    # Whether chat templates think unless a request says otherwise (its `chat_template_kwargs`
    # `enable_thinking`): "off" renders them with thinking turned off; "on" and "auto" with it on.
    reasoning: Literal["on", "off", "auto"] = "auto"
    metrics: bool = True  # serve GET /metrics (--no-metrics: 501)
    # Every chat completion answered whole carries llama-server's `__verbose` (the prompt as the model
    # read it, the output); a request's `verbose` field turns it on or off for that request.
    verbose: bool = False

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
        if self.stream_interval_ms is not None and not self.stream_interval_ms >= 0:
            raise ValueError("stream_interval_ms must be >= 0")
        if self.alias is not None and not self.aliases:
            raise ValueError("alias must name at least one name")
        if self.alias is not None and self.model_name is not None:
            raise ValueError("give alias or model_name, not both")
        if self.chat_template is not None and self.chat_template_file is not None:
            raise ValueError("give chat_template or chat_template_file, not both")
        if self.temp is not None and not 0.0 <= self.temp <= 2.0:
            raise ValueError("temp must be in [0, 2]")
        if self.n_predict < -1 or self.n_predict == 0:
            raise ValueError("n_predict must be -1 (no limit) or >= 1")
        if self.max_queue < 0 or self.max_connections < 1:
            raise ValueError("max_queue must be >= 0 and max_connections >= 1")

    @property
    def aliases(self) -> list[str]:
        return sorted({a.strip() for a in (self.alias or "").split(",") if a.strip()})

    @property
    def tag_list(self) -> list[str]:
        return sorted({t.strip() for t in (self.tags or "").split(",") if t.strip()})

    @property
    def hosts(self) -> list[str]:
        """The addresses to bind: `host` may name several, comma-separated (llama-server's `--host a,b`)."""
        return [h.strip() for h in self.host.split(",") if h.strip()] or [self.host]

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
        elif any(h in ("0.0.0.0", "::", "") for h in self.hosts):
            return True
        else:
            allowed = {h.lower() for h in self.hosts} | {"localhost", "127.0.0.1", "::1", "[::1]"}
        host = host.strip().lower()
        if "*" in allowed or not host:  # no Host at all (HTTP/1.0) names no other site either
            return True
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 or host.startswith("[") and "]:" in host else host
        return host in allowed or name in allowed or name.strip("[]") in allowed
