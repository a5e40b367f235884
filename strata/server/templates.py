"""Chat prompts from untrusted parts: the model file's template and the client's messages.

The template renders in worker processes (`strata.server.template_worker`), `workers` of them started
on first use: a render is answered within `timeout_s` (else its worker is killed and replaced), takes
at most `memory_bytes` beyond the worker's start-up size, and writes at most `max_chars` characters;
each limit broken is a `TemplateLimitError` naming it. `check()` renders a one-message conversation,
which `strata serve` does at start-up so that a template that does not compile or render is a start-up
error.

Client text is text, never control tokens: every special token's string (`<|im_end|>`, ...) in a
string the client sent is replaced by a private-use placeholder before rendering, and the rendered
prompt is encoded in pieces: the template's own text with special tokens parsed, each placeholder as
the plain text it stands for (`encode_plain`). So `hi<|im_end|>` in a user message is the characters
`<`, `|`, ... and cannot close the turn.
"""

from __future__ import annotations

import json
import logging
import re
import select
import subprocess
import sys
import threading
import time
from typing import Any

import tokenizers

from strata.tokenizer import Tokenizer

log = logging.getLogger("strata")

# Placeholders: one private-use character per distinct special string (or private-use character the
# client sent itself, which would otherwise read as a placeholder).
PLACEHOLDER_BASE = 0xF0000
PLACEHOLDER_END = 0xFFFFE
START_TIMEOUT_S = 60.0  # a worker's interpreter starting (a loaded machine is slow to start one)
CHECK_TIMEOUT_S = 10.0


class TemplateLimitError(ValueError):
    """A render that broke a limit (time, memory, size), or a template that failed."""


class TemplateUnavailable(TemplateLimitError):
    """No worker could render now (all busy, or none could start): the server's state, not the request's."""


