"""A response's events (`strata.server.jobs`): streams that hand events to a callback are merged
without a task each, events that arrived together are taken together, and a stream that fell behind
writes them in one piece, the last event's with the stream's end; `--stream-interval-ms` reaches the engine."""

from __future__ import annotations

import asyncio
import json

from strata.engine.types import EngineEvent
from strata.server.jobs import Interrupted, Job, MergedEvents, stream_response
from strata.server.responses import CompletionChunks


class HandStream:
    """A stream that hands its events to a callback, those before it first, as the engine's does; `emit`
    is the engine."""

    def __init__(self) -> None:
        self.listener = None
        self.early: list[EngineEvent] = []

    def listen(self, callback, whole: bool = False) -> None:
        self.listener = callback
        for ev in self.early:
            callback(ev)

    def emit(self, ev: EngineEvent) -> None:
        if self.listener is None:
            self.early.append(ev)
        else:
            self.listener(ev)


class Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def token(rid: str, k: int, finish: str | None = None) -> EngineEvent:
    return EngineEvent(rid, (k,), f" t{k}", finish, 3, k)


def test_merged_events_come_in_batches_and_a_failure_after_them():
    async def run() -> None:
        a, b, plain_done = HandStream(), HandStream(), asyncio.Event()

        async def plain():  # any async iterable still works, read by a task
            yield token("c", 1, "stop")
            plain_done.set()

        job = Job(Engine(), ["a", "b", "c"])
        merged = MergedEvents([a, b, plain()], job)
        assert len(merged.tasks) == 1
        await plain_done.wait()
        a.emit(token("a", 1))
        b.emit(token("b", 1))
        a.emit(token("a", 2, "length"))
        got = await merged.batch()
        assert [(i, ev.token_ids[0]) for i, ev in got] == [(2, 1), (0, 1), (1, 1), (0, 2)]
        b.emit(token("b", 2))
        job.interrupt("going away")
        assert [(i, ev.text) for i, ev in await merged.batch()] == [(1, " t2")]
        try:
            await merged.batch()
            raise AssertionError("the interruption was not raised")
        except Interrupted as e:
            assert str(e) == "going away"
        merged.close()
        b.emit(token("b", 3))  # after close: dropped
        assert not merged.ready

    asyncio.run(run())


class Request:
    """What `stream_response` reads of a request: `receive`, which waits for a disconnect that never comes."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}


def test_a_stream_behind_writes_every_ready_event_in_one_piece():
    async def run() -> list[str]:
        s = HandStream()
        job = Job(Engine(), ["cmpl-1"])
        chunks = CompletionChunks("cmpl-1", "m", 1, True, None, [""])
        body = stream_response(Request(), job, [s], chunks).body_iterator
        writes = []
        s.emit(token("cmpl-1", 1))
        writes.append(await body.__anext__())
        for k in (2, 3, 4):  # three steps before the stream looks again
            s.emit(token("cmpl-1", k))
        writes.append(await body.__anext__())
        s.emit(token("cmpl-1", 5, "length"))
        writes.append(await body.__anext__())
        try:
            await body.__anext__()
            raise AssertionError("the stream did not end")
        except StopAsyncIteration:
            pass
        return writes

    writes = asyncio.run(run())
    events = [[line[len("data: "):] for line in w.split("\n\n") if line] for w in writes]
    assert [len(e) for e in events] == [1, 3, 3]  # the last: the final token, the usage, [DONE]
    texts = [json.loads(d)["choices"][0]["text"] for e in events for d in e if d != "[DONE]" and
             json.loads(d)["choices"]]
    assert texts == [" t1", " t2", " t3", " t4", " t5"]
    assert json.loads(events[2][1])["usage"]["completion_tokens"] == 5 and events[2][2] == "[DONE]"


def test_the_stream_interval_option_reaches_the_engine(tok):
    import argparse

    import pytest

    from strata.engine.types import EngineStats
    from strata.server.app import build_app
    from strata.server.config import ServerConfig
    from strata.server.serve import configure_parser, resolve

    _, srv = resolve(configure_parser(argparse.ArgumentParser()).parse_args(["--stream-interval-ms", "0"]))
    assert srv.stream_interval_ms == 0 and ServerConfig().stream_interval_ms is None
    with pytest.raises(ValueError, match="stream_interval_ms"):
        ServerConfig(stream_interval_ms=-1)

    class Served:
        model_name, max_model_len, tokenizer, stream_interval_s = "m", 64, tok, 0.016

        def stats(self) -> EngineStats:
            return EngineStats(parallel=1, queue_len=0, slots_busy=0, kv_blocks_used=0, kv_blocks_total=1,
                               prompt_tokens_total=0, generation_tokens_total=0, requests_finished_total=0,
                               give_ways_total=0, preemptions_total=0)

        def submit(self, req, logprobs: bool = False):
            raise AssertionError("no request is sent")

    kept, given = Served(), Served()
    build_app(kept, ServerConfig()).state.strata.close()
    build_app(given, ServerConfig(stream_interval_ms=2.5)).state.strata.close()
    assert kept.stream_interval_s == 0.016 and given.stream_interval_s == 0.0025
