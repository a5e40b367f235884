"""What llama.cpp's own server suite checks beyond the request shapes: llama-server's flags (`--alias`,
`--tags`, `--host a,b`, `--reasoning`, `--verbose`, `--metrics`), its `llamacpp:*` metric families and
header, its `timings`, its default seed, its context error and the variables every chat template gets.
One real server on the embedded model (CPU) for the module; the switches that would need a second one
run in-process over a fake engine."""

from __future__ import annotations

import asyncio
import datetime
import json
import socket
import sys
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from serving import running_server
from strata.engine.types import EngineEvent, EngineRequest, EngineStats
from strata.loaders import default_model_path
from strata.server.app import build_app
from strata.server.config import ServerConfig
from strata.server.metrics import llama_metrics
from strata.tokenizer import Tokenizer

CTX = 256
CHAT = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
# Shows the variables the server gives every template, beside a plain conversation.
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}thinking={{ enable_thinking }} date={{ date_string }} "
            "datetime={{ datetime }}\nassistant:{% endif %}")


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


HOSTS = "127.0.0.1,::1" if ipv6_loopback() else "127.0.0.1"
CONFIG = {"ctx": CTX, "parallel": 2, "device": "cpu", "seed": 42, "log_level": "warning", "host": HOSTS,
          "alias": "tinyllama-2,fim,code", "tags": "chat,fim,small", "reasoning": "off", "verbose": True,
          "cors_origins": "localhost", "chat_template": TEMPLATE, "chunk_size": 32, "temp": 0.0,
          "n_predict": 5}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("llama-compat"), CONFIG) as base:
        yield base


