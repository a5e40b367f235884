"""OpenAI's Responses API (`POST /v1/responses`, and `GET /v1/responses/{id}`), as the OpenAI Agents SDK
and coding agents call it.

A request is translated into the chat-completion request it means and runs the chat path (templates,
checks, output parsers): `input` as a string or items (messages with `input_text` / `output_text`
parts, `function_call` and `function_call_output` items), `instructions` as a system message,
`max_output_tokens`, `temperature`, `top_p`, function `tools` and `tool_choice`, structured output
through `text.format` (`json_schema`, `json_object`). The output is items: `reasoning` (a `<think>`
model's reasoning), `message` (`output_text`) and `function_call`; streamed as the Responses event
sequence (`response.created` ... `response.completed`). Responses are kept in memory (the last
MAX_STORED, unless `store: false`) for `previous_response_id`, which continues one's conversation.
Built-in tools (web search, file search, ...) and non-text input are a 400 naming them.
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from typing import Any, Iterator, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import Field, ValidationError

from strata.engine.types import EngineEvent
from strata.server import protocol as P
from strata.server.errors import APIError, validation_error
from strata.server.jobs import collect, stream_response, visible_tokens
from strata.server.llama_routes import Timer
from strata.server.request_body import read_json
from strata.server.service import ModelService
from strata.server.tools import ChatOutputParser, Delta

MAX_STORED = 256  # responses kept for previous_response_id


class ResponsesRequest(P.RequestModel):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=P.MAX_OUTPUT_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop context silently
    seed: int | None = None  # an extension, as in the chat API
    # llama-server's, when streamed: `timings` on every text delta, and a `response.in_progress` event with
    # `prompt_progress` per chunk of the prompt read; the last event carries `timings` when either is set.
    timings_per_token: bool = False
    return_progress: bool = False


def _text_of(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "reasoning_text", "summary_text"):
            raise APIError(400, f"{where}: content of type {kind!r} is not supported (text only)", param="input")
        parts.append(part.get("text") or "")
    return "".join(parts)


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: consecutive function calls become one assistant
    message's `tool_calls`, their outputs `tool` messages."""
    out: list[dict[str, Any]] = []
    for k, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{k}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role: expected user, assistant, system or developer", param="input")
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id") or f"call_{k}", "type": "function",
                    "function": {"name": item.get("name") or "", "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where)
            out.append({"role": "tool", "tool_call_id": item.get("call_id") or "", "content": text})
        elif kind == "reasoning":
            continue  # earlier reasoning is not sent back to the model, as chat templates drop it
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported", param="input")
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for k, t in enumerate(tools):
        if t.get("type") != "function":
            raise APIError(400, f"tools[{k}]: tools of type {t.get('type')!r} are not supported (function tools "
                                f"only)", param="tools")
        out.append({"type": "function", "function": {k2: t[k2] for k2 in ("name", "description", "parameters")
                                                      if t.get(k2) is not None}})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise APIError(400, f"tool_choice of type {choice.get('type')!r} is not supported", param="tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    raise APIError(400, f"text.format of type {fmt.get('type')!r} is not supported", param="text")


class ResponsesAPI:
    def __init__(self, service: ModelService):
        self.s = service
        # response id -> (the chat messages it continued, its output items): previous_response_id
        self.stored: collections.OrderedDict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = \
            collections.OrderedDict()
        self.bodies: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()

    def routers(self) -> list[APIRouter]:
        r = APIRouter(dependencies=[Depends(self.s.authorize)])
        r.add_api_route("/v1/responses", self.create, methods=["POST"])
        r.add_api_route("/responses", self.create, methods=["POST"])
        r.add_api_route("/v1/responses/{rid}", self.get, methods=["GET"])
        return [r]

    async def get(self, rid: str) -> Response:
        body = self.bodies.get(rid)
        if body is None:
            raise APIError(404, f"no stored response {rid!r}", param="response_id", code="not_found")
        return Response(json.dumps(body), media_type="application/json")

    def _keep(self, rid: str, history: list[dict[str, Any]], items: list[dict[str, Any]], body: dict[str, Any]) -> None:
        self.stored[rid] = (history, items)
        self.bodies[rid] = body
        while len(self.stored) > MAX_STORED:
            self.stored.popitem(last=False)
            self.bodies.popitem(last=False)

    async def create(self, request: Request) -> Response:
        s = self.s
        data = await read_json(request, s.cfg.max_body_bytes, s.cfg.body_timeout)
        try:
            body = ResponsesRequest.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            prev = self.stored.get(body.previous_response_id)
            if prev is None:
                raise APIError(404, f"previous_response_id {body.previous_response_id!r} is not stored (responses "
                                    f"are kept in memory, the last {MAX_STORED})", param="previous_response_id",
                               code="previous_response_not_found")
            history = prev[0] + _messages(prev[1])
        items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
        turn = _messages(items)
        messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + \
            [m for m in history if m["role"] != "system" or not body.instructions] + turn
        chat_data: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream,
                                     "max_tokens": body.max_output_tokens, "temperature": body.temperature,
                                     "top_p": body.top_p, "tools": _tools(body.tools),
                                     "tool_choice": _tool_choice(body.tool_choice),
                                     "parallel_tool_calls": body.parallel_tool_calls,
                                     "response_format": _response_format(body.text), "seed": body.seed,
                                     "return_progress": body.return_progress}
        effort = (body.reasoning or {}).get("effort")
        if effort is not None:
            chat_data["chat_template_kwargs"] = {"enable_thinking": effort not in ("none", "minimal")}
        try:
            chat = P.ChatCompletionRequest.model_validate({k: v for k, v in chat_data.items() if v is not None})
            chat.check_supported()
        except ValidationError as e:
            raise validation_error(e) from None
        except P.Unsupported as e:
            raise APIError(400, str(e), param=e.param, code="unsupported_parameter") from None
        rid = f"resp_{uuid.uuid4().hex}"
        job, streams, parsers, _ = await s.start_chat(rid, chat)
        out = _Output(rid, body, body.model or s.model_name, parsers[0] if parsers else None)
        kept = history + turn

        def done(response: dict[str, Any]) -> None:
            if body.store:
                self._keep(rid, kept, response["output"], response)

        if body.stream:
            out.on_done = done
            return stream_response(request, job, streams, out, end=None)
        r = (await collect(request, job, streams))[0]
        ev = EngineEvent(rid, tuple(r.token_ids), "".join(r.text), r.finish_reason, r.prompt_tokens,
                         r.completion_tokens, cached_tokens=r.cached_tokens)
        for _ in out.event(0, ev):
            pass
        done(out.response)
        return Response(json.dumps(out.response), media_type="application/json")


class _Output:
    """Engine events to Responses output items; as SSE events when streamed (the `Chunks` interface of
    `strata.server.jobs.stream_response`), else read `response` after the last event."""

    def __init__(self, rid: str, body: ResponsesRequest, model: str, parser: ChatOutputParser | None):
        self.rid, self.body, self.model, self.parser = rid, body, model, parser
        self.created = int(time.time())
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
        self.sent = 0
        self.on_done: Any = None
        self.response = self._response("in_progress")
        self.timer = Timer()
        self.reported = False  # prompt progress reported (the cache's share first)
        self.cached = 0
        self.delta_extra: dict[str, Any] = {}  # what each text delta carries beside its own fields

    def _response(self, status: str, usage: dict[str, Any] | None = None, incomplete: str | None = None,
                  ) -> dict[str, Any]:
        b = self.body
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": list(self.items), "usage": usage, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "previous_response_id": b.previous_response_id, "temperature": b.temperature, "top_p": b.top_p,
                "tools": b.tools or [], "tool_choice": b.tool_choice or "auto",
                "parallel_tool_calls": b.parallel_tool_calls is not False,
                "text": b.text or {"format": {"type": "text"}}, "metadata": b.metadata or {}, "store": b.store,
                "reasoning": b.reasoning, "truncation": "disabled"}

    def _sse(self, kind: str, data: dict[str, Any]) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    # -- the item being written --------------------------------------------------------------------

    def _index(self) -> int:
        return len(self.items) - 1

    def _start(self, kind: str) -> Iterator[str]:
        yield from self._close()
        if kind == "message":
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self.open = item
        yield self._sse("response.output_item.added", {"output_index": self._index(), "item": {**item, "content": []}})
        item["content"].append(part)
        yield self._sse("response.content_part.added", {"item_id": item["id"], "output_index": self._index(),
                                                        "content_index": 0, "part": dict(part)})

    def _text(self, kind: str, text: str) -> Iterator[str]:
        if self.open is None or self.open["type"] != kind:
            yield from self._start(kind)
        item = self.open
        assert item is not None
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        yield self._sse(name, {"item_id": item["id"], "output_index": self._index(), "content_index": 0,
                               "delta": text, **extra, **self.delta_extra})

    def _close(self) -> Iterator[str]:
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = "completed"
        idx = self.items.index(item)
        if item["type"] == "function_call":
            yield self._sse("response.function_call_arguments.done", {"item_id": item["id"], "output_index": idx,
                                                                      "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            yield self._sse(f"response.{kind}.done", {"item_id": item["id"], "output_index": idx, "content_index": 0,
                                                      "text": part["text"], **({"logprobs": []} if kind == "output_text"
                                                                               else {})})
            yield self._sse("response.content_part.done", {"item_id": item["id"], "output_index": idx,
                                                           "content_index": 0, "part": dict(part)})
        yield self._sse("response.output_item.done", {"output_index": idx, "item": item})

    def _call(self, d: dict[str, Any]) -> Iterator[str]:
        fn = d.get("function") or {}
        index = d.get("index", 0)
        if "id" in d:
            yield from self._close()
            item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": d["id"],
                    "name": fn.get("name") or "", "arguments": "", "status": "in_progress"}
            self.items.append(item)
            self.calls[index] = self.open = item
            yield self._sse("response.output_item.added", {"output_index": self._index(), "item": dict(item)})
        item = self.calls.get(index)
        fragment = fn.get("arguments") or ""
        if item is not None and fragment:
            item["arguments"] += fragment
            yield self._sse("response.function_call_arguments.delta", {"item_id": item["id"],
                                                                       "output_index": self.items.index(item),
                                                                       "delta": fragment})

    def _delta(self, d: Delta) -> Iterator[str]:
        if d.tool_call is not None:
            yield from self._call(d.tool_call)
        elif d.reasoning:
            yield from self._text("reasoning", d.reasoning)
        elif d.content:
            yield from self._text("message", d.content)

    # -- the Chunks interface ----------------------------------------------------------------------

    def start(self) -> Iterator[str]:
        yield self._sse("response.created", {"response": self._response("in_progress")})
        yield self._sse("response.in_progress", {"response": self._response("in_progress")})

    def event(self, i: int, ev: EngineEvent) -> Iterator[str]:
        self.timer.seen(ev)
        if ev.prompt_read is not None:
            yield from self._progress(ev)
            return
        if ev.error:
            self.response = {**self._response("failed"), "error": {"code": "server_error", "message": ev.error}}
            yield self._sse("response.failed", {"response": self.response})
            return
        ids, _, _ = visible_tokens(ev, self.sent)
        self.sent += len(ids)
        if self.body.timings_per_token:
            self.delta_extra = {"timings": self.timer.timings(ev.prompt_tokens, self.cached, self.sent)}
        deltas = self.parser.push(ev.text) if self.parser is not None else [Delta(content=ev.text)] if ev.text else []
        if ev.finish_reason is not None and self.parser is not None:
            deltas += self.parser.finish()
        for d in deltas:
            yield from self._delta(d)
        if ev.finish_reason is None:
            return
        yield from self._close()
        if not self.items:  # an empty answer is still a message
            yield from self._start("message")
            yield from self._close()
        usage = {"input_tokens": ev.prompt_tokens, "output_tokens": ev.completion_tokens,
                 "total_tokens": ev.prompt_tokens + ev.completion_tokens,
                 "input_tokens_details": {"cached_tokens": ev.cached_tokens},
                 "output_tokens_details": {"reasoning_tokens": 0}}
        length = ev.finish_reason == "length"
        self.response = self._response("incomplete" if length else "completed", usage,
                                       "max_output_tokens" if length else None)
        if self.on_done is not None:
            self.on_done(self.response)
        last: dict[str, Any] = {"response": self.response}
        if self.body.timings_per_token or self.body.return_progress:
            last["timings"] = self.timer.timings(ev.prompt_tokens, max(self.cached, ev.cached_tokens), self.sent)
        yield self._sse("response.incomplete" if length else "response.completed", last)

    def _progress(self, ev: EngineEvent) -> Iterator[str]:
        """llama-server's progress events: `response.in_progress` with `prompt_progress`."""
        self.cached = ev.cached_tokens
        for first in [True, False] if not self.reported else [False]:
            data: dict[str, Any] = {"response": self._response("in_progress"),
                                    "prompt_progress": self.timer.progress(ev, first)}
            if self.body.timings_per_token:
                data["timings"] = self.timer.read_timings(ev.cached_tokens if first else ev.prompt_read,
                                                          ev.cached_tokens, not first)
            yield self._sse("response.in_progress", data)
        self.reported = True

    def error(self, message: str) -> Iterator[str]:
        self.response = {**self._response("failed"), "error": {"code": "server_shutting_down", "message": message}}
        yield self._sse("response.failed", {"response": self.response})

    def end(self) -> Iterator[str]:
        return iter(())


def responses_routers(service: ModelService) -> list[APIRouter]:
    return ResponsesAPI(service).routers()
