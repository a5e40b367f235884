"""The engine loop in its own thread, with thread-safe submission and per-request event streams.

The HTTP layer calls `submit` from its event loop and iterates the returned `RequestStream`
(`async for event in stream`); plain threads iterate it synchronously (`for event in stream`).
Events cross threads by `call_soon_threadsafe` (async consumers) or a `queue.Queue` (sync ones). The
loop thread owns the `LLMEngine` outright: every mutation of it happens on that thread, so the engine
itself needs no locks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from typing import AsyncIterator, Iterator

from strata.config import EngineConfig
from strata.engine.engine import LLMEngine, RequestError, check_prompt
from strata.engine.types import EngineEvent, EngineRequest, EngineStats

log = logging.getLogger("strata")


class RequestStream:
    def __init__(self, request_id: str, engine: "AsyncEngine"):
        self.request_id = request_id
        self._engine = engine
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            self._aq: asyncio.Queue | None = asyncio.Queue()
        except RuntimeError:
            self._loop, self._aq = None, None
        self._q: queue.Queue = queue.Queue()
        self.finished = False

    def _put(self, ev: EngineEvent) -> None:  # called on the engine thread
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, ev)
            except RuntimeError:  # the consumer's loop is gone: nobody is listening any more
                self._engine.abort(self.request_id)
        else:
            self._q.put(ev)

    def __aiter__(self) -> AsyncIterator[EngineEvent]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[EngineEvent]:
        assert self._aq is not None, "submit() from an event loop to iterate asynchronously"
        while not self.finished:
            ev = await self._aq.get()
            self.finished = ev.finish_reason is not None
            yield ev

    def __iter__(self) -> Iterator[EngineEvent]:
        while not self.finished:
            ev = self._q.get()
            self.finished = ev.finish_reason is not None
            yield ev

    def abort(self) -> None:
        if not self.finished:
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.model_name = engine.model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.engine_config = engine.cfg
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stats = engine.stats()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="strata-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "AsyncEngine":
        return cls(LLMEngine(cfg))

    # ---- called from any thread -------------------------------------------------------------------
    def submit(self, req: EngineRequest, logprobs: bool = False) -> RequestStream:
        """Validates synchronously (raises RequestError), then queues the request for the loop."""
        check_prompt(len(req.prompt_ids), self.max_model_len, self.engine.context_sizes)
        stream = RequestStream(req.request_id, self)
        self._inbox.put(("add", req, stream, logprobs))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None, None))
        self._wake.set()

    def stats(self) -> EngineStats:
        """The latest snapshot (slots included). The engine thread builds a new immutable one after
        every step and swaps the reference, so readers never see a half-updated one and never call
        into the engine."""
        return self._stats

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.close()

    @staticmethod
    def new_request_id(prefix: str = "req") -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}"

    def request(self, prompt_ids, params, request_id: str | None = None) -> EngineRequest:
        return EngineRequest(request_id or self.new_request_id(), tuple(prompt_ids), params, time.monotonic())

    # ---- the engine thread ------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, a, stream, logprobs = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add_request(a, logprobs=logprobs)
                    self._streams[a.request_id] = stream
                except Exception as e:  # refused (RequestError) or failed: this request alone ends
                    if not isinstance(e, RequestError):
                        log.exception("request %s could not be added", a.request_id)
                    stream._put(EngineEvent(a.request_id, (), "", "abort", len(a.prompt_ids), 0, error=str(e)))
            else:
                ev = self.engine.abort(a)
                if ev is not None:
                    self._deliver(ev)

    def _deliver(self, ev: EngineEvent) -> None:
        stream = self._streams.get(ev.request_id)
        if stream is not None:
            stream._put(ev)
            if ev.finish_reason is not None:
                del self._streams[ev.request_id]

    def _loop(self) -> None:
        while not self._stop:
            self._drain_inbox()
            if not self.engine.has_work():
                self._stats = self.engine.stats()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                events = self.engine.step()
            except Exception as e:  # step() fails only the requests a fault concerns; this is the last resort
                log.exception("engine step failed")
                for rid in list(self._streams):
                    self.engine.abort(rid)
                    self._deliver(EngineEvent(rid, (), "", "abort", error=f"engine error: {e}"))
                events = []
            for ev in events:
                self._deliver(ev)
            self._stats = self.engine.stats()
