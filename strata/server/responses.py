"""OpenAI response bodies made of engine events: whole chat and text completions, their SSE chunks when
streamed, and usage.

The routes (`strata.server.openai_routes`) turn requests into engine requests; this module turns the
engine's events into what OpenAI clients read.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

from fastapi.responses import Response
from pydantic import BaseModel

from strata.engine.types import EngineEvent
from strata.server import protocol as P
from strata.server.jobs import Result, visible_tokens
from strata.server.logprobs import LogprobFormatter
from strata.server.tools import ChatOutputParser


# serialize_as_any: a usage is a `CachedUsage` (its prompt_tokens_details are not in P.Usage's schema).
def json_response(model: BaseModel, extra: dict[str, Any] | None = None) -> Response:
    """`model` as JSON, with `extra`'s keys beside its own (llama-server's `__verbose`) when given."""
    if not extra:
        return Response(model.model_dump_json(serialize_as_any=True), media_type="application/json")
    body = {**model.model_dump(mode="json", serialize_as_any=True), **extra}
    return Response(json.dumps(body, separators=(",", ":"), ensure_ascii=False), media_type="application/json")


def sse_event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json(serialize_as_any=True)}\n\n"


def error_event(message: str, code: str | None = None) -> str:
    """The SSE line that ends a stream the engine failed (or the server interrupted: `code`)."""
    return sse_event(P.ErrorResponse(error=P.ErrorDetail(message=message, type="server_error", code=code)))


class CachedUsage(P.Usage):
    prompt_tokens_details: dict  # {"cached_tokens": prompt tokens read from the prefix cache}, as OpenAI


def response_usage(parts: list[Result] | list[EngineEvent], per_prompt: int | None = None) -> P.Usage:
    """The usage of a response whose choices are `parts` (results, or their last events): each prompt
    counted once (`per_prompt`: choices per prompt, in order; None: one prompt), completions summed;
    cached tokens of the choice that found the most."""
    step = per_prompt or len(parts)
    prompt = sum(parts[k].prompt_tokens for k in range(0, len(parts), step))
    completion = sum(p.completion_tokens for p in parts)
    return CachedUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       speculation=pooled_spec([p.spec for p in parts if p.spec]),
                       prompt_tokens_details={"cached_tokens": max(p.cached_tokens for p in parts)})


def pooled_spec(specs: list[dict]) -> dict | None:
    """One speculation summary for several choices: counts summed, rates weighted by drafts proposed."""
    if len(specs) <= 1:
        return specs[0] if specs else None
    weights = [s["drafts_proposed"] for s in specs]
    proposed, accepted = sum(weights), sum(s["drafts_accepted"] for s in specs)

    def mean(values: list[float]) -> float:
        return sum(w * v for w, v in zip(weights, values)) / proposed if proposed else 0.0

    positions = len(specs[0]["accepted_per_position"])
    return {"drafts_proposed": proposed, "drafts_accepted": accepted,
            "verification_steps": sum(s["verification_steps"] for s in specs),
            "acceptance": accepted / proposed if proposed else 0.0,
            "mean_accepted_length": mean([s["mean_accepted_length"] for s in specs]),
            "accepted_per_position": [mean([s["accepted_per_position"][j] for s in specs]) for j in range(positions)]}


class Chunks:
    """What both SSE formats share: `n` choices, each with its own count of tokens sent; an error
    ends the stream; token ids are paired with logprobs (`logprobs`, None when the request asked for
    none); usage follows the last choice's finish."""

    def __init__(self, rid: str, model: str, n: int, include_usage: bool, logprobs: LogprobFormatter | None):
        self.rid, self.model = rid, model
        self.include_usage, self.logprobs = include_usage, logprobs
        self.created = int(time.time())
        self.sent = [0] * n
        self.finals: dict[int, EngineEvent] = {}  # the finished choices' final events
        self.per_prompt: int | None = None  # choices per prompt when a request has several prompts

    def error(self, message: str) -> Iterator[str]:
        """A stream the server ends before the engine did (its shutdown)."""
        yield error_event(message, "server_shutting_down")

    def _error_or_tokens(self, i: int, ev: EngineEvent) -> tuple[str | None, tuple[int, ...], Any, Any]:
        if ev.error:
            return error_event(ev.error), (), None, None
        ids, lps, tops = visible_tokens(ev, self.sent[i])
        self.sent[i] += len(ids)
        return None, ids, lps, tops

    def _usage_when_done(self, i: int, ev: EngineEvent) -> P.Usage | None:
        if ev.finish_reason is None:
            return None
        self.finals[i] = ev
        if not self.include_usage or len(self.finals) < len(self.sent):
            return None
        return response_usage([self.finals[k] for k in range(len(self.sent))], self.per_prompt)


