"""Anthropic's Messages API (`POST /v1/messages`), as llama-server and vLLM serve it to coding agents.

A request is translated into the chat-completion request it means (content blocks into OpenAI
messages: `tool_use` into an assistant's `tool_calls`, `tool_result` into a `tool` message; tools
into function tools; `tool_choice` any/tool into required/named) and runs the chat path's
templating, checks, submission and output parsers. Only the response is Anthropic's own: content
blocks (`thinking`, `text`, `tool_use`), `stop_reason`, and streamed, its SSE event sequence.

The key is read from `x-api-key` or `Authorization: Bearer`; errors have Anthropic's shape
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterator, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from strata.engine.types import EngineEvent
from strata.server import protocol as P
from strata.server.errors import APIError, validation_error
from strata.server.jobs import Result, collect, stream_response
from strata.server.request_body import read_json, validate_body
from strata.server.service import ModelService
from strata.server.tools import ChatOutputParser, Delta

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class AnthropicError(APIError):
    """An APIError answered in Anthropic's error shape."""

    @classmethod
    def of(cls, e: APIError) -> "AnthropicError":
        return cls(e.status, e.message, type_=e.type, param=e.param, code=e.code, headers=e.headers)

    def response(self) -> Response:
        return Response(json.dumps(_error_body(self.status, self.message)), status_code=self.status,
                        media_type="application/json", headers=self.headers)


def _error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


# -- request ----------------------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class Block(_Model):
    type: str
    text: str | None = None
    thinking: str | None = None  # thinking
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list["Block"] | None = None
    is_error: bool | None = None


class Message(_Model):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Model):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: str | None = None  # "custom" or absent; Anthropic's server tools are not supported


class ToolChoiceSpec(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class Thinking(_Model):
    type: Literal["enabled", "disabled", "adaptive"]


class MessagesRequest(_Model):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceSpec | None = None
    thinking: Thinking | None = None
    metadata: dict[str, Any] | None = None


def _text_of(blocks: str | list[Block] | None, where: str) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    for b in blocks:
        if b.type != "text":
            raise APIError(400, f"{where}: content blocks of type {b.type!r} are not supported here", param=where)
    return "".join(b.text or "" for b in blocks)


def _chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages; a user turn's tool results come first, as tool messages."""
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _text_of(body.system, "system")})
    for k, m in enumerate(body.messages):
        where = f"messages[{k}]"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[dict[str, Any]] = []
        for b in m.content:
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.id or not b.name:
                    raise APIError(400, f"{where}: a tool_use block needs id and name", param=where)
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name, "arguments": json.dumps(b.input or {})}})
            elif b.type == "tool_result" and m.role == "user":
                if not b.tool_use_id:
                    raise APIError(400, f"{where}: a tool_result block needs tool_use_id", param=where)
                result = _text_of(b.content, where)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": f"Error: {result}" if b.is_error else result})
            elif b.type == "thinking" and m.role == "assistant":
                thoughts.append(b.thinking or "")  # the chat template decides whether the model sees it
            elif b.type == "redacted_thinking" and m.role == "assistant":
                continue
            else:
                raise APIError(400, f"{where}: content blocks of type {b.type!r} are not supported in "
                                    f"{m.role} messages", param=where)
        reasoning = {"reasoning_content": "".join(thoughts)} if thoughts else {}
        if calls:
            out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls} | reasoning)
        elif texts or m.role == "assistant":
            out.append({"role": m.role, "content": "".join(texts)} | reasoning)
    return out


def _tool_choice(choice: ToolChoiceSpec | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice of type 'tool' needs a name", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"any": "required"}.get(choice.type, choice.type)


def to_chat_request(body: MessagesRequest) -> P.ChatCompletionRequest:
    tools = None
    if body.tools:
        for i, t in enumerate(body.tools):
            if t.type not in (None, "custom"):
                raise APIError(400, f"tools[{i}]: tools of type {t.type!r} are not supported", param=f"tools[{i}]")
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in body.tools]
    chat: dict[str, Any] = {
        "model": body.model, "messages": _chat_messages(body), "max_tokens": body.max_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k or None,
        "stop": body.stop_sequences, "tools": tools, "tool_choice": _tool_choice(body.tool_choice),
    }
    if body.thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    return validate_body(P.ChatCompletionRequest, chat)


# -- response ---------------------------------------------------------------------------------------


def _stop_reason(engine_reason: str | None, parser: ChatOutputParser | None, output: str,
                 stops: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). `output` is the decoded completion, stop string included: the
    engine cuts the stop string from the text it sends, and stops at the first it finds."""
    if parser is not None and parser.finish_reason(engine_reason) == "tool_calls":
        return "tool_use", None
    if engine_reason == "length":
        return "max_tokens", None
    hits = [(i, s) for s in stops if (i := output.find(s)) >= 0]
    if engine_reason == "stop" and hits:
        return "stop_sequence", min(hits)[1]
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _message(rid: str, model: str, r: Result, parser: ChatOutputParser | None, output: str,
             stops: list[str]) -> dict[str, Any]:
    text = "".join(r.text)
    content: list[dict[str, Any]] = []
    if parser is None:
        if text:
            content.append({"type": "text", "text": text})
    else:
        parsed = parser.parse(text)
        if parsed.reasoning:
            content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
        if parsed.content:
            content.append({"type": "text", "text": parsed.content})
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _tool_input(c.arguments)}
                    for c in parsed.tool_calls]
    reason, sequence = _stop_reason(r.finish_reason, parser, output, stops)
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": _usage(r.prompt_tokens, r.cached_tokens, r.completion_tokens)}


def _usage(prompt: int, cached: int | None, output: int) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt tokens read anew; those the prefix cache held are
    cache reads (Strata writes no explicit cache entries, so nothing counts as a cache creation)."""
    cached = cached or 0
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": output}


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


