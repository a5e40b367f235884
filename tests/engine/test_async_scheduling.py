"""Async scheduling: the scheduler's run-ahead and the engine's pipelined single-group steps.

A run-ahead chunk is scheduled while the request's previous chunk is still in flight; its first input
may be the token that chunk samples (`pending`), which only the device knows yet. The fake runner
here plays the device: it remembers each request's last sampled token and feeds it to pending
inputs, and keeps a paged "KV cache" so a chunk that starts at the wrong place or reads a freed
block fails. Outputs must equal those of plain, one-step-at-a-time scheduling."""

from __future__ import annotations

import time

import pytest

from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.params import SamplingParams
from strata.sched import RequestStatus
from strata.sched.scheduler import PENDING_TOKEN
from test_scheduler import drive, make_sched, next_token, req


class AheadRunner:
    """Computes a step at launch (as the device would, in order) with pending inputs resolved."""

    def __init__(self, sched):
        self.sched, self.bs = sched, sched.config.block_size
        self.kv: dict[tuple[int, int], tuple[str, int, int]] = {}
        self.last: dict[str, int] = {}  # request id -> the token its latest launched step sampled

    def __call__(self, out) -> dict[str, int]:
        sampled = {}
        for c in out.chunks:
            r = c.request
            ids = r.all_ids[: c.start]  # committed context before the chunk
            for pos in range(c.start):
                assert self.kv[(r.block_ids[pos // self.bs], pos % self.bs)] == (r.request_id, pos, ids[pos])
            inputs = c.token_ids
            if c.pending:
                assert inputs[0] == PENDING_TOKEN and c.start == len(r.all_ids)
                inputs = [self.last[r.request_id]] + inputs[1:]
            for i, tok in enumerate(inputs):
                self.kv[(r.block_ids[(c.start + i) // self.bs], (c.start + i) % self.bs)] = (r.request_id, c.start + i, tok)
            if c.sample:
                sampled[r.request_id] = self.last[r.request_id] = next_token(ids + inputs)
        return sampled


def drive_ahead(sched, arrivals=None, max_steps=4000):
    """Pipelined: schedule and run step t, then update step t-1 (the engine's async order)."""
    arrivals = dict(arrivals or {})
    runner = AheadRunner(sched)
    previous = None
    ahead = 0
    for step in range(max_steps):
        for r in arrivals.pop(step, []):
            sched.add(r)
        if not sched.has_unfinished() and not arrivals and previous is None:
            return ahead
        out = sched.schedule()
        ahead += sum(1 for c in out.chunks if c.pending)
        launched = (out, runner(out))
        if previous is not None:
            for r in sched.update(*previous):
                assert r.is_finished and r.slot is None and not r.block_ids
        previous = launched if out.chunks or out.finished else None
        if previous is None and not sched.has_unfinished() and not arrivals:
            return ahead
    raise AssertionError("scheduler did not drain")


def outputs(reqs):
    return {r.request_id: (list(r.output_ids), r.finish_reason) for r in reqs}


def two_runs(make, **cfg):
    plain = make()
    drive(make_sched(**cfg), {0: plain[:2], 3: plain[2:]})
    ahead_reqs = make()
    s = make_sched(run_ahead=True, **cfg)
    ahead = drive_ahead(s, {0: ahead_reqs[:2], 3: ahead_reqs[2:]})
    assert s.allocator.num_used == 0
    return outputs(plain), outputs(ahead_reqs), ahead, s


def test_run_ahead_gives_the_same_outputs_with_reads_give_way_and_eos():
    def make():
        return [req("a", 40, 30, eos=(next_token([0]),)), req("b", 300, 20, ignore_eos=True),
                req("c", 5, 25, ignore_eos=True), req("d", 200, 12, eos=tuple(range(100, 300)))]

    plain, ahead, count, _ = two_runs(make, parallel=3, chunk_size=64, max_num_batched_tokens=96, block_size=4)
    assert ahead == plain
    assert count > 20  # most decodes ran ahead


def test_run_ahead_with_preemption_gives_the_same_outputs():
    def make():
        return [req(r, 8, 16, ignore_eos=True) for r in "abcd"]

    plain, ahead, count, s = two_runs(make, parallel=4, block_size=4, num_blocks=13)
    assert ahead == plain and count > 0 and s.preemptions_total >= 1


def test_a_run_ahead_decode_follows_the_in_flight_one_and_waits_where_the_host_must_know():
    s = make_sched(parallel=2, run_ahead=True, block_size=4)
    a = req("a", 6, max_tokens=2, ignore_eos=True)
    b = req("b", 6, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)
    s.add(a), s.add(b)
    first = s.schedule()  # both read their prompt and sample
    second = s.schedule()  # a runs ahead of its in-flight read; b (penalised) must wait for its token
    assert [(c.request.request_id, c.start, c.num_tokens, c.pending) for c in second.chunks] == [("a", 6, 1, 1)]
    s.update(first, {"a": 7, "b": 8})
    assert a.num_computed_tokens == 6 and a.output_ids == [7]
    third = s.schedule()  # b decodes normally; a's in-flight token is its last (max_tokens 2): no run-ahead
    assert [(c.request.request_id, c.start, c.pending) for c in third.chunks] == [("b", 6, 0)]
    assert [r.request_id for r in s.update(second, {"a": 9})] == ["a"]
    assert a.status is RequestStatus.FINISHED_LENGTH and a.output_ids == [7, 9]
    fourth = s.schedule()  # b is in flight and penalised: nothing to run
    assert fourth.chunks == []
    s.update(third, {"b": 10})
    assert [(c.request.request_id, c.start) for c in s.schedule().chunks] == [("b", 7)]


def test_a_run_ahead_chunk_of_a_request_that_stopped_is_dropped():
    s = make_sched(parallel=1, run_ahead=True, block_size=4)
    a = req("a", 5, max_tokens=10, eos=(99,))
    s.add(a)
    first = s.schedule()
    second = s.schedule()
    assert second.chunks[0].pending == 1
    assert [r.request_id for r in s.update(first, {"a": 99})] == ["a"]  # EOS: finished, blocks freed
    assert s.update(second, {"a": 5}) == [] and a.output_ids == [99]
    assert s.allocator.num_used == 0 and not s.has_unfinished()


# ---------------------------------------------------------------- the engine (CPU, fp32)

PROMPTS = ["It is a truth universally acknowledged, that", "To be, or not to be:",
           "In the beginning God created the heaven and the earth. And the earth was"]


def run_engine(async_scheduling: bool, **kw):
    cfg = dict(device="cpu", ctx=1024, parallel=3, chunk_size=16, max_num_batched_tokens=40)
    e = LLMEngine(EngineConfig(**{**cfg, **kw, "async_scheduling": async_scheduling}), progress=False)
    long_prompt = e.tokenizer.encode(" ".join(PROMPTS) * 3)
    specs = [(PROMPTS[0], dict(max_tokens=20, ignore_eos=True)),
             (PROMPTS[1], dict(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)),
             (long_prompt, dict(max_tokens=9, ignore_eos=True)),
             (PROMPTS[2], dict(max_tokens=30, stop=["e "]))]
    for i, (p, params) in enumerate(specs):
        ids = p if isinstance(p, list) else e.tokenizer.encode(p)
        e.add_request(EngineRequest(f"r{i}", tuple(ids), SamplingParams(**params), time.monotonic()))
    events = e.run_to_completion()
    got = {rid: ([t for ev in evs for t in ev.token_ids], "".join(ev.text for ev in evs), evs[-1].finish_reason)
           for rid, evs in events.items()}
    assert e.allocator.num_used == 0
    return got, e


# "preempting": a pool that holds the long prompt's read and output alone (102 + 9 of 112 tokens), not
# beside the others.
@pytest.mark.parametrize("kw", [{}, {"kv_size": 112, "block_size": 16}], ids=["roomy", "preempting"])
def test_engine_async_equals_sync(kw):
    sync, _ = run_engine(False, **kw)
    got, e = run_engine(True, **kw)
    assert e.pipelined and e.scheduler.config.run_ahead
    assert got == sync
    assert e.stats().preemptions_total > 0 if kw else True
    assert got["r3"][2] == "stop" and "e " not in got["r3"][1]


def test_async_scheduling_is_the_cuda_default_and_refuses_drafts():
    assert EngineConfig(device="cpu").resolved().async_scheduling is False
    assert EngineConfig(device="cuda").resolved().async_scheduling is True
    assert EngineConfig(device="cuda", spec=2).resolved().async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(spec=2, async_scheduling=True)


def test_solo_reads_with_run_ahead_give_the_same_outputs():
    """solo_read_tokens with run-ahead: short reads arriving beside a long decode get steps of their
    own (the decodes wait one step), and every output is the plain scheduler's."""
    def make():
        return [req("a", 10, 40, ignore_eos=True), req("b", 12, 6, ignore_eos=True),
                req("c", 9, 5, ignore_eos=True), req("d", 14, 7, ignore_eos=True)]

    arrivals = lambda rs: {0: rs[:1], 3: rs[1:2], 6: rs[2:3], 7: rs[3:]}  # noqa: E731
    plain = make()
    drive(make_sched(parallel=4, chunk_size=64), arrivals(plain))
    solo = make()
    s = make_sched(run_ahead=True, parallel=4, chunk_size=64, solo_read_tokens=16)
    drive_ahead(s, arrivals(solo))
    assert outputs(solo) == outputs(plain)
    assert s.solo_reads_total >= 2 and s.allocator.num_used == 0


def test_engine_solo_reads_give_the_tokens_of_mixed_steps():
    """The engine with solo reads forced on (the CPU has no prompt graphs, so it never asks for them):
    short requests arriving beside a decoding one, pipelined; the tokens of mixed steps."""
    import dataclasses

    def run(solo: bool):
        e = LLMEngine(EngineConfig(device="cpu", ctx=1024, parallel=3, chunk_size=16, max_num_batched_tokens=40),
                      progress=False)
        assert e.scheduler.config.solo_read_tokens == 0
        if solo:
            e.scheduler.config = dataclasses.replace(e.scheduler.config, solo_read_tokens=16)
        got: dict[str, list[int]] = {}

        def add(rid, text, n):
            e.add_request(EngineRequest(rid, tuple(e.tokenizer.encode(text)),
                                        SamplingParams(max_tokens=n, ignore_eos=True), time.monotonic()))

        add("long", PROMPTS[0], 30)
        for i, p in enumerate(PROMPTS[1:]):
            for _ in range(3):
                for ev in e.step():
                    got.setdefault(ev.request_id, []).extend(ev.token_ids)
            add(f"s{i}", p[:40], 6)
        for rid, evs in e.run_to_completion().items():
            got.setdefault(rid, []).extend(t for ev in evs for t in ev.token_ids)
        assert e.stats().solo_reads_total == e.scheduler.solo_reads_total
        return got, e.scheduler.solo_reads_total

    mixed, none = run(False)
    got, solos = run(True)
    assert none == 0 and solos >= 1
    assert got == mixed
