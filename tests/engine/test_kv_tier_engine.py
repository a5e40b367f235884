"""The host KV tier in the engine (embedded model, fp32, CPU): with a resident window smaller than the
prompt, greedy output is identical to a run with every block in the device pool: two slots, chunked
reads with a give-way, speculation (MTP), preemption; the prefix cache's host tier serves a hit; a
context that does not fit both tiers is refused naming the sizes."""

from __future__ import annotations

import time

import pytest

from strata.attention.reference import PagedAttention
from strata.config import EngineConfig
from strata.engine.engine import LLMEngine, RequestError
from strata.engine.types import EngineRequest
from strata.params import SamplingParams

TEXT = open(__file__.replace("tests/engine/test_kv_tier_engine.py", "strata/assets/default-model/README.md")).read()


def run(prompts, max_tokens=20, arrive=None, **kw):
    base = dict(device="cpu", ctx=1024, parallel=2, chunk_size=64, max_num_batched_tokens=128, prefix_cache=False)
    e = LLMEngine(EngineConfig(**{**base, **kw}), progress=False)
    arrive = arrive or {}
    out: dict[str, list[int]] = {}
    steps = 0
    pending = [i for i in range(len(prompts)) if i not in arrive]
    for i in pending:
        e.add_request(EngineRequest(f"r{i}", tuple(prompts[i]), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                    time.monotonic()))
    while e.has_work() or any(s >= steps for s in arrive.values()):
        for i, s in arrive.items():
            if s == steps:
                e.add_request(EngineRequest(f"r{i}", tuple(prompts[i]),
                                            SamplingParams(max_tokens=max_tokens, ignore_eos=True), time.monotonic()))
        for ev in e.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
        steps += 1
    return out, e


@pytest.fixture(scope="module")
def prompts():
    e = LLMEngine(EngineConfig(device="cpu", ctx=256), progress=False)
    ids = e.tokenizer.encode(TEXT)
    return [ids[:230], ids[300:420], ids[500:540]]


@pytest.fixture(scope="module")
def plain(prompts):
    return run(prompts[:2])[0]


def test_window_smaller_than_the_prompt_gives_identical_greedy_output(prompts, plain):
    out, e = run(prompts[:2], kv_resident=48)
    assert out == plain
    s = e.stats()
    assert s.kv_blocks_moved_total > 10 and e.runner.attn.host_rows_total > 0
    assert type(e.runner.attn.inner) is PagedAttention  # the torch reference on the CPU (Triton on CUDA)
    assert s.kv_host_blocks_used == 0  # every request finished: its host blocks are free again


def test_tier_with_int8_storage_matches_int8_without(prompts):
    base, _ = run(prompts[:1], kv="int8")
    out, _ = run(prompts[:1], kv="int8", kv_resident=32)
    assert out == base


def test_tier_through_give_way_and_preemption(prompts, plain):
    two = [prompts[0], prompts[2]]
    want, _ = run(two, arrive={1: 2}, max_num_batched_tokens=64)
    out, e = run(two, arrive={1: 2}, kv_resident=32, max_num_batched_tokens=64)
    assert out == want and e.scheduler.give_ways_total > 0
    # A device pool of 7 blocks for two slots: requests are preempted and recomputed.
    out, e = run(prompts[:2], kv_resident=32, kv_size=112)
    assert out == plain and e.scheduler.preemptions_total > 0


def test_tier_with_speculation(prompts, plain):
    out, e = run(prompts[:2], kv_resident=48, spec=3, batch_mtp=True)
    assert out == plain
    assert e.stats().spec["mean_accepted_length"] > 1.0 and e.stats().kv_blocks_moved_total > 0


def test_prefix_cache_host_tier_serves_a_hit(prompts):
    """Blocks moved to the host keep their prefix keys: a second request with the same prompt, after the
    device pool has been reused by another one, takes them from the host tier."""
    kw = dict(prefix_cache=True, kv_resident=32, parallel=1, kv_size=320, kv_host_memory=0.01)
    first, _ = run([prompts[0]], prefix_cache=False, parallel=1)
    e = LLMEngine(EngineConfig(device="cpu", ctx=1024, chunk_size=64, max_num_batched_tokens=128, **kw), progress=False)
    outs = {}
    for rid, p in (("a", prompts[0]), ("b", prompts[1]), ("c", prompts[0])):
        e.add_request(EngineRequest(rid, tuple(p), SamplingParams(max_tokens=20, ignore_eos=True), time.monotonic()))
        evs = e.run_to_completion()[rid]
        outs[rid] = ([t for ev in evs for t in ev.token_ids], evs[-1].cached_tokens)
    s = e.stats()
    assert outs["c"][0] == outs["a"][0] == first["r0"]
    assert outs["c"][1] >= 160 and s.prefix_cache_host_hits_total == 1
    assert s.prefix_cache_host_cached_tokens_total >= 160


def test_context_beyond_both_tiers_is_refused_naming_the_sizes():
    e = LLMEngine(EngineConfig(device="cpu", ctx=4096, parallel=1, chunk_size=64, kv_size=256, kv_resident=64,
                               kv_host_memory=0.0005), progress=False)
    with pytest.raises(RequestError, match="device KV pool with --kv-resident 64 .* host KV pool"):
        e.add_request(EngineRequest("x", tuple([5] * 3000), SamplingParams(max_tokens=4), time.monotonic()))
