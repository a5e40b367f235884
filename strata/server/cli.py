"""The `serve` subcommand for `strata.cli`: `add_serve_parser(subparsers)`."""

from __future__ import annotations

import argparse
from typing import Any

from strata.server.serve import cmd_serve, configure_parser


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="OpenAI-compatible HTTP server. Options come from --config FILE (JSON) and flags; "
                    "flags win.",
    )
    configure_parser(p)
    p.set_defaults(func=cmd_serve)
    return p
