"""Graceful shutdown of a real `strata serve` on CUDA (`pytest -m gpu -s tests/gpu/test_gpu_shutdown.py`):
the CPU scenarios of tests/server/test_shutdown.py, and one with long streams, long whole completions
and a short stream all in service at SIGTERM. Every request gets its full answer or a terminal error
(an SSE error event and [DONE], or the JSON error body); none is cut silently.

The embedded model decodes thousands of tokens a second on a GPU, more than its 4,096-token context
holds in the drain window, so the server runs it from a directory whose config allows 65,536
positions (the weights are the embedded model's; greedy text past 4,096 is not the point)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from serving import server_log
from strata.loaders import default_model_path
from test_shutdown import NAME, Call, _server, sigterm_ends_long_requests, sigterm_lets_requests_in_service_finish

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CTX = 65536
LONG = 64000  # beyond what the fastest slot decodes between the first request and the drain's end


def long_context_model(root) -> str:
    """The embedded model's files, its config allowing `CTX` positions."""
    src = default_model_path()
    path = os.path.join(str(root), "long-context-model")
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), os.path.join(path, name))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "max_position_embeddings": CTX}, f)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return long_context_model(tmp_path_factory.mktemp("model"))


def cuda(model: str) -> dict:
    return {"device": "cuda", "model": model, "ctx": CTX}


def test_sigterm_on_cuda_ends_long_requests_with_terminal_errors(tmp_path, model):
    sigterm_ends_long_requests(tmp_path, long=LONG, **cuda(model))


def test_sigterm_on_cuda_lets_requests_in_service_finish(tmp_path, model):
    sigterm_lets_requests_in_service_finish(tmp_path, **cuda(model))


def sigterm_with_everything_in_service(tmp_path, long: int, short: int, shutdown_timeout: float, **config) -> None:
    """Four slots: two long streams, two long whole completions and one short stream run at once when
    SIGTERM comes; the short one finishes in the drain window with its full answer, the long ones end
    with terminal errors at its end, and the server exits 1 (requests had to be ended)."""
    proc, base, log = _server(tmp_path, **{"shutdown_timeout": shutdown_timeout, "parallel": 5, **config})
    try:
        def body(n, stream):
            return {"model": NAME, "prompt": "Once upon a time", "max_tokens": n, "ignore_eos": True, "stream": stream,
                    "temperature": 0}

        streams = [Call(base, "/v1/completions", body(long, True)),
                   Call(base, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": long, "ignore_eos": True, "stream": True})]
        wholes = [Call(base, "/v1/completions", body(long, False)) for _ in range(2)]
        for c in streams + wholes:
            c.start()
            assert c.started_output.wait(120)
        short = Call(base, "/v1/completions", body(short, True), lines=1)
        short.start()
        assert short.started_output.wait(60)
        time.sleep(0.5)  # the whole completions are in their slots too
        proc.send_signal(signal.SIGTERM)
        for c in streams + wholes + [short]:
            c.join(shutdown_timeout + 60)
            assert not c.is_alive()
        assert proc.wait(timeout=60) == 1
    finally:
        text = server_log(proc, log)
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
    for c in streams:
        assert c.error is None and c.status == 200, (c.error, c.lines[-3:])
        data = c.data()
        assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["code"] == "server_shutting_down", data[-3:]
        assert not [d for d in data if '"finish_reason":"length"' in d]
    for c in wholes:
        assert c.error is None and c.status == 503 and c.json["error"]["code"] == "server_shutting_down", c.json
    data = short.data()
    assert short.error is None and data[-1] == "[DONE]", data[-3:]
    chunks = [json.loads(d) for d in data[:-1]]
    assert not [c for c in chunks if "error" in c]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_sigterm_on_cuda_with_everything_in_service(tmp_path, model):
    sigterm_with_everything_in_service(tmp_path, long=LONG, short=1500, shutdown_timeout=10, **cuda(model))