class _MessageEvents:
    """Engine events of one completion to Anthropic's SSE events: one content block per run of
    thinking, text or one tool call, opened when its first piece arrives and stopped when the next
    block opens or the message ends."""

    def __init__(self, tokenizer: Any, rid: str, model: str, parser: ChatOutputParser | None,
                 stops: list[str], input_tokens: int):
        self.tokenizer, self.rid, self.model, self.parser, self.stops = tokenizer, rid, model, parser, stops
        self.input_tokens = input_tokens
        self.blocks = 0
        self.open: str | None = None  # the open block's type
        self.ids: list[int] = []  # the completion's tokens, to tell which stop sequence ended it

    def start(self) -> Iterator[str]:
        message = {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": _usage(self.input_tokens, 0, 0)}
        yield _event("message_start", {"type": "message_start", "message": message})

    def end(self) -> Iterator[str]:
        return iter(())  # message_stop is sent with the finishing event

    def error(self, message: str) -> Iterator[str]:
        yield _event("error", _error_body(503, message))

    def _close(self) -> Iterator[str]:
        if self.open is not None:
            yield _event("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})
            self.open = None

    def _open(self, block: dict[str, Any]) -> Iterator[str]:
        yield from self._close()
        yield _event("content_block_start", {"type": "content_block_start", "index": self.blocks,
                                             "content_block": block})
        self.open = block["type"]
        self.blocks += 1

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.blocks - 1,
                                              "delta": delta})

    def _piece(self, d: Delta) -> Iterator[str]:
        if d.reasoning:
            if self.open != "thinking":
                yield from self._open({"type": "thinking", "thinking": "", "signature": ""})
            yield self._delta({"type": "thinking_delta", "thinking": d.reasoning})
        elif d.content:
            if self.open != "text":
                yield from self._open({"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": d.content})
        elif d.tool_call is not None:
            fn = d.tool_call.get("function") or {}
            if d.tool_call.get("id"):
                yield from self._open({"type": "tool_use", "id": d.tool_call["id"], "name": fn.get("name", ""),
                                       "input": {}})
            if fn.get("arguments"):
                yield self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})

    def event(self, i: int, ev: EngineEvent) -> Iterator[str]:
        if ev.error:
            yield _event("error", _error_body(500, f"the engine failed the request: {ev.error}"))
            return
        self.ids.extend(ev.token_ids[: max(0, ev.completion_tokens - len(self.ids))])
        if self.parser is None:
            pieces = [Delta(content=ev.text)] if ev.text else []
        else:
            pieces = self.parser.push(ev.text) + (self.parser.finish() if ev.finish_reason is not None else [])
        for d in pieces:
            yield from self._piece(d)
        if ev.finish_reason is None:
            return
        yield from self._close()
        output = self.tokenizer.decode(self.ids) if self.stops and ev.finish_reason == "stop" else ""
        reason, sequence = _stop_reason(ev.finish_reason, self.parser, output, self.stops)
        yield _event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                       "usage": _usage(ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens)})
        yield _event("message_stop", {"type": "message_stop"})


# -- the endpoint -----------------------------------------------------------------------------------


def _authorize(s: ModelService, request: Request) -> None:
    if s.cfg.api_key is not None and not s.key_matches(request):
        raise APIError(401, "invalid x-api-key: send `x-api-key: <key>` or `Authorization: Bearer <key>`")


async def anthropic_messages(s: ModelService, request: Request) -> Response:
    try:
        _authorize(s, request)
        data = await read_json(request, s.cfg.max_body_bytes, s.cfg.body_timeout)
        try:
            body = MessagesRequest.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        chat = to_chat_request(body)
        rid = f"msg_{uuid.uuid4().hex[:24]}"
        job, streams, parsers, prompt_ids = await s.start_chat(rid, chat)
        n_prompt = len(prompt_ids)
        parser = parsers[0] if parsers else None
        stops = list(chat.stop or [])
        if body.stream:
            events = _MessageEvents(s.tokenizer, rid, body.model or s.model_name, parser, stops, n_prompt)
            return stream_response(request, job, streams, events, end=None)
        r = (await collect(request, job, streams))[0]
        output = s.tokenizer.decode(r.token_ids) if stops and r.finish_reason == "stop" else ""
        return Response(json.dumps(_message(rid, body.model or s.model_name, r, parser, output, stops)),
                        media_type="application/json")
    except APIError as e:
        raise AnthropicError.of(e) from None


def anthropic_router(s: ModelService) -> APIRouter:
    """`POST /v1/messages`: its own key header and error shape, so not behind the OpenAI routes' `authorize`."""

    async def messages(request: Request) -> Response:
        return await anthropic_messages(s, request)

    router = APIRouter()
    router.add_api_route("/v1/messages", messages, methods=["POST"])
    return router
