"""One request never takes others down: a fault in one request's sampling or output fails that
request alone, a failed step fails the requests in it (not the queue), and the engine goes on
serving. Faults are injected into the embedded model's engine (fp32, CPU)."""

from __future__ import annotations

import time

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.async_engine import AsyncEngine
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.params import SamplingParams

PROMPTS = ["It is a truth universally acknowledged, that", "To be, or not to be:",
           "In the beginning God created the heaven and the earth."]
TOKENS = 12


def engine(**kw) -> LLMEngine:
    base = dict(device="cpu", ctx=512, parallel=3, chunk_size=64, max_num_batched_tokens=256)
    return LLMEngine(EngineConfig(**{**base, **kw}))


def req(eng: LLMEngine, rid: str, prompt: str, **kw) -> EngineRequest:
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, **kw)
    return EngineRequest(rid, tuple(eng.tokenizer.encode(prompt)), params, time.monotonic())


def run(eng: LLMEngine, on_step=None) -> dict[str, list]:
    events: dict[str, list] = {}
    step = 0
    while eng.has_work():
        if on_step is not None:
            on_step(step)
        for ev in eng.step():
            events.setdefault(ev.request_id, []).append(ev)
        step += 1
    return events


def tokens(evs) -> list[int]:
    return [t for ev in evs for t in ev.token_ids]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def eng(request):
    return engine(async_scheduling=request.param)


@pytest.fixture(scope="module")
def alone(eng):
    out = {}
    for i, p in enumerate(PROMPTS):
        eng.add_request(req(eng, f"alone{i}", p))
        out[i] = tokens(run(eng)[f"alone{i}"])
    return out


def test_a_fault_in_one_requests_sampling_fails_it_alone(eng, alone):
    """The overflow that once ended every stream (a top_k no int64 holds) set on one request after its
    third step: it ends with an error, the two beside it keep their greedy tokens, nothing leaks."""
    eng.add_request(req(eng, "a", PROMPTS[0]))
    eng.add_request(req(eng, "b", PROMPTS[1]))
    bad = req(eng, "bad", PROMPTS[2], temperature=0.8, seed=1)
    eng.add_request(bad)

    def corrupt(step: int) -> None:
        if step == 3:
            bad.params.top_k = 2**63

    got = run(eng, corrupt)
    assert tokens(got["a"]) == alone[0] and tokens(got["b"]) == alone[1]
    assert got["a"][-1].finish_reason == "length" and got["a"][-1].error is None
    last = got["bad"][-1]
    assert last.finish_reason == "abort" and "top_k" in last.error, last
    assert 0 < len(tokens(got["bad"])) < TOKENS
    assert eng.allocator.num_used == 0 and not eng.requests and not eng.runner.sampling.samplers
    eng.add_request(req(eng, "after", PROMPTS[2]))
    assert tokens(run(eng)["after"]) == alone[2]


def test_a_fault_in_one_requests_output_fails_it_alone(eng, alone):
    eng.add_request(req(eng, "a", PROMPTS[0]))
    eng.add_request(req(eng, "bad", PROMPTS[1]))

    def broken(delta: str):
        raise UnicodeError("injected")

    eng.text["bad"].stops.push = broken
    got = run(eng)
    assert tokens(got["a"]) == alone[0]
    assert got["bad"][-1].finish_reason == "abort" and "injected" in got["bad"][-1].error
    assert eng.allocator.num_used == 0 and not eng.requests


@pytest.mark.parametrize("fault, words", [(RuntimeError("injected step fault"), "injected step fault"),
                                          (torch.OutOfMemoryError("injected"), "--parallel")])
def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(alone, fault, words):
    """Two requests decode in a step that raises; the third waits for a slot. The two end with an
    error event, the waiting one runs afterwards with its own tokens, and the pool is whole again."""
    eng = engine(parallel=2)
    launch, calls = eng.runner.launch, []

    def failing(chunks):
        calls.append(len(chunks))
        if len(calls) == 4:
            raise fault
        return launch(chunks)

    eng.runner.launch = failing
    for i in range(3):
        eng.add_request(req(eng, f"r{i}", PROMPTS[i]))
    got = run(eng)
    for i in (0, 1):
        assert got[f"r{i}"][-1].finish_reason == "abort" and words in got[f"r{i}"][-1].error
    assert tokens(got["r2"]) == alone[2] and got["r2"][-1].error is None
    assert eng.allocator.num_used == 0 and not eng.requests and eng.stats().slots_busy == 0


def test_the_engine_thread_survives_a_request_it_cannot_add(alone):
    """A failure while adding a request (not a refusal) ends that request's stream; the loop thread
    goes on and serves the next."""
    core = engine()
    matcher = core._matcher

    def failing(params):
        if params.seed == 666:
            raise TypeError("injected")
        return matcher(params)

    core._matcher = failing
    ae = AsyncEngine(core)
    try:
        bad = list(ae.submit(req(core, "bad", PROMPTS[0], seed=666)))
        assert bad[-1].finish_reason == "abort" and "injected" in bad[-1].error
        good = list(ae.submit(req(core, "good", PROMPTS[0])))
        assert tokens(good) == alone[0] and good[-1].finish_reason == "length"
    finally:
        ae.shutdown()