class ChatChunks(Chunks):
    """Engine events to `chat.completion.chunk` SSE lines. With `parsers` (one per choice), each
    choice's text goes through its `ChatOutputParser` and every Delta it gives is one chunk; logprobs of
    an event that gave none wait for the choice's next chunk (at the end, an empty-content one)."""

    def __init__(self, rid: str, model: str, n: int, include_usage: bool, logprobs: LogprobFormatter | None,
                 parsers: list[ChatOutputParser] | None = None):
        super().__init__(rid, model, n, include_usage, logprobs)
        self.parsers = parsers
        self.held: list[list[P.TokenLogprob]] = [[] for _ in range(n)]

    def _chunk(self, i: int, delta: P.ChatDelta, finish: str | None = None,
               logprobs: P.ChoiceLogprobs | None = None) -> str:
        choice = P.ChatChunkChoice(index=i, delta=delta, finish_reason=finish, logprobs=logprobs)
        return sse_event(P.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model,
                                               choices=[choice]))

    def start(self) -> Iterator[str]:
        for i in range(len(self.sent)):
            yield self._chunk(i, P.ChatDelta(role="assistant"))

    def event(self, i: int, ev: EngineEvent) -> Iterator[str]:
        error, ids, lps, tops = self._error_or_tokens(i, ev)
        if error:
            yield error
            return
        lp = self.logprobs.chat_logprobs(ids, lps, tops) if self.logprobs is not None else None
        finish = ev.finish_reason
        if self.parsers is None:
            if ev.text or lp is not None and lp.content:
                yield self._chunk(i, P.ChatDelta(content=ev.text), logprobs=lp)
        else:
            yield from self._parsed(i, ev, lp)
            if finish is not None:
                finish = self.parsers[i].finish_reason(finish)
        if ev.finish_reason is not None:
            yield self._chunk(i, P.ChatDelta(), finish=finish)
        usage = self._usage_when_done(i, ev)
        if usage is not None:
            yield sse_event(P.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[],
                                                  usage=usage))

    def _parsed(self, i: int, ev: EngineEvent, lp: P.ChoiceLogprobs | None) -> Iterator[str]:
        out = self.parsers[i]  # type: ignore[index]
        deltas = out.push(ev.text)
        if ev.finish_reason is not None:
            deltas += out.finish()
        if lp is not None and lp.content:
            self.held[i].extend(lp.content)
        for d in deltas:
            delta = P.ChatDelta(content=d.content, reasoning_content=d.reasoning,
                                tool_calls=[d.tool_call] if d.tool_call is not None else None)
            yield self._chunk(i, delta, logprobs=self._take_held(i))
        if ev.finish_reason is not None and self.held[i]:
            yield self._chunk(i, P.ChatDelta(content=""), logprobs=self._take_held(i))

    def _take_held(self, i: int) -> P.ChoiceLogprobs | None:
        if not self.held[i]:
            return None
        held, self.held[i] = self.held[i], []
        return P.ChoiceLogprobs(content=held)


def chat_message(r: Result, out: ChatOutputParser | None) -> tuple[P.AssistantMessage, str | None]:
    """A whole choice's message and finish reason; with `out` (a fresh parser), its text split into
    reasoning, content and tool calls."""
    text = "".join(r.text)
    if out is None:
        return P.AssistantMessage(content=text), r.finish_reason
    parsed = out.parse(text)
    calls = [c.to_openai() for c in parsed.tool_calls]
    message = P.AssistantMessage(content=(parsed.content or None) if calls else parsed.content,
                                 reasoning_content=parsed.reasoning, tool_calls=calls or None)
    return message, out.finish_reason(r.finish_reason)


class CompletionChunks(Chunks):
    """Engine events to `text_completion` SSE lines."""

    def __init__(self, rid: str, model: str, n: int, include_usage: bool, logprobs: LogprobFormatter | None,
                 echo: list[str]):
        super().__init__(rid, model, n, include_usage, logprobs)
        self.echo = echo  # per choice
        self.offset = [0] * n

    def _chunk(self, i: int, text: str, finish: str | None = None, logprobs: P.CompletionLogprobs | None = None,
               usage: P.Usage | None = None) -> str:
        choices = [] if usage else [P.CompletionChoice(index=i, text=text, finish_reason=finish, logprobs=logprobs)]
        return sse_event(P.Completion(id=self.rid, created=self.created, model=self.model, choices=choices,
                                      usage=usage))

    def start(self) -> Iterator[str]:
        for i, text in enumerate(self.echo):
            if text:
                yield self._chunk(i, text)

    def event(self, i: int, ev: EngineEvent) -> Iterator[str]:
        error, ids, lps, tops = self._error_or_tokens(i, ev)
        if error:
            yield error
            return
        lp = (self.logprobs.completion_logprobs(ids, lps, self.offset[i], tops) if self.logprobs is not None
              else None)
        self.offset[i] += len(ev.text)
        if ev.text or ev.finish_reason is not None or lp is not None and lp.tokens:
            yield self._chunk(i, ev.text, ev.finish_reason, lp)
        usage = self._usage_when_done(i, ev)
        if usage is not None:
            yield self._chunk(i, "", usage=usage)
