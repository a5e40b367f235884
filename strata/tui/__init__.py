"""`strata tui [URL]`: a terminal UI (Textual) for a running Strata server: live slots, engine rates, chat.

This module imports neither Textual nor httpx, so `strata.cli` can register the subcommand on a
machine without them (`pip install 'strata[tui]'` adds them); `cmd_tui` imports them when it runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("url", nargs="?", default=DEFAULT_URL, help=f"the server's base URL (default: {DEFAULT_URL})")
    p.add_argument("--api-key", default=None, help="the server's API key (default: $STRATA_API_KEY)")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between /strata/slots polls (default: 0.5)")
    p.add_argument("--system", default=None, help="system message for the chat")
    p.add_argument("--max-tokens", "-n", type=int, default=None, help="max_tokens of each chat reply")
    p.add_argument("--temperature", "--temp", type=float, default=None, help="temperature of chat replies")
    return p


def cmd_tui(a: argparse.Namespace) -> int:
    from strata.env import ENV

    try:
        from strata.tui.app import run
    except ImportError as e:
        print(f"strata tui needs textual and httpx ({e}); install them with: pip install 'strata[tui]'",
              file=sys.stderr)
        return 2
    if a.interval <= 0:
        raise ValueError("--interval must be positive")
    options = {k: v for k, v in (("max_tokens", a.max_tokens), ("temperature", a.temperature)) if v is not None}
    return run(a.url, a.api_key or ENV.API_KEY.get() or None, interval_s=a.interval, system=a.system,
               chat_options=options)


def add_tui_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tui", help="terminal UI for a running server: slots, rates, chat",
        description="Watch a running `strata serve` (GET /strata/slots, refreshed twice a second) and chat with it. "
                    "Keys: enter sends, esc stops the reply, ctrl+c (or q outside the input) quits.",
    )
    configure_parser(p)
    p.set_defaults(func=cmd_tui)
    return p
