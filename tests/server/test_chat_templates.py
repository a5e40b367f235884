"""A model file's chat template is untrusted code: it renders in worker processes under a time, memory
and output limit (each broken limit a 400 naming it, the worker replaced), a slow template holds up
no other request's tokenization, and a template that does not compile or render is a start-up error."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from strata.engine.types import EngineEvent, EngineRequest, EngineStats
from strata.loaders import default_model_path
from strata.server.config import ServerConfig
from strata.server.templates import TemplateLimitError, TemplateRenderer
from strata.tokenizer import Tokenizer

HOSTILE = ("{% set c = messages[0]['content'] %}"
           "{% if c == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
           "{% elif c == 'big' %}{{ ('x' * 1000000000) | length }}"
           "{% elif c == 'long' %}{% for i in range(100000) %}{{ c }}{% endfor %}"
           "{% endif %}<|im_start|>user\n{{ c }}<|im_end|>\n<|im_start|>assistant\n")


def one(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_each_limit_is_an_error_naming_it_and_the_renderer_goes_on(tok):
    r = TemplateRenderer(dataclasses.replace(tok, chat_template=HOSTILE), max_chars=10_000, timeout_s=1.0,
                         memory_bytes=256 << 20)
    try:
        assert r.render(one("hi"), None, True, {}).endswith("hi<|im_end|>\n<|im_start|>assistant")
        for content, words in (("loop", "longer than 1 s"), ("big", "more than 256 MiB"),
                               ("long", "longer than 10000 characters")):
            t0 = time.monotonic()
            with pytest.raises(TemplateLimitError, match=words):
                r.render(one(content), None, True, {})
            assert time.monotonic() - t0 < 10
            assert "hi<|im_end|>" in r.render(one("hi"), None, True, {})
    finally:
        r.close()


@pytest.mark.parametrize("template, words", [
    ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
    ("{{ raise_exception('no conversations here') }}", "no conversations here"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than"),
])
def test_a_broken_template_fails_the_check(tok, template, words):
    r = TemplateRenderer(dataclasses.replace(tok, chat_template=template), max_chars=10_000, timeout_s=1.0)
    try:
        with pytest.raises(ValueError, match=words):
            r.check()
    finally:
        r.close()


def test_a_broken_template_is_a_start_up_error(tmp_path):
    src = default_model_path()
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            os.symlink(os.path.join(src, name), tmp_path / name)
        elif name.endswith(".json"):
            (tmp_path / name).write_bytes(open(os.path.join(src, name), "rb").read())
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m.content }"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "strata.cli", "serve", str(tmp_path), "--device", "cpu", "--port", "0"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "STRATA_NO_PROGRESS": "1"})
    assert r.returncode == 2 and "chat template cannot render a conversation" in r.stderr, r.stderr[-2000:]


class LoopingTemplateEngine:
    """Answers every request with "ok"; its chat template loops on the message `loop`."""

    model_name = "looping"
    model_type = None
    max_model_len = 512

    def __init__(self, tok: Tokenizer) -> None:
        self.tokenizer = dataclasses.replace(tok, chat_template=HOSTILE)

    def stats(self) -> EngineStats:
        return EngineStats(parallel=4, queue_len=0, slots_busy=0, kv_blocks_used=0, kv_blocks_total=1,
                           prompt_tokens_total=0, generation_tokens_total=0, requests_finished_total=0,
                           give_ways_total=0, preemptions_total=0)

    def submit(self, req: EngineRequest, logprobs: bool = False):
        async def events():
            await asyncio.sleep(0)
            yield EngineEvent(req.request_id, (1,), "ok", "stop", prompt_tokens=len(req.prompt_ids), completion_tokens=1)
        return events()

    def abort(self, request_id: str) -> None:
        pass


def test_looping_renders_hold_up_no_other_request(tok, monkeypatch):
    import uvicorn

    from strata.server import service
    from strata.server.app import build_app

    monkeypatch.setattr(service, "TEMPLATE_TIMEOUT_S", 1.0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = build_app(LoopingTemplateEngine(tok), ServerConfig())
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        statuses: list[int] = []

        def chat() -> None:
            r = httpx.post(base + "/v1/chat/completions", json={"model": "looping", "messages": one("loop")}, timeout=60)
            statuses.append(r.status_code)
            assert "longer than 1 s" in r.json()["error"]["message"]

        loops = [threading.Thread(target=chat) for _ in range(6)]
        for t in loops:
            t.start()
        time.sleep(0.3)  # both template workers are looping now, four more renders wait
        for _ in range(3):
            t0 = time.monotonic()
            r = httpx.post(base + "/v1/completions", json={"model": "looping", "prompt": "hi"}, timeout=10)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
            r = httpx.post(base + "/tokenize", json={"prompt": "hi"}, timeout=10)
            assert r.status_code == 200 and time.monotonic() - t0 < 0.5
        for t in loops:
            t.join(60)
        assert statuses == [400] * 6
        r = httpx.post(base + "/v1/chat/completions", json={"model": "looping", "messages": one("hi")}, timeout=10)
        assert r.status_code == 200
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_templates_can_write_todays_date():
    import datetime

    from strata.tokenizer import render_chat_template

    text = render_chat_template("{{ strftime_now('%d %b %Y') }}|{{ messages[0]['content'] }}",
                                [{"role": "user", "content": "hi"}], None, False, "", "", {})
    assert text == datetime.datetime.now().strftime("%d %b %Y") + "|hi"


def test_templates_can_break_out_of_loops():
    from strata.tokenizer import render_chat_template

    source = "{% for m in messages %}{% if m['role'] == 'stop' %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}"
    msgs = [{"role": "user", "content": "a"}, {"role": "stop", "content": "b"}, {"role": "user", "content": "c"}]
    assert render_chat_template(source, msgs, None, False, "", "", {}) == "a"
