"""Tool-call and reasoning parsers (strata/server/tools.py, reasoning.py) and the chat template's tools.

Every streamed case is checked at every split point of its text (and one character at a time) against
the whole-text parse: the same content, the same calls, OpenAI's delta shapes, and no partial tag ever
sent as content.
"""

from __future__ import annotations

import json
import os

import pytest

from strata.server.reasoning import ReasoningParser, reasoning_parser_for, thinking_opened_in_prompt
from strata.server.tools import (ChatOutputParser, GlmToolParser, HermesToolParser, ToolCall, ToolChoice,
                                 ToolRequestError, resolve_tool_choice, template_tools, tool_parser_for,
                                 tools_for_template)
from strata.tokenizer import ChatTemplateError, Tokenizer, messages_for_template

DEFAULT_MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "strata", "assets", "default-model")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "zip": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, CLOCK]


def hermes_block(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


HERMES_CASES = {
    "one": (hermes_block("get_weather", {"city": "Paris"}), "", [("get_weather", {"city": "Paris"})]),
    "before_after": ("Let me check.\n\n" + hermes_block("get_weather", {"city": "Oslo", "days": 2}) + "\nDone.",
                     "Let me check.\n\n\nDone.", [("get_weather", {"city": "Oslo", "days": 2})]),
    "several": (hermes_block("get_weather", {"city": "Rome"}) + "\n" + hermes_block("now", {}),
                "", [("get_weather", {"city": "Rome"}), ("now", {})]),
    "two_in_one_block": ('<tool_call>{"name": "now", "arguments": {}}\n{"name": "now", "arguments": {"tz": "UTC"}}'
                         '</tool_call>', "", [("now", {}), ("now", {"tz": "UTC"})]),
    "string_arguments": ('<tool_call>{"name": "now", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>', "",
                         [("now", {"tz": "CET"})]),
    "malformed": ("a <tool_call>{not json}</tool_call> b " + hermes_block("now", {}),
                  "a <tool_call>{not json}</tool_call> b", [("now", {})]),
    "bad_then_good": ("<tool_call>oops\n" + hermes_block("now", {}), "<tool_call>oops", [("now", {})]),
    "nan_is_not_json": ('<tool_call>{"name": "now", "arguments": {"x": NaN}}</tool_call>',
                        '<tool_call>{"name": "now", "arguments": {"x": NaN}}</tool_call>', []),
    "no_name": ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    "unclosed_valid": ('<tool_call>\n{"name": "now", "arguments": {}}\n', "", [("now", {})]),
    "unclosed_cut": ('x <tool_call>\n{"name": "now", "argu', 'x <tool_call>\n{"name": "now", "argu', []),
    "lookalike_tags": ("<tool <tool_cal> <b>bold</b> <", "<tool <tool_cal> <b>bold</b> <", []),
    "no_calls": ("  plain answer\n", "plain answer", []),
    "unicode": ("é " + hermes_block("get_weather", {"city": "Zürich"}), "é", [("get_weather", {"city": "Zürich"})]),
}

GLM_CASES = {
    "one": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
            "", [("get_weather", {"city": "Paris", "days": 3})]),
    "typed_values": ("<tool_call>set<arg_key>on</arg_key><arg_value>true</arg_value><arg_key>xs</arg_key>"
                     '<arg_value>[1, 2]</arg_value><arg_key>o</arg_key><arg_value>{"a": null}</arg_value>'
                     "<arg_key>s</arg_key><arg_value>two words</arg_value><arg_key>nan</arg_key>"
                     "<arg_value>NaN</arg_value></tool_call>",
                     "", [("set", {"on": True, "xs": [1, 2], "o": {"a": None}, "s": "two words", "nan": "NaN"})]),
    "schema_string": ("<tool_call>get_weather\n<arg_key>zip</arg_key>\n<arg_value>90210</arg_value>\n"
                      "<arg_key>days</arg_key>\n<arg_value>7</arg_value>\n</tool_call>",
                      "", [("get_weather", {"zip": "90210", "days": 7})]),
    "no_args_and_content": ("Checking the time.\n<tool_call>now\n</tool_call>\nand the weather:\n"
                            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lima</arg_value>\n"
                            "</tool_call>", "Checking the time.\n\nand the weather:",
                            [("now", {}), ("get_weather", {"city": "Lima"})]),
    "spaces": ("<tool_call>ls <arg_key>dirPath</arg_key> <arg_value>backend</arg_value> </tool_call>",
               "", [("ls", {"dirPath": "backend"})]),
    "bad_name": ("<tool_call>hello there</tool_call> ok", "<tool_call>hello there</tool_call> ok", []),
    "json_instead": ('<tool_call>{"name": "now"}</tool_call>', '<tool_call>{"name": "now"}</tool_call>', []),
    "bad_then_good": ("<tool_call>a b <tool_call>now</tool_call>", "<tool_call>a b", [("now", {})]),
    "unclosed_mid_value": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", "",
                           [("get_weather", {})]),
    "unclosed_after_pair": ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rio</arg_value>\n", "",
                            [("get_weather", {"city": "Rio"})]),
    "lookalike_tags": ("1 < 2 and <tool_cal", "1 < 2 and <tool_cal", []),
}


