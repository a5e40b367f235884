"""KV capacity is a request limit: with `--kv-size` below `--ctx`, the context the server advertises
and enforces is what the pool holds, and a prompt that cannot fit is a 400 naming both sizes, never a
200 with an empty or silently cut answer."""

from __future__ import annotations

import httpx
import pytest

from serving import running_server
from strata.loaders import default_model_path
from strata.tokenizer import Tokenizer

FILLER = open(f"{default_model_path()}/README.md").read()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = {"ctx": 4096, "kv_size": 512, "parallel": 1, "device": "cpu", "log_level": "warning"}
    with running_server(tmp_path_factory.mktemp("kv"), config) as base:
        yield base


def test_the_pool_is_the_context(server):
    tok = Tokenizer.from_hf_dir(default_model_path())
    assert httpx.get(server + "/v1/models").json()["data"][0]["max_model_len"] == 512
    prompt = tok.decode(tok.encode(FILLER)[:701])
    n = len(tok.encode(prompt))
    r = httpx.post(server + "/v1/completions", json={"model": "strata-default", "prompt": prompt, "max_tokens": 4},
                   timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert "512 tokens" in err["message"] and f"{n + 4} tokens" in err["message"] and "KV cache" in err["message"]
    # Prompt and output that fit the pool run to their length.
    short = tok.decode(tok.encode(FILLER)[:400])
    r = httpx.post(server + "/v1/completions", json={"model": "strata-default", "prompt": short, "max_tokens": 100,
                                                     "ignore_eos": True}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 100
    assert r.json()["choices"][0]["finish_reason"] == "length"
    # Chat without max_tokens gets the rest of the pool's context, and says it stopped for length.
    r = httpx.post(server + "/v1/chat/completions", json={"model": "strata-default", "ignore_eos": True,
                                                          "messages": [{"role": "user", "content": short}]}, timeout=120)
    usage = r.json()["usage"]
    assert r.status_code == 200 and usage["total_tokens"] == 512 and r.json()["choices"][0]["finish_reason"] == "length"
