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
from strata.models.qwen3_next import GatedDeltaNet
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


def test_varlen_equals_one_call_per_sequence():
    from strata.kernels.gated_delta import gated_delta_varlen

    lengths = [5, 70, 1]
    q, k, v, g, b, _ = _inputs(sum(lengths), seed=11)
    states = torch.stack([torch.zeros(3, 16, 8), 0.3 * torch.randn(3, 16, 8), 0.3 * torch.randn(3, 16, 8)])
    out, finals = gated_delta_varlen(q, k, v, g, b, lengths, states)
    r0 = 0
    for i, n in enumerate(lengths):
        o, s = gated_delta_chunked_ref(q[r0 : r0 + n], k[r0 : r0 + n], v[r0 : r0 + n], g[r0 : r0 + n], b[r0 : r0 + n],
                                       states[i])
        torch.testing.assert_close(out[r0 : r0 + n], o)
        torch.testing.assert_close(finals[i], s)
        r0 += n


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


def tiny_next_config(**overrides) -> ModelConfig:
    """A small qwen3_next config for one-layer tests (one full-attention layer in four)."""
    base = dict(model_type="qwen3_next", vocab_size=16, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4, intermediate_size=16,
                full_attention_interval=4)
    return ModelConfig.from_hf({**base, **overrides})


