"""llama-server's native API and request rules beside the OpenAI one, OpenAI's Responses API through the
official client, and the request fields that act (or are refused): one real server on the embedded
model (CPU) for the module, keyed, with CORS for localhost pages and the chatml template named."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from serving import running_server
from strata.grammar.spec import has_finite_value
from strata.server.chat_templates import BUILTIN_TEMPLATES, resolve_chat_template
from strata.server.config import ServerConfig

KEY = "sk-llama-test"
NAME = "strata-llama"
CTX = 512
PROMPT = "Once upon a time"
CHAT = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
CONFIG = {"ctx": CTX, "parallel": 2, "device": "cpu", "api_key": KEY, "model_name": NAME, "log_level": "warning",
          "cors_origins": "localhost,https://app.example", "chat_template": "chatml", "seed": 42}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("llama"), CONFIG) as base:
        yield base


def oai(base: str, path: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=base + path, api_key=KEY, max_retries=0, timeout=60)


# ---- no server ---------------------------------------------------------------------------------


def test_cors_origins_match_exactly_or_any_localhost_port():
    cfg = ServerConfig(cors_origins="localhost, https://app.example")
    for origin in ("http://localhost", "http://localhost:8080", "http://127.0.0.1:3000", "http://[::1]:3000",
                   "https://app.example", "https://app.example/"):
        assert cfg.cors_allows(origin), origin
    for origin in ("http://evil.com", "http://localhost.evil.com", "http://notlocalhost", "https://app.example.org",
                   "http://localhost:80x", ""):
        assert not cfg.cors_allows(origin), origin
    assert not ServerConfig().cors_allows("http://localhost")  # off unless named


def test_chat_template_names_files_and_text(tmp_path):
    assert resolve_chat_template("llama3", None) == BUILTIN_TEMPLATES["llama3"]
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert resolve_chat_template(str(path), None) == resolve_chat_template(None, str(path)) == path.read_text()
    assert resolve_chat_template("{{ x }}", None) == "{{ x }}"
    with pytest.raises(ValueError, match="neither a built-in name"):
        resolve_chat_template("no-such-template", None)
    with pytest.raises(ValueError, match="not both"):
        ServerConfig(chat_template="chatml", chat_template_file="x")


@pytest.mark.parametrize("schema, finite", [
    ({"$ref": "#"}, False),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, False),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, False),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, True),
    ({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, True),
    ({"$defs": {"n": {"type": "object", "required": ["next"],
                      "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}},
      "$ref": "#/$defs/n"}, True),
])
def test_schemas_without_a_finite_value_are_found(schema, finite):
    assert has_finite_value(schema) is finite


def test_device_presence_and_frequency_penalties_match_the_reference():
    import torch

    from strata.params import SamplingParams
    from strata.runner.device_sampling import DeviceSampler, RowParams, output_penalties
    from strata.sampling import apply_output_penalties

    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    output = [3, 3, 3, 7, 9]
    row = RowParams.of(SamplingParams(presence_penalty=1.5, frequency_penalty=2.0), 0, 0)
    row.penalties = output_penalties(output, 1.5, 2.0)
    ds = DeviceSampler(4, 50, "cpu")
    x = ds.transformed(logits, 0, ds.fill([row, RowParams()]))
    assert torch.allclose(x[0], apply_output_penalties(logits[0], output, 1.5, 2.0))
    assert torch.equal(x[1], logits[1])
    assert (logits[0] - x[0])[[3, 7, 1]].tolist() == pytest.approx([7.5, 3.5, 0.0])


# ---- auth, CORS, monitoring --------------------------------------------------------------------


def test_key_on_every_protected_route_in_either_header(server):
    for method, path in (("POST", "/completion"), ("POST", "/completions"), ("POST", "/chat/completions"),
                         ("GET", "/models"), ("GET", "/props"), ("POST", "/apply-template"), ("GET", "/slots"),
                         ("GET", "/strata/slots"), ("GET", "/metrics"), ("POST", "/v1/responses")):
        r = httpx.request(method, server + path, json={})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    for headers in ({"X-Api-Key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        r = httpx.post(server + "/completion", json={"prompt": PROMPT, "n_predict": 2}, headers=headers, timeout=60)
        assert r.status_code == 200 and "content" in r.json()


def test_cors_only_for_the_named_origins(server):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}
    r = httpx.options(server + "/completions", headers={"Origin": "http://localhost:3000", **pre})
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert r.headers["Access-Control-Allow-Credentials"] == "true"
    assert r.headers["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"
    r = httpx.options(server + "/completions", headers={"Origin": "http://evil.com", **pre})
    assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers
    r = httpx.get(server + "/models", headers={"Origin": "https://app.example", "X-Api-Key": KEY})
    assert r.headers["Access-Control-Allow-Origin"] == "https://app.example"
    other = httpx.get(server + "/health", headers={"Origin": "http://evil.com"})
    assert "Access-Control-Allow-Origin" not in other.headers


def test_slots_props_and_models_in_llama_servers_shapes(server):
    h = {"X-Api-Key": KEY}
    slots = httpx.get(server + "/slots", headers=h).json()
    assert [s["id"] for s in slots] == [0, 1] and all(s["n_ctx"] == CTX and not s["is_processing"] for s in slots)
    assert "slots" in httpx.get(server + "/strata/slots", headers=h).json()
    props = httpx.get(server + "/props", headers=h).json()
    assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == CTX
    assert props["default_generation_settings"]["params"]["seed"] == 42
    assert props["chat_template"] == BUILTIN_TEMPLATES["chatml"]
    assert httpx.post(server + "/props", json={}, headers=h).status_code == 403
    models = httpx.get(server + "/models", headers=h).json()
    assert [m["id"] for m in models["data"]] == [NAME]


# ---- /completion -------------------------------------------------------------------------------


def native(server: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server + "/completion", json=body, headers={"X-Api-Key": KEY}, timeout=60, **kw)


def test_native_completion_whole_and_streamed_agree(server):
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "return_tokens": True}
    whole = native(server, body).json()
    assert whole["stop"] is True and whole["stop_type"] == "limit" and whole["tokens_predicted"] == 8
    assert whole["timings"]["predicted_n"] == 8 and whole["timings"]["prompt_n"] + whole["tokens_cached"] == \
        whole["tokens_evaluated"]
    assert len(whole["tokens"]) == 8 and whole["generation_settings"]["n_predict"] == 8
    assert isinstance(whole["has_new_line"], bool) and whole["truncated"] is False
    with httpx.stream("POST", server + "/completion", json={**body, "stream": True}, headers={"X-Api-Key": KEY},
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert all(not e["stop"] for e in events[:-1]) and events[-1]["stop"] and events[-1]["stop_type"] == "limit"
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [t for e in events[:-1] for t in e["tokens"]] == whole["tokens"]


def test_native_prompts_as_ids_mixed_and_batched(server, tok):
    ids = httpx.post(server + "/tokenize", json={"content": PROMPT, "add_special": True},
                     headers={"X-Api-Key": KEY}).json()["tokens"]
    base = {"n_predict": 4, "temperature": 0}
    text = native(server, {**base, "prompt": PROMPT}).json()["content"]
    assert native(server, {**base, "prompt": ids}).json()["content"] == text
    batch = native(server, {**base, "prompt": [ids, PROMPT, {"prompt_string": PROMPT}]}).json()
    assert [b["index"] for b in batch] == [0, 1, 2] and {b["content"] for b in batch} == {text}
    half = len(PROMPT) // 2
    mixed = native(server, {**base, "prompt": tok.encode(PROMPT[:half]) + [PROMPT[half:]]})
    assert mixed.status_code == 200 and isinstance(mixed.json()["content"], str)
    assert native(server, {**base, "prompt": {"prompt_string": "x", "multimodal_data": ["aGk="]}}).status_code == 400


def test_native_logit_bias_n_probs_and_response_fields(server, tok):
    base = {"prompt": PROMPT, "n_predict": 6, "temperature": 0}
    free = native(server, {**base, "return_tokens": True}).json()["tokens"]
    banned = native(server, {**base, "return_tokens": True, "logit_bias": [[free[0], False]]}).json()["tokens"]
    assert banned[0] != free[0]
    word = tok.decode([free[0]])
    assert native(server, {**base, "return_tokens": True, "logit_bias": {word: -100}}).json()["tokens"][0] != free[0]
    probs = native(server, {**base, "n_probs": 3}).json()["completion_probabilities"]
    assert len(probs) == 6 and all(len(p["top_logprobs"]) == 3 and p["logprob"] <= 0 for p in probs)
    assert probs[0]["top_logprobs"][0]["id"] == probs[0]["id"]  # greedy: the pick heads its alternatives
    only = native(server, {**base, "response_fields": ["content", "generation_settings/n_predict"]}).json()
    assert set(only) == {"content", "generation_settings/n_predict"} and only["generation_settings/n_predict"] == 6


def test_native_post_sampling_probs_are_the_filtered_distribution(server):
    """post_sampling_probs: probabilities (not logprobs) after top-k, top-p and min-p; only tokens they
    keep are listed, so a short list holds the whole distribution; streamed chunks carry the same."""
    body = {"prompt": PROMPT, "n_predict": 5, "n_probs": 10, "temperature": 1.0, "top_k": 8, "min_p": 0.02,
            "seed": 4, "post_sampling_probs": True}
    probs = native(server, body).json()["completion_probabilities"]
    assert len(probs) == 5
    for p in probs:
        top = [t["prob"] for t in p["top_probs"]]
        assert "logprob" not in p and 0 < p["prob"] <= 1 and 1 <= len(top) <= 8 and all(0 < v <= 1 for v in top)
        assert top == sorted(top, reverse=True) and min(top) >= 0.02 * top[0] - 1e-6
        assert len(top) == 8 or sum(top) == pytest.approx(1.0, abs=1e-4)
        assert next(t["prob"] for t in p["top_probs"] if t["id"] == p["id"]) == pytest.approx(p["prob"])
    greedy = native(server, {**body, "temperature": 0})
    assert all(p["prob"] == 1.0 and [t["id"] for t in p["top_probs"]] == [p["id"]]
               for p in greedy.json()["completion_probabilities"])
    with httpx.stream("POST", server + "/completion", json={**body, "stream": True}, headers={"X-Api-Key": KEY},
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [p for e in events for p in e.get("completion_probabilities", ())] == probs


@pytest.mark.parametrize("field, value", [("id_slot", 1), ("mirostat", 2),
                                          ("typical_p", 0.5), ("dry_multiplier", 0.8), ("xtc_probability", 0.5),
                                          ("top_n_sigma", 1.0), ("input_suffix", "x")])
def test_native_fields_strata_cannot_give_are_400s_naming_them(server, field, value):
    r = native(server, {"prompt": PROMPT, "n_predict": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


# ---- templates, tokenizer, token counts --------------------------------------------------------


def test_apply_template_token_counts_and_tokenize_shapes(server):
    h = {"X-Api-Key": KEY}
    prompt = httpx.post(server + "/apply-template", json={"messages": CHAT}, headers=h).json()["prompt"]
    assert prompt == "<|im_start|>system\nBook<|im_end|>\n<|im_start|>user\nWhat is the best book<|im_end|>\n" \
                     "<|im_start|>assistant\n"
    closed = httpx.post(server + "/apply-template", json={"messages": CHAT, "add_generation_prompt": False},
                        headers=h).json()["prompt"]
    assert closed == prompt.removesuffix("<|im_start|>assistant\n")
    n = httpx.post(server + "/chat/completions/input_tokens", json={"messages": CHAT}, headers=h).json()
    counted = httpx.post(server + "/tokenize", json={"messages": CHAT}, headers=h).json()["count"]
    assert n == {"input_tokens": counted}
    anthropic = httpx.post(server + "/v1/messages/count_tokens", headers=h,
                           json={"system": "Book", "messages": [{"role": "user", "content": "What is the best book"}]})
    assert anthropic.json() == {"input_tokens": counted}
    pieces = httpx.post(server + "/tokenize", json={"content": "emoji 🤗 ok", "with_pieces": True}, headers=h).json()
    assert all(set(p) == {"id", "piece"} for p in pieces["tokens"])
    ids = [p["id"] for p in pieces["tokens"]]
    assert httpx.post(server + "/detokenize", json={"tokens": ids}, headers=h).json()["content"] == "emoji 🤗 ok"


def test_assistant_prefill_continues_the_final_message(server):
    c = oai(server)
    messages = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "Once upon"}]
    r = c.chat.completions.create(model="any", messages=messages, max_tokens=1,
                                  extra_body={"continue_final_message": True})
    assert r.usage.prompt_tokens == httpx.post(server + "/tokenize", headers={"X-Api-Key": KEY}, json={
        "prompt": "<|im_start|>user\nTell me<|im_end|>\n<|im_start|>assistant\nOnce upon"}).json()["count"]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="any", messages=messages, max_tokens=1,
                                  extra_body={"continue_final_message": True, "add_generation_prompt": True})


# ---- OpenAI routes: leniency and fields that act -----------------------------------------------


def test_model_optional_unprefixed_routes_and_fingerprint(server):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server + "/chat/completions", json={"messages": CHAT, "max_tokens": 2}, headers=h, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == NAME and r.json()["system_fingerprint"].startswith("b")
    chunks = [json.loads(line[6:]) for line in httpx.post(
        server + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "stream": True}, headers=h,
        timeout=60).text.splitlines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}


def test_n_predict_and_n_probs_act_on_openai_routes(server):
    c = oai(server)
    r = c.chat.completions.create(model="x", messages=CHAT, extra_body={"n_predict": 3, "n_probs": 2,
                                                                       "ignore_eos": True})
    assert r.usage.completion_tokens == 3 and len(r.choices[0].logprobs.content) == 3
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)


def test_list_of_prompts_has_openai_batch_indices(server):
    r = oai(server).completions.create(model="x", prompt=[PROMPT, "It was"], n=2, max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.usage.completion_tokens == 12
    one = oai(server).completions.create(model="x", prompt=PROMPT, max_tokens=3, temperature=0)
    two = oai(server).completions.create(model="x", prompt="It was", max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens + two.usage.prompt_tokens
    assert r.choices[2].text == two.choices[0].text


def test_presence_and_frequency_penalties_change_greedy_output(server):
    c = oai(server)
    body = dict(model="x", prompt="the the the the the", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    plain = c.completions.create(**body).choices[0].text
    freq = c.completions.create(**body, frequency_penalty=2.0).choices[0].text
    pres = c.completions.create(**body, presence_penalty=2.0).choices[0].text
    assert freq != plain and pres != plain
    words = freq.split()
    assert max(words.count(w) for w in set(words)) <= max(plain.split().count(w) for w in set(plain.split()))


@pytest.mark.parametrize("field, value", [("mirostat", 1), ("typical_p", 0.9), ("xtc_probability", 0.1)])
def test_llama_samplers_are_400s_on_openai_routes(server, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        oai(server).chat.completions.create(model="x", messages=CHAT, max_tokens=1, extra_body={field: value})
    assert e.value.param == field


def test_json_schema_output_is_compact_and_ends(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
              "required": ["ok", "count", "tags"], "additionalProperties": False}
    c = oai(server)
    for seed in range(5):
        r = c.chat.completions.create(model="x", messages=CHAT, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}})
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and text == json.dumps(json.loads(text), separators=(",", ":"))
    with pytest.raises(openai.BadRequestError, match="no finite value"):
        c.chat.completions.create(model="x", messages=CHAT, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": {
                "type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]}}})


# ---- /v1/responses with the official client ----------------------------------------------------


def test_responses_text_streaming_and_previous_response(server):
    c = oai(server)
    r = c.responses.create(model="x", input="Once upon a time", instructions="Tell a story.", max_output_tokens=6)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output_text and r.usage.output_tokens == 6
    events = list(c.responses.create(input="Hello", max_output_tokens=4, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == events[-1].response.output_text
    follow = c.responses.create(input="And then?", previous_response_id=r.id, max_output_tokens=2)
    assert follow.usage.input_tokens > r.usage.input_tokens
    assert c.responses.retrieve(r.id).id == r.id
    with pytest.raises(openai.NotFoundError):
        c.responses.create(input="x", previous_response_id="resp_nope", max_output_tokens=1)


def test_responses_structured_output_and_function_calls(server):
    c = oai(server)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = c.responses.create(input="A number", text={"format": {"type": "json_schema", "name": "n", "schema": schema,
                                                              "strict": True}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text)["n"], int)
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                             "required": ["city"], "additionalProperties": False}}]
    r = c.responses.create(input="Weather in Paris?", tools=tools, tool_choice="required",
                           parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    done = c.responses.create(previous_response_id=r.id, max_output_tokens=4, input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert done.output[-1].type == "message"
    with pytest.raises(openai.BadRequestError):
        c.responses.create(input="x", tools=[{"type": "web_search"}])
