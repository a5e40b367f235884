"""`<think>…</think>` reasoning split out of a chat completion, whole or streamed.

Thinking models (Qwen3, GLM-4.5) write their reasoning between `<think>` and `</think>` before the
answer. Some templates open the `<think>` tag in the prompt itself, so the output starts inside the
reasoning (`opened_in_prompt`). The split is defined once, by the streaming parser; the whole-text
`parse` runs the same parser, so streamed and non-streamed answers always agree:

- the output starts with `<think>` (after optional whitespace), or the prompt opened it: the text up to
  `</think>` is reasoning (surrounding whitespace dropped) and the rest is content (leading whitespace
  dropped); with no `</think>` at all, everything is reasoning;
- otherwise there is no reasoning (`None`) and the content is the text unchanged.

A tag split across chunks is held back until it is known to be a tag or not: no partial tag is ever
sent as text.
"""

from __future__ import annotations

from typing import Literal

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
REASONING_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe", "qwen3_next", "glm4_moe"})

Kind = Literal["reasoning", "content"]


def partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (text to hold back)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class Trimmer:
    """Passes text on without its leading and trailing whitespace, however the text is split: trailing
    whitespace is held until more text follows it, and dropped if none does."""

    def __init__(self) -> None:
        self.started = False
        self.pending = ""

    def feed(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        body = text.rstrip()
        if not body:
            self.pending += text
            return ""
        out = self.pending + body
        self.pending = text[len(body):]
        return out


def merge_pieces(pieces: list[tuple[Kind, str]]) -> list[tuple[Kind, str]]:
    out: list[tuple[Kind, str]] = []
    for kind, text in pieces:
        if not text:
            continue
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


class ReasoningStream:
    """Incremental splitter: `push(delta)` and `finish()` return `[(kind, text)]`, kind `reasoning` or
    `content`, in output order. `entered` tells whether a reasoning block was seen."""

    def __init__(self, opened_in_prompt: bool = False):
        self.opened_in_prompt = opened_in_prompt
        self.state: Literal["start", "reasoning", "content"] = "start"
        self.entered = False
        self.buf = ""
        self.reasoning = Trimmer()
        self.skip_space = False  # content right after `</think>` starts at its first non-space

    def push(self, delta: str) -> list[tuple[Kind, str]]:
        self.buf += delta
        out: list[tuple[Kind, str]] = []
        self._drain(out, final=False)
        return merge_pieces(out)

    def finish(self) -> list[tuple[Kind, str]]:
        out: list[tuple[Kind, str]] = []
        self._drain(out, final=True)
        return merge_pieces(out)

    def _enter_reasoning(self) -> None:
        self.state, self.entered = "reasoning", True

    def _drain(self, out: list[tuple[Kind, str]], final: bool) -> None:
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(THINK_OPEN):
                self.buf = head[len(THINK_OPEN):]
                self._enter_reasoning()
            elif not final and THINK_OPEN.startswith(head):
                return  # only whitespace, or a tag still arriving
            elif self.opened_in_prompt:
                self._enter_reasoning()
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = self.buf.find(THINK_CLOSE)
            if end < 0:
                keep = 0 if final else partial_tag_suffix(self.buf, THINK_CLOSE)
                out.append(("reasoning", self.reasoning.feed(self.buf[:len(self.buf) - keep])))
                self.buf = self.buf[len(self.buf) - keep:]
                return
            out.append(("reasoning", self.reasoning.feed(self.buf[:end])))
            self.buf = self.buf[end + len(THINK_CLOSE):]
            self.state, self.skip_space = "content", True
        content, self.buf = self.buf, ""
        if self.skip_space:
            content = content.lstrip()
            self.skip_space = not content
        out.append(("content", content))


class ReasoningParser:
    """`<think>…</think>` reasoning. `parse` gives `(reasoning, content)`: reasoning is None when the output
    has no reasoning block. `stream` gives a `ReasoningStream` that splits the same way piece by piece."""

    def stream(self, opened_in_prompt: bool = False) -> ReasoningStream:
        return ReasoningStream(opened_in_prompt)

    def parse(self, text: str, opened_in_prompt: bool = False) -> tuple[str | None, str]:
        s = self.stream(opened_in_prompt)
        pieces = s.push(text) + s.finish()
        reasoning = "".join(t for k, t in pieces if k == "reasoning")
        content = "".join(t for k, t in pieces if k == "content")
        return (reasoning if s.entered else None), content


def reasoning_parser_for(model_type: str | None, chat_template: str | None,
                         enable_thinking: bool = True) -> ReasoningParser | None:
    """The parser for a model's reasoning, or None when its output is not split.

    A template that mentions `</think>` decides; without a template, the model type does (Qwen3,
    GLM-4.5). `enable_thinking=False` (from `chat_template_kwargs`) turns parsing off: the template then
    closes the think block in the prompt and the whole output is the answer.
    """
    if not enable_thinking:
        return None
    if chat_template is not None:
        return ReasoningParser() if THINK_CLOSE in chat_template else None
    return ReasoningParser() if (model_type or "") in REASONING_MODEL_TYPES else None


def thinking_opened_in_prompt(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open `<think>` block, so the output starts as reasoning."""
    return prompt.rstrip().endswith(THINK_OPEN)
