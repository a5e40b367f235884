"""`strata tui`: a Textual app watching a running Strata server and chatting with it.

Top to bottom: the status line (model, queue, KV use, give-ways, preemptions), an error line while
the server cannot be read, sparklines of engine generation rate and TTFT, the slots table, the chat
pane and its input. The slots are polled from `GET /strata/slots`; the chat streams `/v1/chat/completions`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from contextlib import aclosing
from typing import Any

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import DataTable, Footer, Header, Input, Label, Sparkline, Static

from strata.tui.client import ServerClient, ServerUnavailable
from strata.tui.format import SLOT_COLUMNS, rate_label, slot_cells, status_line, zero_based

HISTORY = 120  # sparkline samples kept: a minute of polls at 2/s


class SlotsTable(DataTable):
    """One row per engine slot, keyed by slot id; rows are updated in place so the cursor stays put."""

    def on_mount(self) -> None:
        self.show_cursor = False  # a highlighted row would hide the colours of its state and bars
        for name, width in SLOT_COLUMNS:
            self.add_column(name, key=name, width=width)

    def show(self, slots: list[dict[str, Any]]) -> None:
        keys = [str(s.get("id", i)) for i, s in enumerate(slots)]
        if keys != [row.value for row in self.rows]:
            self.clear()
            for key, slot in zip(keys, slots):
                self.add_row(*slot_cells(slot), key=key)
            return
        for key, slot in zip(keys, slots):
            for (column, _), cell in zip(SLOT_COLUMNS, slot_cells(slot)):
                self.update_cell(key, column, cell)

    def states(self) -> list[str]:
        return [str(self.get_row_at(i)[1]) for i in range(self.row_count)]


class ChatMessage(Static):
    """One turn of the chat; the assistant's grows as its stream arrives. Text is never parsed as markup."""

    def __init__(self, role: str, text: str = ""):
        super().__init__(classes=role)
        self.role = role
        self.text = text
        self.note = ""
        self.note_style = "dim"

    def on_mount(self) -> None:
        self._redraw()

    def add(self, text: str) -> None:
        self.text += text
        self._redraw()

    def set_note(self, note: str, style: str = "dim") -> None:
        self.note = note
        self.note_style = style
        self._redraw()

    def _redraw(self) -> None:
        content = Text.assemble(("you: " if self.role == "user" else "strata: ", "bold"), self.text)
        if self.note:
            content.append(f"  {self.note}", style=self.note_style)
        self.update(content)


