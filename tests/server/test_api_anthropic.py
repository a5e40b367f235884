"""Anthropic's Messages API (`POST /v1/messages`) through the official `anthropic` client: plain
messages against a real `strata serve` on the embedded model, tool use over the fake Qwen3 engine of
test_api_tools (which answers `<think>plan</think>Sure.<tool_call>{...}</tool_call>`)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from serving import running_server
from test_api_tools import KEY, NAME, fake  # noqa: F401  (the fake engine's server fixture)

HELLO = [{"role": "user", "content": "In the beginning"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    config = {"ctx": 512, "parallel": 1, "device": "cpu", "api_key": KEY, "model_name": NAME,
              "log_level": "warning"}
    with running_server(tmp_path_factory.mktemp("anthropic"), config) as base:
        yield base


def client(base: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=60)


def test_plain_message_whole_and_streamed(served):
    c = client(served)
    m = c.messages.create(model=NAME, max_tokens=6, messages=HELLO, extra_body={"temperature": 0},
                          system="You are a scribe.")
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("max_tokens", "end_turn") and m.stop_sequence is None
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 6
    with c.messages.stream(model=NAME, max_tokens=6, messages=HELLO, extra_body={"temperature": 0},
                           system=[{"type": "text", "text": "You are a scribe."}]) as s:
        names = [ev.type for ev in s]
        final = s.get_final_message()
    assert names[0] == "message_start" and names[-1] == "message_stop" and "content_block_delta" in names
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens
    # The same prompt again: what the prefix cache held is a cache read, the rest input, as Anthropic counts.
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == m.usage.input_tokens + m.usage.cache_read_input_tokens)
    assert final.usage.cache_read_input_tokens > 0 and final.usage.cache_creation_input_tokens == 0


def test_stop_sequences(served):
    c = client(served)
    full = c.messages.create(model=NAME, max_tokens=12, messages=HELLO, extra_body={"temperature": 0}).content[0].text
    stop = full.strip()[1:3]
    m = c.messages.create(model=NAME, max_tokens=12, messages=HELLO, extra_body={"temperature": 0}, stop_sequences=[stop, "§§"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert stop not in "".join(b.text for b in m.content)
    with c.messages.stream(model=NAME, max_tokens=12, messages=HELLO, extra_body={"temperature": 0}, stop_sequences=[stop]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_auth_and_errors_have_anthropics_shape(served):
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(served, "wrong").messages.create(model=NAME, max_tokens=2, messages=HELLO)
    assert e.value.status_code == 401 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    ok = httpx.post(served + "/v1/messages", headers={"Authorization": f"Bearer {KEY}"},
                    json={"model": NAME, "max_tokens": 2, "messages": HELLO}, timeout=60)
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    bad = httpx.post(served + "/v1/messages", headers={"x-api-key": KEY}, json={"model": NAME, "messages": HELLO})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in bad.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client(served).messages.create(model=NAME, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    # Any model name is the one served (as llama-server and its Anthropic clients expect).
    assert client(served).messages.create(model="nope", max_tokens=2, messages=HELLO).type == "message"


# ---- tools, over the fake Qwen3 engine ------------------------------------------------------------


def test_tool_use_whole_and_streamed(fake):  # noqa: F811
    _, base = fake
    c = client(base)
    kw = dict(model=NAME, max_tokens=100, messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=[WEATHER], tool_choice={"type": "any"})
    m = c.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == "plan" and m.content[1].text == "Sure."
    call = m.content[2]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id
    assert m.stop_reason == "tool_use"
    partial, types = [], []
    with c.messages.stream(**kw) as s:
        for ev in s:
            if ev.type == "content_block_start":
                types.append(ev.content_block.type)
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                partial.append(ev.delta.partial_json)
        final = s.get_final_message()
    assert types == ["thinking", "text", "tool_use"] and json.loads("".join(partial)) == {"city": "Paris"}
    assert final.stop_reason == "tool_use" and final.content[2].input == {"city": "Paris"}
    assert final.content[0].thinking == "plan" and final.content[1].text == "Sure."


def test_tool_result_conversation_reaches_the_prompt(fake, monkeypatch):  # noqa: F811
    from test_api_tools import FakeQwen3Engine

    from strata.server import anthropic as A

    prompts = []
    answer = FakeQwen3Engine.submit

    def recording(self, req, logprobs: bool = False):
        prompts.append(req.prompt_ids)
        return answer(self, req, logprobs)

    monkeypatch.setattr(FakeQwen3Engine, "submit", recording)
    _, base = fake
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny, 21 C"}]},
                                     {"type": "text", "text": "And tomorrow?"}]}]
    m = client(base).messages.create(model=NAME, max_tokens=100, messages=messages, tools=[WEATHER],
                                     system="Be brief.")
    assert m.stop_reason == "tool_use"
    prompt = FakeQwen3Engine().tokenizer.decode(list(prompts[-1]), skip_special=False)
    # The default ChatML renders roles and contents (not tools): the result is a tool turn.
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in prompt and "Be brief." in prompt
    assert prompt.index("Let me look.") < prompt.index("sunny, 21 C") < prompt.index("And tomorrow?")
    body = A.MessagesRequest.model_validate({"model": NAME, "max_tokens": 5, "messages": messages})
    chat = A.to_chat_request(body).chat()
    assert [x["role"] for x in chat] == ["user", "assistant", "tool", "user"]
    assert chat[1]["tool_calls"][0] == {"id": "toolu_1", "type": "function",
                                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert chat[2] == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "toolu_1"}


def test_earlier_thinking_reaches_the_template_as_reasoning_content():
    from strata.server import anthropic as A

    messages = [{"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "Add them.", "signature": ""},
                                                  {"type": "redacted_thinking", "data": "x"},
                                                  {"type": "text", "text": "4"}]},
                {"role": "user", "content": "And 3 + 3?"}]
    body = A.MessagesRequest.model_validate({"model": NAME, "max_tokens": 5, "messages": messages})
    chat = A.to_chat_request(body).chat()
    assert chat[1] == {"role": "assistant", "content": "4", "reasoning_content": "Add them."}
    assert "reasoning_content" not in chat[0] and "reasoning_content" not in chat[2]
