"""`strata serve`: its parser, the merge of config file and command line, loading the engine, uvicorn.

Precedence, lowest first: dataclass defaults, then the JSON file given by `--config`, then flags typed
on the command line. Engine flags are generated from `EngineConfig`'s fields (name, default, type) by
`strata.cli_args`, as for `strata generate` and `strata chat`, so a field the engine gains becomes a
flag and a config-file key without touching this module. The file's keys are `EngineConfig` and
`ServerConfig` field names (`kv_size` or `kv-size`); any other key is an error that names it.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    "host": "address to bind; 0.0.0.0 exposes the server to the network",
    "port": "TCP port",
    "api_key": f"require `Authorization: Bearer KEY` on /v1/*; unset: ${API_KEY_ENV} if set",
    "model_name": "the model name clients send; unset: the engine's",
    "log_level": "uvicorn log level",
    "graceful_shutdown_s": "seconds to let open streams finish on shutdown",
    "max_body_bytes": "largest request body accepted (413 beyond)",
}


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


def serve(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> int:
    import uvicorn

    from strata.server.app import build_app

    engine = load_engine(engine_cfg)
    try:
        app = build_app(engine, server_cfg, own_engine=True)
        name = app.state.strata.model_name
        print(f"strata: serving {name!r} (context {engine.max_model_len}) on http://{server_cfg.host}:"
              f"{server_cfg.port}/v1", file=sys.stderr, flush=True)
        config = uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port, log_level=server_cfg.log_level,
                                timeout_graceful_shutdown=server_cfg.graceful_shutdown_s)
        server = uvicorn.Server(config)
        server.run()
        return 0 if server.started else 1
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
