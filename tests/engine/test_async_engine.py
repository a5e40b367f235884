"""`AsyncEngine`'s delivery from the engine thread to consumers, over a scripted core (no model): each
event reaches its stream in order, a callback (`listen`) gets those that arrived before it first, steps
that finish while the consumers' event loop is busy reach it in one wake-up, within `stream_interval_s`
of the last wake-up a decoding request's events wait for the next (its first and last go at once), and a
consumer of whole results is handed a request's events when it ends."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from strata.engine.async_engine import CPU_STREAM_INTERVAL_S, AsyncEngine, default_stream_interval
from strata.engine.types import EngineEvent, EngineRequest, EngineStats
from strata.params import SamplingParams


class ScriptedCore:
    """One token per step for each request; a step waits for the test to allow it when `gated`."""

    model_name = "scripted"
    tokenizer = None
    max_model_len = 64
    context_sizes = ""
    cfg = None

    def __init__(self, gated: bool = False):
        self.requests: dict[str, list] = {}
        self.allow = threading.Semaphore(0)
        self.gated = gated
        self.steps = 0

    def stats(self) -> EngineStats:
        return EngineStats(parallel=4, queue_len=0, slots_busy=len(self.requests), kv_blocks_used=0,
                           kv_blocks_total=1, prompt_tokens_total=0, generation_tokens_total=0,
                           requests_finished_total=0, give_ways_total=0, preemptions_total=0)

    def add_request(self, req: EngineRequest, logprobs: bool = False) -> None:
        self.requests[req.request_id] = [req, 0]

    def abort(self, rid: str) -> EngineEvent | None:
        r = self.requests.pop(rid, None)
        return None if r is None else EngineEvent(rid, (), "", "abort", 1, r[1])

    def has_work(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[EngineEvent]:
        if self.gated:
            self.allow.acquire()
        events = []
        for rid, r in list(self.requests.items()):
            r[1] += 1
            finish = "length" if r[1] >= r[0].params.max_tokens else None
            if finish:
                del self.requests[rid]
            events.append(EngineEvent(rid, (r[1],), f"t{r[1]}", finish, 1, r[1]))
        self.steps += 1
        return events

    def close(self) -> None:
        pass


def request(rid: str, tokens: int) -> EngineRequest:
    return EngineRequest(rid, (1,), SamplingParams(max_tokens=tokens), time.monotonic())


def test_async_and_sync_consumers_get_every_event_in_order():
    ae = AsyncEngine(ScriptedCore())
    try:
        async def consume() -> list[list[EngineEvent]]:
            streams = [ae.submit(request(f"a{i}", 5 + i)) for i in range(3)]

            async def one(s) -> list[EngineEvent]:
                return [ev async for ev in s]

            return await asyncio.gather(*(one(s) for s in streams))

        for i, evs in enumerate(asyncio.run(consume())):
            assert [ev.token_ids[0] for ev in evs] == list(range(1, 6 + i))
            assert evs[-1].finish_reason == "length" and all(ev.finish_reason is None for ev in evs[:-1])
        evs = list(ae.submit(request("s", 4)))  # from a plain thread
        assert [ev.text for ev in evs] == ["t1", "t2", "t3", "t4"] and evs[-1].finish_reason == "length"
    finally:
        ae.shutdown()


def test_listen_takes_the_events_already_arrived_first():
    core = ScriptedCore(gated=True)
    ae = AsyncEngine(core)
    try:
        async def consume() -> list[EngineEvent]:
            stream = ae.submit(request("r", 6))
            for _ in range(3):
                core.allow.release()
            while core.steps < 3:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)  # the three events reach the stream
            got: list[EngineEvent] = []
            done = asyncio.get_running_loop().create_future()
            stream.listen(lambda ev: (got.append(ev), ev.finish_reason and done.set_result(None)))
            assert [ev.text for ev in got] == ["t1", "t2", "t3"]
            for _ in range(3):
                core.allow.release()
            await done
            assert stream.finished
            return got

        assert [ev.text for ev in asyncio.run(consume())] == ["t1", "t2", "t3", "t4", "t5", "t6"]
    finally:
        ae.shutdown()


def test_steps_done_while_the_loop_is_busy_reach_it_in_one_wake_up():
    core = ScriptedCore(gated=True)
    ae = AsyncEngine(core)
    try:
        async def consume() -> tuple[int, list[str]]:
            loop = asyncio.get_running_loop()
            wakes = 0
            plain = loop.call_soon_threadsafe

            def counting(*args, **kw):
                nonlocal wakes
                wakes += 1
                return plain(*args, **kw)

            loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
            seen: list[EngineEvent] = []
            for i in range(2):
                ae.submit(request(f"r{i}", 4)).listen(seen.append)
            for _ in range(4):
                core.allow.release()
            # The loop is held up here (no await) until all four steps' events wait for it.
            box = ae._mailboxes[loop]
            deadline = time.monotonic() + 10
            while len(box._items) < 8 and time.monotonic() < deadline:
                time.sleep(0.001)
            await asyncio.sleep(0)
            return wakes, [ev.text for ev in seen]

        wakes, texts = asyncio.run(consume())
        assert wakes == 1  # four steps of two requests each: one wake-up
        assert texts == ["t1", "t1", "t2", "t2", "t3", "t3", "t4", "t4"]
    finally:
        ae.shutdown()


def test_a_whole_result_listener_is_handed_the_events_when_the_request_ends():
    core = ScriptedCore(gated=True)
    ae = AsyncEngine(core)
    try:
        async def consume() -> tuple[list[str], list[str]]:
            got: list[EngineEvent] = []
            done = asyncio.get_running_loop().create_future()
            stream = ae.submit(request("w", 5))
            stream.listen(lambda ev: (got.append(ev), ev.finish_reason and done.set_result(None)), whole=True)
            for _ in range(3):
                core.allow.release()
            while core.steps < 3:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)
            early = [ev.text for ev in got]
            for _ in range(2):
                core.allow.release()
            await done
            return early, [ev.text for ev in got]

        early, texts = asyncio.run(consume())
        assert early == [] and texts == ["t1", "t2", "t3", "t4", "t5"]
    finally:
        ae.shutdown()


def test_within_the_stream_interval_only_first_and_last_events_go_at_once():
    core = ScriptedCore(gated=True)
    ae = AsyncEngine(core, stream_interval_s=60.0)
    try:
        async def consume() -> tuple[list[str], list[str], list[str]]:
            got: list[EngineEvent] = []
            done = asyncio.get_running_loop().create_future()
            ae.submit(request("p", 5)).listen(lambda ev: (got.append(ev), ev.finish_reason and done.set_result(None)))

            async def after(steps: int) -> list[str]:
                while core.steps < steps:
                    await asyncio.sleep(0.001)
                await asyncio.sleep(0.05)
                return [ev.text for ev in got]

            core.allow.release()
            first = await after(1)
            for _ in range(3):
                core.allow.release()
            middle = await after(4)
            core.allow.release()
            await done
            return first, middle, [ev.text for ev in got]

        first, middle, texts = asyncio.run(consume())
        assert first == ["t1"] and middle == ["t1"] and texts == ["t1", "t2", "t3", "t4", "t5"]
    finally:
        ae.shutdown()
    cpu, cuda = ScriptedCore(), ScriptedCore()
    cpu.device, cuda.device = SimpleNamespace(type="cpu"), SimpleNamespace(type="cuda")
    assert (default_stream_interval(cpu), default_stream_interval(cuda)) == (CPU_STREAM_INTERVAL_S, 0.0)
