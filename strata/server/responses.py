"""Response bodies of the OpenAI API: whole completions gathered from engine events, SSE chunks of
streamed ones, usage, and the engine requests behind one response (`_Job`, `_Merged`).

`app.py` owns the routes and turns requests into engine requests; this module turns engine events
into what clients read.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from strata.engine.types import EngineEvent
from strata.server import protocol as P
from strata.server.tools import ChatOutputParser

if TYPE_CHECKING:
    from strata.server.app import _Server


# serialize_as_any: a usage is a `_CachedUsage` (its prompt_tokens_details are not in P.Usage's schema).
def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(serialize_as_any=True), media_type="application/json")


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json(serialize_as_any=True)}\n\n"


_Tops = tuple[tuple[tuple[int, float], ...], ...]


def _visible(ev: EngineEvent, sent: int) -> tuple[tuple[int, ...], tuple[float, ...] | None, _Tops | None]:
    """The event's tokens that belong to the completion (the engine does not count a final EOS), with
    their logprobs and alternatives where the event has them."""
    keep = max(0, min(len(ev.token_ids), ev.completion_tokens - sent))
    return (ev.token_ids[:keep], tuple(ev.logprobs[:keep]) if ev.logprobs is not None else None,
            tuple(ev.top_logprobs[:keep]) if ev.top_logprobs is not None else None)


class _Result:
    """A whole completion gathered from engine events."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] | None = None
        self.tops: list[tuple[tuple[int, float], ...]] | None = None
        self.finish_reason: str | None = None
        self.prompt_tokens = self.completion_tokens = 0
        self.error: str | None = None
        self.spec: dict | None = None
        self.cached_tokens = 0

    def add(self, ev: EngineEvent) -> None:
        self.text.append(ev.text)
        ids, lps, tops = _visible(ev, len(self.token_ids))
        self.token_ids.extend(ids)
        if lps is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs.extend(lps)
        if tops is not None:
            self.tops = self.tops if self.tops is not None else []
            self.tops.extend(tops)
        self.finish_reason = ev.finish_reason or self.finish_reason
        self.prompt_tokens, self.completion_tokens = ev.prompt_tokens, ev.completion_tokens
        self.error = ev.error or self.error
        self.spec = ev.spec or self.spec
        self.cached_tokens = ev.cached_tokens or self.cached_tokens


class _CachedUsage(P.Usage):
    prompt_tokens_details: dict  # {"cached_tokens": prompt tokens read from the prefix cache}, as OpenAI


def _usage(parts: list[_Result] | list[EngineEvent]) -> P.Usage:
    """The usage of a response whose choices are `parts` (results, or their last events): the prompt
    counted once, completions summed; cached tokens of the choice that found the most."""
    prompt = parts[0].prompt_tokens
    completion = sum(p.completion_tokens for p in parts)
    return _CachedUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                        speculation=_pooled_spec([p.spec for p in parts if p.spec]),
                        prompt_tokens_details={"cached_tokens": max(p.cached_tokens for p in parts)})


def _pooled_spec(specs: list[dict]) -> dict | None:
    """One speculation summary for several choices: counts summed, rates weighted by drafts proposed."""
    if len(specs) <= 1:
        return specs[0] if specs else None
    weights = [s["drafts_proposed"] for s in specs]
    proposed, accepted = sum(weights), sum(s["drafts_accepted"] for s in specs)

    def mean(values: list[float]) -> float:
        return sum(w * v for w, v in zip(weights, values)) / proposed if proposed else 0.0

    positions = len(specs[0]["accepted_per_position"])
    return {"drafts_proposed": proposed, "drafts_accepted": accepted,
            "acceptance": accepted / proposed if proposed else 0.0,
            "mean_accepted_length": mean([s["mean_accepted_length"] for s in specs]),
            "accepted_per_position": [mean([s["accepted_per_position"][j] for s in specs]) for j in range(positions)]}


class _Chunks:
    """What both SSE formats share: `n` choices, each with its own count of tokens sent; an error
    ends the stream; token ids are paired with logprobs; usage follows the last choice's finish."""

    def __init__(self, server: "_Server", rid: str, model: str, include_usage: bool, logprobs: bool, n: int):
        self.s, self.rid, self.model = server, rid, model
        self.include_usage, self.logprobs = include_usage, logprobs
        self.created = int(time.time())
        self.sent = [0] * n
        self.last: list[EngineEvent] = []  # the finished choices' final events

    def _error_or_tokens(self, i: int, ev: EngineEvent) -> tuple[str | None, tuple[int, ...], Any, Any]:
        if ev.error:
            return self.s.stream_error(ev.error), (), None, None
        ids, lps, tops = _visible(ev, self.sent[i])
        self.sent[i] += len(ids)
        return None, ids, lps, tops

    def _usage_when_done(self, ev: EngineEvent) -> P.Usage | None:
        if ev.finish_reason is None:
            return None
        self.last.append(ev)
        return _usage(self.last) if self.include_usage and len(self.last) == len(self.sent) else None