def randomized(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """`module` frozen, every parameter drawn from 0.3 · N(0, 1) (its zero or one inits would hide
    layout mistakes)."""
    torch.manual_seed(seed)
    module.requires_grad_(False)
    for p in module.parameters():
        p.copy_(0.3 * torch.randn_like(p))
    return module


def test_packed_projection_gives_the_same_layer_output():
    """`GatedDeltaNet.pack` reorders in_proj_qkvz's rows so that q|k|v and z are views of its output:
    the layer's output (a decode step and a chunk, fresh states each) is the same as before packing."""
    cfg = tiny_next_config()
    layer = randomized(GatedDeltaNet(cfg, 0))
    x = torch.randn(7, 32)

    def run():
        """A 4-token chunk from a fresh state, then two decode steps of two sequences each."""
        states = StatePool.for_model(cfg, 3, "cpu", torch.float32, 0, 4)
        outs = []
        for slot in (0, 1):
            states.set_spans([(0, 4, slot, True, False)])
            outs.append(layer(x[slot : slot + 4], states))
        for t in range(2):
            states.set_spans([(0, 1, 1, False, False), (1, 1, 0, False, False)])
            outs.append(layer(x[3 + t : 5 + t], states))
        return outs

    before = run()
    layer.pack()
    assert layer.in_proj_weight is not None
    assert layer.in_proj_qkvz.weight.data_ptr() == layer.in_proj_weight.data_ptr()  # a view, no second copy
    for got, ref in zip(run(), before):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


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
    linear_layers = [m for m in e.model.modules() if isinstance(m, GatedDeltaNet)]
    assert linear_layers and all(m.in_proj_weight is not None for m in linear_layers)  # packed: one projection
    assert not e.scheduler.config.prefix_cache
    for p, ref in zip(prompts, refs):
        assert _run(e, [p]) == [ref]


def test_engine_batched_and_chunked_match_hf(next_model):
    path, prompts, refs = next_model
    assert _run(_engine(path, parallel=4), prompts) == refs
    assert _run(_engine(path, parallel=3, chunk_size=8, max_num_batched_tokens=24), prompts[:3]) == refs[:3]
    # Two batch groups stepped in turn, one launched before the other is collected.
    assert _run(_engine(path, parallel=4, batch_groups=2, overlap=True), prompts[:3]) == refs[:3]


def test_concurrent_read_matches_hf(next_model, monkeypatch):
    """Reads on their own stage (STRATA_PIPED_CONCURRENT): its runner has its own view of the states."""
    path, prompts, refs = next_model
    monkeypatch.setenv("STRATA_PIPED_CONCURRENT", "1")
    e = _engine(path, parallel=3, chunk_size=16, max_num_batched_tokens=32)
    assert e.read_stage is not None and e.read_stage.runner.attn.states is not e.runner.attn.states
    assert _run(e, prompts) == refs
    e.close()


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


# ---- the MTP head and speculation ------------------------------------------------------------------

def _zc_rms(x, w, eps=1e-6):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


@pytest.fixture(scope="module")
def mtp_dir(tiny_model_dirs, tmp_path_factory):
    """The tiny checkpoint plus random `mtp.*` tensors and `num_nextn_predict_layers: 1`, as Qwen3-Next
    checkpoints store the draft head (HF's class drops it on save)."""
    import json

    from safetensors.torch import load_file, save_file

    from strata.models.registry import build_model

    src, hf = tiny_model_dirs["qwen3_next"]
    out = tmp_path_factory.mktemp("next_mtp")
    conf = json.load(open(f"{src}/config.json"))
    conf["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(conf))
    torch.manual_seed(4)
    donor = build_model(ModelConfig.from_hf(conf), with_mtp=True)
    mtp_sd = {k: v for k, v in donor.state_dict().items() if k.startswith("mtp.")}
    for k, v in mtp_sd.items():
        v.copy_(0.1 * torch.randn_like(v) if k.endswith("norm.weight") else 0.05 * torch.randn_like(v))
    tensors = load_file(f"{src}/model.safetensors")
    save_file({**tensors, **mtp_sd}, str(out / "model.safetensors"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes(open(f"{src}/{f}", "rb").read())
    return str(out), hf, tensors, mtp_sd


def test_mtp_head_matches_its_formula(mtp_dir):
    """fc([norm_e(embed(t_{i+1})); norm_h(h_i)]) → HF's full-attention block → norm → lm_head."""
    from test_models import _fuse_experts
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

    from strata.loaders import load_model
    from strata.attention import CausalBatch

    path, hf, tensors, sd = mtp_dir
    lm = load_model(path)
    assert lm.has_mtp and len(lm.model.mtp_layers) == 1 and lm.model.num_attention_layers == 2
    t = 20
    ids = torch.randint(0, hf.config.vocab_size, (t + 1,))
    pos = torch.arange(t)
    with torch.no_grad():
        h_main = hf.model(ids[None, :t]).last_hidden_state[0]
        _, ours = lm.model.mtp_forward(h_main, ids[1:], pos, CausalBatch(1, t))
        emb = tensors["model.embed_tokens.weight"][ids[1:]]
        x = torch.cat([_zc_rms(emb, sd["mtp.pre_fc_norm_embedding.weight"]),
                       _zc_rms(h_main, sd["mtp.pre_fc_norm_hidden.weight"])], -1) @ sd["mtp.fc.weight"].T
        hf.config.layer_types = list(hf.config.layer_types) + ["full_attention"]
        n = hf.config.num_hidden_layers
        block = Qwen3NextDecoderLayer(hf.config, layer_idx=n).eval()
        p = "mtp.layers.0."
        block.load_state_dict(_fuse_experts({k[len(p):]: v for k, v in sd.items() if k.startswith(p)}), strict=True)
        hf.config.layer_types = hf.config.layer_types[:n]
        cos_sin = hf.model.rotary_emb(x[None], pos[None])
        mask = torch.full((t, t), -torch.inf).triu(1)[None, None]
        y = block(x[None], position_embeddings=cos_sin, attention_mask=mask, position_ids=pos[None])
        y = y[0] if isinstance(y, tuple) else y
        ref = _zc_rms(y[0], sd["mtp.norm.weight"]) @ tensors["lm_head.weight"].T
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-4, err


@pytest.mark.parametrize("kw", [dict(spec=2), dict(spec=3, parallel=3, chunk_size=16, max_num_batched_tokens=64),
                                dict(spec=2, concurrent=True)])
def test_speculation_output_equals_plain(mtp_dir, next_model, monkeypatch, kw):
    """Drafts from an oracle that knows the plain output, right or wrong by a fixed pattern: all
    accepted, only the first, or none. A linear layer's state then goes back to the row of the last
    accepted draft (or stays), and the output must still be the plain greedy one."""
    _speculate_with_the_oracle(mtp_dir, next_model, monkeypatch, dict(kw))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_speculation_output_equals_plain(mtp_dir, next_model, monkeypatch):
    """The same on CUDA in fp32: verification rows through the delta-rule kernel, rolled back by row."""
    _speculate_with_the_oracle(mtp_dir, next_model, monkeypatch, dict(spec=2, device="cuda", dtype="float32"))


def _speculate_with_the_oracle(mtp_dir, next_model, monkeypatch, kw):
    from strata.speculative import drafter as drafter_mod

    path = mtp_dir[0]
    _, prompts, refs = next_model
    expected = {tuple(p): r for p, r in zip(prompts, refs)}
    depth: dict[str, tuple[int, int]] = {}

    def oracle(self, reqs, rows, logits, top, top_p):
        out = []
        for r in reqs:
            done = len(r.output_ids)
            prev = depth.get(r.request_id)
            d = prev[1] + 1 if prev and prev[0] == done else 0
            depth[r.request_id] = (done, d)
            ref = expected[tuple(r.prompt_ids)]
            tok = ref[done + d] if done + d < len(ref) else 0
            right = done % 3 == 0 or (done % 3 == 1 and d == 0)
            out.append((tok if right else (tok + 1) % logits.shape[-1], 1.0, None))
        return out

    monkeypatch.setattr(drafter_mod.MTPDrafter, "_picks", oracle)
    if kw.pop("concurrent", False):  # reads on their own stage, drafts verified on the decode lane
        monkeypatch.setenv("STRATA_PIPED_CONCURRENT", "1")
    e = _engine(path, **{"parallel": 2, **kw})
    assert _run(e, prompts) == refs
    st = e.stats().spec
    assert 0 < st["drafts_accepted"] < st["drafts_proposed"]


def test_speculation_with_the_random_head_equals_plain(mtp_dir, next_model):
    path = mtp_dir[0]
    _, prompts, refs = next_model
    assert _run(_engine(path, parallel=4, spec=2), prompts) == refs


def test_80b_shape_counts():
    """The bench shape holds Qwen3-Next-80B-A3B's published size, and its per-slot state is what the
    layers need: 36 linear layers x (conv window 8192 x 3 in bf16 + 32 x 128 x 128 fp32)."""
    from strata.bench import roofline
    from strata.bench.random_model import shape_config

    cfg = shape_config("qwen3-next-80b-a3b")
    assert 79e9 < roofline.total_params(cfg) < 81e9
    assert cfg.num_full_attention_layers == 12
    assert StatePool.bytes_per_state(cfg, torch.bfloat16) == 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_matches_hf(next_model):
    """The serving engine on CUDA in fp32 equals HF, its decode steps replaying graphs that update the
    linear-attention states of the slots they name; in bf16 its agreement with HF fp32 is printed."""
    path, prompts, refs = next_model
    e = _engine(path, device="cuda", dtype="float32", parallel=4)
    assert e.runner.graphs
    assert _run(e, prompts) == refs
    got = _run(_engine(path, device="cuda", dtype="bfloat16", parallel=4), prompts)
    same = sum(a == b for g, r in zip(got, refs) for a, b in zip(g, r))
    print(f"qwen3_next cuda bf16 engine: {same}/{sum(map(len, refs))} tokens equal HF fp32")
