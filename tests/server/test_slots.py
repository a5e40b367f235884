"""GET /slots and the /metrics exposition: slot states from the engine's snapshot (deterministic, on an
engine stepped by hand), then a real `strata serve` on the embedded model polled while it reads and
decodes."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving import running_server
from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest, EngineStats, RateWindow, SlotSnapshot
from strata.loaders import default_model_path
from strata.params import SamplingParams
from strata.server.metrics import slots_json

KEY = "sk-slots-test"
NAME = "strata-slots"
FILLER = open(f"{default_model_path()}/README.md").read() * 4
SLOT_FIELDS = {"id": int, "state": str, "request_id": (str, type(None)), "prompt_tokens": int, "prompt_read": int,
               "generated": int, "max_tokens": int, "tokens_per_s": float, "give_ways": int, "drafts_proposed": int,
               "drafts_accepted": int, "acceptance": (float, type(None))}
TOTAL_FIELDS = {"parallel": int, "queue": int, "rejected": int, "kv_blocks_used": int, "kv_blocks_total": int, "give_ways": int,
                "preemptions": int, "prompt_tokens": int, "generation_tokens": int, "requests_finished": int,
                "uptime_s": float, "ttft_last_s": (float, type(None)), "generation_tok_s": float}
METRIC_NAMES = [  # names are part of the product (dashboards and alerts use them): none may go missing
    "strata_model_info", "strata_uptime_seconds", "strata_queue_length", "strata_requests_rejected_total",
    "strata_slots_busy", "strata_slots_total",
    "strata_kv_blocks_used", "strata_kv_blocks_total", "strata_kv_cache_usage_ratio", "strata_prompt_tokens_total",
    "strata_generation_tokens_total", "strata_requests_finished_total", "strata_give_ways_total",
    "strata_preemptions_total", "strata_prompt_tokens_per_second", "strata_generation_tokens_per_second",
    "strata_time_to_first_token_seconds_bucket", "strata_time_to_first_token_seconds_sum",
    "strata_time_to_first_token_seconds_count", "strata_http_requests_total",
]


def check_schema(body: dict) -> None:
    assert set(body) == {"model", "time", "slots", "totals"} and isinstance(body["time"], float)
    for slot in body["slots"]:
        assert set(slot) == set(SLOT_FIELDS), slot
        for name, kind in SLOT_FIELDS.items():
            assert isinstance(slot[name], kind), (name, slot)
        assert slot["state"] in ("idle", "waiting", "reading", "decoding")
    assert [s["id"] for s in body["slots"]] == list(range(body["totals"]["parallel"]))
    assert set(body["totals"]) == set(TOTAL_FIELDS)
    for name, kind in TOTAL_FIELDS.items():
        assert isinstance(body["totals"][name], kind), (name, body["totals"])


# ---- the snapshot, without a server -------------------------------------------------------------


def test_rate_window_stays_small_and_spans_the_window():
    now = [0.0]
    rate = RateWindow(window_s=5.0, clock=lambda: now[0])
    for i in range(10_000):  # 10 s of updates every millisecond, 100 tokens/s
        now[0] = i / 1000
        r = rate.update(i / 10, now[0])
    assert len(rate.samples) <= 5.0 / (5.0 / 50) + 2 and r == pytest.approx(100.0, rel=0.01)
    for _ in range(12):  # idle past the window, updated as the engine's idle loop does: the rate falls to 0
        now[0] += 0.5
        r = rate.update(999.9, now[0])
    assert r == 0.0


def test_slots_json_matches_the_schema():
    slots = (SlotSnapshot(0), SlotSnapshot(1, "decoding", "cmpl-1", prompt_tokens=7, prompt_read=7, generated=3,
                                           max_tokens=9, tokens_per_s=12.5, drafts_proposed=4, drafts_accepted=3))
    stats = EngineStats(parallel=2, queue_len=1, slots_busy=1, kv_blocks_used=2, kv_blocks_total=64,
                        prompt_tokens_total=7, generation_tokens_total=3, requests_finished_total=0,
                        give_ways_total=0, preemptions_total=0, uptime_seconds=1.5, slots=slots)
    body = slots_json(stats, "m", now=123.0)
    check_schema(body)
    assert body["slots"][0] == {**dict.fromkeys(SLOT_FIELDS, 0), "id": 0, "state": "idle", "request_id": None,
                                "tokens_per_s": 0.0, "acceptance": None}
    assert body["slots"][1]["acceptance"] == 0.75 and body["totals"]["queue"] == 1
    assert (body["model"], body["time"], body["totals"]["ttft_last_s"]) == ("m", 123.0, None)


def test_slot_states_through_a_give_way_and_speculation(tok):
    e = LLMEngine(EngineConfig(device="cpu", ctx=1024, parallel=2, chunk_size=16, max_num_batched_tokens=64, spec=2))
    long_ids = tok.encode(FILLER)[:300]
    short_ids = tok.encode("To be, or not to be:")
    assert [s.state for s in e.stats().slots] == ["idle", "idle"]
    e.add_request(EngineRequest("long", tuple(long_ids), SamplingParams(max_tokens=8, ignore_eos=True), time.monotonic()))
    for _ in range(3):
        e.step()
    long = e.stats().slots[0]
    assert (long.state, long.request_id, long.prompt_tokens, long.prompt_read, long.generated, long.max_tokens) == (
        "reading", "long", 300, 48, 0, 8)
    e.add_request(EngineRequest("short", tuple(short_ids), SamplingParams(max_tokens=12, ignore_eos=True),
                                time.monotonic()))
    e.step()  # the short prompt is read in one step; the long read gives way to it
    stats = e.stats()
    long, short = stats.slots
    assert (long.state, long.prompt_read, long.give_ways) == ("waiting", 48, 1)
    assert (short.state, short.prompt_read, short.generated) == ("decoding", len(short_ids), 1)
    assert stats.ttft_last_seconds is not None and stats.give_ways_total == 1
    while e.requests.get("short") is not None and e.stats().slots[1].drafts_proposed == 0:
        e.step()
    long, short = e.stats().slots
    assert long.state == "reading" and long.prompt_read > 48  # reads again beside the short decode
    assert short.drafts_proposed > 0 and 0.0 <= short.acceptance <= 1.0
    assert short.generated > 1 and short.tokens_per_s > 0
    e.run_to_completion()
    stats = e.stats()
    assert [s.state for s in stats.slots] == ["idle", "idle"] and stats.requests_finished_total == 2
    assert stats.generation_tokens_per_second > 0  # 20 tokens within the last few seconds


# ---- a real server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = {"ctx": 1024, "device": "cpu", "api_key": KEY, "model_name": NAME, "log_level": "warning"}
    with running_server(tmp_path_factory.mktemp("slots"), config, ["--parallel", "2", "--chunk-size", "16"]) as base:
        yield base


def test_idle_server(http):
    r = http.get("/strata/slots")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    check_schema(body)
    assert body["model"] == NAME and abs(body["time"] - time.time()) < 60
    assert [s["state"] for s in body["slots"]] == ["idle", "idle"]
    assert all(s["request_id"] is None and s["acceptance"] is None for s in body["slots"])
    totals = body["totals"]
    assert (totals["parallel"], totals["queue"], totals["kv_blocks_used"]) == (2, 0, 0) and totals["kv_blocks_total"] > 0


def test_a_long_request_reads_then_decodes_then_frees_its_slot(http, tok):
    before = http.get("/strata/slots").json()["totals"]
    prompt = tok.encode(FILLER)[:600]
    done = threading.Event()
    usage: dict = {}

    def stream() -> None:
        body = {"model": NAME, "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.Client(base_url=str(http.base_url), headers=http.headers, timeout=60) as own:
                with own.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and '"usage":{' in line:
                            usage.update(json.loads(line[6:])["usage"])
        finally:
            done.set()

    worker = threading.Thread(target=stream)
    worker.start()
    seen_reading = seen_decoding = None
    last_read = last_generated = 0
    deadline = time.monotonic() + 60
    while not done.is_set() and time.monotonic() < deadline:
        time.sleep(0.005)  # a read step takes a few ms here: polls often enough, leaves the engine the CPU
        body = http.get("/strata/slots").json()
        busy = [s for s in body["slots"] if s["state"] != "idle"]
        if not busy:
            continue
        (slot,) = busy
        assert slot["request_id"].startswith("cmpl-") and slot["prompt_tokens"] == 600 and slot["max_tokens"] == 200
        assert slot["prompt_read"] >= last_read and slot["generated"] >= last_generated
        last_read, last_generated = slot["prompt_read"], slot["generated"]
        if slot["state"] == "reading" and 0 < slot["prompt_read"] < slot["prompt_tokens"]:
            seen_reading = seen_reading or slot
        if slot["state"] == "decoding" and slot["generated"] > 0 and slot["tokens_per_s"] > 0:
            seen_decoding = seen_decoding or (slot, body["totals"])
    worker.join(60)
    assert seen_reading is not None, "never saw the prompt read in progress"
    assert seen_reading["generated"] == 0 and seen_reading["prompt_read"] % 16 == 0
    assert seen_decoding is not None, "never saw the slot decoding"
    slot, totals = seen_decoding
    assert slot["prompt_read"] == 600 and slot["acceptance"] is None and slot["drafts_proposed"] == 0
    assert totals["generation_tok_s"] > 0 and totals["ttft_last_s"] is not None
    assert usage["completion_tokens"] == 200

    # The finishing step's events reach the client just before the snapshot after it is swapped in.
    deadline = time.monotonic() + 10
    while True:
        after = http.get("/strata/slots").json()
        if all(s["state"] == "idle" for s in after["slots"]) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    check_schema(after)
    assert [s["state"] for s in after["slots"]] == ["idle", "idle"]
    t = after["totals"]
    assert t["requests_finished"] == before["requests_finished"] + 1
    assert t["generation_tokens"] == before["generation_tokens"] + 200
    assert t["prompt_tokens"] == before["prompt_tokens"] + 600
    assert t["kv_blocks_used"] == 0 and t["uptime_s"] > before["uptime_s"]


def test_slots_follow_the_metrics_auth_rule(server):
    """/slots answers exactly whoever may read /metrics; /v1/* is behind the key."""
    assert httpx.get(server + "/v1/models").status_code == 401
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}"}):
        slots, metrics = (httpx.get(server + path, headers=headers) for path in ("/strata/slots", "/metrics"))
        assert slots.status_code == metrics.status_code, headers
        if headers.get("Authorization") == f"Bearer {KEY}":
            assert slots.status_code == 200


def test_metrics_parse_with_prometheus_client(http):
    done = http.post("/v1/completions", json={"model": NAME, "prompt": "Once", "max_tokens": 3, "ignore_eos": True})
    assert done.status_code == 200
    http.get("/strata/slots")
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    samples = {s.name: s for f in families.values() for s in f.samples}
    for name in METRIC_NAMES:
        assert name in samples, name
    assert samples["strata_slots_total"].value == 2 and samples["strata_model_info"].labels == {"model": NAME}
    assert families["strata_prompt_tokens"].type == "counter"
    buckets = [s for s in families["strata_time_to_first_token_seconds"].samples if s.name.endswith("_bucket")]
    assert [s.labels["le"] for s in buckets] == ["0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0",
                                                 "2.5", "5.0", "10.0", "30.0", "60.0", "+Inf"]
    assert buckets[-1].value == samples["strata_time_to_first_token_seconds_count"].value >= 1
    assert samples["strata_generation_tokens_total"].value >= 3
    assert samples["strata_solo_reads_total"].value == 0  # the CPU captures no prompt graphs: never solo
    slots_seen = [s for s in families["strata_http_requests"].samples if s.labels["path"] == "/strata/slots"]
    assert slots_seen and all(s.labels["method"] == "GET" for s in slots_seen)
