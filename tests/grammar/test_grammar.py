"""Structured output: GrammarSpec, the llguidance-backed compiler and matchers, tool-call grammars, and
the protocol's response_format shapes. CPU only, on the embedded model's tokenizer (8,192 tokens) and a
hand-made 8-token vocabulary where masks can be checked token by token."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tokenizers
from pydantic import ValidationError
from tokenizers import decoders, models, pre_tokenizers

import strata.server.protocol as P
from strata.grammar import GrammarCompiler, GrammarError, GrammarSpec, check_spec, mask_words, valid_prefix
from strata.grammar.spec import close_objects
from strata.params import SamplingParams
from strata.server.tool_grammar import tool_call_grammar
from strata.server.tools import GlmToolParser, HermesToolParser, ToolChoice, ToolRequestError
from strata.tokenizer import Tokenizer

MODEL_DIR = "strata/assets/default-model"
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "tags": {"type": "array", "items": {"enum": ["new", "paid"]}},
        "ship": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    "required": ["id", "ship"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                       "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {}}},
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_hf_dir(f"{_repo()}/{MODEL_DIR}")


def _repo() -> str:
    import os

    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    return GrammarCompiler(tok, 8192, threads=2)


def _tiny_tokenizer(special: tuple[str, ...] = ()) -> Tokenizer:
    vocab = {"<eos>": 0, "a": 1, "b": 2, "c": 3, "ab": 4, "abc": 5, "{": 6, "}": 7}
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("ab", "c")]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<eos>", *special])
    return Tokenizer(tk=tk, eos_ids=(0,))


def _allowed(row: np.ndarray) -> list[int]:
    return np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0].tolist()


def _mask(m, words: int) -> list[int]:
    row = np.zeros(words, np.int32)
    m.fill_mask(row)
    return _allowed(row)


def _walk(compiler, tok, spec, text: str) -> tuple[int, int, object]:
    """(tokens accepted, tokens in text, matcher). Every token the mask allows is accepted; every token
    of a fully accepted text was allowed by its mask. (The converse fails for invalid text: a mask also
    leaves out tokens that would spell a forced continuation non-canonically, which `accept` takes.)"""
    m = compiler.matcher(spec)
    ids = tok.encode(text, add_special=False)
    row = np.zeros(compiler.mask_words, np.int32)
    refused_by_mask = []
    for n, t in enumerate(ids):
        m.fill_mask(row)
        allowed = bool((int(row[t >> 5]) >> (t & 31)) & 1)
        accepted = m.accept(t)
        assert accepted or not allowed, f"token {n} ({t}) is in the mask but not accepted"
        if not accepted:
            return n, len(ids), m
        if not allowed:
            refused_by_mask.append(n)
    assert not refused_by_mask, f"tokens {refused_by_mask} of a valid text were masked out"
    return len(ids), len(ids), m


# -- GrammarSpec -------------------------------------------------------------------------------------


def test_spec_is_hashable_data_and_checks_its_fields():
    a = GrammarSpec.json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    assert a == GrammarSpec.json_schema({"type": "object", "properties": {"b": {}, "a": {}}}) and hash(a) == hash(
        GrammarSpec("json_schema", a.text))
    assert list(a.schema()["properties"]) == ["b", "a"]  # property order is kept: it is the generation order
    assert GrammarSpec.choice(["yes", 'say "no"']).text == 'start: "yes" | "say \\"no\\""'
    for bad in (lambda: GrammarSpec("xml", "x"), lambda: GrammarSpec("regex", ""),
                lambda: GrammarSpec("json_object", "{}"), lambda: GrammarSpec.json_schema([1]),
                lambda: GrammarSpec.json_schema({"x": float("nan")}), lambda: GrammarSpec.choice([])):
        with pytest.raises(GrammarError):
            bad()
    assert SamplingParams(grammar=a).grammar is a
    with pytest.raises(ValueError):
        SamplingParams(grammar={"type": "json_object"})


def test_strict_closes_objects_with_properties_only():
    closed = close_objects({"type": "object", "properties": {"x": {"type": "object", "properties": {"y": {}}},
                                                             "free": {"type": "object"}},
                            "allOf": [{"properties": {"z": {}}}], "$defs": {"d": {"properties": {"w": {}}}}})
    assert closed["additionalProperties"] is False
    assert closed["properties"]["x"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["free"]  # a free-form object stays free
    assert "additionalProperties" not in closed["allOf"][0]  # closing allOf branches would forbid each other's keys
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert close_objects({"properties": {}, "additionalProperties": True})["additionalProperties"] is True


# -- compiling ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [
    GrammarSpec.json_object(), GrammarSpec.json_schema(ORDER_SCHEMA), GrammarSpec.regex(r"[0-9]{3}-[a-z]+"),
    GrammarSpec.grammar('root ::= "yes" | "no" ws\nws ::= [ ]*'), GrammarSpec.grammar('start: "yes" | "no"'),
    GrammarSpec("tool_call", 'start: "<tool_call>" %json {"type": "object"} "</tool_call>"'),
], ids=["json_object", "json_schema", "regex", "gbnf", "lark", "tool_call"])
def test_every_kind_compiles_and_is_cached(compiler, spec):
    compiled = compiler.compile(spec)
    assert compiler.compile(spec) is compiled
    check_spec(spec)


@pytest.mark.parametrize("spec, problem", [
    (GrammarSpec.json_schema({"type": "objec"}), "invalid JSON schema: Invalid type: objec"),
    (GrammarSpec.json_schema({"properties": {"a": {"$ref": "#/$defs/nope"}}}), "does not exist"),
    (GrammarSpec.json_schema({"type": "string", "pattern": "(("}), "unclosed group"),
    (GrammarSpec.json_schema({"type": "integer", "minimum": "one"}), "minimum"),
    (GrammarSpec.regex("a(("), "invalid regex"),
    (GrammarSpec.grammar('root ::= "a" | bar'), "bar"),
    (GrammarSpec.grammar("start: foo"), 'unknown name: "foo"'),
])
def test_invalid_specs_name_the_problem(compiler, spec, problem):
    with pytest.raises(GrammarError) as e:
        compiler.compile(spec)
    assert problem in str(e.value)
    with pytest.raises(GrammarError) as e:
        check_spec(spec)  # the same answer without a tokenizer
    assert problem in str(e.value)


def test_a_missing_special_token_fails_only_with_the_tokenizer(compiler):
    spec = GrammarSpec.grammar('start: <|no_such_token|> "x"')
    check_spec(spec)
    with pytest.raises(GrammarError, match="unknown special token"):
        compiler.compile(spec)


def test_the_cache_is_lru(tok):
    c = GrammarCompiler(tok, 8192, cache_size=2, warm=False)
    a, b, d = (GrammarSpec.regex(r) for r in ("a+", "b+", "d+"))
    ca = c.compile(a)
    c.compile(b)
    assert c.compile(a) is ca  # a is now the most recent
    c.compile(d)  # evicts b, the least recently used
    assert list(c._cache) == [a, d] and c.compile(a) is ca


# -- matching ----------------------------------------------------------------------------------------


def test_walking_valid_json_accepts_then_terminates(compiler, tok):
    text = json.dumps({"id": 7, "tags": ["new"], "ship": {"city": "Lyon"}}, separators=(",", ":"))
    n, total, m = _walk(compiler, tok, GrammarSpec.json_schema(ORDER_SCHEMA), text)
    assert n == total
    assert m.can_stop() and m.must_stop() and not m.is_terminated()  # after "}" only a stop token may follow
    assert _mask(m, compiler.mask_words) == sorted(tok.stop_ids)
    assert not m.accept(tok.encode("x", add_special=False)[0])
    assert m.accept(min(tok.stop_ids)) and m.is_terminated()
    assert _mask(m, compiler.mask_words) == sorted(tok.stop_ids)  # a finished row still allows something
    assert not m.accept(min(tok.stop_ids))


@pytest.mark.parametrize("text", [
    '{"id":0,"ship":{"city":"Lyon"}}',  # minimum 1
    '{"id":3}',  # ship is required
    '{"id":3,"ship":{"city":"Lyon"},"extra":1}',  # strict: no other keys
    '{"id":3,"tags":["old"],"ship":{"city":"Lyon"}}',  # not in the enum
])
def test_invalid_json_is_refused(compiler, tok, text):
    n, total, m = _walk(compiler, tok, GrammarSpec.json_schema(ORDER_SCHEMA), text)
    assert n < total
    assert not m.is_terminated() and m.num_tokens == n  # the refused token left the state as it was


def test_json_is_compact(compiler, tok):
    """No free whitespace between tokens: a small model cannot wander into spaces."""
    for text in ('{"id": 3,"ship":{"city":"Lyon"}}', '{ "id":3,"ship":{"city":"Lyon"}}', '{"id":3,\n"ship":{"city":"Lyon"}}'):
        n, total, _ = _walk(compiler, tok, GrammarSpec.json_schema(ORDER_SCHEMA), text)
        assert n < total, text


def test_not_strict_allows_other_keys(compiler, tok):
    text = '{"id":3,"ship":{"city":"Lyon"},"extra":1}'
    n, total, _ = _walk(compiler, tok, GrammarSpec.json_schema(ORDER_SCHEMA, strict=False), text)
    assert n == total


def test_masks_on_a_tiny_vocabulary():
    tiny = _tiny_tokenizer()
    c = GrammarCompiler(tiny, 40, threads=1)  # a padded head: 40 logits for 8 tokens
    assert c.mask_words == mask_words(40) == 2
    m = c.matcher(GrammarSpec.regex("ab+"))
    # The grammar forces "ab", which the tokenizer writes as one token: "a" alone would not be canonical.
    assert _mask(m, 2) == [4]
    assert m.accept(4)
    assert _mask(m, 2) == [0, 2] and m.can_stop() and not m.must_stop()
    assert not m.accept(3) and not m.accept(33)  # "c", and an id past the tokenizer
    assert m.accept(2) and _mask(m, 2) == [0, 2]
    m = c.matcher(GrammarSpec.regex("c|abc"))
    assert _mask(m, 2) == [1, 3, 4, 5]  # a, c, ab, abc: every token that starts a match
    assert m.accept(5) and _mask(m, 2) == [0] and m.must_stop()


def test_rollback_restores_earlier_masks(compiler, tok):
    m = compiler.matcher(GrammarSpec.json_schema(ORDER_SCHEMA))
    ids = tok.encode('{"id":12,"ship":{"city":"Oslo"}}', add_special=False)
    masks = []
    for t in ids:
        masks.append(_mask(m, compiler.mask_words))
        assert m.accept(t)
    m.rollback(4)
    assert m.num_tokens == len(ids) - 4 and _mask(m, compiler.mask_words) == masks[-4]
    assert m.accept_many(ids[-4:]) == 4 and m.must_stop()
    assert m.accept(min(tok.stop_ids))
    m.rollback(1)  # a rejected stop draft
    assert not m.is_terminated() and m.must_stop()
    with pytest.raises(ValueError):
        m.rollback(len(ids) + 1)


def test_valid_prefix_counts_drafts_and_keeps_the_state(compiler, tok):
    m = compiler.matcher(GrammarSpec.json_schema(ORDER_SCHEMA))
    ids = tok.encode('{"id":12,"ship":{"city":"Oslo"}}', add_special=False)
    stop = min(tok.stop_ids)
    assert valid_prefix(m, ids[:5]) == 5 and m.num_tokens == 0
    bad = tok.encode("x", add_special=False)
    assert valid_prefix(m, ids[:3] + bad + ids[4:6]) == 3
    assert valid_prefix(m, ids + [stop, stop]) == len(ids) + 1  # nothing after a stop token
    m.accept_many(ids)
    assert valid_prefix(m, [stop]) == 1 and valid_prefix(m, bad) == 0 and valid_prefix(m, []) == 0
    assert m.num_tokens == len(ids)
    m.accept(stop)
    assert valid_prefix(m, [stop]) == 0


def test_fill_masks_fills_draft_rows_like_one_by_one(compiler, tok):
    spec = GrammarSpec.json_schema(ORDER_SCHEMA)
    ids = tok.encode('{"id":12,"ship":{"city":"Oslo"}}', add_special=False)
    stop = min(tok.stop_ids)
    a, b, e = compiler.matcher(spec), compiler.matcher(spec), compiler.matcher(spec)
    b.accept_many(ids[:-2])
    e.accept_many(ids[:-1])
    bad = tok.encode("x", add_special=False)[0]
    bitmask = np.full((12, compiler.mask_words), 7, np.int32)
    drafts_a = ids[:2] + [bad, ids[3]]  # third draft invalid
    counts = compiler.fill_masks([(a, 0, drafts_a), (b, 5, []), (e, 7, [ids[-1], stop])], bitmask)
    assert counts == [2, 0, 2]
    ref = compiler.matcher(spec)
    for i in range(3):  # row 0: now; rows 1-2: after each valid draft
        assert _allowed(bitmask[i]) == _mask(ref, compiler.mask_words)
        if i < 2:
            assert ref.accept(drafts_a[i])
    assert (bitmask[3:5] == -1).all()  # past the invalid draft: all ones
    assert _allowed(bitmask[5]) == _mask(b, compiler.mask_words)
    assert (bitmask[6] == 7).all() and (bitmask[10:] == 7).all()  # rows not named are untouched
    assert _allowed(bitmask[8]) == sorted(tok.stop_ids) and _allowed(bitmask[9]) == sorted(tok.stop_ids)
    assert a.num_tokens == 0 and b.num_tokens == len(ids) - 2 and e.num_tokens == len(ids) - 1
    with pytest.raises(ValueError):
        compiler.fill_masks([(a, 11, [ids[0]])], bitmask)  # the draft row would be past the end
    with pytest.raises(ValueError):
        a.fill_mask(np.zeros(compiler.mask_words, np.int64))


# -- tool-call grammars ------------------------------------------------------------------------------


HERMES_OK = [
    '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","days":3}}\n</tool_call>',
    '<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome"}}\n</tool_call>\n'
    '<tool_call>\n{"name":"ping","arguments":{}}\n</tool_call>',
]
HERMES_BAD = [
    '<tool_call>\n{"name":"get_weathex","arguments":{"city":"Paris"}}\n</tool_call>',  # no such function
    '<tool_call>\n{"name":"get_weather","arguments":{"city":3}}\n</tool_call>',  # wrong type
    '<tool_call>\n{"name":"get_weather","arguments":{"days":3}}\n</tool_call>',  # city is required
    '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","when":1}}\n</tool_call>',  # unknown key
    'Sure. <tool_call>\n{"name":"ping","arguments":{}}\n</tool_call>',  # text instead of a call
]
GLM_OK = [
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris, France</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n<arg_key>unit</arg_key>\n"
    "<arg_value>c</arg_value>\n</tool_call>\n<tool_call>ping\n<arg_key>x</arg_key>\n<arg_value>[1]</arg_value>\n"
    "</tool_call>",
]
GLM_BAD = [
    "<tool_call>get_weathex\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
    "<arg_value>zero</arg_value>\n</tool_call>",
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>unit</arg_key>\n"
    "<arg_value>kelvin</arg_value>\n</tool_call>",
]


@pytest.mark.parametrize("fmt, good, bad", [("hermes", HERMES_OK, HERMES_BAD), ("glm45", GLM_OK, GLM_BAD)])
def test_required_accepts_valid_calls_and_refuses_the_rest(compiler, tok, fmt, good, bad):
    spec = tool_call_grammar(TOOLS, ToolChoice("required"), fmt, tok)
    assert spec.kind == "tool_call"
    parser = HermesToolParser() if fmt == "hermes" else GlmToolParser()
    for text in good:
        n, total, m = _walk(compiler, tok, spec, text)
        assert n == total and m.can_stop(), text
        content, calls = parser.parse(text, TOOLS)
        assert calls and not content  # what the grammar lets through, the parser reads as calls
    for text in bad:
        n, total, _ = _walk(compiler, tok, spec, text)
        assert n < total, text


@pytest.mark.parametrize("fmt", ["hermes", "glm45"])
def test_a_named_function_allows_one_call_of_it(compiler, tok, fmt):
    spec = tool_call_grammar(TOOLS, ToolChoice("function", "get_weather"), fmt, tok)
    good, two_calls = (HERMES_OK if fmt == "hermes" else GLM_OK)
    n, total, m = _walk(compiler, tok, spec, good)
    assert n == total and m.must_stop()
    ping = ('<tool_call>\n{"name":"ping","arguments":{}}\n</tool_call>' if fmt == "hermes"
            else "<tool_call>ping\n</tool_call>")
    n, total, _ = _walk(compiler, tok, spec, ping)
    assert n < total
    single = tool_call_grammar(TOOLS, ToolChoice("required"), fmt, tok, parallel=False)
    n, total, _ = _walk(compiler, tok, single, two_calls)
    assert n < total


def test_reasoning_may_come_first(compiler, tok):
    optional = tool_call_grammar(TOOLS, ToolChoice("function", "ping"), "glm45", tok, reasoning="optional")
    for text in ("<think>which one? </think>\n\n<tool_call>ping\n</tool_call>", "<tool_call>ping\n</tool_call>"):
        n, total, _ = _walk(compiler, tok, optional, text)
        assert n == total, text
    opened = tool_call_grammar(TOOLS, ToolChoice("function", "ping"), "hermes", tok, reasoning="open")
    text = 'so: ping </think>\n<tool_call>\n{"name":"ping","arguments":{}}\n</tool_call>'
    assert _walk(compiler, tok, opened, text)[0] == len(tok.encode(text, add_special=False))


def test_tags_held_as_special_tokens_are_matched_as_tokens():
    tiny = _tiny_tokenizer(special=("<tool_call>", "</tool_call>"))
    open_id, close_id = tiny.token_to_id("<tool_call>"), tiny.token_to_id("</tool_call>")
    tools = [{"type": "function", "function": {"name": "abc", "parameters": {
        "type": "object", "properties": {"c": {"type": "string"}}, "required": ["c"]}}}]
    spec = tool_call_grammar(tools, ToolChoice("required"), "glm45", tiny)
    assert f"<[{open_id}]>" in spec.text and f"<[{close_id}]>" in spec.text
    c = GrammarCompiler(tiny, 16, threads=1)
    m = c.matcher(spec)
    assert _mask(m, 1) == [open_id]
    assert m.accept(open_id) and m.accept_many(tiny.encode("abc", add_special=False)) == 1


def test_tool_grammar_only_for_forced_choices(tok):
    assert tool_call_grammar(TOOLS, ToolChoice("auto"), "hermes", tok) is None
    assert tool_call_grammar(TOOLS, ToolChoice("none"), "hermes", tok) is None
    with pytest.raises(ToolRequestError):
        tool_call_grammar(TOOLS, ToolChoice("required"), "mistral", tok)


# -- the protocol ------------------------------------------------------------------------------------


BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("fields, spec", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, GrammarSpec.json_object()),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": ORDER_SCHEMA,
                                                                  "strict": True}}},
     GrammarSpec.json_schema(ORDER_SCHEMA, strict=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": ORDER_SCHEMA}}},
     GrammarSpec.json_schema(ORDER_SCHEMA, strict=False)),
    ({"response_format": {"type": "json_object", "schema": {"type": "array"}}},
     GrammarSpec.json_schema({"type": "array"}, strict=False)),
    ({"response_format": {"type": "regex", "regex": "[0-9]+"}}, GrammarSpec.regex("[0-9]+")),
    ({"response_format": {"type": "grammar", "grammar": 'root ::= "y"'}}, GrammarSpec.grammar('root ::= "y"')),
    ({"grammar": 'root ::= "y"'}, GrammarSpec.grammar('root ::= "y"')),
    ({"json_schema": {"type": "integer"}}, GrammarSpec.json_schema({"type": "integer"}, strict=False)),
    ({"structured_outputs": {"choice": ["a", "b"]}}, GrammarSpec.choice(["a", "b"])),
    ({"structured_outputs": {"json": '{"type":"object"}'}}, GrammarSpec.json_schema({"type": "object"}, False)),
    ({"structured_outputs": {"regex": "x+"}}, GrammarSpec.regex("x+")),
])
def test_response_format_shapes(fields, spec):
    for model, body in ((P.ChatCompletionRequest, BASE), (P.CompletionRequest, {"model": "m", "prompt": "x"})):
        req = model.model_validate({**body, **fields})
        req.check_supported()
        assert req.grammar_spec() == spec


@pytest.mark.parametrize("fields, param, problem", [
    ({"response_format": {"type": "xml"}}, "response_format", "Input should be"),
    ({"response_format": "json"}, "response_format", "valid dictionary"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format", "dictionary"),
    ({"response_format": {"type": "regex"}}, "response_format", "needs a non-empty 'regex'"),
    ({"response_format": {"type": "grammar", "grammar": ""}}, "response_format", "needs a non-empty 'grammar'"),
    ({"grammar": " "}, "grammar", "empty"),
    ({"json_schema": ["not", "a", "schema"]}, "json_schema", "dictionary"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs", "not a JSON schema"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "y"'}, None, "at most one"),
])
def test_bad_response_formats_are_400s_naming_the_field(fields, param, problem):
    with pytest.raises(ValidationError) as e:
        P.ChatCompletionRequest.model_validate({**BASE, **fields})
    err = e.value.errors()[0]
    loc = [str(p) for p in err["loc"]]
    assert (loc[0] if loc else None) == param and problem in str(err["msg"]), err


@pytest.mark.parametrize("fields, param, problem", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format", "invalid JSON schema: Invalid type: objec"),
    ({"response_format": {"type": "regex", "regex": "(("}}, "response_format", "unclosed group"),
    ({"response_format": {"type": "grammar", "grammar": "root ::= bar"}}, "response_format", "bar"),
    ({"grammar": "root ::= bar"}, "grammar", "bar"),
    ({"json_schema": {"type": "objec"}}, "json_schema", "objec"),
    ({"structured_outputs": {"json": {"type": "string", "pattern": "(("}}}, "structured_outputs", "unclosed group"),
])
def test_a_constraint_that_does_not_compile_names_its_field_and_problem(compiler, fields, param, problem):
    """The shape passes the protocol; compiling (off the event loop, with the engine's tokenizer) fails
    with the message of the 400, whose param is `grammar_param`."""
    req = P.ChatCompletionRequest.model_validate({**BASE, **fields})
    assert req.grammar_param == param
    with pytest.raises(GrammarError) as e:
        compiler.compile(req.grammar_spec())
    assert problem in str(e.value)


def test_a_grammar_cannot_be_combined_with_forced_tool_calls():
    tools = [{"type": "function", "function": {"name": "f"}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        req = P.ChatCompletionRequest.model_validate({**BASE, "tools": tools, "tool_choice": choice,
                                                      "response_format": {"type": "json_object"}})
        with pytest.raises(P.Unsupported) as e:
            req.check_supported()
        assert e.value.param == "response_format"
    P.ChatCompletionRequest.model_validate({**BASE, "tools": tools, "tool_choice": "auto",
                                            "response_format": {"type": "json_object"}}).check_supported()
