"""Structured output end to end: `response_format` (json_object, json_schema, regex), forced
`tool_choice` and /v1/messages' `tool_choice`, through the official clients against a real `strata
serve` on the embedded model (CPU), one plain server and one speculating (--spec 2, its MTP head).

The embedded model is tiny and untrained for JSON: only the grammar makes its output parse. It pads
with newlines (up to the grammar's whitespace bound), so schemas here are small and greedy prompts are
ones it is known to finish within `max_tokens`.
"""

from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest

from serving import running_server

KEY = "sk-strata-test"
NAME = "strata-test"
BASE = {"ctx": 512, "parallel": 2, "device": "cpu", "api_key": KEY, "model_name": NAME, "log_level": "warning"}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}
CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "trip", "schema": CITY, "strict": True}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"]}}}


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("structured"), BASE) as base:
        yield base


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("structured-spec"), {**BASE, "parallel": 1, "spec": 2}) as base:
        yield base


def check_city(text: str) -> None:
    """`text` is a JSON object valid under CITY (checked by hand: jsonschema is not a dependency)."""
    obj = json.loads(text)
    assert set(obj) == {"city", "days"}, obj
    assert isinstance(obj["city"], str) and len(obj["city"]) <= 12
    assert type(obj["days"]) is int and 1 <= obj["days"] <= 7


def test_json_object_parses(plain):
    r = client(plain).chat.completions.create(model=NAME, messages=CHAT, max_tokens=40, temperature=0,
                                              response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_json_schema_validates_and_speculation_changes_nothing(plain, spec):
    outputs = []
    for base in (plain, spec):
        r = client(base).chat.completions.create(model=NAME, messages=CHAT, max_tokens=80, temperature=0,
                                                 response_format=CITY_FORMAT)
        assert r.choices[0].finish_reason == "stop"
        check_city(r.choices[0].message.content)
        outputs.append(r.choices[0].message.content)
    assert outputs[0] == outputs[1]


def test_json_schema_streams(plain):
    stream = client(plain).chat.completions.create(model=NAME, messages=CHAT, max_tokens=80, temperature=0,
                                                   response_format=CITY_FORMAT, stream=True)
    parts, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert finish == "stop"
    check_city("".join(parts))


def test_regex_chat_and_completions(plain):
    pattern = r"[a-c]{3}-\d{2}"
    fmt = {"type": "regex", "regex": pattern}
    c = client(plain)
    r = c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0, response_format=fmt,
                                  logprobs=True, top_logprobs=5)
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(pattern, r.choices[0].message.content)
    # Alternatives the grammar masks out read as OpenAI's -9999, not -inf (which is not JSON).
    for entry in r.choices[0].logprobs.content:
        assert entry.logprob > -9999.0 and all(-9999.0 <= t.logprob <= 0 for t in entry.top_logprobs)
    assert any(t.logprob == -9999.0 for e in r.choices[0].logprobs.content for t in e.top_logprobs)
    r = c.completions.create(model=NAME, prompt="Give me a code:", max_tokens=12, temperature=0,
                             extra_body={"response_format": fmt})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(pattern, r.choices[0].text)


@pytest.mark.parametrize("kw, param, needle", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}),
     "response_format", "objec"),
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}, "strict": True}}), "response_format",
     "uniqueItems"),
    (dict(response_format={"type": "regex", "regex": "(ab"}), "response_format", "regex"),
    (dict(extra_body={"grammar": "root ::= foo"}), "grammar", "foo"),
])
def test_bad_grammars_are_400s_naming_the_problem(plain, kw, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client(plain).chat.completions.create(model=NAME, messages=CHAT, max_tokens=4, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert needle in e.value.body["message"]


def check_time_call(message) -> None:
    assert message.tool_calls and len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments) in ({"zone": "UTC"}, {"zone": "CET"})


def test_tool_choice_required_and_named_make_a_valid_call(plain):
    c = client(plain)
    r = c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=80, temperature=0, tools=[TIME],
                                  tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    check_time_call(r.choices[0].message)
    named = {"type": "function", "function": {"name": "get_time"}}
    stream = c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=80, temperature=0,
                                       tools=[WEATHER, TIME], tool_choice=named, stream=True)
    name, args, finish = "", "", None
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                if tc.function is not None:
                    name += tc.function.name or ""
                    args += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and name == "get_time"
    assert json.loads(args) in ({"zone": "UTC"}, {"zone": "CET"})


def test_messages_tool_choice_is_enforced(plain):
    a = anthropic.Anthropic(base_url=plain, api_key=KEY, max_retries=0, timeout=120)
    tool = {"name": "get_time", "description": "The time in a zone.",
            "input_schema": TIME["function"]["parameters"]}
    m = a.messages.create(model=NAME, max_tokens=80, messages=CHAT, tools=[tool],
                          tool_choice={"type": "tool", "name": "get_time"}, extra_body={"temperature": 0})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1
    assert uses[0].name == "get_time" and uses[0].input in ({"zone": "UTC"}, {"zone": "CET"})
