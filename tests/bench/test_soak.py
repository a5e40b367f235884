"""`strata bench soak`: how each request's end is classified, the memory figures, the probe comparison,
and a short soak of the embedded model on the CPU (--batch-invariant): nothing lost, greedy answers
under load the same as alone, memory flat after the warm-up."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from strata.bench import soak
from strata.bench.soak import MemorySampler, compare_probes, memory_summary, one_request, tally, timeline
from strata.cli import main


def _event(obj) -> bytes:
    return f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n".encode()


TEXT = {"choices": [{"index": 0, "text": "abc", "finish_reason": None}]}
FINISH = {"choices": [{"index": 0, "text": "d", "finish_reason": "length"}]}
USAGE = {"choices": [], "usage": {"completion_tokens": 2}}


class Scripted(BaseHTTPRequestHandler):
    """Answers /v1/completions as the request's `prompt` says: a whole stream, a cut one, an error
    event, no finish reason, a 429, a 503 or a 500."""

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        how = body["prompt"]
        if how in ("busy", "draining", "broken"):
            code = {"busy": 429, "draining": 503, "broken": 500}[how]
            self.send_response(code)
            self.send_header("Retry-After", "2")
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "no"}}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        events = {"ok": [TEXT, FINISH, USAGE, "[DONE]"], "cut": [TEXT, TEXT], "cut_after_finish": [TEXT, FINISH],
                  "error": [TEXT, {"error": {"message": "engine error", "code": "x"}}, "[DONE]"],
                  "no_finish": [TEXT, "[DONE]"],
                  "malformed": [{"choices": [{"logprobs": {"tokens": ["a"]}}]}, "[DONE]"]}[how]
        for e in events:
            self.wfile.write(_event(e))
            self.wfile.flush()


@pytest.fixture(scope="module")
def scripted_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("how, outcome, reason", [
    ("ok", "completed", None), ("cut", "lost", "cut"), ("cut_after_finish", "lost", "cut"),
    ("error", "lost", "stream_error"), ("no_finish", "lost", "no_finish_reason"), ("busy", "rejected", "429"),
    ("draining", "rejected", "503"), ("broken", "lost", "http_500"), ("malformed", "lost", "malformed"),
])
def test_each_end_of_a_request_is_classified(scripted_url, how, outcome, reason):
    r = one_request(scripted_url, {"prompt": how})
    assert (r["outcome"], r["reason"]) == (outcome, reason)
    if how == "ok":
        assert r["text"] == "abcd" and r["finish_reason"] == "length" and r["tokens"] == 2
    if outcome == "rejected":
        assert r["retry_after"] == "2"


def test_a_refused_connection_is_lost(scripted_url):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: the connection is refused
        r = one_request(f"http://127.0.0.1:{port}", {"prompt": "ok"})
    assert (r["outcome"], r["reason"]) == ("lost", "connection")


def test_tally_and_timeline():
    rows = [{"outcome": "completed", "reason": None, "tokens": 5, "end": 100.5},
            {"outcome": "lost", "reason": "cut", "tokens": 0, "end": 101.2},
            {"outcome": "rejected", "reason": "429", "tokens": 0, "end": 103.9},
            {"outcome": "completed", "reason": None, "tokens": 7, "end": 103.1}]
    t = tally(rows)
    assert (t["requests_completed"], t["requests_lost"], t["requests_rejected"], t["tokens_generated"]) == (2, 1, 1, 12)
    assert t["lost_reasons"] == {"cut": 1} and t["lost_shown"] == [rows[1]]
    assert [(r["completed"], r["lost"], r["rejected"]) for r in timeline(rows, 100.0, 2.0)] == [(1, 1, 0), (1, 0, 1)]


def test_memory_growth_is_counted_from_the_end_of_the_warmup():
    samples = [{"t": t, "m": m} for t, m in [(-1, 5), (0, 10), (1, 50), (2, 40), (3, 60), (4, 55), (5, None)]]
    assert memory_summary(samples, "m", 1.5) == {"at_warmup_end": 50, "peak_after_warmup": 60,
                                                 "growth_after_warmup": 10, "end_growth": 5}
    # Memory that only falls after the warm-up has grown by nothing.
    assert memory_summary(samples[:4], "m", 1.0)["growth_after_warmup"] == 0
    assert memory_summary(samples, "other", 1.0)["peak_after_warmup"] is None


def test_gpu_memory_is_torchs_reserved_and_nvidia_smis_figure_for_this_process(monkeypatch):
    import types

    import torch

    listing = types.SimpleNamespace(stdout="99, 7\n1234, 2048\n1234, 16\n")
    calls = []
    monkeypatch.setattr(soak.subprocess, "run", lambda *a, **k: calls.append(a) or listing)
    monkeypatch.setattr(soak.os, "getpid", lambda: 1234)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 * 2**30)
    sampler = MemorySampler(1.0, "cuda")
    sampler.sample()
    assert sampler.samples[0]["gpu_reserved"] == 5 * 2**30 and sampler.samples[0]["gpu_process"] == 2064 * 2**20
    assert sampler.samples[0]["host_rss"] > 0
    # A process nvidia-smi does not list (another PID namespace): asked once, then no more.
    listing.stdout = "99, 7\n"
    sampler.sample()
    sampler.sample()
    assert [s["gpu_process"] for s in sampler.samples[1:]] == [None, None] and len(calls) == 2

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(soak.subprocess, "run", missing)
    assert soak.nvidia_smi_bytes(1234) is None


def test_a_changed_or_missing_probe_answer_is_not_identical():
    a = [{"outcome": "completed", "text": "x y", "logprobs": [-0.5, -1.0], "finish_reason": "length"}] * 2
    assert compare_probes(a, [a, a])["greedy_identical"]
    nudged = [a[0], {**a[1], "logprobs": [-0.5, -1.0000001]}]
    r = compare_probes(a, [nudged])
    assert r["greedy_identical"] and not r["probe_logprobs_identical"]
    r = compare_probes(a, [a, [a[0], {**a[1], "text": "x z"}]])
    assert not r["greedy_identical"] and r["probe_mismatches"][0]["round"] == 1
    assert not compare_probes(a, [[a[0], {**a[1], "outcome": "lost", "text": ""}]])["greedy_identical"]
    assert not compare_probes(a, [])["greedy_identical"]  # never compared under load


def test_cpu_soak_loses_nothing_and_keeps_greedy_answers(tmp_path):
    out = tmp_path / "soak.json"
    assert main(["bench", "soak", "--model", "default", "--device", "cpu", "--clients", "4", "--parallel", "2",
                 "--seconds", "8", "--warmup", "2", "--sample-every", "1", "--prompts", "8,40,120",
                 "--max-tokens", "4,12", "--probe-prompts", "8,60", "--probe-tokens", "8", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    s = res["summary"]
    assert s["clients"] == 4 and 8 <= s["seconds"] < 20 and res["device"] == "cpu"
    assert s["requests_lost"] == 0 and res["lost_reasons"] == {} and s["requests_rejected"] == 0
    # 4 clients on 2 slots for 8 s, each request at most 120 + 12 tokens: many rounds each.
    assert s["requests_completed"] >= 16
    assert s["requests_completed"] == sum(r["completed"] for r in res["timeline"])
    assert 4 * s["requests_completed"] <= s["tokens_generated"] <= 12 * s["requests_completed"]
    assert s["greedy_identical"] is True and s["probe_rounds_under_load"] >= 1
    assert [p["tokens"] for p in res["probe_answers"]] == [8, 8] and all(p["text"] for p in res["probe_answers"])
    assert s["memory_measure"] == "host_rss" and res["config"]["batch_invariant"] is True
    peak, base, growth = (s["peak_memory_after_warmup_bytes"], s["memory_at_warmup_end_bytes"],
                          s["memory_growth_after_warmup_bytes"])
    assert peak >= base > 100 * 2**20 and growth == peak - base
    assert growth < 64 * 2**20, growth  # the KV pool and buffers are preallocated: flat after warm-up
    samples = res["memory_samples"]
    assert len(samples) >= 8 and samples[0]["t"] < 0 < samples[-1]["t"]  # from before the soak to its end
    pytest.importorskip("matplotlib")
    assert (tmp_path / "soak.png").stat().st_size > 0
