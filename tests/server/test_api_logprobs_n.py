"""Top logprobs, n > 1, /tokenize and /detokenize: real `strata serve` processes on the embedded model
(CPU), one plain and one speculating (--spec 2, the model's MTP head), driven by the `openai` client;
and the engine's top lists directly (on CUDA too, where decode steps replay graphs)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch

from serving import running_server
from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.params import SamplingParams

KEY = "sk-strata-test"
NAME = "strata-test"
CTX = 1024
PROMPT = "It is a truth universally acknowledged, that"
CHAT = [{"role": "user", "content": "In the beginning"}]
BASE = {"ctx": CTX, "parallel": 4, "device": "cpu", "api_key": KEY, "model_name": NAME, "log_level": "warning"}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("plain"), BASE) as base:
        yield base


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("spec"), {**BASE, "spec": 2}) as base:
        yield base


def client(base: str, path: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=base + path, api_key=KEY, max_retries=0, timeout=60)


def check_chat_logprobs(content, k: int, greedy: bool) -> None:
    for entry in content:
        top = entry.top_logprobs
        values = [t.logprob for t in top]
        assert len(top) == k and values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values) and entry.logprob <= 0 and values[0] >= entry.logprob - 1e-5
        assert entry.bytes == list(entry.token.encode()) and all(t.bytes == list(t.token.encode()) for t in top)
        if greedy:  # the sampled token is the argmax: it heads the list with its own logprob
            assert (top[0].token, top[0].logprob) == (entry.token, entry.logprob)


def chat_top(c: openai.OpenAI, k: int, extra: dict | None = None, **kw):
    return c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=k,
                                     extra_body={"ignore_eos": True, **(extra or {})}, **kw)


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_chat_top_logprobs_stream_and_not(request, which):
    c = client(request.getfixturevalue(which))
    full = chat_top(c, 5, temperature=0)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 8
    assert "".join(e.token for e in content) == full.choices[0].message.content
    check_chat_logprobs(content, 5, greedy=True)
    streamed = [e for ch in chat_top(c, 5, temperature=0, stream=True)
                for e in (ch.choices[0].logprobs.content if ch.choices and ch.choices[0].logprobs else [])]
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, [t.token for t in e.top_logprobs]) for e in content]
    # Sampled, with repetition penalty: alternatives come from the same (penalised) distribution.
    sampled = chat_top(c, 3, {"repetition_penalty": 1.2}, temperature=1.0, seed=4)
    check_chat_logprobs(sampled.choices[0].logprobs.content, 3, greedy=False)
    # logprobs without top_logprobs: empty lists, as OpenAI sends.
    bare = c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=3, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)


def test_speculation_keeps_the_greedy_top_lists(plain, spec):
    a, b = (chat_top(client(base), 4, temperature=0).choices[0].logprobs.content for base in (plain, spec))
    assert [e.token for e in a] == [e.token for e in b]
    for x, y in zip(a, b):
        assert [t.token for t in x.top_logprobs][:2] == [t.token for t in y.top_logprobs][:2]
        assert x.logprob == pytest.approx(y.logprob, abs=1e-3)


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_completions_legacy_logprobs(request, which):
    c = client(request.getfixturevalue(which))
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = c.completions.create(**kw).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for tok, value, alts in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # Up to 3 alternatives and the sampled token (fewer when two tokens decode to the same text).
        assert 1 <= len(alts) <= 4 and all(v <= 0 for v in alts.values())
        assert alts[tok] == value and max(alts.values()) == value  # greedy: the sampled token is the best
    chunks = list(c.completions.create(stream=True, **kw))
    streamed = [d for ch in chunks if ch.choices[0].logprobs for d in ch.choices[0].logprobs.top_logprobs]
    assert streamed == lp.top_logprobs


def test_n_choices_seeded_and_reproducible(plain):
    c = client(plain)
    kw = dict(model=NAME, messages=CHAT, max_tokens=6, temperature=1.0, seed=11, n=3, extra_body={"ignore_eos": True})
    first, again = c.chat.completions.create(**kw), c.chat.completions.create(**kw)
    texts = [ch.message.content for ch in first.choices]
    assert [ch.index for ch in first.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert texts == [ch.message.content for ch in again.choices]
    one = c.chat.completions.create(**{**kw, "n": 1})  # choice 0 draws from the request's own seed
    assert one.choices[0].message.content == texts[0]
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (one.usage.prompt_tokens, 18)
    assert first.usage.total_tokens == one.usage.prompt_tokens + 18

    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    by_index: dict[int, str] = {}
    finishes = []
    for ch in chunks[:-1]:
        (choice,) = ch.choices
        by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
        finishes += [choice.index] if choice.finish_reason else []
    assert sorted(finishes) == [0, 1, 2] and [by_index[i] for i in range(3)] == texts
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18
    assert len({ch.id for ch in chunks}) == 1


def test_n_choices_completions_and_greedy(plain):
    c = client(plain)
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0, n=3, extra_body={"ignore_eos": True})
    full = c.completions.create(**kw)
    assert [ch.index for ch in full.choices] == [0, 1, 2] and len({ch.text for ch in full.choices}) == 1
    assert full.usage.completion_tokens == 15
    seen: dict[int, str] = {}
    for ch in c.completions.create(stream=True, **kw):
        seen[ch.choices[0].index] = seen.get(ch.choices[0].index, "") + ch.choices[0].text
    assert seen == {i: full.choices[0].text for i in range(3)}
    # Logprobs per choice too.
    lp = c.completions.create(**{**kw, "n": 2, "logprobs": 2}).choices
    assert all(len(ch.logprobs.top_logprobs) == 5 for ch in lp)


def _busy(base: str) -> float:
    for line in httpx.get(base + "/metrics", headers={"X-Api-Key": KEY}, timeout=10).text.splitlines():
        if line.startswith("strata_slots_busy "):
            return float(line.split()[1])
    raise KeyError("strata_slots_busy")


def test_closing_a_stream_aborts_every_choice(plain):
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": CTX - 20, "n": 3, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=plain, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            indices = set()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    indices.add(json.loads(line[6:])["choices"][0]["index"])
                if indices == {0, 1, 2}:
                    break
    deadline = time.monotonic() + 10
    while _busy(plain):
        assert time.monotonic() < deadline, "an aborted choice still holds its slot"
        time.sleep(0.05)


def test_tokenize_and_detokenize(plain):
    root = client(plain, "")
    tok = root.post("/tokenize", body={"prompt": PROMPT}, cast_to=object)
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == CTX
    assert root.post("/detokenize", body={"tokens": tok["tokens"]}, cast_to=object) == {"prompt": PROMPT,
                                                                                         "content": PROMPT}
    chat = client(plain).chat.completions.create(model=NAME, messages=CHAT, max_tokens=1)
    templated = root.post("/tokenize", body={"model": NAME, "messages": CHAT}, cast_to=object)
    assert templated["count"] == chat.usage.prompt_tokens
    with httpx.Client(base_url=plain, timeout=10) as h:
        assert h.post("/tokenize", json={"prompt": "a"}).status_code == 401  # the same key as /v1/*


BAD = [
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "n": 17}, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, "n"),
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, None),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
]


def test_bad_inputs_are_400s(plain):
    with httpx.Client(base_url=plain, headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as h:
        for path, body, param in BAD:
            r = h.post(path, json={"model": NAME, **body})
            assert r.status_code == 400, (path, body, r.text)
            assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
        r = h.post("/tokenize", json={"model": "gpt-4o", "prompt": "a"})
        assert r.status_code == 200 and r.json()["count"] >= 1  # any model name is the served one
    with pytest.raises(openai.BadRequestError) as e:
        client(plain).chat.completions.create(model=NAME, messages=CHAT, logprobs=True, top_logprobs=25)
    assert e.value.param == "top_logprobs"


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu,
                                   pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("spec", [0, 2])
def test_engine_top_lists_match_the_picks(device, spec):
    """In the engine (on CUDA: the graph path too): greedy, penalised-greedy and sampled-penalised
    rows' lists hold each token's own logprob, and the request that asks for fewest gets fewest."""
    e = LLMEngine(EngineConfig(device=device, dtype="float32", ctx=512, parallel=4, spec=spec), progress=False)
    ids = tuple(e.tokenizer.encode(PROMPT))
    asks = {"greedy": ({}, 5), "penalised": ({"repetition_penalty": 1.3}, 20),
            "sampled": ({"temperature": 1.0, "seed": 3, "repetition_penalty": 1.2}, 2), "none": ({}, 0)}
    for rid, (kw, k) in asks.items():
        e.add_request(EngineRequest(rid, ids, SamplingParams(max_tokens=12, ignore_eos=True, **kw), 0.0,
                                    top_logprobs=k), logprobs=True)
    for rid, events in e.run_to_completion().items():
        toks = [t for ev in events for t in ev.token_ids]
        lps = [v for ev in events for v in ev.logprobs]
        tops = [t for ev in events if ev.top_logprobs is not None for t in ev.top_logprobs]
        k = asks[rid][1]
        assert len(toks) == 12 and len(tops) == (12 if k else 0)
        for t, lp, top in zip(toks, lps, tops):
            values = [v for _, v in top]
            assert len(top) == k and values == sorted(values, reverse=True) and values[0] <= 0
            assert values[0] >= lp - 1e-5 and dict(top).get(t, lp) == pytest.approx(lp, abs=1e-5)
            if rid != "sampled":
                assert top[0][0] == t


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("spec", [0, 2])
def test_filtered_lists_are_the_distribution_after_the_samplers_filters(device, spec):
    """With filtered_logprobs (llama-server's post_sampling_probs) the first token's list is the
    filtered distribution rebuilt from the plain top 20 (top_k 10 keeps it within them); on every
    token after it (drafted ones too, with spec) the pick has the probability its list gives it, at
    most top_k tokens are kept, none below min_p of the best, and a greedy row is one token at 1."""
    from strata.sampling import filtered_probs

    e = LLMEngine(EngineConfig(device=device, dtype="float32", ctx=512, parallel=4, spec=spec), progress=False)
    ids = tuple(e.tokenizer.encode(PROMPT))
    filtered = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7, top_k=10, top_p=0.9, min_p=0.05,
                              seed=5)
    asks = {"raw": (SamplingParams(max_tokens=1, ignore_eos=True), False),
            "filtered": (filtered, True),
            "greedy": (SamplingParams(max_tokens=12, ignore_eos=True), True)}
    for rid, (params, post) in asks.items():
        e.add_request(EngineRequest(rid, ids, params, 0.0, top_logprobs=20 if rid == "raw" else 10,
                                    filtered_logprobs=post), logprobs=True)
    out = {rid: ([t for ev in evs for t in ev.token_ids], [v for ev in evs for v in ev.logprobs],
                 [t for ev in evs if ev.top_logprobs is not None for t in ev.top_logprobs])
           for rid, evs in e.run_to_completion().items()}

    raw = torch.full((e.model_config.vocab_size,), float("-inf"))
    for t, v in out["raw"][2][0]:
        raw[t] = v
    ref = filtered_probs(raw, filtered)
    toks, lps, tops = out["filtered"]
    kept = [(t, v) for t, v in tops[0] if v > float("-inf")]
    assert [t for t, _ in kept] == ref.nonzero()[:, 0][ref[ref > 0].argsort(descending=True)].tolist()
    assert [v for _, v in kept] == pytest.approx(ref[[t for t, _ in kept]].log().tolist(), abs=1e-4)
    assert len(toks) == len(tops) == 12
    for t, lp, top in zip(toks, lps, tops):
        probs = {a: torch.tensor(v).exp().item() for a, v in top if v > float("-inf")}
        assert 1 <= len(probs) <= 10 and probs[t] == pytest.approx(torch.tensor(lp).exp().item(), abs=1e-5)
        assert min(probs.values()) >= 0.05 * max(probs.values()) - 1e-6 and sum(probs.values()) <= 1 + 1e-5
    toks, lps, tops = out["greedy"]
    assert all(lp == 0.0 for lp in lps)
    assert all([(a, v) for a, v in top if v > float("-inf")] == [(t, 0.0)] for t, top in zip(toks, tops))
