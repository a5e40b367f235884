"""Tool calls, reasoning and `chat_template_kwargs` through the chat API.

The request side runs through the official `openai` client against a real `strata serve` on the
embedded model (whose template has no tools branch, so it answers in plain content). The output side
needs a model that writes `<think>` and `<tool_call>`: an app from `build_app` over a fake engine that
streams a fixed Qwen3-style answer in small pieces, served by uvicorn on a loopback port.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from strata.engine.types import EngineEvent, EngineRequest, EngineStats
from strata.loaders import default_model_path
from strata.server.config import ServerConfig
from strata.tokenizer import Tokenizer
from serving import running_server

KEY = "sk-strata-test"
NAME = "strata-test"
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ANSWER = ('<think>plan</think>Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>')


# ---- the embedded model, real server ------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    config = {"ctx": 512, "parallel": 1, "device": "cpu", "api_key": KEY, "model_name": NAME,
              "log_level": "warning"}
    with running_server(tmp_path_factory.mktemp("tools"), config) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_tools_auto_answers_a_plain_message(served):
    r = served.chat.completions.create(model=NAME, messages=CHAT, tools=[WEATHER], tool_choice="auto",
                                       max_tokens=8, temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str) and not msg.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")
    # A conversation that carries an earlier call and its result is accepted too.
    history = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = served.chat.completions.create(model=NAME, messages=history, tools=[WEATHER], max_tokens=4,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.role == "assistant"


@pytest.mark.parametrize("kw, param", [
    (dict(tools=[{"type": "retrieval"}]), "tools[0]"),
    (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(extra_body={"chat_template_kwargs": {"messages": []}}), "chat_template_kwargs"),
    (dict(extra_body={"chat_template_kwargs": {"tools": []}}), "chat_template_kwargs"),
])
def test_bad_tool_fields_are_400s_naming_the_param(served, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        served.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param


# ---- the wiring, over a fake Qwen3 engine -------------------------------------------------------


class FakeQwen3Engine:
    """Answers every request with ANSWER, a few characters per event, one token per event."""

    model_name = NAME
    model_type = "qwen3"
    max_model_len = 512

    def __init__(self) -> None:
        tok = Tokenizer.from_hf_dir(default_model_path())
        # No template of its own: the model type decides (Qwen3 thinks), the default ChatML renders.
        self.tokenizer = dataclasses.replace(tok, chat_template=None)

    def stats(self) -> EngineStats:
        return EngineStats(parallel=1, queue_len=0, slots_busy=0, kv_blocks_used=0, kv_blocks_total=1,
                           prompt_tokens_total=0, generation_tokens_total=0, requests_finished_total=0,
                           give_ways_total=0, preemptions_total=0)

    def submit(self, req: EngineRequest, logprobs: bool = False):
        pieces = [ANSWER[i:i + 3] for i in range(0, len(ANSWER), 3)]

        async def events():
            for k, text in enumerate(pieces):
                await asyncio.sleep(0)
                yield EngineEvent(req.request_id, (1,), text, "stop" if k == len(pieces) - 1 else None,
                                  prompt_tokens=len(req.prompt_ids), completion_tokens=k + 1,
                                  logprobs=(-0.5,) if logprobs else None)
        return events()

    def abort(self, request_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def fake():
    import uvicorn

    from strata.server.app import build_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = build_app(FakeQwen3Engine(), ServerConfig(model_name=NAME, api_key=KEY))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.01)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=30), base
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def test_reasoning_and_tool_calls_whole(fake):
    c, base = fake
    r = c.chat.completions.create(model=NAME, messages=CHAT, tools=[WEATHER], n=2)
    for choice in r.choices:
        msg = choice.message
        assert msg.reasoning_content == "plan" and msg.content == "Sure."
        assert len(msg.tool_calls) == 1 and msg.tool_calls[0].function.name == "get_weather"
        assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
        assert msg.tool_calls[0].id.startswith("call_") and choice.finish_reason == "tool_calls"
    # Without tools the call stays text; with thinking off the reasoning does too.
    raw = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": NAME, "messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    msg = raw.json()["choices"][0]["message"]
    assert msg["content"] == ANSWER and "reasoning_content" not in msg and "tool_calls" not in msg
    assert raw.json()["choices"][0]["finish_reason"] == "stop"


def test_reasoning_and_tool_calls_streamed(fake):
    c, _ = fake
    reasoning, content, calls, finish, logprobs = {}, {}, {}, {}, {}
    for chunk in c.chat.completions.create(model=NAME, messages=CHAT, tools=[WEATHER], n=2, stream=True,
                                           logprobs=True):
        for ch in chunk.choices:
            d = ch.delta
            reasoning[ch.index] = reasoning.get(ch.index, "") + (getattr(d, "reasoning_content", None) or "")
            content[ch.index] = content.get(ch.index, "") + (d.content or "")
            for tc in d.tool_calls or []:
                slot = calls.setdefault(ch.index, {}).setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.id:
                    assert tc.id.startswith("call_") and tc.type == "function"
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
            if ch.logprobs and ch.logprobs.content:
                logprobs[ch.index] = logprobs.get(ch.index, 0) + len(ch.logprobs.content)
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    n_events = -(-len(ANSWER) // 3)
    for i in range(2):
        assert reasoning[i] == "plan" and content[i] == "Sure." and finish[i] == "tool_calls"
        assert list(calls[i]) == [0] and calls[i][0]["name"] == "get_weather"
        assert json.loads(calls[i][0]["arguments"]) == {"city": "Paris"}
        assert logprobs[i] == n_events  # none lost to events that gave no delta
