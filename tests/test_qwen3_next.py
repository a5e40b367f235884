"""Qwen3-Next (hybrid Gated DeltaNet + gated attention MoE) on a tiny random checkpoint, fp32, CPU:
the delta-rule and conv references against their definitions and HF's, and the serving engine's
greedy output against HF's alone, batched, chunked, through a give-way and through a preemption."""

from __future__ import annotations

import time

import pytest
import torch

from strata.config import EngineConfig, ModelConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.kernels.gated_delta import (causal_conv1d_ref, causal_conv1d_step_ref, gated_delta_chunked_ref,
                                        gated_delta_step_ref)
from strata.kvcache.state_pool import StatePool
from strata.params import SamplingParams

NEW_TOKENS = 12


def _inputs(n, h=3, dk=16, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, h, dk, generator=g), torch.randn(n, h, dk, generator=g)
    v = torch.randn(n, h, dv, generator=g)
    decay = -2 * torch.rand(n, h, generator=g)
    beta = torch.rand(n, h, generator=g)
    return q, k, v, decay, beta, 0.3 * torch.randn(h, dk, dv, generator=g)


@pytest.mark.parametrize("n,chunk", [(1, 64), (37, 8), (150, 64), (64, 64)])
def test_chunked_delta_rule_equals_the_token_recurrence(n, chunk):
    q, k, v, g, b, s0 = _inputs(n, seed=n)
    out, state = gated_delta_chunked_ref(q, k, v, g, b, s0, chunk=chunk)
    s, steps = s0[None], []
    for t in range(n):
        o, s = gated_delta_step_ref(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], b[t : t + 1], s)
        steps.append(o)
    torch.testing.assert_close(out, torch.cat(steps), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, s[0], rtol=1e-5, atol=1e-5)


def test_delta_rule_split_anywhere_carries_its_state():
    q, k, v, g, b, _ = _inputs(100, seed=7)
    whole, s_whole = gated_delta_chunked_ref(q, k, v, g, b, None)
    a, s_a = gated_delta_chunked_ref(q[:45], k[:45], v[:45], g[:45], b[:45], None, chunk=16)
    c, s_c = gated_delta_chunked_ref(q[45:], k[45:], v[45:], g[45:], b[45:], s_a, chunk=32)
    torch.testing.assert_close(torch.cat([a, c]), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_c, s_whole, rtol=1e-5, atol=1e-5)


def test_delta_rule_matches_hf_reference():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    q, k, v, g, b, s0 = _inputs(80, seed=3)
    ref, ref_state = torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], b[None], initial_state=s0[None],
                                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, state = gated_delta_chunked_ref(q, k, v, g, b, s0, chunk=32)
    torch.testing.assert_close(out, ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state[0], rtol=1e-5, atol=1e-5)


def test_conv_in_pieces_and_steps_equals_whole():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(30, 12, generator=g), torch.randn(12, 4, generator=g)
    whole, st_whole = causal_conv1d_ref(x, w, None)
    a, st = causal_conv1d_ref(x[:11], w, None)
    outs = [a]
    for t in range(11, 30):
        o, st = causal_conv1d_step_ref(x[t : t + 1], w, st[None])
        st = st[0]
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), whole)
    torch.testing.assert_close(st, st_whole)
    ref = torch.nn.functional.silu(torch.nn.functional.conv1d(x.t()[None], w[:, None], padding=3, groups=12)[0, :, :30]).t()
    torch.testing.assert_close(whole, ref)


def test_layer_types_from_the_interval():
    d = dict(model_type="qwen3_next", vocab_size=8, hidden_size=8, num_hidden_layers=8, num_attention_heads=2,
             full_attention_interval=4)
    cfg = ModelConfig.from_hf(d)
    assert [cfg.layer_is_linear(i) for i in range(8)] == [True, True, True, False] * 2
    assert cfg.is_hybrid and cfg.num_full_attention_layers == 2
    assert not ModelConfig.from_hf({**d, "model_type": "qwen3"}).is_hybrid


# ---- the serving engine ------------------------------------------------------------------------------

PROMPT_LENS = (40, 7, 130, 300)


@pytest.fixture(scope="module")
def next_model(tiny_model_dirs):
    path, hf = tiny_model_dirs["qwen3_next"]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    return path, prompts, refs


def _engine(path, **kw) -> LLMEngine:
    base = dict(model=path, device="cpu", ctx=512, parallel=1, chunk_size=512, max_num_batched_tokens=1024)
    return LLMEngine(EngineConfig(**{**base, **kw}), progress=False)


def _req(rid, ids, n=NEW_TOKENS):
    return EngineRequest(rid, tuple(ids), SamplingParams(max_tokens=n, ignore_eos=True), time.monotonic())


def _run(e: LLMEngine, prompts) -> list[list[int]]:
    for i, p in enumerate(prompts):
        e.add_request(_req(f"r{i}", p))
    got = e.run_to_completion()
    return [[t for ev in got[f"r{i}"] for t in ev.token_ids] for i in range(len(prompts))]


def test_engine_alone_matches_hf(next_model):
    path, prompts, refs = next_model
    e = _engine(path)
    assert isinstance(e.states, StatePool) and e.pool.num_layers == 1  # K/V for the one full-attention layer
    assert not e.scheduler.config.prefix_cache
    for p, ref in zip(prompts, refs):
        assert _run(e, [p]) == [ref]


def test_engine_batched_and_chunked_match_hf(next_model):
    path, prompts, refs = next_model
    assert _run(_engine(path, parallel=4), prompts) == refs
    assert _run(_engine(path, parallel=3, chunk_size=8, max_num_batched_tokens=24), prompts) == refs


def test_give_way_keeps_the_long_output(next_model):
    path, prompts, refs = next_model
    e = _engine(path, parallel=2, chunk_size=32, max_num_batched_tokens=48)
    e.add_request(_req("long", prompts[3]))
    out, order, steps = {}, [], 0
    while e.has_work():
        if steps == 2:
            e.add_request(_req("short", prompts[1]))
        for ev in e.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finish_reason:
                order.append(ev.request_id)
        steps += 1
    assert e.scheduler.give_ways_total >= 1 and order[0] == "short"
    assert out["long"] == refs[3] and out["short"] == refs[1]


def test_preemption_recomputes_the_state(next_model):
    path, prompts, refs = next_model
    # The three prompts' K/V fit, their growth does not: one is preempted and read again from its
    # start, its slot's state meanwhile written by others.
    e = _engine(path, parallel=4, kv_size=208, block_size=16)
    assert _run(e, prompts[:3]) == refs[:3]
    assert e.scheduler.preemptions_total >= 1


def test_spec_is_refused_with_a_reason(next_model):
    with pytest.raises(ValueError, match="--spec"):
        _engine(next_model[0], spec=2)
