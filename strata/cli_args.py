"""Command-line flags and JSON config files generated from config dataclasses, and what every `strata`
command shares: the root parser, logging to stderr and the error policy (`run_command`).

`strata generate`, `strata chat` and `strata serve` all take their engine options from here: one flag
per `EngineConfig` field (name, type and default from the field, help from its trailing comment), so
a field the engine gains becomes a flag of every command and a config-file key at once.

The flags' defaults are suppressed: only flags typed on the command line land in the namespace, so a
`--config` file can sit between the dataclass defaults and them. Precedence, lowest first: dataclass
defaults, the JSON file, flags typed.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import os
import re
import sys
import types
import typing
from typing import Any, Callable, Collection, Literal, Mapping, Sequence

from strata.config import EngineConfig
from strata.env import ENV

_NONE_WORDS = ("none", "null")
ENGINE_GROUP_TITLE = "engine (fields of EngineConfig)"


class ConfigFileError(ValueError):
    pass


def field_comments(cls: type) -> dict[str, str]:
    """Help text for each field, from the class source, the one place it is written: the field's trailing
    `# comment`, else the comment lines right above it."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    above: list[str] = []
    for line in src.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        field = re.match(r"^\s+(\w+):[^#\n]*(?:#(.*))?$", line)
        if field and not stripped.startswith(("def ", "return ")):
            text = (field[2] or "").strip() or " ".join(above)
            if text and field[1] not in out:  # the field, not a later method's local of the same name
                out[field[1]] = text
        above = []
    return out


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), optional
    return hint, False


def check_value(name: str, value: Any, hint: Any) -> Any:
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
            return check_value(name, json.loads(text), base)

    def convert(text: str) -> Any:
        if optional and text.lower() in _NONE_WORDS:
            return None
        return scalar(text)

    convert.__name__ = getattr(scalar, "__name__", name)  # argparse names the type in its errors
    return convert, (choices + [None] if choices and optional else choices)


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def add_field_flags(group: argparse._ActionsContainer, cls: type, *, skip: Collection[str] = (),
                    help: Mapping[str, str] | None = None, dests: Mapping[str, str] | None = None) -> None:
    """One flag per field of the dataclass `cls` but those in `skip`: `--field-name`, stored under
    `dests.get(name, name)` (the flag is that dest with dashes). Booleans are `--x/--no-x`; optional
    fields also take `none`; tuple/list fields take JSON. Help: `help[name]`, else the field's
    `metadata["help"]`, else its trailing comment."""
    comments = field_comments(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        dest = (dests or {}).get(f.name, f.name)
        text = (help or {}).get(f.name) or f.metadata.get("help") or comments.get(f.name)
        # argparse expands %-formats in help; comments may contain a literal %.
        text = f"{text.replace('%', '%%') + ' ' if text else ''}(default: {_default(f)})"
        flag = "--" + dest.replace("_", "-")
        conv, choices = _cli_type(f.name, hints[f.name])
        if conv is None:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=text)
        else:
            group.add_argument(flag, dest=dest, type=conv, choices=choices, default=argparse.SUPPRESS, help=text,
                               metavar=None if choices else dest.upper())


def add_model_arg(p: argparse.ArgumentParser) -> None:
    """The positional MODEL (EngineConfig.model), suppressed when absent so a config file may name it."""
    p.add_argument("model", nargs="?", default=argparse.SUPPRESS,
                   help="HF model directory or .gguf file (default: the embedded model)")


def add_engine_flags(p: argparse.ArgumentParser, *, skip: Collection[str] = (),
                     dests: Mapping[str, str] | None = None) -> argparse._ArgumentGroup:
    """Every `EngineConfig` field but `model` (the positional) and `skip`, as a flag in its own help
    group. `dests` renames a field's flag where the command has another option of that name."""
    group = p.add_argument_group(ENGINE_GROUP_TITLE)
    add_field_flags(group, EngineConfig, skip={"model", *skip}, dests=dests)
    return group