class _ChatChunks(_Chunks):
    """Engine events to `chat.completion.chunk` SSE lines. With `parsers` (one per choice), each
    choice's text goes through its `ChatOutputParser` and every Delta it gives is one chunk; logprobs of
    an event that gave none wait for the choice's next chunk (at the end, an empty-content one)."""

    def __init__(self, server: "_Server", rid: str, model: str, include_usage: bool, logprobs: bool, n: int,
                 parsers: list[ChatOutputParser] | None = None):
        super().__init__(server, rid, model, include_usage, logprobs, n)
        self.parsers = parsers
        self.held: list[list[P.TokenLogprob]] = [[] for _ in range(n)]

    def _chunk(self, i: int, delta: P.ChatDelta, finish: str | None = None,
               logprobs: P.ChoiceLogprobs | None = None) -> str:
        choice = P.ChatChunkChoice(index=i, delta=delta, finish_reason=finish, logprobs=logprobs)
        return _sse(P.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[choice]))

    def start(self) -> Iterator[str]:
        for i in range(len(self.sent)):
            yield self._chunk(i, P.ChatDelta(role="assistant", content=""))

    def event(self, i: int, ev: EngineEvent) -> Iterator[str]:
        error, ids, lps, tops = self._error_or_tokens(i, ev)
        if error:
            yield error
            return
        lp = self.s.chat_logprobs(ids, lps, tops) if self.logprobs else None
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
        usage = self._usage_when_done(ev)
        if usage is not None:
            yield _sse(P.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[],
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


def _chat_message(r: _Result, out: ChatOutputParser | None) -> tuple[P.AssistantMessage, str | None]:
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


class _CompletionChunks(_Chunks):
    """Engine events to `text_completion` SSE lines."""

    def __init__(self, server: "_Server", rid: str, model: str, include_usage: bool, logprobs: bool, n: int,
                 echo: str):
        super().__init__(server, rid, model, include_usage, logprobs, n)
        self.echo = echo
        self.offset = [0] * n

    def _chunk(self, i: int, text: str, finish: str | None = None, logprobs: P.CompletionLogprobs | None = None,
               usage: P.Usage | None = None) -> str:
        choices = [] if usage else [P.CompletionChoice(index=i, text=text, finish_reason=finish, logprobs=logprobs)]
        return _sse(P.Completion(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage))

    def start(self) -> Iterator[str]:
        if self.echo:
            for i in range(len(self.sent)):
                yield self._chunk(i, self.echo)

    def event(self, i: int, ev: EngineEvent) -> Iterator[str]:
        error, ids, lps, tops = self._error_or_tokens(i, ev)
        if error:
            yield error
            return
        lp = self.s.completion_logprobs(ids, lps, self.offset[i], tops) if self.logprobs else None
        self.offset[i] += len(ev.text)
        if ev.text or ev.finish_reason is not None or lp is not None and lp.tokens:
            yield self._chunk(i, ev.text, ev.finish_reason, lp)
        usage = self._usage_when_done(ev)
        if usage is not None:
            yield self._chunk(i, "", usage=usage)


class _Job:
    """The engine requests behind one response, one per choice; `close()` aborts those not finished."""

    def __init__(self, engine: Any, rids: list[str]):
        self.engine, self.rids = engine, rids
        self.running = set(range(len(rids)))

    @property
    def finished(self) -> bool:
        return not self.running

    def done(self, i: int) -> None:
        self.running.discard(i)

    def close(self) -> None:
        for i in sorted(self.running):
            self.engine.abort(self.rids[i])
        self.running.clear()


class _Merged:
    """The events of a job's streams as (choice index, event), in the order they arrive, until every
    stream has finished; `close()` stops listening."""

    def __init__(self, streams: list[Any]):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.left = len(streams)
        self.tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, i: int, stream: Any) -> None:
        try:
            async for ev in stream:
                self.queue.put_nowait((i, ev))
        except Exception as e:  # handed to the consumer, which would otherwise wait forever
            self.queue.put_nowait((i, e))

    def __aiter__(self) -> "_Merged":
        return self

    async def __anext__(self) -> tuple[int, EngineEvent]:
        if not self.left:
            raise StopAsyncIteration
        i, ev = await self.queue.get()
        if isinstance(ev, Exception):
            raise ev
        self.left -= ev.finish_reason is not None
        return i, ev

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()


class _EngineStreamResponse(StreamingResponse):
    """SSE over an engine request that is aborted however the response ends: a client gone before the
    body iterator ever started leaves no generator frame whose `finally` could do it."""

    def __init__(self, job: _Job, body: AsyncIterator[str]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close()
