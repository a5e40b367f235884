"""The engine loop in its own thread, with thread-safe submission and per-request event streams.

The HTTP layer calls `submit` from its event loop and iterates the returned `RequestStream`
(`async for event in stream`) or has each event handed to a callback (`stream.listen`); plain threads
iterate it synchronously (`for event in stream`). The loop thread owns the `LLMEngine` outright: every
mutation of it happens on that thread, so the engine itself needs no locks.

Events reach a sync consumer through a `queue.Queue`; async consumers get theirs through one `_Mailbox`
per event loop: a step's events for that loop go in together and wake it once (`call_soon_threadsafe`),
and steps that finish before the loop has taken the previous ones add to the same wake-up instead of
scheduling another. Each wake-up costs the loop thread a pass of its own (and a streaming client a
read), and while that pass runs the engine thread waits for the GIL at its next Python line. On a CPU
engine, where those passes also take the cores the engine runs on, a loop is woken at most every
`stream_interval_s` while its requests decode (CPU_STREAM_INTERVAL_S): the steps in between add to the
next wake-up. A request's first event and its last go at once, so the time to the first token and to
the end are unchanged; a consumer that wants only whole results (`listen(..., whole=True)`) is handed a
request's events when it ends.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import deque
from typing import AsyncIterator, Callable, Iterator

from strata.config import EngineConfig
from strata.engine.engine import LLMEngine, RequestError, check_prompt
from strata.engine.types import EngineEvent, EngineRequest, EngineStats

log = logging.getLogger("strata")

# While requests only decode, the stats snapshot (/metrics, /slots) is rebuilt at most this often: it costs
# the engine thread about 1% of a short CPU step. A step that admits or ends a request always rebuilds it.
STATS_INTERVAL_S = 0.005
# The shortest time between two wake-ups of a loop while its requests decode on a CPU engine: one frame of
# a 60 Hz display. Each wake-up's pass makes the engine thread wait for the GIL three to five times; beside
# the embedded model's ~1.3 ms steps on two cores, streaming kept ~0.77 of the engine's speed with a
# wake-up every step, ~0.89 every 8 ms and ~0.95 every 16 ms (docs/PERFORMANCE.md).
CPU_STREAM_INTERVAL_S = 0.016


def default_stream_interval(engine: LLMEngine) -> float:
    """CPU_STREAM_INTERVAL_S for an engine on the CPU; 0 (every step) elsewhere, where the engine thread
    waits for the device with the GIL released."""
    device = getattr(engine, "device", None)
    return CPU_STREAM_INTERVAL_S if getattr(device, "type", None) == "cpu" else 0.0


class _Mailbox:
    """Events on their way from the engine thread to one event loop (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple["RequestStream", EngineEvent]] = []
        self._scheduled = False
        self.posted_at = -float("inf")  # the engine thread's: when it last posted here

    def post(self, items: list[tuple["RequestStream", EngineEvent]]) -> None:  # the engine thread
        with self._lock:
            self._items += items
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._hand_out)
        except RuntimeError:  # the consumers' loop is gone: nobody is listening any more
            with self._lock:
                items, self._items, self._scheduled = self._items, [], False
            for stream, _ in items:
                stream._engine.abort(stream.request_id)

    def _hand_out(self) -> None:  # the loop's thread
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for stream, ev in items:
            try:
                stream._push(ev)
            except Exception:  # a consumer's callback: the other streams still get their events
                log.exception("request %s: its event could not be handed over", stream.request_id)


