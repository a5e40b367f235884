"""`strata serve`: merge the config file and the command line, load the engine, run uvicorn.

Precedence, lowest first: dataclass defaults, then the JSON file given by `--config`, then flags typed
on the command line. Engine flags are generated from `EngineConfig`'s fields (name, default, type), so
a field the engine gains becomes a flag and a config-file key without touching this module. The
file's keys are `EngineConfig` and `ServerConfig` field names (`kv_size` or `kv-size`); any other key
is an error that names it.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import sys
import types
import typing
from typing import Any, Callable, Literal

from strata.config import EngineConfig
from strata.env import ENV
from strata.server.config import ServerConfig

# ServerConfig wins a name clash: its options are the ones this command is about.
SERVER_FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}
ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig) if f.name not in SERVER_FIELDS}
_HINTS = {**typing.get_type_hints(EngineConfig), **typing.get_type_hints(ServerConfig)}
_NONE_WORDS = ("none", "null")
API_KEY_ENV = ENV.API_KEY.name


class ConfigFileError(ValueError):
    pass


def _field_comments(cls: type) -> dict[str, str]:
    """Help text for each field: its trailing `# comment` in the class source, the one place it is written."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    return {m[1]: m[2].strip() for m in re.finditer(r"^\s+(\w+):[^#\n]*#(.*)$", src, re.M)}


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), optional
    return hint, False


def _check(name: str, value: Any, hint: Any) -> Any:
    """`value` (from JSON) if it fits `hint`; raises ConfigFileError naming the key otherwise."""
    base, optional = _unwrap(hint)
    if value is None:
        if optional:
            return None
        raise ConfigFileError(f"config key {name!r} must not be null")
    if typing.get_origin(base) is Literal:
        if value not in typing.get_args(base):
            raise ConfigFileError(f"config key {name!r} must be one of {list(typing.get_args(base))}, got {value!r}")
        return value
    if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if base in (int, str, bool):
        if isinstance(value, base) and (base is bool or not isinstance(value, bool)):
            return value
        raise ConfigFileError(f"config key {name!r} must be {base.__name__}, got {value!r}")
    origin = typing.get_origin(base)
    if origin in (tuple, list) and isinstance(value, list):
        return tuple(value) if origin is tuple else list(value)
    if origin is None and isinstance(base, type) and not isinstance(value, base):
        raise ConfigFileError(f"config key {name!r} must be {base.__name__}, got {value!r}")
    return value


def _cli_type(name: str, hint: Any) -> tuple[Callable[[str], Any] | None, list[Any] | None]:
    """(argparse `type`, `choices`) for a field; None type means a boolean switch."""
    base, optional = _unwrap(hint)
    if base is bool:
        return None, None
    choices = list(typing.get_args(base)) if typing.get_origin(base) is Literal else None
    if choices:
        scalar: Callable[[str], Any] = type(choices[0])
    elif base in (int, float, str):
        scalar = base
    else:
        def scalar(text: str) -> Any:  # structured values (tuples, lists) are typed as JSON
            return _check(name, json.loads(text), base)

    def convert(text: str) -> Any:
        if optional and text.lower() in _NONE_WORDS:
            return None
        return scalar(text)

    convert.__name__ = getattr(scalar, "__name__", name)  # argparse names the type in its errors
    return convert, (choices + [None] if choices and optional else choices)


def _add_field_flag(group: argparse._ArgumentGroup, f: dataclasses.Field, help_: str | None) -> None:
    flag = "--" + f.name.replace("_", "-")
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    conv, choices = _cli_type(f.name, _HINTS[f.name])
    # argparse expands %-formats in help; comments may contain a literal %.
    text = f"{help_.replace('%', '%%') + ' ' if help_ else ''}(default: {default})"
    if conv is None:
        group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=text)
    else:
        group.add_argument(flag, dest=f.name, type=conv, choices=choices, default=argparse.SUPPRESS, help=text,
                           metavar=None if choices else f.name.upper())


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
    p.add_argument("model", nargs="?", default=argparse.SUPPRESS,
                   help="HF model directory or .gguf file (default: the embedded model)")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="JSON file of engine and server options; flags given here override it")
    srv = p.add_argument_group("server")
    for name, f in SERVER_FIELDS.items():
        _add_field_flag(srv, f, _SERVER_HELP.get(name))
    eng = p.add_argument_group("engine (fields of EngineConfig)")
    comments = _field_comments(EngineConfig)
    for name, f in ENGINE_FIELDS.items():
        if name != "model":
            _add_field_flag(eng, f, f.metadata.get("help") or comments.get(name))
    return p


def read_config_file(path: str) -> dict[str, Any]:
    """The file's options as {field name: value}, checked against the fields' types."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except OSError as e:
        raise ConfigFileError(f"cannot read config file {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigFileError(f"config file {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {path} must hold a JSON object")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in SERVER_FIELDS and name not in ENGINE_FIELDS:
            raise ConfigFileError(f"config file {path}: unknown key {key!r} "
                                  f"(known: {', '.join(sorted({*SERVER_FIELDS, *ENGINE_FIELDS}))})")
        out[name] = _check(key, value, _HINTS[name])
    return out


def resolve(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """Defaults < config file < explicit flags (the parser leaves flags not typed out of `args`);
    the API key falls back to $STRATA_API_KEY."""
    merged = read_config_file(args.config) if getattr(args, "config", None) else {}
    merged.update({k: v for k, v in vars(args).items() if k in SERVER_FIELDS or k in ENGINE_FIELDS})
    # A key typed on the command line shows in `ps`; the environment keeps it out of sight.
    if "api_key" not in merged and ENV.API_KEY.get():
        merged["api_key"] = ENV.API_KEY.get()
    if isinstance(merged.get("model"), str):
        merged["model"] = os.path.expanduser(merged["model"])
    engine_kw = {k: v for k, v in merged.items() if k in ENGINE_FIELDS}
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


def main(argv: list[str] | None = None) -> int:
    """`python -m strata.server.serve ...` is `strata serve ...` (one parser, one error policy)."""
    from strata.cli import main as strata_main

    return strata_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