def read_config_file(path: str, classes: Sequence[type], *, ignore: Collection[str] = ()) -> dict[str, Any]:
    """The JSON object in `path` as {field name: value}, each key (`kv_size` or `kv-size`) a field of
    one of `classes` (the first that has it types it) and checked against its type. Keys in `ignore`
    are dropped; any other key is an error that names it."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except OSError as e:
        raise ConfigFileError(f"cannot read config file {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigFileError(f"config file {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {path} must hold a JSON object")
    hints: dict[str, Any] = {}
    for cls in reversed(classes):
        hints.update(typing.get_type_hints(cls))
    known = {f.name for cls in classes for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in ignore:
            continue
        if name not in known:
            raise ConfigFileError(f"config file {path}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        out[name] = check_value(key, value, hints[name])
    return out


def typed_options(args: argparse.Namespace, cls: type, *, skip: Collection[str] = (),
                  dests: Mapping[str, str] | None = None) -> dict[str, Any]:
    """{field name: value} for the fields of `cls` whose flags were typed (see `add_field_flags`)."""
    out = {}
    for f in dataclasses.fields(cls):
        dest = (dests or {}).get(f.name, f.name)
        if f.name not in skip and dest in vars(args):
            out[f.name] = getattr(args, dest)
    return out


def expand_model_path(options: dict[str, Any]) -> dict[str, Any]:
    if isinstance(options.get("model"), str):
        options["model"] = os.path.expanduser(options["model"])
    return options


def engine_config(args: argparse.Namespace, *, dests: Mapping[str, str] | None = None,
                  ignore_file_keys: Collection[str] = ()) -> EngineConfig:
    """The EngineConfig of a command built with `add_model_arg` + `add_engine_flags` (and optionally a
    `--config FILE` option, dest `config`): defaults < the file's engine keys < flags typed. The
    file's keys in `ignore_file_keys` are dropped (another command's options)."""
    path = getattr(args, "config", None)
    merged = read_config_file(path, [EngineConfig], ignore=ignore_file_keys) if path else {}
    merged.update(typed_options(args, EngineConfig, dests=dests))
    return EngineConfig(**expand_model_path(merged))


# -- what every `strata` command shares ----------------------------------------------------------------


def strata_parser() -> tuple[argparse.ArgumentParser, Any]:
    """The `strata` parser and its subcommands' action (dest `command`), for each module that adds one."""
    parser = argparse.ArgumentParser(prog="strata", description="Strata LLM inference")
    return parser, parser.add_subparsers(dest="command", required=True)


class _Stderr(logging.StreamHandler):
    """A handler on whatever sys.stderr is when a record is written (tests swap it per test)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure_logging(command: str) -> None:
    """strata's logger to stderr at STRATA_LOG_LEVEL: by default INFO for a server's operator and
    WARNING for the interactive commands, whose stderr carries progress and speed lines. `strata tui`
    leaves it alone (Textual owns the terminal), as does a process that set up strata's logger itself."""
    logger = logging.getLogger("strata")
    if command == "tui" or logger.handlers:
        return
    level = ENV.LOG_LEVEL.get().strip().upper() or ("INFO" if command == "serve" else "WARNING")
    logger.setLevel(level)
    handler = _Stderr(sys.stderr)
    handler.setFormatter(logging.Formatter("strata: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False


def run_command(args: argparse.Namespace) -> int:
    """Runs a parsed `strata` subcommand (`args.func`) and gives its exit status: a bad option, config or
    model file (ValueError, which a loader's LoadError is) or a model that does not fit the GPU is one
    line on stderr and status 2; ctrl+c is 130."""
    try:
        configure_logging(args.command)
        return args.func(args)
    except ValueError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if type(e).__name__ != "OutOfMemoryError":  # torch's, named without importing torch here
            raise
        detail = (str(e).splitlines() or ["no detail"])[0]
        print(f"strata: error: out of GPU memory while starting ({detail}); lower --ctx, --parallel or --kv-size, "
              "use --kv int8, --gpu-memory-utilization below 0.9, or --gpu-memory / --n-cpu-moe to keep experts "
              "in RAM", file=sys.stderr)
        return 2
