"""Graceful shutdown of a real `strata serve` (embedded model, CPU). On SIGTERM /health says draining and
new requests get 503 at once; requests in service run to completion within --shutdown-timeout; those
still running then end with a terminal error (OpenAI: an SSE error event and [DONE]; Anthropic: an
`error` event; whole completions: the JSON error body) and none is cut silently. Exit 0 after a clean
drain, 1 when requests had to be ended."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from serving import server_log, start_server

NAME = "strata-drain"


def _server(tmp_path, **config):
    base_cfg = {"ctx": 4096, "parallel": 4, "device": "cpu", "model_name": NAME, "log_level": "info"}
    return start_server(tmp_path, {**base_cfg, **config})


class Call(threading.Thread):
    """One request on its own connection: status, the body's lines (streamed) or JSON, any exception."""

    def __init__(self, base: str, path: str, body: dict, lines: int = 6):
        super().__init__()
        self.wanted = lines
        self.base, self.path, self.body = base, path, body
        self.status: int | None = None
        self.lines: list[str] = []
        self.json: dict | None = None
        self.error: Exception | None = None
        self.started_output = threading.Event()

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.base, timeout=120) as c:
                if not self.body.get("stream"):
                    self.started_output.set()
                    r = c.post(self.path, json=self.body)
                    self.status, self.json = r.status_code, r.json()
                    return
                with c.stream("POST", self.path, json=self.body) as r:
                    self.status = r.status_code
                    for line in r.iter_lines():
                        if line:
                            self.lines.append(line)
                        if len(self.lines) >= self.wanted:
                            self.started_output.set()
        except Exception as e:
            self.error = e
        finally:
            self.started_output.set()

    def data(self) -> list[str]:
        return [line[6:] for line in self.lines if line.startswith("data: ")]


LONG = 4000  # 20 s of decoding at the embedded model's best speed: none finishes within the timeout


def sigterm_ends_long_requests(tmp_path, long: int = LONG, **config) -> None:
    """Four long requests on two slots: two decode, two wait (one of them an Anthropic stream, which
    has sent its message_start), and none can finish within the timeout. `config` overrides the
    server's (the GPU test's device and model)."""
    proc, base, log = _server(tmp_path, **{"shutdown_timeout": 3, "parallel": 2, **config})
    try:
        chat = Call(base, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "Hi"}],
                                                   "max_tokens": long, "ignore_eos": True, "stream": True})
        comp = Call(base, "/v1/completions", {"model": NAME, "prompt": "Once", "max_tokens": long, "n": 2,
                                              "ignore_eos": True, "stream": True})
        whole = Call(base, "/v1/completions", {"model": NAME, "prompt": "Once", "max_tokens": long, "ignore_eos": True})
        anth = Call(base, "/v1/messages", {"model": NAME, "messages": [{"role": "user", "content": "Hi"}],
                                           "max_tokens": long, "stream": True}, lines=2)
        calls = [chat, comp, whole, anth]
        for c in calls:  # one at a time: the chat and one choice take the slots, the others queue
            c.start()
            assert c.started_output.wait(60)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        t0 = time.monotonic()
        health = httpx.get(base + "/health", timeout=5)
        late = httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": "late", "max_tokens": 2}, timeout=5)
        assert time.monotonic() - t0 < 2
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutting_down"
        for c in calls:
            c.join(60)
        assert proc.wait(timeout=30) == 1
    finally:
        text = server_log(proc, log)
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
    for c in (chat, comp):
        assert c.error is None and c.status == 200, (c.error, c.lines[-3:])
        data = c.data()
        assert data[-1] == "[DONE]", data[-3:]
        assert json.loads(data[-2]).get("error", {}).get("code") == "server_shutting_down", data[-3:]
        assert not [d for d in data if '"finish_reason":"length"' in d], [len(data), data[-4:]]
    assert anth.error is None and anth.status == 200
    assert anth.lines[-2] == "event: error" and json.loads(anth.lines[-1][6:])["error"]["type"] == "overloaded_error"
    assert whole.error is None and whole.status == 503 and whole.json["error"]["code"] == "server_shutting_down"


def test_sigterm_ends_long_requests_with_terminal_errors(tmp_path):
    sigterm_ends_long_requests(tmp_path)


def sigterm_lets_requests_in_service_finish(tmp_path, **config) -> None:
    proc, base, log = _server(tmp_path, **{"shutdown_timeout": 60, **config})
    try:
        short = Call(base, "/v1/completions", {"model": NAME, "prompt": "Once", "max_tokens": 60, "ignore_eos": True,
                                               "stream": True, "temperature": 0})
        short.start()
        assert short.started_output.wait(60)
        proc.send_signal(signal.SIGTERM)
        short.join(60)
        assert proc.wait(timeout=60) == 0
    finally:
        server_log(proc, log)
    data = short.data()
    assert short.error is None and data[-1] == "[DONE]"
    finishes = [json.loads(d)["choices"][0]["finish_reason"] for d in data[:-1] if json.loads(d)["choices"]]
    assert finishes[-1] == "length"
    assert sum(len(json.loads(d)["choices"][0]["text"]) > 0 for d in data[:-1]) >= 30


def test_sigterm_lets_requests_in_service_finish(tmp_path):
    sigterm_lets_requests_in_service_finish(tmp_path)
