"""Grammars through the engine (CPU, the embedded model; JSON schemas under speculation are
tested through the server, tests/server/test_api_structured.py): the mask path of eager steps, verification
rows under speculation (drafts the grammar rejects are cut) and async scheduling (a constrained
request runs ahead, its rows sampled in a second stage once the matcher has seen the token before
them) all give the greedy output of plain stepping, and it matches its grammar."""

from __future__ import annotations

import json
import re
import time

import pytest

from strata.config import EngineConfig
from strata.engine.engine import LLMEngine, RequestError
from strata.engine.types import EngineRequest
from strata.grammar import GrammarSpec
from strata.params import SamplingParams

PATTERN = r"(ab|cd|ef){3}-[0-9]{3}"


def run(e: LLMEngine, specs: dict[str, GrammarSpec | None], **kw) -> dict[str, tuple[str, str, int, int]]:
    """Per request: (text, finish reason, completion tokens, tokens sent)."""
    prompt = e.tokenizer.apply_chat_template([{"role": "user", "content": "What is the weather in Paris?"}],
                                             add_generation_prompt=True)
    ids = tuple(e.tokenizer.encode(prompt, add_special=False))
    for rid, spec in specs.items():
        params = SamplingParams(max_tokens=40 if spec else 8, temperature=0, grammar=spec, **kw)
        e.add_request(EngineRequest(rid, ids, params, time.monotonic()))
    events = e.run_to_completion()
    return {rid: ("".join(ev.text for ev in evs), evs[-1].finish_reason, evs[-1].completion_tokens,
                  sum(len(ev.token_ids) for ev in evs)) for rid, evs in events.items()}


def test_masked_output_is_the_same_stepped_plainly_speculated_and_run_ahead():
    specs = {"object": GrammarSpec.json_object(), "code": GrammarSpec.regex(PATTERN), "free": None}
    results = []
    for kw in ({}, {"spec": 2}, {"async_scheduling": True}):
        e = LLMEngine(EngineConfig(device="cpu", ctx=512, parallel=3, **kw), progress=False)
        if not kw:
            alone = run(e, {"free": None})["free"]
        results.append(run(e, specs))
        if e.drafter is not None:
            assert e.drafter.total.as_dict()["drafts_proposed"] > 0
        if kw.get("async_scheduling"):
            assert e.runner.two_stage_steps >= 5  # the constrained requests ran ahead
        assert not e.runner.matchers  # dropped with their requests
    assert results[0] == results[1] == results[2]
    out = results[0]
    assert out["free"] == alone  # rows without a grammar are untouched by a constrained neighbour
    assert isinstance(json.loads(out["object"][0]), dict)
    assert re.fullmatch(PATTERN, out["code"][0])
    for rid in ("object", "code"):  # finished when nothing but a stop token could follow: none was sampled
        text, reason, completion, sent = out[rid]
        assert reason == "stop" and completion == sent


def test_grammar_requests_need_a_compilable_grammar():
    e = LLMEngine(EngineConfig(device="cpu", ctx=128, parallel=1), progress=False)
    bad = SamplingParams(max_tokens=4, grammar=GrammarSpec.json_schema({"type": "objec"}))
    with pytest.raises(RequestError, match="objec"):
        e.add_request(EngineRequest("x", (1, 2, 3), bad, time.monotonic()))
    assert not e.requests and not e.runner.matchers
    # ignore_eos does not let a finished grammar run on.
    done = run(e, {"o": GrammarSpec.json_object()}, ignore_eos=True)["o"]
    assert done[1] == "stop" and isinstance(json.loads(done[0]), dict)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_two_stage_graphs_give_the_plain_output():
    """On CUDA with graphs (fp32): constrained requests run ahead through the forward graph and the
    head graph of their bucket, and answer as stepping synchronously does."""
    specs = {"object": GrammarSpec.json_object(), "code": GrammarSpec.regex(PATTERN), "free": None}
    results = []
    for kw in ({"async_scheduling": False}, {"async_scheduling": True}):
        e = LLMEngine(EngineConfig(device="cuda", dtype="float32", ctx=512, parallel=3, **kw), progress=False)
        assert all(g.forward is not None and g.head is not None for g in e.runner.graphs.values())
        results.append(run(e, specs))
        if kw["async_scheduling"]:
            assert e.runner.two_stage_steps >= 5
    assert results[0] == results[1]
