"""The engine requests behind one HTTP response, whatever API it speaks: a `Job` of one request per
choice, their events merged as they arrive, then gathered into whole `Result`s (`collect`) or written
as server-sent events (`stream_response`). A request whose client goes away, mid-stream or while
waiting for a whole completion, is aborted in the engine so its slot frees at the next step.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from strata.engine.types import EngineEvent
from strata.server.errors import APIError

Tops = tuple[tuple[tuple[int, float], ...], ...]  # per token, its (token id, logprob) alternatives


def visible_tokens(ev: EngineEvent, sent: int) -> tuple[tuple[int, ...], tuple[float, ...] | None, Tops | None]:
    """The event's tokens that belong to the completion (the engine does not count a final EOS), with
    their logprobs and alternatives where the event has them; `sent` is how many came before."""
    keep = max(0, min(len(ev.token_ids), ev.completion_tokens - sent))
    return (ev.token_ids[:keep], tuple(ev.logprobs[:keep]) if ev.logprobs is not None else None,
            tuple(ev.top_logprobs[:keep]) if ev.top_logprobs is not None else None)


class Result:
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
        self.emitted = 0  # tokens the engine emitted, a final EOS included

    def add(self, ev: EngineEvent) -> None:
        self.text.append(ev.text)
        self.emitted += len(ev.token_ids)
        ids, lps, tops = visible_tokens(ev, len(self.token_ids))
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


class Interrupted(Exception):
    """A job ended by the server (its shutdown), not by the engine: the response ends with this error."""


class Job:
    """The engine requests behind one response, one per choice; `close()` aborts those not finished
    and calls `on_close` once (the server's count of requests in service)."""

    def __init__(self, engine: Any, rids: list[str], on_close: Any = None):
        self.engine, self.rids = engine, rids
        self.running = set(range(len(rids)))
        self.on_close = on_close
        self.merged: MergedEvents | None = None  # set while a response reads the job's events
        self.interrupted: str | None = None

    @property
    def finished(self) -> bool:
        return not self.running

    def done(self, i: int) -> None:
        self.running.discard(i)

    def close(self) -> None:
        for i in sorted(self.running):
            self.engine.abort(self.rids[i])
        self.running.clear()
        if self.on_close is not None:
            on_close, self.on_close = self.on_close, None
            on_close(self)

    def interrupt(self, message: str) -> None:
        """Ends the response now with `message` (an SSE error event, or an error body) and aborts the
        engine requests; a response not yet reading events ends so as soon as it starts."""
        self.interrupted = message
        if self.merged is not None:
            self.merged.interrupt(Interrupted(message))


class MergedEvents:
    """The events of a job's streams as (choice index, event), in the order they arrive, until every
    stream has finished; `close()` stops listening. A stream that can hand its events to a callback
    (`listen`, the engine's own) is read without a task of its own; any other async iterable is read by
    one. `batch()` gives every event that has arrived, so a consumer that fell behind catches up in one
    pass. `whole`: the consumer wants only finished results, so such streams may hold events back until
    their request ends."""

    def __init__(self, streams: list[Any], job: Job | None = None, whole: bool = False):
        self.ready: deque[tuple[int, Any]] = deque()
        self.waiter: asyncio.Future | None = None
        self.left = len(streams)
        self.closed = False
        self.tasks = []
        for i, s in enumerate(streams):
            listen = getattr(s, "listen", None)
            if listen is not None:
                listen(functools.partial(self._put, i), whole=whole)
            else:
                self.tasks.append(asyncio.ensure_future(self._pump(i, s)))
        if job is not None:
            job.merged = self
            if job.interrupted is not None:
                self.interrupt(Interrupted(job.interrupted))

    def _put(self, i: int, ev: Any) -> None:
        if self.closed:
            return
        self.ready.append((i, ev))
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def interrupt(self, e: Exception) -> None:
        self._put(-1, e)

    async def _pump(self, i: int, stream: Any) -> None:
        try:
            async for ev in stream:
                self._put(i, ev)
        except Exception as e:  # handed to the consumer, which would otherwise wait forever
            self._put(i, e)

    def __aiter__(self) -> "MergedEvents":
        return self

    async def __anext__(self) -> tuple[int, EngineEvent]:
        if not self.left:
            raise StopAsyncIteration
        await self._wait()
        return self._take()

    async def batch(self) -> list[tuple[int, EngineEvent]]:
        """At least one event, waiting for it, and every other one already arrived, in order; empty
        once every stream has finished. A failure is raised by the call that would return it first."""
        if not self.left:
            return []
        await self._wait()
        out = [self._take()]
        while self.left and self.ready and not isinstance(self.ready[0][1], Exception):
            out.append(self._take())
        return out

    async def _wait(self) -> None:
        while not self.ready:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def _take(self) -> tuple[int, EngineEvent]:
        i, ev = self.ready.popleft()
        if isinstance(ev, Exception):
            raise ev
        self.left -= ev.finish_reason is not None
        return i, ev

    def close(self) -> None:
        self.closed = True
        self.ready.clear()
        for t in self.tasks:
            t.cancel()


class EngineStreamResponse(StreamingResponse):
    """SSE over an engine request that is aborted however the response ends: a client gone before the
    body iterator ever started leaves no generator frame whose `finally` could do it."""

    def __init__(self, job: Job, body: AsyncIterator[str]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close()


async def wait_disconnect(request: Request) -> None:
    # The body has been read, so the next message the server sends is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(request: Request, job: Job, streams: list[Any]) -> list[Result]:
    """Each choice's whole completion; a client gone first is a 499, an engine failure a 500."""
    results = [Result() for _ in streams]
    merged = MergedEvents(streams, job, whole=True)

    async def pump() -> None:
        while batch := await merged.batch():
            for i, ev in batch:
                results[i].add(ev)
                if ev.finish_reason is not None:
                    job.done(i)
                if ev.error:
                    return  # the response fails: the other choices are aborted

    pumping = asyncio.ensure_future(pump())
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({pumping, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        complete = pumping.done()
        if not complete:
            pumping.cancel()
        merged.close()
        job.close()
    if not complete:
        raise APIError(499, "the client closed the request", code="client_closed_request")
    try:
        pumping.result()
    except Interrupted as e:
        raise APIError(503, str(e), type_="server_error", code="server_shutting_down") from None
    error = next((r.error for r in results if r.error), None)
    if error:
        raise APIError(500, f"the engine failed the request: {error}", type_="server_error")
    return results


async def _event_stream(request: Request, job: Job, streams: list[Any], chunks: Any, end: str | None,
                        ) -> AsyncIterator[str]:
    async def abort_when_gone() -> None:
        await wait_disconnect(request)
        job.close()

    watcher = asyncio.ensure_future(abort_when_gone())
    merged = MergedEvents(streams, job)
    try:
        for piece in chunks.start():
            yield piece
        # The events that arrived together are written together: one write however far the stream fell
        # behind, and the last event's pieces go with the stream's end.
        out: list[str] = []
        try:
            done = False
            while not done:
                batch = await merged.batch()
                done = not batch
                for i, ev in batch:
                    if ev.finish_reason is not None:
                        job.done(i)
                    out += chunks.event(i, ev)
                    if ev.error or job.finished:
                        done = True
                        break
                if out and not done:
                    yield "".join(out)
                    out = []
        except Interrupted as e:
            job.close()
            out += chunks.error(str(e))
        out += chunks.end() if end is None else [end]
        if out:
            yield "".join(out)
    finally:
        watcher.cancel()
        merged.close()
        job.close()


def stream_response(request: Request, job: Job, streams: list[Any], chunks: Any,
                    end: str | None = "data: [DONE]\n\n") -> StreamingResponse:
    """SSE of `chunks` (`start()`, `event(i, ev)` and `error(message)`, each giving SSE lines), closed
    by `end`, or by `chunks.end()` when None. A job interrupted by the server gets `error` then the end."""
    return EngineStreamResponse(job, _event_stream(request, job, streams, chunks, end))
