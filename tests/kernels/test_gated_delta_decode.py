"""Gated DeltaNet's decode kernels (Triton, interpreted on the CPU) against their torch references on
fresh random inputs: state rows scattered in a pool, the rows not named left alone, two steps in a row,
key heads mapped to value heads inside the kernel, g and beta made from the raw projections inside it;
then a tiny Qwen3-Next decoding through the kernels against the reference path (logits) and HF (greedy
tokens through the engine)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import gated_delta_decode as gdd
from strata.kernels.gated_delta import causal_conv1d_step_ref
from strata.kernels.gated_delta_decode import (causal_conv1d_decode_ref, causal_conv1d_decode_triton, delta_gates,
                                               gated_delta_decode_ref, gated_delta_decode_triton,
                                               gated_delta_decode_with_gating_triton)

CUDA = torch.cuda.is_available()
interpreter_only = pytest.mark.skipif(CUDA, reason="the interpreter cases run without a GPU")
ROWS = torch.tensor([4, 0, 2])  # S=3 sequences' state rows in a pool of 6


def _delta_inputs(s, hk, hv, dk, dv, pool, dtype, seed, device="cpu"):
    """q, k, v as strided views of one projected row each, as the model's conv output hands them over;
    g fp32 (the model computes it so), beta in the model's dtype."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(s, 2 * hk * dk + hv * dv, generator=gen).to(dtype).to(device)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(s, hk, dk), k.view(s, hk, dk), v.view(s, hv, dv)
    g = (-2 * torch.rand(s, hv, generator=gen)).to(device)
    beta = torch.rand(s, hv, generator=gen).to(dtype).to(device)
    states = (0.3 * torch.randn(pool, hv, dk, dv, generator=gen)).to(device)
    return q, k, v, g, beta, states


def _tols(dtype):
    # fp32: summation order only. bf16: the output's one rounding may flip by an ulp (2^-8 relative).
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)


@interpreter_only
@pytest.mark.parametrize("dtype,dv,block_dv,index_dtype", [(torch.float32, 32, 16, torch.int64),
                                                           (torch.bfloat16, 64, 16, torch.int32),
                                                           (torch.float32, 48, 32, torch.int32),
                                                           (torch.bfloat16, 32, 16, torch.int64)])
def test_delta_kernel_matches_reference_twice(dtype, dv, block_dv, index_dtype):
    index = ROWS.to(index_dtype)
    q, k, v, g, beta, states = _delta_inputs(3, 2, 4, 32, dv, 6, dtype, seed=dv + block_dv)
    before, ref_states = states.clone(), states.clone()
    for step in range(2):  # the second step starts from the states the first wrote
        if step:
            q, k, v, g, beta, _ = _delta_inputs(3, 2, 4, 32, dv, 6, dtype, seed=99)
        ref = gated_delta_decode_ref(q, k, v, g, beta, ref_states, index)
        got = gated_delta_decode_triton(q, k, v, g, beta, states, index, block_dv=block_dv)
        assert got.dtype == v.dtype and got.shape == v.shape
        torch.testing.assert_close(got.float(), ref.float(), **_tols(dtype))
        torch.testing.assert_close(states, ref_states, rtol=1e-5, atol=1e-5)
    untouched = [r for r in range(6) if r not in ROWS.tolist()]
    assert torch.equal(states[untouched], before[untouched])


@interpreter_only
def test_delta_kernel_writes_into_out_and_maps_key_heads():
    """Value head h reads key head h // (Hv/Hk): the same as the reference on keys repeated by hand."""
    q, k, v, g, beta, states = _delta_inputs(3, 2, 4, 32, 32, 6, torch.float32, seed=5)
    ref_states = states.clone()
    out = torch.full_like(v, float("nan"))
    got = gated_delta_decode_triton(q, k, v, g, beta, states, ROWS, out=out)
    assert got is out
    ref_q, ref_k = q.repeat_interleave(2, dim=1), k.repeat_interleave(2, dim=1)
    ref = gated_delta_decode_ref(ref_q, ref_k, v, g, beta, ref_states, ROWS)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, ref_states, rtol=1e-5, atol=1e-5)