def splits(text: str):
    """Every way to cut `text` in two, and one character at a time."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


def run_stream(stream, chunks: list[str]) -> tuple[list, str, list[tuple[str, dict]]]:
    """Feeds chunks; returns (all deltas, content, [(name, arguments)]) rebuilt the way a client does."""
    deltas = []
    for c in chunks:
        deltas += stream.push(c)
    deltas += stream.finish()
    calls: list[dict] = []
    for d in deltas:
        assert sum(x is not None for x in (d.content, d.reasoning, d.tool_call)) == 1
        if d.tool_call is None:
            continue
        tc = d.tool_call
        if "id" in tc:  # the first delta of a call: OpenAI's shape, empty arguments
            assert tc["index"] == len(calls) and tc["type"] == "function" and tc["id"].startswith("call_")
            assert tc["function"]["arguments"] == "" and set(tc["function"]) == {"name", "arguments"}
            calls.append({"name": tc["function"]["name"], "arguments": ""})
        else:
            assert tc["index"] == len(calls) - 1 and set(tc) == {"index", "function"}
            assert set(tc["function"]) == {"arguments"}
            calls[-1]["arguments"] += tc["function"]["arguments"]
    content = "".join(d.content for d in deltas if d.content is not None)
    return deltas, content, [(c["name"], json.loads(c["arguments"])) for c in calls]


def check_parser(parser, text: str, want_content: str, want_calls: list, tools=None) -> None:
    content, calls = parser.parse(text, tools)
    assert content == want_content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls
    assert all(isinstance(c, ToolCall) and c.id.startswith("call_") for c in calls)
    for chunks in splits(text):
        deltas, s_content, s_calls = run_stream(parser.stream(tools), chunks)
        assert (s_content, s_calls) == (want_content, want_calls), chunks
        if "<" not in want_content:  # no piece of a tag was ever sent as content
            assert not any(d.content and "<" in d.content for d in deltas), chunks


@pytest.mark.parametrize("case", sorted(HERMES_CASES))
def test_hermes(case):
    check_parser(HermesToolParser(), *HERMES_CASES[case])


@pytest.mark.parametrize("case", sorted(GLM_CASES))
def test_glm(case):
    check_parser(GlmToolParser(), *GLM_CASES[case], tools=TOOLS)


def test_glm_streams_arguments_as_they_complete():
    text = GLM_CASES["one"][0]
    stream = GlmToolParser().stream(TOOLS)
    cut = text.index("<arg_key>days")
    first = stream.push(text[:cut])
    assert [d.tool_call["function"] for d in first] == [{"name": "get_weather", "arguments": ""},
                                                        {"arguments": '{"city": "Paris"'}]
    rest = stream.push(text[cut:]) + stream.finish()
    assert [d.tool_call["function"]["arguments"] for d in rest] == [', "days": 3', "}"]


def test_hermes_sends_a_call_whole_when_its_block_closes():
    text = HERMES_CASES["one"][0]
    stream = HermesToolParser().stream()
    assert stream.push(text[:-1]) == []
    deltas = stream.push(text[-1:])
    assert [d.tool_call["function"] for d in deltas] == [{"name": "get_weather", "arguments": ""},
                                                         {"arguments": '{"city": "Paris"}'}]


def test_glm_without_schema_types_values_from_json():
    _, calls = GlmToolParser().parse(GLM_CASES["schema_string"][0])
    assert json.loads(calls[0].arguments) == {"zip": 90210, "days": 7}


def test_three_way_splits_of_a_sample():
    text = "ok <tool_call>now\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call> x"
    want = ("ok  x", [("now", {"a": 1})])
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            _, content, calls = run_stream(GlmToolParser().stream(), [text[:i], text[i:j], text[j:]])
            assert (content, calls) == want, (i, j)


def test_tool_parser_for():
    assert isinstance(tool_parser_for("qwen3", None), HermesToolParser)
    assert isinstance(tool_parser_for("qwen3_moe", "anything"), HermesToolParser)
    assert isinstance(tool_parser_for("qwen2", None), HermesToolParser)
    assert isinstance(tool_parser_for("glm4_moe", None), GlmToolParser)
    assert isinstance(tool_parser_for("llama", "...<tool_call>{{ name }}<arg_key>..."), GlmToolParser)
    assert isinstance(tool_parser_for("llama", "...<tool_call>\n{...}</tool_call>"), HermesToolParser)
    assert tool_parser_for("llama", "{{ messages }}") is None and tool_parser_for("llama", None) is None
    assert HermesToolParser.format == "hermes" and GlmToolParser.format == "glm45"


# -- tool_choice and tools ----------------------------------------------------------------------------


def test_tool_choice():
    assert resolve_tool_choice(None, None) == ToolChoice("none")
    assert resolve_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert resolve_tool_choice("required", TOOLS) == ToolChoice("required")
    named = resolve_tool_choice({"type": "function", "function": {"name": "now"}}, TOOLS)
    assert named == ToolChoice("function", "now")
    assert template_tools(TOOLS, ToolChoice("none")) is None
    assert template_tools(TOOLS, named) == TOOLS and template_tools(None, ToolChoice("auto")) is None
    call = ToolCall("call_1", "now", "{}")
    other = ToolCall("call_2", "get_weather", "{}")
    assert ToolChoice("auto").complied([]) is None and ToolChoice("none").complied([call]) is None
    assert ToolChoice("required").complied([call]) and not ToolChoice("required").complied([])
    assert named.complied([call]) and not named.complied([call, other]) and not named.complied([])
    assert ToolChoice("none").uses_tools is False and named.uses_tools


@pytest.mark.parametrize("choice, tools, param", [
    ("sometimes", TOOLS, "tool_choice"),
    ("required", None, "tool_choice"),
    ({"type": "function", "function": {"name": "nope"}}, TOOLS, "tool_choice"),
    ({"type": "function"}, TOOLS, "tool_choice"),
    (42, TOOLS, "tool_choice"),
])
def test_bad_tool_choice(choice, tools, param):
    with pytest.raises(ToolRequestError) as e:
        resolve_tool_choice(choice, tools)
    assert e.value.param == param


@pytest.mark.parametrize("tools, param", [
    ("x", "tools"),
    ([{"type": "retrieval"}], "tools[0]"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
    ([CLOCK, CLOCK], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters"),
])
def test_bad_tools(tools, param):
    with pytest.raises(ToolRequestError) as e:
        tools_for_template(tools)
    assert e.value.param == param


# -- reasoning ----------------------------------------------------------------------------------------

REASONING_CASES = {
    "closed": ("<think>\nLet me think.\n\nYes.\n</think>\n\nThe answer.", False, "Let me think.\n\nYes.",
               "The answer."),
    "leading_space": ("\n<think>a</think>b\n", False, "a", "b\n"),
    "no_think": ("  Just an answer </think> here", False, None, "  Just an answer </think> here"),
    "opened": ("step 1\n</think>\n\nDone", True, "step 1", "Done"),
    "opened_repeats_tag": ("<think>step</think>Done", True, "step", "Done"),
    "truncated": ("<think>still thinking </thi", False, "still thinking </thi", ""),
    "opened_truncated": ("thinking...\n", True, "thinking...", ""),
    "empty": ("<think></think>answer", False, "", "answer"),
    "lookalike": ("<thin>k", False, None, "<thin>k"),
    "only_open_partial": ("<thi", False, None, "<thi"),
}


@pytest.mark.parametrize("case", sorted(REASONING_CASES))
def test_reasoning(case):
    text, opened, want_reasoning, want_content = REASONING_CASES[case]
    parser = ReasoningParser()
    assert parser.parse(text, opened_in_prompt=opened) == (want_reasoning, want_content)
    for chunks in splits(text):
        stream = parser.stream(opened_in_prompt=opened)
        pieces = [p for c in chunks for p in stream.push(c)] + stream.finish()
        got = {k: "".join(t for kk, t in pieces if kk == k) for k in ("reasoning", "content")}
        assert (got["reasoning"] if stream.entered else None, got["content"]) == (want_reasoning, want_content)
        for kind, want in (("reasoning", want_reasoning or ""), ("content", want_content)):
            if "<" not in want:  # no piece of a tag was ever sent as text
                assert not any("<" in t for k, t in pieces if k == kind), chunks


def test_reasoning_streams_before_the_closing_tag():
    stream = ReasoningParser().stream()
    assert stream.push("<think>abc") == [("reasoning", "abc")]
    assert stream.push(" def</th") == [("reasoning", " def")]
    assert stream.push("ink>\n\nHi") == [("content", "Hi")]
    assert stream.finish() == []


def test_reasoning_parser_for():
    qwen3_tpl = "...{{ '<think>\\n\\n</think>\\n\\n' }}..."
    assert reasoning_parser_for("qwen3", qwen3_tpl) is not None
    assert reasoning_parser_for("qwen3", qwen3_tpl, enable_thinking=False) is None
    assert reasoning_parser_for("glm4_moe", None) is not None and reasoning_parser_for("llama", None) is None
    assert reasoning_parser_for("glm4_moe", "<|im_start|>{{ m['content'] }}") is None  # the template decides
    assert thinking_opened_in_prompt("<|im_start|>assistant\n<think>\n")
    assert not thinking_opened_in_prompt("<|assistant|>\n<think></think>")
    assert not thinking_opened_in_prompt("<|im_start|>assistant\n")


# -- reasoning and tool calls together ----------------------------------------------------------------


def test_chat_output_stream_matches_parse():
    text = ("<think>I should call get_weather.\n<tool_call>not a call</tool_call>\n</think>\n\nSure."
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Kyiv</arg_value>\n</tool_call>")
    whole = ChatOutputParser(ReasoningParser(), GlmToolParser(), request_tools=TOOLS).parse(text)
    assert whole.reasoning == "I should call get_weather.\n<tool_call>not a call</tool_call>"
    assert whole.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("get_weather", {"city": "Kyiv"})]
    for chunks in splits(text):
        p = ChatOutputParser(ReasoningParser(), GlmToolParser(), request_tools=TOOLS)
        deltas = [d for c in chunks for d in p.push(c)] + p.finish()
        assert "".join(d.reasoning for d in deltas if d.reasoning) == whole.reasoning
        assert "".join(d.content for d in deltas if d.content) == whole.content
        assert [(c.name, c.arguments) for c in p.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
        assert p.finish_reason("stop") == "tool_calls" and p.finish_reason("length") == "length"


def test_chat_output_without_parsers_passes_text_through():
    out = ChatOutputParser(None, None).parse(" text <think>x</think>\n")
    assert (out.content, out.reasoning, out.tool_calls) == (" text <think>x</think>\n", None, [])
    assert ChatOutputParser(None, None).finish_reason("stop") == "stop"
    opened = ChatOutputParser(ReasoningParser(), HermesToolParser(), opened_in_prompt=True).parse(
        "why\n</think>\n" + hermes_block("now", {}))
    assert (opened.reasoning, opened.content, [c.name for c in opened.tool_calls]) == ("why", "", ["now"])


# -- chat template plumbing ---------------------------------------------------------------------------

# A small template shaped like Qwen3's and GLM-4.5's: tools in a system block, assistant tool calls
# (GLM iterates the arguments' items, Qwen re-serializes them), tool results, and a thinking switch.
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% for tc in m.tool_calls or [] %}{% set f = tc.function %}<call {{ f.name }}>"
    "{% for k, v in f.arguments.items() %}[{{ k }}={{ v | tojson }}]{% endfor %}"
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}</call>{% endfor %}"
    "{% if m.role == 'tool' %}({{ m.tool_call_id }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}{% endif %}"
)


def tokenizer_with(template: str | None) -> Tokenizer:
    tok = Tokenizer.from_hf_dir(DEFAULT_MODEL)
    tok.chat_template = template
    return tok


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_template_gets_tools_calls_and_kwargs():
    tok = tokenizer_with(TOOL_TEMPLATE)
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS)
    assert text.startswith("<tools>" + json.dumps(WEATHER) + ";")
    assert '<call get_weather>[city="Paris"][days=2]{"city": "Paris", "days": 2}</call>' in text
    assert "<tool>sunny(call_1)" in text
    assert text.endswith("<assistant><think>") and thinking_opened_in_prompt(text)
    off = tok.apply_chat_template(CONVERSATION, tools=None, enable_thinking=False)
    assert not off.startswith("<tools>") and off.endswith("<think></think>")
    assert not thinking_opened_in_prompt(off)
    assert tok.apply_chat_template(CONVERSATION, tools=[]) == tok.apply_chat_template(CONVERSATION)
    # The caller's messages keep their JSON-string arguments.
    assert CONVERSATION[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 2}'
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(CONVERSATION, bos_token="<s>")


def test_messages_for_template():
    bad = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}, "odd"]}]
    assert messages_for_template(bad) == bad
    listed = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]
    assert messages_for_template(listed) == listed
    converted = messages_for_template(CONVERSATION)
    assert converted[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 2}
    assert converted[0] is CONVERSATION[0] and converted[2] is CONVERSATION[2]


def test_embedded_model_template():
    tok = Tokenizer.from_hf_dir(DEFAULT_MODEL)
    # The embedded model's template is plain ChatML: no tools branch and no thinking, so `tools` and
    # `enable_thinking` change nothing, and the server parses GLM-4.5 calls (its model type) but no
    # reasoning.
    assert tok.chat_template and "tools" not in tok.chat_template and "think" not in tok.chat_template
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS, enable_thinking=False) == plain
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False) == plain[:-22]
    assert isinstance(tool_parser_for("glm4_moe", tok.chat_template), GlmToolParser)
    assert reasoning_parser_for("glm4_moe", tok.chat_template) is None