class StrataTUI(App):
    """Watches `base_url` and chats with it. `chat_options` are merged into every chat request body
    (e.g. {"max_tokens": 512, "temperature": 0.7})."""

    TITLE = "Strata"
    CSS = """
    #status { height: 1; padding: 0 1; background: $boost; }
    #error { height: auto; padding: 0 1; color: $text; background: $error 60%; display: none; }
    #error.shown { display: block; }
    #sparks { height: 3; }
    .spark { width: 1fr; padding: 0 1; }
    .spark Label { height: 1; color: $text-muted; }
    .spark Sparkline { height: 2; }
    SlotsTable { height: auto; max-height: 18; }
    #chat { height: 1fr; min-height: 4; border: round $primary 50%; padding: 0 1; }
    #chat > .user { color: $text-accent; }
    """
    BINDINGS = [
        Binding("escape", "stop", "stop reply", priority=True),
        Binding("ctrl+c", "quit", "quit", priority=True),
        Binding("q", "quit", "quit", show=False),
    ]

    def __init__(self, base_url: str, api_key: str | None = None, *, interval_s: float = 0.5,
                 retry_s: float = 1.0, system: str | None = None, chat_options: dict[str, Any] | None = None):
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.interval_s = interval_s
        self.retry_s = retry_s
        self.chat_options = dict(chat_options or {})
        self.history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.model: str | None = None
        self.last_slots: dict[str, Any] | None = None
        self.error: str | None = None
        self.gen_rates: deque[float] = deque(maxlen=HISTORY)
        self.ttfts: deque[float] = deque(maxlen=HISTORY)
        self._last_ttft: float | None = None
        self._client: ServerClient | None = None
        self._streaming = False

    # -- layout ------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="≡")
        yield Static(Text("connecting…", style="dim"), id="status")
        yield Static(id="error")
        with Horizontal(id="sparks"):
            with Vertical(classes="spark"):
                yield Label("generation: -", id="gen-label")
                yield Sparkline([], id="gen-spark")
            with Vertical(classes="spark"):
                yield Label("TTFT: -", id="ttft-label")
                yield Sparkline([], id="ttft-spark")
        yield SlotsTable(id="slots")
        yield VerticalScroll(id="chat")
        yield Input(placeholder="message (enter sends, esc stops the reply)", id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.base_url
        self._client = ServerClient(self.base_url, self.api_key)
        self.query_one("#prompt", Input).focus()
        self._poll_loop()

    async def on_unmount(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    # -- polling /strata/slots--------------------------------------------------------------------------

    @work(group="poll", exclusive=True)
    async def _poll_loop(self) -> None:
        assert self._client is not None
        attempt = 0
        key_checked = False
        while True:
            started = time.monotonic()
            try:
                if not key_checked:
                    # /strata/slots may be open to all while /v1 wants the key: a wrong key must show here, not
                    # first when a chat message fails. Checked again after every failure.
                    self.model = await self._client.model_name()
                    key_checked = True
                doc = await self._client.slots()
            except ServerUnavailable as e:
                key_checked = False
                attempt += 1
                self.show_error(f"{e} - retrying every {self.retry_s:g}s (attempt {attempt})")
                await asyncio.sleep(self.retry_s)
                continue
            try:
                self.show_slots(doc)
            except (TypeError, ValueError, AttributeError, KeyError) as e:
                # A server speaking another version of the document: say so rather than crash the UI.
                self.show_error(f"/strata/slots: unexpected document ({type(e).__name__}: {e})")
            else:
                attempt = 0
                self.show_error(None)
            await asyncio.sleep(max(self.interval_s - (time.monotonic() - started), 0.05))

    def show_error(self, message: str | None) -> None:
        self.error = message
        line = self.query_one("#error", Static)
        line.update(Text(f"⚠ {message}") if message else "")
        line.set_class(message is not None, "shown")

    def show_slots(self, doc: dict[str, Any]) -> None:
        self.last_slots = doc
        self.model = str(doc.get("model") or self.model or "")
        totals = doc.get("totals") or {}
        self.query_one("#status", Static).update(status_line(doc))
        self.query_one(SlotsTable).show(doc["slots"])
        rate = totals.get("generation_tok_s")
        if isinstance(rate, (int, float)):
            self.gen_rates.append(float(rate))
        ttft = totals.get("ttft_last_s")
        # TTFT is one number per request, so a sample is kept only when a new first token changed it.
        if isinstance(ttft, (int, float)) and ttft != self._last_ttft:
            self._last_ttft = ttft
            self.ttfts.append(float(ttft) * 1000)
        self.query_one("#gen-spark", Sparkline).data = zero_based(list(self.gen_rates), HISTORY)
        self.query_one("#gen-label", Label).update(rate_label("generation", list(self.gen_rates), "tok/s"))
        self.query_one("#ttft-spark", Sparkline).data = zero_based(list(self.ttfts), HISTORY)
        self.query_one("#ttft-label", Label).update(rate_label("TTFT", list(self.ttfts), "ms", 0))

    # -- chat --------------------------------------------------------------------------------------

    @property
    def streaming(self) -> bool:
        return self._streaming

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self._streaming:
            self.notify("a reply is still streaming; esc stops it", severity="warning")
            return
        event.input.clear()
        self.history.append({"role": "user", "content": text})
        chat = self.query_one("#chat", VerticalScroll)
        chat.mount(ChatMessage("user", text))
        reply = ChatMessage("assistant")
        chat.mount(reply)
        chat.scroll_end(animate=False)
        self._streaming = True
        self._stream_reply(reply)

    @work(group="chat", exclusive=True)
    async def _stream_reply(self, reply: ChatMessage) -> None:
        assert self._client is not None
        chat = self.query_one("#chat", VerticalScroll)
        started = time.monotonic()
        first: float | None = None
        note, style, failed = "", "dim", False
        try:
            model = self.model or await self._client.model_name()
            stream = self._client.stream_chat(self.history, model, self.chat_options)
            async with aclosing(stream) as events:
                async for event in events:
                    if "text" in event:
                        first = first or time.monotonic()
                        reply.add(event["text"])
                        chat.scroll_end(animate=False)
                    elif "usage" in event:
                        n = int(event["usage"].get("completion_tokens") or 0)
                        spent = time.monotonic() - (first or started)
                        note = f"[{n} tokens, {n / spent:.1f} tok/s]" if spent > 0 else f"[{n} tokens]"
        except asyncio.CancelledError:
            note, style = "[stopped]", "yellow"
            raise
        except ServerUnavailable as e:
            note, style, failed = f"[{e}]", "red", True
        finally:
            if failed and not reply.text:
                self.history.pop()  # the turn never happened; the next message must not follow it
            else:
                self.history.append({"role": "assistant", "content": reply.text})
            reply.set_note(note, style)
            self._streaming = False

    def action_stop(self) -> None:
        """Stops the streaming reply (closing the stream aborts it on the server); otherwise leaves the
        input so that `q` quits."""
        if self._streaming:
            self.workers.cancel_group(self, "chat")
        elif isinstance(self.focused, Input):
            self.query_one(SlotsTable).focus()


def run(base_url: str, api_key: str | None, *, interval_s: float = 0.5, system: str | None = None,
        chat_options: dict[str, Any] | None = None) -> int:
    StrataTUI(base_url, api_key, interval_s=interval_s, system=system, chat_options=chat_options).run()
    return 0