def _gate_inputs(s, hk, hv, dtype, seed, grouped, device="cpu"):
    """a, b as views of one projected row, as the model splits it: [S, Hk, Hv/Hk] per key head
    (`grouped`) or [S, Hv] column blocks; a spans softplus's threshold (20) and far below zero, b
    saturates the sigmoid both ways. A_log, dt_bias [Hv] in the model's dtype, as loaded."""
    gen = torch.Generator().manual_seed(seed)
    r = hv // hk
    a, b = 4 * torch.randn(s, hv, generator=gen), 4 * torch.randn(s, hv, generator=gen)
    n = a.view(-1)[::2].numel()
    a.view(-1)[::2] = torch.tensor([25.0, -100.0, 20.5, -30.0, 300.0, -1e4]).repeat(n)[:n]
    n = b.view(-1)[1::3].numel()
    b.view(-1)[1::3] = torch.tensor([-1000.0, 40.0, -17.0, 60.0]).repeat(n)[:n]
    a, b = a.to(dtype).to(device), b.to(dtype).to(device)
    if grouped:
        ba = torch.cat([b.view(s, hk, r), a.view(s, hk, r)], dim=-1)
        b, a = ba[..., :r], ba[..., r:]
    else:
        ba = torch.cat([b, a], dim=1)
        b, a = ba[:, :hv], ba[:, hv:]
    a_log = (torch.rand(hv, generator=gen) * 2.5 - 2).to(dtype).to(device)
    dt_bias = (0.5 * torch.randn(hv, generator=gen)).to(dtype).to(device)
    return a, b, a_log, dt_bias


def _model_gates(a, b, a_log, dt_bias):
    """The model's gates as its torch lines wrote them, before the kernel made them."""
    a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    beta = b.sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


@interpreter_only
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # sigmoid(-1000): exp(1000) is inf, as in torch
@pytest.mark.parametrize("dtype,grouped", [(torch.float32, True), (torch.bfloat16, True),
                                           (torch.float32, False), (torch.bfloat16, False)])
def test_gating_kernel_matches_torch_gates_twice(dtype, grouped):
    """The fused-gating entry against torch's g, beta and the reference step. The states' 1e-5 bound
    also pins the gates: an error in g scales the whole decayed state, and a bf16 beta left unrounded
    (2^-9 relative) moves every written column by far more than 1e-5."""
    index = ROWS.int()
    q, k, v, _, _, states = _delta_inputs(3, 2, 4, 32, 32, 6, dtype, seed=7)
    before, ref_states = states.clone(), states.clone()
    for step in range(2):
        if step:
            q, k, v, *_ = _delta_inputs(3, 2, 4, 32, 32, 6, dtype, seed=8)
        a, b, a_log, dt_bias = _gate_inputs(3, 2, 4, dtype, seed=10 * step + grouped, grouped=grouped)
        g, beta = _model_gates(a, b, a_log, dt_bias)
        assert (g < -20 * a_log.float().exp()).any() and (g.abs() < 1e-10).any()  # both softplus regimes
        assert beta.dtype == dtype and (beta == 0).any() and (beta == 1).any()
        ours = delta_gates(a, b, a_log, dt_bias)
        assert torch.equal(ours[0], g) and torch.equal(ours[1], beta)
        ref = gated_delta_decode_ref(q, k, v, g, beta, ref_states, index)
        got = gated_delta_decode_with_gating_triton(q, k, v, a, b, a_log, dt_bias, states, index, block_dv=16)
        torch.testing.assert_close(got.float(), ref.float(), **_tols(dtype))
        torch.testing.assert_close(states, ref_states, rtol=1e-5, atol=1e-5)
    untouched = [r for r in range(6) if r not in ROWS.tolist()]
    assert torch.equal(states[untouched], before[untouched])


def test_gating_entry_refuses_misshapen_gates():
    q, k, v, _, _, states = _delta_inputs(3, 2, 4, 32, 32, 6, torch.float32, seed=1)
    a, b, a_log, dt_bias = _gate_inputs(3, 2, 4, torch.float32, seed=1, grouped=True)
    with pytest.raises(ValueError, match="a: expected"):
        gated_delta_decode_with_gating_triton(q, k, v, a[:, :1], b, a_log, dt_bias, states, ROWS)
    with pytest.raises(ValueError, match="A_log, dt_bias"):
        gated_delta_decode_with_gating_triton(q, k, v, a, b, a_log[:2], dt_bias, states, ROWS)