class RequestStream:
    def __init__(self, request_id: str, engine: "AsyncEngine"):
        self.request_id = request_id
        self._engine = engine
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._mailbox = engine._mailbox(self._loop) if self._loop is not None else None
        self._q: queue.Queue | None = queue.Queue() if self._loop is None else None
        self._ready: deque[EngineEvent] = deque()  # arrived on the loop, not yet taken
        self._waiter: asyncio.Future | None = None
        self._listener: Callable[[EngineEvent], None] | None = None
        self._whole = False  # set on the loop's thread: the engine thread may hold events until the end
        self._held: list[EngineEvent] = []  # the engine thread's, while `_whole`
        self._started = False  # the engine thread's: an event of this request was posted
        self.finished = False

    def _push(self, ev: EngineEvent) -> None:  # the loop's thread
        if self._listener is not None:
            self.finished = ev.finish_reason is not None
            self._listener(ev)
            return
        self._ready.append(ev)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def listen(self, callback: Callable[[EngineEvent], None], whole: bool = False) -> None:
        """Hands each event to `callback` on the loop's thread as it arrives, those already arrived
        first, instead of to iteration: no task wakes up per event. With `whole` (a consumer that wants
        only the finished result) the engine thread keeps the events until the request ends and hands
        them over together, so the loop is not woken for every step."""
        assert self._loop is not None, "submit() from an event loop to listen"
        self._whole = whole
        self._listener = callback
        while self._ready and self._listener is callback:
            ev = self._ready.popleft()
            self.finished = ev.finish_reason is not None
            callback(ev)

    def __aiter__(self) -> AsyncIterator[EngineEvent]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[EngineEvent]:
        assert self._loop is not None, "submit() from an event loop to iterate asynchronously"
        while not self.finished:
            if not self._ready:
                self._waiter = self._loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
                continue
            ev = self._ready.popleft()
            self.finished = ev.finish_reason is not None
            yield ev

    def __iter__(self) -> Iterator[EngineEvent]:
        assert self._q is not None, "submit() outside an event loop to iterate synchronously"
        while not self.finished:
            ev = self._q.get()
            self.finished = ev.finish_reason is not None
            yield ev

    def abort(self) -> None:
        if not self.finished:
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, stream_interval_s: float | None = None):
        """`stream_interval_s`: the shortest time between two wake-ups of a consumer's event loop while
        its requests decode (see the module docstring); None: `default_stream_interval(engine)`."""
        self.engine = engine
        self.model_name = engine.model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.engine_config = engine.cfg
        self._inbox: deque[tuple] = deque()  # appends and pops are atomic: no lock
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}
        self._mailbox_lock = threading.Lock()
        self._outbox: dict[_Mailbox, list[tuple[RequestStream, EngineEvent]]] = {}  # the engine thread's, per pass
        self._stats = engine.stats()
        self._stats_time = time.monotonic()
        self.stream_interval_s = default_stream_interval(engine) if stream_interval_s is None else stream_interval_s
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
        self._inbox.append(("add", req, stream, logprobs))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id, None, None))
        self._wake.set()

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> _Mailbox:
        with self._mailbox_lock:
            box = self._mailboxes.get(loop)
            if box is None:
                for gone in [lp for lp in self._mailboxes if lp.is_closed()]:
                    del self._mailboxes[gone]
                box = self._mailboxes[loop] = _Mailbox(loop)
            return box

    def stats(self) -> EngineStats:
        """The latest snapshot (slots included). The engine thread builds a new immutable one after a
        step that admitted or ended a request, else at most every STATS_INTERVAL_S, and swaps the
        reference, so readers never see a half-updated one and never call into the engine."""
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
    def _drain_inbox(self) -> bool:
        """Adds and aborts what the inbox holds; whether it held anything."""
        took = False
        while self._inbox:
            kind, a, stream, logprobs = self._inbox.popleft()
            took = True
            if kind == "add":
                try:
                    self.engine.add_request(a, logprobs=logprobs)
                    self._streams[a.request_id] = stream
                except Exception as e:  # refused (RequestError) or failed: this request alone ends
                    if not isinstance(e, RequestError):
                        log.exception("request %s could not be added", a.request_id)
                    self._send(stream, EngineEvent(a.request_id, (), "", "abort", len(a.prompt_ids), 0, error=str(e)))
            else:
                ev = self.engine.abort(a)
                if ev is not None:
                    self._deliver(ev)
        return took

    def _deliver(self, ev: EngineEvent) -> None:
        stream = self._streams.get(ev.request_id)
        if stream is not None:
            if ev.finish_reason is not None:
                del self._streams[ev.request_id]
            self._send(stream, ev)

    def _send(self, stream: RequestStream, ev: EngineEvent) -> None:
        """Queues `ev` for its consumer: at once for a thread, with the pass's others for a loop (`_flush`)."""
        if stream._mailbox is None:
            stream._q.put(ev)
        elif stream._whole and ev.finish_reason is None:
            stream._held.append(ev)
        else:
            items = self._outbox.setdefault(stream._mailbox, [])
            if stream._held:
                items += [(stream, held) for held in stream._held]
                stream._held = []
            items.append((stream, ev))

    def _flush(self, force: bool = False) -> None:
        """Posts each loop's pending events, unless its last wake-up was under `stream_interval_s` ago and
        none of them is a request's first or last (`force`: all of them, as the engine goes idle)."""
        if not self._outbox:
            return
        now = time.monotonic()
        held = {}
        for box, items in self._outbox.items():
            if (force or now - box.posted_at >= self.stream_interval_s
                    or any(ev.finish_reason is not None or not stream._started for stream, ev in items)):
                for stream, _ in items:
                    stream._started = True
                box.posted_at = now
                box.post(items)
            else:
                held[box] = items
        self._outbox = held

    def _loop(self) -> None:
        changed = False  # requests admitted or ended since the last snapshot
        while not self._stop:
            changed |= self._drain_inbox()
            idle = not self.engine.has_work()
            self._flush(force=idle)
            if idle:
                self._stats, self._stats_time, changed = self.engine.stats(), time.monotonic(), False
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
                changed |= ev.finish_reason is not None
            now = time.monotonic()
            if changed or now - self._stats_time >= STATS_INTERVAL_S:
                # Before the events go: a consumer that sees a request end sees counts that include it.
                self._stats, self._stats_time, changed = self.engine.stats(), now, False
            self._flush()