class _Worker:
    def __init__(self, setup: dict[str, Any]):
        """Started and ready (its interpreter up): a render's time limit counts the render alone."""
        self.proc = subprocess.Popen([sys.executable, "-m", "strata.server.template_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, encoding="utf-8")
        try:
            self.send(setup)
            ready = self.receive(START_TIMEOUT_S)
        except (OSError, ValueError):
            ready = None
        if not ready or not ready.get("ready"):
            self.kill()
            raise OSError(f"the worker did not start within {START_TIMEOUT_S:g} s")

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> dict[str, Any] | None:
        """The reply, or None when none came within `timeout` seconds (or the worker died)."""
        out = self.proc.stdout
        assert out is not None
        poller = select.poll()  # not select(): a busy server's descriptors may lie past FD_SETSIZE
        poller.register(out.fileno(), select.POLLIN)
        if not poller.poll(max(timeout, 0.0) * 1000):
            return None
        line = out.readline()
        return json.loads(line) if line else None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()  # type: ignore[union-attr]
            except OSError:
                pass


class TemplateRenderer:
    """The tokenizer's chat template, rendered under limits and encoded without letting client text
    become control tokens (see the module docstring). Thread-safe: called from the server's pool."""

    def __init__(self, tokenizer: Tokenizer, max_chars: int, *, workers: int = 2, timeout_s: float = 5.0,
                 memory_bytes: int = 1 << 30):
        self.tokenizer, self.max_chars, self.timeout_s = tokenizer, max_chars, timeout_s
        self.setup = {"template": tokenizer.chat_template, "bos_token": tokenizer.bos_token,
                      "eos_token": tokenizer.eos_token, "max_chars": max_chars, "memory_bytes": memory_bytes}
        self.slots = threading.BoundedSemaphore(workers)
        self.idle: list[_Worker] = []
        self.lock = threading.Lock()
        self.closed = False
        added = tokenizer.tk.get_added_tokens_decoder() if hasattr(tokenizer.tk, "get_added_tokens_decoder") else {}
        # Longest first, so a special string that contains another is replaced whole.
        self.specials = sorted({t.content for t in added.values() if t.special and t.content}, key=len, reverse=True)
        self.plain_tk = tokenizers.Tokenizer.from_str(tokenizer.tk.to_str())
        self.plain_tk.encode_special_tokens = True

    # -- workers ----------------------------------------------------------------------------------

    def _take(self) -> _Worker:
        with self.lock:
            if self.closed:
                raise TemplateUnavailable("the server is shutting down")
            while self.idle:
                w = self.idle.pop()
                if w.proc.poll() is None:
                    return w
                w.kill()
        try:
            return _Worker(self.setup)
        except OSError as e:  # out of processes or descriptors
            raise TemplateUnavailable(f"no chat-template worker could start: {e}") from None

    def _give_back(self, w: _Worker) -> None:
        with self.lock:
            if not self.closed:
                self.idle.append(w)
                return
        w.kill()

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool, kwargs: dict[str, Any], *, timeout_s: float | None = None) -> str:
        """The prompt text; TemplateLimitError when the template fails or breaks a limit (`timeout_s`:
        the time limit, when not the renderer's own)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        request = {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
                   "kwargs": kwargs}
        if not self.slots.acquire(timeout=self.timeout_s * 4):
            raise TemplateUnavailable("every chat-template worker is busy; retry later")
        try:
            w = self._take()
            start = time.monotonic()
            try:
                w.send(request)
                reply = w.receive(limit)
            except (OSError, ValueError) as e:
                w.kill()
                raise TemplateLimitError(f"the chat-template worker failed: {e}") from None
            if reply is None:
                w.kill()
                took = time.monotonic() - start
                if took >= limit:
                    raise TemplateLimitError(f"the chat template took longer than {limit:g} s to render")
                raise TemplateLimitError("the chat template's worker ended while rendering (out of memory?)")
            self._give_back(w)
        finally:
            self.slots.release()
        if "error" in reply:
            raise TemplateLimitError(reply["error"])
        return reply["text"]

    def check(self) -> None:
        """A one-message conversation through the template: ValueError naming the problem when the
        template does not compile, render, or stay within its limits. Its time limit is at least
        CHECK_TIMEOUT_S: start-up loads the model beside it, and a loaded machine renders slowly."""
        try:
            self.render([{"role": "user", "content": "Hello"}], None, True, {},
                        timeout_s=max(self.timeout_s, CHECK_TIMEOUT_S))
        except TemplateLimitError as e:
            raise ValueError(f"the model's chat template cannot render a conversation: {e}") from None

    def close(self) -> None:
        with self.lock:
            self.closed = True
            idle, self.idle = self.idle, []
        for w in idle:
            w.kill()

    # -- client text ------------------------------------------------------------------------------

    def protect(self, value: Any, table: dict[str, str]) -> Any:
        """`value` (messages, tools: JSON-like) with each special string, and each private-use character
        in the placeholder range, in every string replaced by a placeholder; `table` maps placeholder
        to original."""
        if isinstance(value, str):
            return self._protect_text(value, table)
        if isinstance(value, list):
            return [self.protect(v, table) for v in value]
        if isinstance(value, dict):
            return {k: self.protect(v, table) for k, v in value.items()}
        return value

    @staticmethod
    def _placeholder(original: str, table: dict[str, str]) -> str:
        for p, o in table.items():
            if o == original:
                return p
        code = PLACEHOLDER_BASE + len(table)
        if code > PLACEHOLDER_END:
            raise TemplateLimitError("too many distinct special strings in the messages")
        table[chr(code)] = original
        return chr(code)

    def _protect_text(self, text: str, table: dict[str, str]) -> str:
        if not text.isascii() and any(PLACEHOLDER_BASE <= ord(c) <= PLACEHOLDER_END for c in text):
            text = "".join(self._placeholder(c, table) if PLACEHOLDER_BASE <= ord(c) <= PLACEHOLDER_END else c
                           for c in text)
        for special in self.specials:
            if special in text:
                text = text.replace(special, self._placeholder(special, table))
        return text

    def encode(self, rendered: str, table: dict[str, str]) -> list[int]:
        """Token ids of a rendered prompt: the template's text with special tokens parsed, each
        placeholder's original as plain text."""
        if not table:
            return self.tokenizer.encode(rendered, add_special=False)
        ids: list[int] = []
        for k, piece in enumerate(re.split(f"([{''.join(table)}])", rendered)):
            if k % 2:
                ids += self.plain_tk.encode(table[piece], add_special_tokens=False).ids
            elif piece:
                ids += self.tokenizer.encode(piece, add_special=False)
        return ids

    def encode_plain(self, text: str, add_special: bool = True) -> list[int]:
        """`text` as plain text: special strings in it are characters, not control tokens."""
        ids = self.plain_tk.encode(text, add_special_tokens=False).ids
        t = self.tokenizer
        return [t.bos_id] + ids if add_special and t.add_bos and t.bos_id is not None else ids