def _conv_inputs(s, c, k, pool, dtype, pool_dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(s, c, generator=gen).to(dtype).to(device)
    w = torch.randn(c, k, generator=gen).to(dtype).to(device)
    conv_pool = torch.randn(pool, c, k - 1, generator=gen).to(pool_dtype).to(device)
    return x, w, conv_pool


@interpreter_only
@pytest.mark.parametrize("dtype,pool_dtype,c,k", [(torch.float32, torch.float32, 200, 4),
                                                  (torch.bfloat16, torch.bfloat16, 96, 4),
                                                  (torch.bfloat16, torch.float32, 40, 3),
                                                  (torch.float32, torch.float32, 24, 2)])
def test_conv_kernel_matches_reference_twice(dtype, pool_dtype, c, k):
    x, w, conv_pool = _conv_inputs(3, c, k, 6, dtype, pool_dtype, seed=c)
    before, ref_pool = conv_pool.clone(), conv_pool.clone()
    for step in range(2):
        if step:
            x = _conv_inputs(3, c, k, 6, dtype, pool_dtype, seed=c + 1)[0]
        ref = causal_conv1d_decode_ref(x, w, ref_pool, ROWS)
        # The reference multiplies and sums in the weight's dtype; the kernel in fp32, rounded once.
        exact, _ = causal_conv1d_step_ref(x, w.float(), conv_pool[ROWS])
        got = causal_conv1d_decode_triton(x, w, conv_pool, ROWS.int() if step else ROWS)
        assert got.dtype == x.dtype
        torch.testing.assert_close(got.float(), exact.float(), **_tols(dtype))
        torch.testing.assert_close(got.float(), ref.float(), **(_tols(dtype) if dtype == torch.float32
                                                                 else dict(rtol=3e-2, atol=3e-2)))
        assert torch.equal(conv_pool, ref_pool)  # windows are moved, never computed
    untouched = [r for r in range(6) if r not in ROWS.tolist()]
    assert torch.equal(conv_pool[untouched], before[untouched])


# ---- a tiny Qwen3-Next through the kernels -----------------------------------------------------------

def _force_kernels(monkeypatch) -> dict[str, int]:
    """The model's decode branch dispatches on `use_triton` (CUDA only); under the interpreter the
    same kernels run on CPU tensors. Returns the call counts, filled as the kernels run, with those of
    the model's torch gates (`model_gates`: its reads need them, its kernel decode steps must not)."""
    from strata.models import qwen3_next

    monkeypatch.setattr(gdd, "use_triton", lambda t: True)
    calls = {}
    for module, name, key in ((gdd, "causal_conv1d_decode_triton", None), (gdd, "gated_delta_decode_triton", None),
                              (gdd, "gated_delta_decode_with_gating_triton", None),
                              (qwen3_next, "delta_gates", "model_gates")):
        def counted(*args, _fn=getattr(module, name), _key=key or name, **kw):
            calls[_key] = calls.get(_key, 0) + 1
            return _fn(*args, **kw)
        monkeypatch.setattr(module, name, counted)
    return calls


@interpreter_only
def test_tiny_model_decode_step_logits_match_reference(tiny_model_dirs, monkeypatch):
    from strata.loaders import load_model
    from strata.attention import ContiguousKV

    path, hf = tiny_model_dirs["qwen3_next"]
    model = load_model(path, device="cpu", dtype=torch.float32, progress=False).model
    cfg = model.config
    cache = ContiguousKV(model.num_attention_layers, 64, cfg.num_key_value_heads, cfg.head_dim, "cpu", torch.float32)
    cache.states = model.new_states(4, "cpu", torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(1))
    slot = 2

    def forward(tokens, start):
        cache.step(start, len(tokens))
        cache.states.set_spans([(0, len(tokens), slot, start == 0, False)])
        with torch.inference_mode():
            return model.compute_logits(model(tokens, torch.arange(start, start + len(tokens)), cache)[-1:])[0]

    forward(ids[:20], 0)  # the prompt, through the reference read path
    saved = [t.clone() for t in (cache.k, cache.v, cache.states.conv_states, cache.states.recurrent_states)]
    ref = forward(ids[20:], 20)
    ref_states = (cache.states.conv_states.clone(), cache.states.recurrent_states.clone())
    for t, s in zip((cache.k, cache.v, cache.states.conv_states, cache.states.recurrent_states), saved):
        t.copy_(s)
    calls = _force_kernels(monkeypatch)
    got = forward(ids[20:], 20)
    linear_layers = cache.states.conv_states.shape[0]
    # one launch each per linear layer, the gates made inside the delta kernel (no torch gates)
    assert calls == {"causal_conv1d_decode_triton": linear_layers,
                     "gated_delta_decode_with_gating_triton": linear_layers}
    # fp32 throughout: the kernels differ from the references by summation order only.
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.states.conv_states, ref_states[0])
    torch.testing.assert_close(cache.states.recurrent_states, ref_states[1], rtol=1e-5, atol=1e-5)


