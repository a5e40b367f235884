"""The host KV tier through the server: a prompt beyond what both tiers hold is a 400 naming the device
and host pools' sizes; a prefix served from the host tier of the prefix cache is counted in the answer's
`usage.prompt_tokens_details.cached_tokens` and on `/metrics`."""

from __future__ import annotations

import re

import httpx
import pytest

from serving import running_server
from strata.loaders import default_model_path
from strata.tokenizer import Tokenizer

TEXT = open(f"{default_model_path()}/README.md").read()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = {"ctx": 4096, "kv_size": 320, "kv_resident": 32, "kv_host_memory": 0.004, "parallel": 1,
              "chunk_size": 64, "max_num_batched_tokens": 128, "device": "cpu", "log_level": "warning"}
    with running_server(tmp_path_factory.mktemp("kv_tier"), config) as base:
        yield base


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_a_context_beyond_both_tiers_is_a_400_naming_their_sizes(server):
    r = httpx.post(server + "/v1/completions", json={"model": "strata-default", "prompt": [5] * 1000, "max_tokens": 4},
                   timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert re.search(r"320 tokens in the device KV pool with --kv-resident 32 \+ \d+ in the host KV pool",
                     err["message"]), err["message"]


def test_a_host_tier_hit_is_counted_in_usage_and_metrics(server):
    """A prompt read once moves its blocks to the host (window of 32 tokens); after another prompt has
    reused the device pool, the same prompt again takes them from the host tier."""
    ids = Tokenizer.from_hf_dir(default_model_path()).encode(TEXT)
    first, other = ids[:230], ids[300:420]

    def complete(prompt):
        body = {"model": "strata-default", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(server + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    a = complete(first)
    complete(other)
    again = complete(first)
    assert again["choices"][0]["text"] == a["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 160
    metrics = httpx.get(server + "/metrics", timeout=10).text
    assert _metric(metrics, "strata_prefix_cache_host_hits_total") == 1
    assert _metric(metrics, "strata_prefix_cache_host_cached_tokens_total") >= 160
    assert _metric(metrics, "strata_kv_blocks_moved_total") > 10
    assert _metric(metrics, "strata_kv_host_blocks_total") > 0