def post(server: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(server + path, json=body, timeout=60)


def llama_families(text: str) -> dict[str, tuple[str, float]]:
    """{name: (type, value)} of the `llamacpp:*` families, each checked to have its HELP and TYPE lines."""
    types, out = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE llamacpp:"):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("llamacpp:"):
            name, value = line.split(" ", 1)
            assert name in types and f"# HELP {name} " in text, name
            out[name] = (types[name], float(value))
    return out


# ---- the real server ----------------------------------------------------------------------------


def test_aliases_and_tags_in_models_and_any_alias_is_served(server):
    card = httpx.get(server + "/models").json()["data"][0]
    assert card["id"] == "code"  # the first alias in alphabetical order, as llama-server's
    assert card["aliases"] == ["code", "fim", "tinyllama-2"] and card["tags"] == ["chat", "fim", "small"]
    r = post(server, "/v1/chat/completions", {"model": "fim", "messages": CHAT, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "fim"


@pytest.mark.skipif("::1" not in HOSTS, reason="no IPv6 loopback")
def test_every_address_of_host_answers(server):
    port = server.rsplit(":", 1)[1]
    for host in ("127.0.0.1", "[::1]"):
        assert httpx.get(f"http://{host}:{port}/health").json() == {"status": "ok"}
        r = httpx.post(f"http://{host}:{port}/completion", json={"prompt": "Once", "n_predict": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 2


def test_cors_header_names_are_spelled_as_llama_servers(server):
    r = httpx.options(server + "/completions", headers={"Origin": "http://localhost:3000",
                                                        "Access-Control-Request-Method": "POST"})
    names = {k for k, _ in r.headers.raw}
    assert {b"Access-Control-Allow-Origin", b"Access-Control-Allow-Methods", b"Access-Control-Allow-Headers",
            b"Access-Control-Allow-Credentials"} <= names, names


def test_reasoning_off_and_the_date_reach_every_template(server):
    today = datetime.date.today()
    prompt = post(server, "/apply-template", {"messages": CHAT}).json()["prompt"]
    assert prompt.endswith(f"thinking=False date={today:%d %b %Y} datetime={today:%b %d %Y}\nassistant:"), prompt
    asked = post(server, "/apply-template", {"messages": CHAT, "chat_template_kwargs": {
        "enable_thinking": True, "date_string": "1 Jan 2000"}}).json()["prompt"]
    assert "thinking=True date=1 Jan 2000 " in asked, asked


def test_verbose_server_answers_with_the_prompt_unless_a_request_says_not(server):
    r = post(server, "/chat/completions", {"messages": CHAT, "max_tokens": 2}).json()
    assert "system: Book\nuser: What is the best book\nthinking=False" in r["__verbose"]["prompt"]
    assert r["__verbose"]["content"] == r["choices"][0]["message"]["content"]
    assert "__verbose" not in post(server, "/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                                                 "verbose": False}).json()


def test_two_final_assistant_messages_need_continue_final_message(server):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "assistant", "content": "Again"}]
    r = post(server, "/chat/completions", {"messages": messages, "max_tokens": 1})
    assert r.status_code == 400 and "continue_final_message" in r.json()["error"]["message"]
    r = post(server, "/chat/completions", {"messages": messages, "max_tokens": 1, "continue_final_message": True})
    assert r.status_code == 200 and r.json()["__verbose"]["prompt"].endswith("assistant: Again")


def test_a_prompt_the_context_cannot_hold_is_llama_servers_error(server):
    body = {"messages": CHAT * 40}
    for stream in (False, True):
        r = post(server, "/chat/completions", {**body, "stream": stream})
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "exceed_context_size_error", err
        assert err["code"] == "context_length_exceeded" and err["n_ctx"] == CTX and err["n_prompt_tokens"] > CTX


def test_unseeded_native_requests_draw_from_the_server_seed(server):
    body = {"prompt": "Once upon a time", "n_predict": 12, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0}
    first, second = (post(server, "/completion", body).json() for _ in range(2))
    assert first["generation_settings"]["seed"] == 42 and first["content"] == second["content"]


def test_temp_is_the_default_temperature_of_every_route(server):
    assert post(server, "/completion", {"prompt": "Once", "n_predict": 1}).json()["generation_settings"][
        "temperature"] == 0.0
    assert httpx.get(server + "/props").json()["default_generation_settings"]["params"]["temperature"] == 0.0
    body = {"messages": CHAT, "max_tokens": 6, "seed": None}
    first, second = (post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
                     for _ in range(2))
    assert first == second  # greedy: the server's seed draws each request differently, temperature 0 ignores it
    warm = post(server, "/v1/chat/completions", {**body, "temperature": 1.5, "top_p": 1.0, "max_tokens": 24})
    assert warm.json()["choices"][0]["message"]["content"] != post(server, "/v1/chat/completions", {
        **body, "temperature": 1.5, "top_p": 1.0, "max_tokens": 24}).json()["choices"][0]["message"]["content"]


def test_n_predict_is_the_limit_of_requests_that_set_none(server):
    body = {"prompt": "Once upon a time", "ignore_eos": True}
    assert post(server, "/completion", body).json()["tokens_predicted"] == 5
    assert post(server, "/completion", {**body, "n_predict": 7}).json()["tokens_predicted"] == 7
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == 5


def test_timings_rates_count_the_steps_after_the_first_token(server):
    one = post(server, "/completion", {"prompt": "I believe", "n_predict": 1}).json()["timings"]
    assert one["predicted_n"] == 1 and one["predicted_per_second"] == one["predicted_per_token_ms"] == 0.0
    t = post(server, "/completion", {"prompt": "I believe", "n_predict": 9, "ignore_eos": True}).json()["timings"]
    assert t["predicted_n"] == 9 and t["predicted_per_second"] == pytest.approx(8 / t["predicted_ms"] * 1e3)
    assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / 8)
    assert t["prompt_ms"] > 0 and t["prompt_per_token_ms"] > 0


def test_metrics_carry_llama_servers_families_and_header(server):
    def scrape() -> tuple[httpx.Response, dict[str, tuple[str, float]]]:
        r = httpx.get(server + "/metrics")
        return r, llama_families(r.text)

    _, before = scrape()
    done = post(server, "/completion", {"prompt": "I believe", "n_predict": 8, "ignore_eos": True}).json()
    r, after = scrape()
    assert (b"Process-Start-Time-Unix", r.headers["process-start-time-unix"].encode()) in r.headers.raw
    assert int(r.headers["process-start-time-unix"]) <= datetime.datetime.now().timestamp()
    for name in ("prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total", "tokens_predicted_total",
                 "tokens_predicted_seconds_total", "n_decode_total", "n_tokens_max", "spec_decode_num_drafts_total"):
        assert after[f"llamacpp:{name}"][0] == "counter", name
    for name in ("prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing", "requests_deferred",
                 "n_busy_slots_per_decode"):
        assert after[f"llamacpp:{name}"][0] == "gauge", name

    def grew(name: str) -> float:
        return after[f"llamacpp:{name}"][1] - before[f"llamacpp:{name}"][1]

    timings = done["timings"]
    assert grew("tokens_predicted_total") == timings["predicted_n"] == 8
    assert grew("prompt_tokens_total") == timings["prompt_n"] and grew("prompt_tokens_cached_total") == \
        timings["cache_n"]
    # One step reads the prompt and gives the first token; each further token is a step of its own.
    assert grew("n_decode_total") == 8 and grew("tokens_predicted_seconds_total") > 0
    assert after["llamacpp:n_tokens_max"][1] >= done["tokens_evaluated"] + 8
    assert after["llamacpp:requests_processing"][1] == 0 and after["llamacpp:n_busy_slots_per_decode"][1] >= 1


def events(server: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server + path, json={**body, "stream": True}, timeout=60) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_native_stream_reports_prompt_progress_with_timings(server):
    prompt = "the quick brown fox jumps over the lazy dog " * 8
    got = events(server, "/completion", {"prompt": prompt, "n_predict": 4, "return_progress": True,
                                         "timings_per_token": True})
    progress = [e for e in got if "prompt_progress" in e]
    total = progress[0]["prompt_progress"]["total"]
    # The cache's share first (nothing read, no time spent), then one report per 32-token chunk.
    assert progress[0]["prompt_progress"] == {"total": total, "cache": 0, "processed": 0, "time_ms": 0}
    assert progress[0]["timings"]["prompt_n"] == 0 and progress[0]["timings"]["prompt_ms"] == 0.0
    assert [p["prompt_progress"]["processed"] for p in progress[1:]] == [*range(32, total, 32), total]
    times = [p["timings"]["prompt_ms"] for p in progress]
    assert times == sorted(times) and times[-1] > 0
    tokens = [e for e in got if e["content"]]
    assert tokens and all("timings" in e and e["timings"]["prompt_n"] == total for e in tokens)
    assert got[-1]["stop"] and got.index(progress[-1]) < got.index(tokens[0])
    assert all("prompt_progress" not in e for e in events(server, "/completion", {"prompt": prompt, "n_predict": 2}))


def test_chat_stream_progress_counts_the_cache_and_timings_come_per_token(server):
    body = {"messages": [{"role": "user", "content": "This is a test" * 10}], "max_tokens": 3, "return_progress": True}
    events(server, "/chat/completions", body)
    again = [e["prompt_progress"] for e in events(server, "/chat/completions", body) if "prompt_progress" in e]
    assert again[0]["cache"] == again[0]["processed"] > 0 and again[-1]["processed"] == again[-1]["total"]
    timed = events(server, "/chat/completions", {"messages": CHAT, "max_tokens": 4, "timings_per_token": True,
                                                 "stream_options": {"include_usage": True}})
    assert "timings" not in timed[0] and timed[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("timings" in e for e in timed[1:]) and timed[-1]["choices"] == []
    assert timed[-1]["timings"]["predicted_n"] == timed[-1]["usage"]["completion_tokens"]
    plain = events(server, "/chat/completions", {"messages": CHAT, "max_tokens": 2})
    assert all("timings" not in e and "prompt_progress" not in e for e in plain)


def test_responses_stream_reports_progress_and_timings(server):
    got = events(server, "/responses", {"input": "This is a test" * 10, "max_output_tokens": 4,
                                        "timings_per_token": True, "return_progress": True})
    progress = [e for e in got if "prompt_progress" in e]
    assert progress and all(e["type"] == "response.in_progress" for e in progress)
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
    deltas = [e for e in got if e["type"] == "response.output_text.delta"]
    assert deltas and all("predicted_per_second" in e["timings"] for e in deltas)
    assert got[-1]["type"] == "response.incomplete" and got[-1]["timings"]["predicted_n"] == 4
    plain = events(server, "/responses", {"input": "Hi", "max_output_tokens": 2})
    assert all("timings" not in e and "prompt_progress" not in e for e in plain)


def test_idle_slots_show_no_budget(server):
    post(server, "/completion", {"prompt": "I believe", "n_predict": 4})
    for slot in httpx.get(server + "/slots").json():
        assert slot["is_processing"] is False
        assert slot["next_token"] == [{"has_next_token": False, "n_decoded": 0, "n_remain": -1}]


# ---- switches, over a fake engine ---------------------------------------------------------------


class EchoEngine:
    """Answers every request with "ok"."""

    model_name = "echo"
    model_type = None
    max_model_len = 512

    def __init__(self) -> None:
        self.tokenizer = Tokenizer.from_hf_dir(default_model_path())

    def stats(self) -> EngineStats:
        return EngineStats(parallel=1, queue_len=0, slots_busy=0, kv_blocks_used=0, kv_blocks_total=1,
                           prompt_tokens_total=0, generation_tokens_total=0, requests_finished_total=0,
                           give_ways_total=0, preemptions_total=0)

    def submit(self, req: EngineRequest, logprobs: bool = False):
        async def events():
            await asyncio.sleep(0)
            yield EngineEvent(req.request_id, (1,), "ok", "stop", prompt_tokens=len(req.prompt_ids),
                              completion_tokens=1)
        return events()

    def abort(self, request_id: str) -> None:
        pass


def test_no_metrics_is_501_and_props_says_so():
    with TestClient(build_app(EchoEngine(), ServerConfig(metrics=False)), base_url="http://localhost") as c:
        r = c.get("/metrics")
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
        assert c.get("/props").json()["endpoint_metrics"] is False
    with TestClient(build_app(EchoEngine(), ServerConfig()), base_url="http://localhost") as c:
        assert c.get("/metrics").status_code == 200 and c.get("/props").json()["endpoint_metrics"] is True


def test_templates_think_by_default_and_reasoning_off_turns_it_off():
    def prompt(cfg: ServerConfig) -> str:
        with TestClient(build_app(EchoEngine(), cfg), base_url="http://localhost") as c:
            return c.post("/apply-template", json={"messages": CHAT}).json()["prompt"]

    assert "thinking=True " in prompt(ServerConfig(chat_template=TEMPLATE))
    assert "thinking=True " in prompt(ServerConfig(chat_template=TEMPLATE, reasoning="on"))
    assert "thinking=False " in prompt(ServerConfig(chat_template=TEMPLATE, reasoning="off"))


def test_alias_and_hosts_are_checked():
    assert ServerConfig(alias=" b, a ,b").aliases == ["a", "b"]
    assert ServerConfig(host="127.0.0.1, ::1").hosts == ["127.0.0.1", "::1"]
    assert ServerConfig(host="127.0.0.1,::1").host_allowed("[::1]:8080")
    for bad in (dict(alias=" , "), dict(alias="a", model_name="b")):
        with pytest.raises(ValueError):
            ServerConfig(**bad)


def test_the_suite_launcher_maps_llama_servers_flags():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from llama_server_suite import strata_args

    args = strata_args(["--port", "8080", "--temp", "0.8", "--host", "127.0.0.1,::1", "--hf-repo", "x/y",
                        "--batch-size", "32", "--alias", "a,b", "--tags", "t", "--ctx-size", "512", "--parallel",
                        "2", "--reasoning", "off", "--verbose", "--no-slots", "--jinja"])
    for flag, value in (("--port", "8080"), ("--temp", "0.8"), ("--host", "127.0.0.1,::1"), ("--chunk-size", "32"),
                        ("--alias", "a,b"), ("--tags", "t"), ("--ctx", "256"), ("--parallel", "2"),
                        ("--reasoning", "off")):
        assert args[args.index(flag) + 1] == value, flag
    assert {"--verbose", "--no-slots", "--no-metrics"} <= set(args) and "--hf-repo" not in args
    unified = strata_args(["--ctx-size", "256", "--parallel", "4", "--kv-unified", "--metrics"])
    assert unified[unified.index("--ctx") + 1] == "256" and "--no-metrics" not in unified


def test_llama_metrics_render_engine_counters():
    stats = EngineStats(parallel=2, queue_len=3, slots_busy=1, kv_blocks_used=0, kv_blocks_total=1,
                        prompt_tokens_total=40, generation_tokens_total=9, requests_finished_total=1,
                        give_ways_total=0, preemptions_total=0, prefix_cache_cached_tokens_total=16,
                        steps_total=10, step_rows_total=15, longest_sequence=65, ttft_sum=0.25,
                        decode_seconds_total=1.5,
                        spec={"drafts_proposed": 6, "drafts_accepted": 4, "verification_steps": 3})
    got = llama_families(llama_metrics(stats).decode())
    assert {k.removeprefix("llamacpp:"): v[1] for k, v in got.items()} == {
        "prompt_tokens_total": 40, "prompt_tokens_cached_total": 16, "prompt_seconds_total": 0.25,
        "tokens_predicted_total": 9, "tokens_predicted_seconds_total": 1.5, "n_decode_total": 10,
        "n_tokens_max": 65, "spec_decode_num_draft_tokens_total": 6, "spec_decode_num_accepted_tokens_total": 4,
        "spec_decode_num_drafts_total": 3, "prompt_tokens_seconds": 0, "predicted_tokens_seconds": 0,
        "requests_processing": 1, "requests_deferred": 3, "n_busy_slots_per_decode": 1.5}