@interpreter_only
def test_tiny_model_engine_greedy_through_kernels_matches_hf(tiny_model_dirs, monkeypatch):
    from strata.config import EngineConfig
    from strata.engine.engine import LLMEngine
    from strata.engine.types import EngineRequest
    from strata.params import SamplingParams

    path, hf = tiny_model_dirs["qwen3_next"]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (9, 23)]
    new = 5
    with torch.no_grad():
        refs = [hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    calls = _force_kernels(monkeypatch)
    e = LLMEngine(EngineConfig(model=path, device="cpu", ctx=128, parallel=3, chunk_size=64,
                               max_num_batched_tokens=128), progress=False)
    for i, p in enumerate(prompts):
        e.add_request(EngineRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=new, ignore_eos=True),
                                    time.monotonic()))
    got = e.run_to_completion()
    assert [[t for ev in got[f"r{i}"] for t in ev.token_ids] for i in range(len(prompts))] == refs
    decode_calls = calls["gated_delta_decode_with_gating_triton"]
    assert decode_calls >= 3 * (new - 1)  # every decode step of the 3 linear layers
    assert "gated_delta_decode_triton" not in calls
    assert calls["model_gates"] >= 3  # the prompt reads still make them in torch


# ---- the 80B-A3B shape on the device ------------------------------------------------------------------

def _cuda_ms(fn, reps=50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("s", [1, 8, 64])
def test_cuda_80b_shape_matches_reference(s):
    """Qwen3-Next-80B-A3B's linear attention: Hk=16, Hv=32, Dk=Dv=128, conv over 8192 channels, K=4;
    bf16 inputs, rows scattered in a pool of 80. The fused-gating entry against torch's gates; the
    kernel follows torch's CUDA gate arithmetic (libdevice), so it should give the g/beta entry's bits
    (printed, not asserted). Prints kernel vs reference times (not asserted)."""
    dtype, pool = torch.bfloat16, 80
    index = torch.randperm(pool, generator=torch.Generator().manual_seed(s))[:s].cuda()
    q, k, v, g, beta, states = _delta_inputs(s, 16, 32, 128, 128, pool, dtype, seed=s, device="cuda")
    ref_states = states.clone()
    for _ in range(2):
        ref = gated_delta_decode_ref(q, k, v, g, beta, ref_states, index)
        got = gated_delta_decode_triton(q, k, v, g, beta, states, index)
        torch.testing.assert_close(got.float(), ref.float(), **_tols(dtype))
        torch.testing.assert_close(states, ref_states, rtol=1e-5, atol=1e-5)
    a, b, a_log, dt_bias = _gate_inputs(s, 16, 32, dtype, seed=s, grouped=True, device="cuda")
    g, beta = _model_gates(a, b, a_log, dt_bias)
    gated_states, plain_states = ref_states.clone(), ref_states.clone()
    for _ in range(2):
        ref = gated_delta_decode_ref(q, k, v, g, beta, ref_states, index)
        plain = gated_delta_decode_triton(q, k, v, g, beta, plain_states, index)
        got = gated_delta_decode_with_gating_triton(q, k, v, a, b, a_log, dt_bias, gated_states, index)
        torch.testing.assert_close(got.float(), ref.float(), **_tols(dtype))
        torch.testing.assert_close(gated_states, ref_states, rtol=1e-5, atol=1e-5)
    same_bits = torch.equal(got, plain) and torch.equal(gated_states, plain_states)
    x, w, conv_pool = _conv_inputs(s, 8192, 4, pool, dtype, dtype, seed=s, device="cuda")
    ref_pool = conv_pool.clone()
    for _ in range(2):
        exact, _ = causal_conv1d_step_ref(x, w.float(), conv_pool[index])
        ref = causal_conv1d_decode_ref(x, w, ref_pool, index)
        got = causal_conv1d_decode_triton(x, w, conv_pool, index)
        torch.testing.assert_close(got.float(), exact.float(), **_tols(dtype))
        torch.testing.assert_close(got.float(), ref.float(), rtol=3e-2, atol=3e-2)
        assert torch.equal(conv_pool, ref_pool)
    times = {
        "delta kernel": _cuda_ms(lambda: gated_delta_decode_triton(q, k, v, g, beta, states, index)),
        "delta ref": _cuda_ms(lambda: gated_delta_decode_ref(q, k, v, g, beta, ref_states, index)),
        "delta+gates kernel": _cuda_ms(lambda: gated_delta_decode_with_gating_triton(q, k, v, a, b, a_log, dt_bias,
                                                                                   states, index)),
        "torch gates": _cuda_ms(lambda: _model_gates(a, b, a_log, dt_bias)),
        "conv kernel": _cuda_ms(lambda: causal_conv1d_decode_triton(x, w, conv_pool, index)),
        "conv ref": _cuda_ms(lambda: causal_conv1d_decode_ref(x, w, ref_pool, index)),
    }
    print(f"gated delta decode S={s}: " + ", ".join(f"{n} {ms * 1e3:.1f} us" for n, ms in times.items())
          + f"; fused gates give the torch-gates kernel's bits: {same_bits}")
