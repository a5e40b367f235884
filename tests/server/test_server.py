"""`strata serve`: a real server process on the embedded model (CPU), driven by the official `openai`
client and by raw HTTP for what the client will not send. One process serves the whole module.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest

from strata.config import EngineConfig
from strata.server.config import ServerConfig
from strata.server.metrics import RateWindow
from strata.server.serve import ConfigFileError, configure_parser, read_config_file, resolve
from serving import running_server

KEY = "sk-strata-test"
NAME = "strata-test"
CTX = 1024
PROMPT = "It is a truth universally acknowledged, that"
CHAT = [{"role": "system", "content": "You are a scribe."}, {"role": "user", "content": "In the beginning"}]


def parse_args(argv: list[str]):
    import argparse

    return configure_parser(argparse.ArgumentParser()).parse_args(argv)


# ---- config merge (no server) -------------------------------------------------------------------


def test_engine_flags_are_generated_from_engine_config():
    import dataclasses

    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert not engine_fields & {f.name for f in dataclasses.fields(ServerConfig)}
    p = configure_parser(__import__("argparse").ArgumentParser())
    flags = {s for a in p._actions for s in a.option_strings}
    for name in engine_fields - {"model"}:
        assert "--" + name.replace("_", "-") in flags, name
    eng, srv = resolve(parse_args([]))
    assert eng == EngineConfig() and srv == ServerConfig() and srv.host == "127.0.0.1"
    eng, _ = resolve(parse_args(["m.gguf", "--ctx", "2048", "--no-give-way", "--seed", "7", "--kv", "int8"]))
    assert (eng.model, eng.ctx, eng.give_way, eng.seed, eng.kv) == ("m.gguf", 2048, False, 7, "int8")
    with pytest.raises(SystemExit):
        parse_args(["--ctx", "many"])


def test_cli_flags_override_the_config_file(tmp_path):
    path = tmp_path / "strata.json"
    path.write_text(json.dumps({"parallel": 3, "kv": "int8", "ctx": 32768, "port": 9001, "api-key": "k",
                                "seed": 5, "gpu_memory_utilization": 1}))
    eng, srv = resolve(parse_args(["--config", str(path), "--ctx", "2048", "--host", "0.0.0.0", "--seed", "none"]))
    assert (eng.parallel, eng.kv, eng.ctx, eng.seed, eng.gpu_memory_utilization) == (3, "int8", 2048, None, 1.0)
    assert (srv.port, srv.api_key, srv.host) == (9001, "k", "0.0.0.0")
    _, srv = resolve(parse_args(["--config", str(path)]))
    assert srv.host == "127.0.0.1"


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("STRATA_API_KEY", "from-env")
    assert resolve(parse_args([]))[1].api_key == "from-env"
    assert resolve(parse_args(["--api-key", "typed"]))[1].api_key == "typed"


@pytest.mark.parametrize("content, match", [
    ({"parallel": 2, "paralel": 4}, "unknown key 'paralel'"),
    ({"ctx": "long"}, "'ctx' must be int"),
    ({"give_way": 1}, "'give_way' must be bool"),
    ({"port": None}, "'port' must not be null"),
    ([1, 2], "JSON object"),
    ("{not json", "not valid JSON"),
])
def test_config_file_errors_name_the_problem(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ConfigFileError, match=re.escape(match)):
        read_config_file(str(path))
    with pytest.raises(ConfigFileError, match="cannot read"):
        read_config_file(str(tmp_path / "missing.json"))


def test_rate_window():
    now = [0.0]
    rate = RateWindow(window_s=10.0, clock=lambda: now[0])
    assert rate.update(100, uptime_s=4.0) == 25.0  # one sample: the lifetime average
    now[0] = 2.0
    assert rate.update(140, 6.0) == 20.0
    now[0] = 30.0
    assert rate.update(700, 34.0) == 20.0  # spans the window back to the newest older sample


# ---- the live server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # parallel comes from the file as 1 and is overridden to 2 on the command line (checked in /metrics).
    config = {"ctx": CTX, "parallel": 1, "device": "cpu", "api_key": KEY, "model_name": NAME,
              "log_level": "warning", "max_body_bytes": 2**16, "spec": 2, "batch_mtp": True}
    with running_server(tmp_path_factory.mktemp("serve"), config, ["--parallel", "2"]) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def metrics(server: str) -> dict[str, float]:
    """Parses the Prometheus text strictly enough to catch format slips; {name{labels}: value}."""
    text = httpx.get(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    kinds, out = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram")
            kinds[name] = kind
            continue
        if line.startswith("# HELP "):
            continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:\w+="(?:[^"\\]|\\.)*",?)*\})? (\S+)', line)
        assert m, line
        family = re.sub(r"_(bucket|sum|count)$", "", m[1]) if m[1] not in kinds else m[1]
        assert family in kinds, line
        out[m[1] + (m[2] or "")] = float(m[3])
    return out


def test_health_models_and_auth(server, client, http):
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == [NAME] and models[0].max_model_len == CTX
    assert client.models.retrieve(NAME).id == NAME
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server + "/v1/completions", json={"model": NAME, "prompt": "a"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2)
    assert httpx.get(server + "/health").status_code == 200  # open to all
    for path in ("/metrics", "/slots", "/strata/slots"):
        assert httpx.get(server + path).status_code == 401, path
    assert httpx.get(server + "/metrics", headers={"X-Api-Key": KEY}).status_code == 200


def test_chat_non_streaming_and_streaming_agree(client, tok):
    prompt_tokens = len(tok.encode(tok.apply_chat_template(CHAT), add_special=False))
    full = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (
        prompt_tokens, 12, prompt_tokens + 12)

    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == ["length"] and chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == prompt_tokens + 12
    assert len({c.id for c in chunks}) == 1


def test_completions_text_tokens_and_streaming(client, tok):
    ids = tok.encode(PROMPT)
    a = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0, seed=1,
                                  extra_body={"ignore_eos": True})
    b = client.completions.create(model=NAME, prompt=ids, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert a.object == "text_completion" and a.choices[0].text == b.choices[0].text != ""
    assert (a.usage.prompt_tokens, a.usage.completion_tokens, a.usage.total_tokens) == (len(ids), 10, len(ids) + 10)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == a.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)
    echoed = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == PROMPT + a.choices[0].text
    # Without max_tokens a completion gets OpenAI's default of 16.
    d = client.completions.create(model=NAME, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert d.usage.completion_tokens == 16


def test_sampling_is_seeded_and_logprobs_are_returned(client):
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.95,
              extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    first, again = (client.completions.create(seed=3, **kw).choices[0].text for _ in range(2))
    assert first == again
    # A temperature too small to divide logits by safely runs greedy instead of failing the step.
    kw.update(temperature=1e-30, top_p=1.0, extra_body={"ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(
        **{**kw, "temperature": 0}).choices[0].text
    lp = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6 and all(x <= 0 for x in lp.token_logprobs)
    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=6, temperature=0, logprobs=True)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_stop_strings(client):
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = text[len(text) // 2:][:3]
    want = text[: text.index(stop)]
    cut = client.completions.create(stop=[stop, "\x00never"], **kw).choices[0]
    assert (cut.text, cut.finish_reason) == (want, "stop")
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == want and streamed[-1].choices[0].finish_reason == "stop"


def test_two_streams_at_once(client, server):
    prompts = [PROMPT, "In the beginning God created the heaven and the earth."]
    solo = [client.completions.create(model=NAME, prompt=p, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    got: dict[int, list[tuple[float, str]]] = {0: [], 1: []}

    def run(i: int) -> None:
        for c in client.completions.create(model=NAME, prompt=prompts[i], max_tokens=24, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
            if c.choices[0].text:
                got[i].append((time.monotonic(), c.choices[0].text))

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert ["".join(t for _, t in got[i]) for i in (0, 1)] == solo
    # Both ran in slots side by side: each stream's first text came before the other's last.
    assert got[0][0][0] < got[1][-1][0] and got[1][0][0] < got[0][-1][0]
    assert metrics(server)["strata_slots_total"] == 2


BAD_REQUESTS = [
    # (path, raw body or JSON, status, param, code)
    ("/v1/chat/completions", b'{"model": "x", "messages": [', 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("/v1/completions", {"model": NAME, "prompt": [5] * (CTX + 10)}, 400, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "word " * CTX}]},
     400, "messages", "context_length_exceeded"),
    ("/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": CTX}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": -1}, 400, "max_tokens", None),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens", None),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "temperature": -0.5}, 400, "temperature", None),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"model": NAME, "prompt": PROMPT, "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"model": NAME, "prompt": PROMPT, "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"model": NAME}, 400, "messages", None),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", None),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages", "unsupported_parameter"),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "n": 17}, 400, "n", None),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "tools": [{"type": "function"}]}, 400,
     "tools[0].function", None),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", None),
    ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "top_logprobs": 3}, 400, "top_logprobs", None),
    ("/v1/completions", {"model": NAME, "prompt": PROMPT, "stop": ""}, 400, "stop", None),
    ("/v1/completions", {"model": NAME, "prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"model": NAME, "prompt": [1, 99999]}, 400, "prompt", None),
    ("/v1/completions", {"model": NAME, "prompt": PROMPT, "presence_penalty": 2.5}, 400, "presence_penalty", None),
    ("/v1/completions", {"model": NAME, "prompt": PROMPT, "seed": 2**64}, 400, "seed", None),
    ("/v1/completions", {"model": NAME, "prompt": "x" * 2**16}, 413, None, "request_too_large"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, http, client):
    for path, body, status, param, code in BAD_REQUESTS:
        r = (http.post(path, content=body, headers={"Content-Type": "application/json"}) if isinstance(body, bytes)
             else http.post(path, json=body))
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        # A context the request cannot fit: llama-server's type and its n_ctx / n_prompt_tokens beside
        # OpenAI's code.
        kind, extra = (("exceed_context_size_error", {"n_ctx", "n_prompt_tokens"}) if code == "context_length_exceeded"
                       else ("invalid_request_error", set()))
        assert set(err) == {"message", "type", "param", "code"} | extra and err["message"], err
        assert (err["param"], err["code"], err["type"]) == (param, code, kind), (body, err)
        assert not extra or err["n_ctx"] == CTX and err["n_prompt_tokens"] > 0, err
    r = http.get("/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert http.get("/v1/chat/completions").status_code == 405
    # One model is served whatever name a request sends (as llama-server does); a lookup is exact.
    assert client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=1).model == "gpt-4o"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=CHAT, n=17)
    assert e.value.param == "n"
    assert http.get("/health").status_code == 200
    after = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 4
    m = metrics(server)
    assert m['strata_http_requests_total{method="POST",path="/v1/chat/completions",status="400"}'] >= 10


def _wait_idle(server: str, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["strata_slots_busy"] == 0 and m["strata_queue_length"] == 0:
            return m
        assert time.monotonic() < deadline, "the aborted request still holds its slot"
        time.sleep(0.05)


def test_client_disconnect_frees_the_slot(server):
    before = _wait_idle(server)
    long = {"model": NAME, "prompt": PROMPT, "max_tokens": CTX - 20, "ignore_eos": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server, headers=headers, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 4:
                    break
    mid = _wait_idle(server)
    # A whole completion would have generated ~1000 tokens; the abort stopped it after a few.
    assert mid["strata_generation_tokens_total"] - before["strata_generation_tokens_total"] < (CTX - 20) / 2
    assert mid["strata_requests_finished_total"] == before["strata_requests_finished_total"] + 1

    # A client that gives up waiting for a whole (non-streamed) completion frees its slot too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=long, headers=headers, timeout=0.5)
    after = _wait_idle(server)
    assert after["strata_generation_tokens_total"] - mid["strata_generation_tokens_total"] < (CTX - 20) / 2
    assert after["strata_requests_finished_total"] == mid["strata_requests_finished_total"] + 1


def test_metrics_cover_the_engine(server, client):
    client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2)
    m = metrics(server)
    for name in ("queue_length", "slots_busy", "kv_blocks_used", "kv_blocks_total", "prompt_tokens_total",
                 "generation_tokens_total", "generation_tokens_per_second", "give_ways_total", "preemptions_total"):
        assert "strata_" + name in m, name
    assert m["strata_kv_blocks_total"] > 0 and m["strata_prompt_tokens_total"] > 0
    buckets = [v for k, v in m.items() if k.startswith("strata_time_to_first_token_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == m["strata_time_to_first_token_seconds_count"] > 0
    assert m[f'strata_model_info{{model="{NAME}"}}'] == 1


def test_speculation_stats_in_usage_and_metrics(server, http):
    r = http.post("/v1/completions", json={"model": NAME, "prompt": "It is a truth universally acknowledged, that",
                                           "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    spec = r.json()["usage"]["speculation"]
    assert spec["drafts_proposed"] > 0 and 0 <= spec["acceptance"] <= 1 and len(spec["accepted_per_position"]) == 2
    m = metrics(server)
    assert m["strata_spec_drafts_proposed_total"] >= spec["drafts_proposed"]
    assert 'strata_spec_accepted_per_position{position="1"}' in m
