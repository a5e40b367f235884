"""`strata tui`: the Textual app driven headless (App.run_test) against a real `strata serve` on the
embedded model with two slots.

`python tests/server/test_tui.py docs/tui.svg` runs the same scenario and writes its screenshot there.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest

pytest.importorskip("textual")

from serving import free_port, running_server  # noqa: E402
from strata.tui import add_tui_parser  # noqa: E402
from strata.tui.app import ChatMessage, SlotsTable, StrataTUI  # noqa: E402
from strata.tui.format import bar, slot_cells, status_line  # noqa: E402

KEY = "sk-strata-tui"
CONFIG = {"ctx": 4096, "device": "cpu", "api_key": KEY, "log_level": "warning", "spec": 2, "batch_mtp": True}
# Long enough (about ten seconds on a CPU) to watch it decode and to stop it midway.
CHAT_OPTIONS = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}  # still streaming when stopped
SIZE = (120, 34)


async def until(pilot, cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await pilot.pause(0.05)


async def watch_chat_and_stop(base: str, screenshot: Path) -> None:
    """The whole session: two slots appear, a chat reply streams while its slot decodes, esc stops it
    and the server frees the slot, ctrl+c quits."""
    app = StrataTUI(base, KEY, interval_s=0.2, chat_options=CHAT_OPTIONS)
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one(SlotsTable)
        await until(pilot, lambda: table.row_count == 2, "two slot rows")
        assert table.states() == ["idle", "idle"] and app.error is None
        assert "strata-default" in str(app.query_one("#status").content)

        await pilot.press(*"Quite quietly, once upon a time", "enter")  # q types, it does not quit
        replies = lambda: [m for m in app.query(ChatMessage) if m.role == "assistant"]  # noqa: E731
        await until(pilot, lambda: len(replies()) == 1 and len(replies()[0].text) > 0, "streamed text")
        reply = replies()[0]
        await until(pilot, lambda: "decoding" in table.states(), "a decoding slot")
        seen = len(reply.text)
        await until(pilot, lambda: len(reply.text) > seen + 20, "more streamed text")
        assert reply.text in str(reply.content)
        assert app.streaming and app.last_slots is not None
        busy = [s for s in app.last_slots["slots"] if s["state"] != "idle"]
        assert len(busy) == 1 and busy[0]["generated"] > 0 and busy[0]["max_tokens"] == CHAT_OPTIONS["max_tokens"]
        await until(pilot, lambda: max(app.gen_rates, default=0) > 0, "a generation rate sample")
        await pilot.pause(0.3)  # one more poll, so the screenshot's table is current
        app.save_screenshot(screenshot.name, path=str(screenshot.parent))

        await pilot.press("escape")
        await until(pilot, lambda: not app.streaming, "the stream to end")
        assert reply.note == "[stopped]"
        stopped_at = len(reply.text)
        # Closing the stream aborted the request: the server frees its slot at its next step.
        await until(pilot, lambda: table.states() == ["idle", "idle"], "the slot to be freed", timeout_s=5)
        assert len(reply.text) == stopped_at and app.history[-1] == {"role": "assistant", "content": reply.text}
        assert len(app.ttfts) >= 1
        await pilot.press("ctrl+c")
        await pilot.pause(0.1)
    assert not app.is_running


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("tui"), CONFIG, ["--parallel", "2"]) as base:
        yield base


def test_slots_chat_stream_and_stop(server, tmp_path):
    shot = tmp_path / "tui.svg"
    asyncio.run(watch_chat_and_stop(server, shot))
    assert shot.read_text().startswith("<svg")


async def error_line(url: str, key: str | None) -> str:
    app = StrataTUI(url, key, retry_s=0.2)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.error is not None and "attempt 2" in app.error, "a retried error", 5)
        assert app.query_one("#error").display
        message = app.error
        await pilot.press("escape", "q")  # esc leaves the input, so q quits
        await pilot.pause(0.1)
        assert not app.is_running
    return message


async def chat_with_wrong_key(base: str) -> tuple[str, str]:
    app = StrataTUI(base, "sk-wrong", retry_s=0.2)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.error is not None and "attempt 2" in app.error, "a retried error", 5)
        assert app.query_one("#error").display
        await pilot.press(*"hi", "enter")
        await until(pilot, lambda: not app.streaming and len(app.query(ChatMessage)) == 2, "the refused reply", 5)
        assert app.history == []  # a refused turn is not part of the conversation
        return app.error, app.query(ChatMessage).last().note


def test_wrong_key_shows_401_and_retries(server):
    line, chat_note = asyncio.run(chat_with_wrong_key(server))
    assert "401" in line and "API key" in line and "retrying" in line
    assert "401" in chat_note


def test_unreachable_server_shows_error_and_retries():
    url = f"http://127.0.0.1:{free_port()}"
    message = asyncio.run(error_line(url, None))
    assert f"cannot reach {url}" in message and "retrying" in message


def test_cells_and_status_line():
    assert slot_cells({"id": 1, "state": "idle"})[2:] == ("",) * 6
    cells = slot_cells({"id": 0, "state": "reading", "request_id": "chatcmpl-0123456789abcdef", "prompt_tokens": 40,
                        "prompt_read": 11, "generated": 0, "max_tokens": 16, "tokens_per_s": 0.0, "give_ways": 2,
                        "acceptance": 0.75})
    assert [str(c) for c in cells[2:]] == ["chatcmpl-01234567…", "━━━╸━━━━━━━━ 11/40", "0/16", "0.0", "2", "75%"]
    filled = lambda t: sum(s.end - s.start for s in t.spans if s.style == "green")  # noqa: E731
    assert (filled(bar(5, 0)), filled(bar(9, 3, width=4)), filled(bar(1, 4, width=8))) == (0, 4, 2)
    line = str(status_line({"model": "m", "slots": [{"state": "decoding"}, {"state": "idle"}],
                            "totals": {"parallel": 2, "queue": 3, "kv_blocks_used": 8, "kv_blocks_total": 32,
                                       "give_ways": 4, "preemptions": 1, "uptime_s": 75}}))
    assert line.startswith("m  slots 1/2  queue 3  KV ") and "8/32 25%" in line
    assert "give-ways 4  preemptions 1" in line and line.endswith("up 1m15s")


def test_parser_and_lazy_import():
    p = argparse.ArgumentParser()
    add_tui_parser(p.add_subparsers(dest="command"))
    a = p.parse_args(["tui"])
    assert (a.url, a.api_key, a.interval) == ("http://127.0.0.1:8000", None, 0.5)
    a = p.parse_args(["tui", "http://gpu-box:9000", "--api-key", "k", "-n", "64"])
    assert (a.url, a.api_key, a.max_tokens) == ("http://gpu-box:9000", "k", 64)
    # Registering the subcommand must not need Textual or httpx: `strata generate` runs without them.
    code = "import sys, strata.tui; assert not {'textual', 'httpx'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/tui.svg").resolve()
    with tempfile.TemporaryDirectory() as tmp, running_server(Path(tmp), CONFIG, ["--parallel", "2"]) as base:
        asyncio.run(watch_chat_and_stop(base, target))
    print(f"wrote {target}")
