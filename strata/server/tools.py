"""Tool calls: the request's `tools` / `tool_choice`, and the calls parsed out of the model's text.

Two output formats, chosen from the model (`tool_parser_for`):

- Hermes (Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block
  per call (a block holding several JSON objects gives several calls);
- GLM-4.5: `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...\\n</tool_call>`; a value
  that parses as JSON keeps its type, anything else is a string (and a parameter the tool's schema
  declares `"type": "string"` always stays a string).

Parsing is defined once, by the streaming parser; `ToolParser.parse` runs the same code over the whole
text, so a streamed answer and a whole one agree exactly. Content is the text outside the call blocks,
with its leading and trailing whitespace dropped. A block that is not a valid call stays in the content,
tags and all. Streamed, a Hermes call is sent whole when its block closes (its JSON is only known to be
valid then); a GLM call is sent as soon as its name is known, then one argument at a time.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

from strata.server.reasoning import ReasoningParser, ReasoningStream, Trimmer, partial_tag_suffix

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
HERMES_MODEL_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next"})
GLM_MODEL_TYPES = frozenset({"glm4_moe"})
MAX_NAME_CHARS = 256
_NAME = re.compile(r"[^\s<>]{1,%d}" % MAX_NAME_CHARS)


class ToolRequestError(ValueError):
    """A bad `tools` or `tool_choice` in a request (a 400); `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Delta:
    """One streamed piece: exactly one field is set. `tool_call` is one entry of OpenAI's
    `delta.tool_calls`: `{"index", "id", "type": "function", "function": {"name", "arguments": ""}}` to
    start a call, then `{"index", "function": {"arguments": fragment}}`."""

    content: str | None = None
    reasoning: str | None = None
    tool_call: dict[str, Any] | None = None


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Python's json reads NaN and Infinity, which clients' JSON parsers reject: such text is not JSON here.
_DECODER = json.JSONDecoder(parse_constant=_no_constants)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _merge(deltas: list[Delta]) -> list[Delta]:
    out: list[Delta] = []
    for d in deltas:
        if d.tool_call is None and not (d.content or d.reasoning):
            continue
        prev = out[-1] if out else None
        if prev is not None and d.content is not None and prev.content is not None:
            out[-1] = Delta(content=prev.content + d.content)
        elif prev is not None and d.reasoning is not None and prev.reasoning is not None:
            out[-1] = Delta(reasoning=prev.reasoning + d.reasoning)
        else:
            out.append(d)
    return out


# -- request side -------------------------------------------------------------------------------------


def tools_for_template(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI `tools`, checked, as HF chat templates take them: `{"type": "function", "function": {...}}`
    entries passed as given. Raises ToolRequestError naming the bad entry."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolRequestError("tools", "tools must be a list")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolRequestError(where, f"{where}: only tools of type 'function' are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolRequestError(f"{where}.function", f"{where}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolRequestError(f"{where}.function.name",
                                   f"{where}.function.name must be a non-empty name without spaces or <>")
        if name in seen:
            raise ToolRequestError(f"{where}.function.name", f"{where}: the function {name!r} is listed twice")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolRequestError(f"{where}.function.parameters", f"{where}.function.parameters must be an object")
    return list(tools)


@dataclass(frozen=True)
class ToolChoice:
    """What a request's `tool_choice` asks for. `mode` is `none`, `auto`, `required` or `function`
    (then `name` is the function). Only `auto` and beyond pass tools to the template and parse calls.

    `required` and `function` are enforced while generating by a grammar built from the tools'
    schemas (`strata/server/tool_grammar.py`) when the engine has a grammar compiler; `complied(calls)`
    tells afterwards whether the model did as asked."""

    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None

    @property
    def uses_tools(self) -> bool:
        return self.mode != "none"

    def complied(self, calls: list[ToolCall]) -> bool | None:
        """None for `none`/`auto` (nothing was demanded); else whether the calls satisfy the choice."""
        if self.mode == "required":
            return bool(calls)
        if self.mode == "function":
            return bool(calls) and all(c.name == self.name for c in calls)
        return None


def resolve_tool_choice(tool_choice: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """OpenAI `tool_choice` (None, "none", "auto", "required", or `{"type": "function", "function":
    {"name": ...}}`) against the request's tools. None means "auto" with tools and "none" without."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolRequestError("tool_choice", "tool_choice must be 'none', 'auto', 'required' or a function")
        if tool_choice != "none" and not tools:
            raise ToolRequestError("tool_choice", f"tool_choice {tool_choice!r} needs tools")
        return ToolChoice(tool_choice)  # type: ignore[arg-type]
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise ToolRequestError("tool_choice",
                               'a named tool_choice is {"type": "function", "function": {"name": ...}}')
    if name not in {t["function"]["name"] for t in tools or []}:
        raise ToolRequestError("tool_choice", f"tool_choice names the function {name!r}, which is not in tools")
    return ToolChoice("function", name)


def template_tools(tools: list[dict[str, Any]] | None, choice: ToolChoice) -> list[dict[str, Any]] | None:
    """What to pass as the template's `tools`: None for `tool_choice` "none" or no tools. All tools are
    passed for a named function too (as vLLM does); the choice is checked afterwards."""
    return tools_for_template(tools) or None if choice.uses_tools else None


def argument_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """function name → its parameters' JSON-schema properties (for typing GLM argument values)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function") or {}
        props = (fn.get("parameters") or {}).get("properties")
        if isinstance(fn.get("name"), str) and isinstance(props, dict):
            out[fn["name"]] = props
    return out


# -- output side --------------------------------------------------------------------------------------


class ToolStream(ABC):
    """Incremental tool-call parser over a completion's text: `push(delta)` and `finish()` return Deltas
    (content and tool-call pieces, in output order). `calls` and `content` hold what was parsed so far.

    Content is scanned for `<tool_call>`, holding back an end that may be the start of one; a format's
    subclass reads each block from `buf` (`_block`) and reports whether the block has ended."""

    def __init__(self, tools: list[dict[str, Any]] | None = None):
        self.buf = ""
        self.in_block = False
        self.trim = Trimmer()
        self.schemas = argument_types(tools)
        self.calls: list[ToolCall] = []
        self.content_parts: list[str] = []
        self._out: list[Delta] = []

    @property
    def content(self) -> str:
        return "".join(self.content_parts)

    def push(self, delta: str) -> list[Delta]:
        self.buf += delta
        self._drain(final=False)
        return self._take()

    def finish(self) -> list[Delta]:
        self._drain(final=True)
        return self._take()

    def _take(self) -> list[Delta]:
        out, self._out = _merge(self._out), []
        return out

    def _drain(self, final: bool) -> None:
        while True:
            if self.in_block:
                if not self._block(final):
                    return
                self.in_block = False
                continue
            start = self.buf.find(CALL_OPEN)
            if start < 0:
                keep = 0 if final else partial_tag_suffix(self.buf, CALL_OPEN)
                self._content(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return
            self._content(self.buf[:start])
            self.buf = self.buf[start + len(CALL_OPEN):]
            self.in_block = True
            self._begin_block()

    def _content(self, text: str) -> None:
        text = self.trim.feed(text)
        if text:
            self.content_parts.append(text)
            self._out.append(Delta(content=text))

    def _start_call(self, name: str) -> None:
        index = len(self.calls)
        self.calls.append(ToolCall(new_call_id(), name, ""))
        self._out.append(Delta(tool_call={"index": index, "id": self.calls[-1].id, "type": "function",
                                          "function": {"name": name, "arguments": ""}}))

    def _arguments(self, fragment: str) -> None:
        index = len(self.calls) - 1
        c = self.calls[index]
        self.calls[index] = ToolCall(c.id, c.name, c.arguments + fragment)
        self._out.append(Delta(tool_call={"index": index, "function": {"arguments": fragment}}))

    def _begin_block(self) -> None:
        pass

    @abstractmethod
    def _block(self, final: bool) -> bool:
        """Consume what can be consumed of the open call block; True once the block is closed."""


def _hermes_calls(body: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) for each JSON object in a block, or None if the block is not valid."""
    calls, i = [], 0
    while True:
        while i < len(body) and body[i].isspace():
            i += 1
        if i == len(body):
            return calls or None
        try:
            obj, i = _DECODER.raw_decode(body, i)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = _DECODER.decode(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append((obj["name"], json.dumps(args, ensure_ascii=False)))


class HermesToolStream(ToolStream):
    def _block(self, final: bool) -> bool:
        end = self.buf.find(CALL_CLOSE)
        if end < 0 and not final:
            return False
        calls = _hermes_calls(self.buf if end < 0 else self.buf[:end])
        if calls is None:
            # Not a call: its text goes back to the content scan, which may find a real one inside.
            self._content(CALL_OPEN)
            return True
        self.buf = "" if end < 0 else self.buf[end + len(CALL_CLOSE):]
        for name, arguments in calls:
            self._start_call(name)
            self._arguments(arguments)
        return True


class GlmToolStream(ToolStream):
    """GLM-4.5 blocks. A block becomes a call once `NAME` is followed by `<arg_key>` or `</tool_call>`;
    before that, anything that cannot be a name (spaces inside, other tags) leaves the block as content.
    After that, text between the tags is ignored, an argument cut off by the end of the block is
    dropped, and the arguments always close as a JSON object."""

    def _begin_block(self) -> None:
        self.state: Literal["name", "key?", "key", "value?", "value"] = "name"
        self.n_args = 0
        self.key = ""

    def _close_call(self) -> None:
        self._arguments("}" if self.n_args else "{}")

    def _find(self, *tags: str) -> tuple[int, str]:
        """The first of `tags` in `buf`: (position, tag), or (-1, "")."""
        hits = [(i, t) for t in tags if (i := self.buf.find(t)) >= 0]
        return min(hits) if hits else (-1, "")

    def _hold(self, *tags: str) -> None:
        """Drops `buf` but for an end that may be the start of one of `tags`."""
        keep = max(partial_tag_suffix(self.buf, t) for t in tags)
        self.buf = self.buf[len(self.buf) - keep:]

    def _may_be_name(self) -> bool:
        """Whether `buf` (no complete tag in it) can still grow into `NAME` + `<arg_key>`/`</tool_call>`."""
        head = self.buf.lstrip()
        name = re.match(r"[^\s<]*", head).group()  # type: ignore[union-attr]
        rest = head[len(name):].lstrip()
        return len(name) <= MAX_NAME_CHARS and (
            not rest or KEY_OPEN.startswith(rest) or CALL_CLOSE.startswith(rest))

    def _value(self, raw: str) -> Any:
        declared = self.schemas.get(self.calls[-1].name, {}).get(self.key, {})
        if isinstance(declared, dict) and declared.get("type") == "string":
            return raw
        try:
            return _DECODER.decode(raw)
        except ValueError:
            return raw

    def _block(self, final: bool) -> bool:
        while True:
            if self.state == "name":
                at, tag = self._find(KEY_OPEN, CALL_CLOSE)
                if at < 0 and not final and self._may_be_name():
                    return False
                head = self.buf if at < 0 else self.buf[:at]
                name = head.strip()
                if not _NAME.fullmatch(name):
                    # Not a call: its text goes back to the content scan, which may find a real one.
                    self._content(CALL_OPEN)
                    return True
                self._start_call(name)
                self.buf = self.buf[len(head):]
                self.state = "key?"
            elif self.state in ("key?", "value?"):
                opener = KEY_OPEN if self.state == "key?" else VALUE_OPEN
                at, tag = self._find(opener, CALL_CLOSE)
                if at < 0:
                    if final:
                        self._close_call()
                        self.buf = ""
                        return True
                    self._hold(opener, CALL_CLOSE)
                    return False
                self.buf = self.buf[at + len(tag):]
                if tag == CALL_CLOSE:
                    self._close_call()
                    return True
                self.state = "key" if opener == KEY_OPEN else "value"
            else:
                closer = KEY_CLOSE if self.state == "key" else VALUE_CLOSE
                at, tag = self._find(closer, CALL_CLOSE)
                if at < 0:
                    if final:
                        self._close_call()
                        self.buf = ""
                        return True
                    return False
                text, self.buf = self.buf[:at], self.buf[at + len(tag):]
                if tag == CALL_CLOSE:
                    self._close_call()
                    return True
                if self.state == "key":
                    self.key, self.state = text.strip(), "value?"
                    continue
                pair = f"{json.dumps(self.key, ensure_ascii=False)}: " \
                       f"{json.dumps(self._value(text), ensure_ascii=False)}"
                self._arguments(("{" if self.n_args == 0 else ", ") + pair)
                self.n_args += 1
                self.state = "key?"


class ToolParser:
    """One output format. `parse(text)` → (content, calls) for a whole completion; `stream()` → a
    ToolStream for a streamed one. `tools` (the request's) lets GLM keep string parameters strings."""

    format: str = ""
    stream_class: type[ToolStream] = ToolStream

    def stream(self, tools: list[dict[str, Any]] | None = None) -> ToolStream:
        return self.stream_class(tools)

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
        s = self.stream(tools)
        s.push(text)
        s.finish()
        return s.content, s.calls


class HermesToolParser(ToolParser):
    format = "hermes"
    stream_class = HermesToolStream


class GlmToolParser(ToolParser):
    format = "glm45"
    stream_class = GlmToolStream


def tool_parser_for(model_type: str | None, chat_template: str | None) -> ToolParser | None:
    """The parser for a model's tool-call format: by `model_type` (qwen2/qwen3 families → Hermes,
    glm4_moe → GLM-4.5), else by the template's text (`<arg_key>` → GLM-4.5, `<tool_call>` → Hermes),
    else None (the model has no known tool-call format)."""
    if model_type in HERMES_MODEL_TYPES:
        return HermesToolParser()
    if model_type in GLM_MODEL_TYPES:
        return GlmToolParser()
    if chat_template and KEY_OPEN in chat_template:
        return GlmToolParser()
    if chat_template and CALL_OPEN in chat_template:
        return HermesToolParser()
    return None


# -- both together ------------------------------------------------------------------------------------


@dataclass
class ChatOutput:
    content: str
    reasoning: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChatOutputParser:
    """A chat completion's text split into reasoning, content and tool calls, streamed or whole.

    Reasoning (when `reasoning` is given) is split off first; only the content that follows is read
    for tool calls (when `tools` is given): a call drafted inside the reasoning is not a call. Either
    parser may be None. `push`/`finish` return merged Deltas; `parse` returns a ChatOutput.
    """

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, *,
                 opened_in_prompt: bool = False, request_tools: list[dict[str, Any]] | None = None):
        self.reasoning: ReasoningStream | None = reasoning.stream(opened_in_prompt) if reasoning else None
        self.tools: ToolStream | None = tools.stream(request_tools) if tools else None
        self.reasoning_parts: list[str] = []
        self.content_parts: list[str] = []

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools else []

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """`tool_calls` when the model stopped by itself after making calls; else the engine's reason."""
        return "tool_calls" if engine_reason == "stop" and self.tool_calls else engine_reason

    def push(self, text: str) -> list[Delta]:
        return self._route(self.reasoning.push(text) if self.reasoning else [("content", text)], final=False)

    def finish(self) -> list[Delta]:
        return self._route(self.reasoning.finish() if self.reasoning else [], final=True)

    def _route(self, pieces: list[tuple[str, str]], final: bool) -> list[Delta]:
        out: list[Delta] = []
        for kind, text in pieces:
            if kind == "reasoning":
                self.reasoning_parts.append(text)
                out.append(Delta(reasoning=text))
            elif self.tools:
                out.extend(self.tools.push(text))
            else:
                out.append(Delta(content=text))
        if final and self.tools:
            out.extend(self.tools.finish())
        out = _merge(out)
        self.content_parts.extend(d.content for d in out if d.content)
        return out

    def parse(self, text: str) -> ChatOutput:
        """The whole completion at once (this parser must be fresh)."""
        self.push(text)
        self.finish()
        return self.result()

    def result(self) -> ChatOutput:
        entered = self.reasoning is not None and self.reasoning.entered
        return ChatOutput(content="".join(self.content_parts),
                          reasoning="".join(self.reasoning_parts) if entered else None,
                          tool_calls=list(self.tool_calls))
