"""`strata serve`: its parser, the merge of config file and command line, loading the engine, uvicorn.

Shutdown (SIGTERM or SIGINT) drains: /health says "draining" and API requests get 503 at once while
the requests in service run to completion, for up to `--shutdown-timeout` seconds; then each one left
ends with an error (an SSE error event and the stream's end, or an error body). The exit status is 0
after a clean drain, 1 when requests had to be ended. A second signal ends them at once.

Precedence, lowest first: dataclass defaults, then the JSON file given by `--config`, then flags typed
on the command line. Engine flags are generated from `EngineConfig`'s fields (name, default, type) by
`strata.cli_args`, as for `strata generate` and `strata chat`, so a field the engine gains becomes a
flag and a config-file key without touching this module. The file's keys are `EngineConfig` and
`ServerConfig` field names (`kv_size` or `kv-size`); any other key is an error that names it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import socket
import sys
from typing import Any

from strata.cli_args import (ConfigFileError, add_engine_flags, add_field_flags, add_model_arg, expand_model_path,
                             run_command, strata_parser, typed_options)
from strata.cli_args import read_config_file as _read_config_file
from strata.config import EngineConfig
from strata.env import ENV
from strata.server.config import ServerConfig

__all__ = ["ConfigFileError", "add_serve_parser", "configure_parser", "read_config_file", "resolve", "serve",
           "cmd_serve", "main"]

# ServerConfig wins a name clash: its options are the ones this command is about.
SERVER_FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}
API_KEY_ENV = ENV.API_KEY.name

_SERVER_HELP = {
    "host": "address to bind (several: comma-separated); 0.0.0.0 exposes the server to the network",
    "port": "TCP port",
    "api_key": f"require `Authorization: Bearer KEY` on /v1/*; unset: ${API_KEY_ENV} if set",
    "model_name": "the model name clients send; unset: the model's file or directory name",
    "log_level": "uvicorn log level",
    "max_body_bytes": "largest request body accepted (413 beyond)",
}
log = logging.getLogger("strata")
# After the drain, the seconds uvicorn gives responses to write their last bytes before it drops them.
FLUSH_S = 5.0


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_model_arg(p)
    p.add_argument("--config", metavar="FILE", default=None,
                   help="JSON file of engine and server options; flags given here override it")
    add_field_flags(p.add_argument_group("server"), ServerConfig, help=_SERVER_HELP)
    add_engine_flags(p, skip=SERVER_FIELDS)
    return p


def read_config_file(path: str) -> dict[str, Any]:
    """The file's options as {field name: value}, checked against the fields' types."""
    return _read_config_file(path, [ServerConfig, EngineConfig])


def resolve(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """Defaults < config file < explicit flags (the parser leaves flags not typed out of `args`);
    the API key falls back to $STRATA_API_KEY."""
    merged = read_config_file(args.config) if getattr(args, "config", None) else {}
    merged.update(typed_options(args, ServerConfig))
    merged.update(typed_options(args, EngineConfig, skip=SERVER_FIELDS))
    # A key typed on the command line shows in `ps`; the environment keeps it out of sight.
    if "api_key" not in merged and ENV.API_KEY.get():
        merged["api_key"] = ENV.API_KEY.get()
    expand_model_path(merged)
    engine_kw = {k: v for k, v in merged.items() if k in EngineConfig.__dataclass_fields__ and k not in SERVER_FIELDS}
    server_kw = {k: v for k, v in merged.items() if k in SERVER_FIELDS}
    return EngineConfig(**engine_kw), ServerConfig(**server_kw)


def load_engine(cfg: EngineConfig) -> Any:
    from strata.engine.async_engine import AsyncEngine

    return AsyncEngine.from_config(cfg)


def uvicorn_config(app: Any, server_cfg: ServerConfig, **kw: Any) -> Any:
    """uvicorn's settings for `app`: the guarded h11 protocol (header deadline, connection cap under the
    open-file limit, `strata.server.connections`) and the keep-alive timeout."""
    import uvicorn

    from strata.server.connections import connection_budget, guarded_protocol

    cap, backlog = connection_budget(server_cfg.max_connections)
    options = dict(host=server_cfg.hosts[0], port=server_cfg.port, log_level=server_cfg.log_level,
                   http=guarded_protocol(cap, server_cfg.header_timeout), backlog=backlog,
                   timeout_keep_alive=server_cfg.keep_alive_timeout, timeout_graceful_shutdown=FLUSH_S)
    return uvicorn.Config(app, **{**options, **kw})


def bind_sockets(hosts: list[str], port: int) -> list[socket.socket]:
    """Listening sockets on each of `hosts` (names or addresses, IPv6 ones bare or in brackets)."""
    sockets = []
    try:
        for host in hosts:
            host = host.strip("[]")
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # "::" beside "0.0.0.0" would otherwise take the IPv4 port too
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, port))
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise ValueError(f"cannot listen on {host} port {port}: {e.strerror or e}") from None
    return sockets


def draining_server(config: Any, service: Any, timeout: float) -> Any:
    """A uvicorn server whose SIGTERM / SIGINT drain `service` (see the module docstring); `exit_code`
    is 0 after a clean drain, 1 when requests had to be ended."""
    import uvicorn

    from strata.server.connections import quiet_accept_errors

    class DrainingServer(uvicorn.Server):
        exit_code = 0
        signals = 0
        drain: asyncio.Task | None = None

        async def startup(self, sockets: Any = None) -> None:
            quiet_accept_errors(asyncio.get_running_loop())
            await super().startup(sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.started:  # still starting: uvicorn's own handling
                super().handle_exit(sig, frame)
                return
            self.signals += 1
            if self.signals >= 3:
                self.force_exit = self.should_exit = True

        async def on_tick(self, counter: int) -> bool:
            if self.signals and self.drain is None:
                self.drain = asyncio.ensure_future(self._drain())
            return await super().on_tick(counter)

        async def _drain(self) -> None:
            loop = asyncio.get_running_loop()
            service.draining = True
            log.info("shutting down: %d requests in service, up to %gs to finish (--shutdown-timeout)",
                     service.in_service, timeout)
            deadline = loop.time() + timeout
            while service.in_service and loop.time() < deadline and self.signals < 2:
                await asyncio.sleep(0.05)
            if service.in_service:
                self.exit_code = 1
                log.warning("shutting down: %d requests still in service end with an error", service.in_service)
                service.interrupt_all()
                flushed = loop.time() + FLUSH_S
                while service.in_service and loop.time() < flushed:
                    await asyncio.sleep(0.02)
            self.should_exit = True

    return DrainingServer(config)


def serve(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> int:
    from strata.server.app import build_app

    engine = load_engine(engine_cfg)
    try:
        app = build_app(engine, server_cfg, own_engine=True)
        name = app.state.strata.model_name
        hosts = server_cfg.hosts
        urls = ", ".join(f"http://{f'[{h}]' if ':' in h and not h.startswith('[') else h}:{server_cfg.port}/v1"
                         for h in hosts)
        print(f"strata: serving {name!r} (context {engine.max_model_len}) on {urls}", file=sys.stderr, flush=True)
        server = draining_server(uvicorn_config(app, server_cfg), app.state.strata, server_cfg.shutdown_timeout)
        server.run(sockets=bind_sockets(hosts, server_cfg.port) if len(hosts) > 1 else None)
        return server.exit_code if server.started else 1
    finally:
        engine.shutdown()  # a second call is a no-op; this one covers a server that never started


def cmd_serve(args: argparse.Namespace) -> int:
    engine_cfg, server_cfg = resolve(args)
    return serve(engine_cfg, server_cfg)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`serve` added to the `strata` command's subcommands."""
    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="OpenAI-compatible HTTP server. Options come from --config FILE (JSON) and flags; "
                    "flags win.",
    )
    configure_parser(p)
    p.set_defaults(func=cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m strata.server.serve ...` is `strata serve ...`: the same parser and error policy."""
    parser, subcommands = strata_parser()
    add_serve_parser(subcommands)
    return run_command(parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
