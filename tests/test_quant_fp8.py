"""FP8 weights made at load (`--quantize fp8`): e4m3 with a scale per output channel, activations
quantized per token, through torch._scaled_mm (on the CPU too), against the dequantize-then-matmul
reference and the float model."""

from __future__ import annotations

import time

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.kernels.quant import QWeight, fp8
from strata.loaders import load_model
from strata.models.attention import CausalBatch
from strata.params import SamplingParams


def test_weights_round_trip_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    w = 0.02 * torch.randn(96, 256, generator=g)
    w[3] *= 50  # rows of very different ranges keep their own scales
    q = QWeight.from_raw("FP8", w, 96, 256)
    assert q.planes["w"].dtype == torch.float8_e4m3fn and q.planes["scale"].shape == (96,)
    back = q.dequantize()
    scale = q.planes["scale"][:, None]
    # e4m3: 3 mantissa bits, so a normal value is within 2^-4 of itself; subnormals within 2^-10 of the scale.
    assert ((back - w).abs() <= w.abs() * 2**-4 + scale * 2**-9).all()
    assert q.nbytes == 96 * 256 + 96 * 4


@pytest.mark.parametrize("m,dtype", [(1, torch.float32), (5, torch.bfloat16), (40, torch.float32)])
def test_matmul_is_close_to_the_reference(m, dtype):
    g = torch.Generator().manual_seed(m)
    w = 0.02 * torch.randn(64, 128, generator=g)
    x = torch.randn(m, 128, generator=g).to(dtype)
    q = QWeight.from_raw("FP8", w, 64, 128)
    got = q.matmul(x)
    ref = fp8.matmul_ref(x, q.planes, 64, 128)
    exact = x.float() @ w.t()
    assert got.dtype == dtype and got.shape == (m, 64)
    # Per-token e4m3 activations: each product is off by up to ~2^-4, the sum by much less.
    err = ((got.float() - exact).abs().max() / exact.abs().max()).item()
    assert err < 0.05, err
    assert ((ref.float() - exact).abs().max() / exact.abs().max()).item() < 0.05


def test_load_with_fp8_keeps_the_model_close(tiny_model_dirs):
    path, _ = tiny_model_dirs["qwen3"]
    plain = load_model(path)
    lm = load_model(path, quantize="fp8")
    attn = lm.model.model.layers[0].self_attn
    mlp = lm.model.model.layers[0].mlp
    assert attn.qkv_q.ggml_type == "FP8" and mlp.gate_up_q.ggml_type == "FP8" and attn.q_proj.weight.is_meta
    ids = torch.randint(0, 320, (48,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = plain.model.compute_logits(plain.model(ids, torch.arange(48), CausalBatch(1, 48)))
        b = lm.model.compute_logits(lm.model(ids, torch.arange(48), CausalBatch(1, 48)))
    err = ((a - b).abs().max() / a.abs().max()).item()
    assert 0 < err < 0.1, err  # quantized (not equal), but close
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


def test_moe_experts_in_fp8_stay_close(tiny_model_dirs):
    """Experts in e4m3 through the grouped path (on the CPU its reference loop over experts)."""
    path, _ = tiny_model_dirs["qwen3_moe"]
    plain = load_model(path)
    lm = load_model(path, quantize="fp8")
    moe = lm.model.model.layers[0].mlp
    assert moe.fp8 is not None and moe.fp8[0].dtype == torch.float8_e4m3fn and moe.w13 is None
    assert moe.experts[0].gate_proj.weight.is_meta
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = plain.model.model.layers[0].mlp(x), moe(x)
    err = ((a - b).abs().max() / a.abs().max()).item()
    assert 0 < err < 0.08, err


def test_engine_serves_fp8(tiny_model_dirs):
    path, _ = tiny_model_dirs["qwen3_moe"]  # MoE experts stay float; attention and dense MLP go FP8
    e = LLMEngine(EngineConfig(model=path, device="cpu", quantize="fp8"), progress=False)
    e.add_request(EngineRequest("a", (5, 17, 42, 99), SamplingParams(max_tokens=8, ignore_eos=True), time.monotonic()))
    assert sum(len(ev.token_ids) for ev in e.run_to_completion()["a"]) == 8
    with pytest.raises(ValueError, match="quantize"):
        EngineConfig(quantize="int4")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 7, 16, 512])
def test_cuda_scaled_mm_matches_the_reference(m):
    g = torch.Generator(device="cuda").manual_seed(m)
    w = 0.02 * torch.randn(4096, 4096, generator=g, device="cuda")
    x = torch.randn(m, 4096, generator=g, device="cuda").to(torch.bfloat16)
    q = QWeight.from_raw("FP8", w, 4096, 4096)
    got = q.matmul(x).float()
    exact = x.float() @ w.t()
    err = ((got - exact).abs().max() / exact.abs().max()).item()
    print(f"fp8 _scaled_mm m={m}: max relative error {err:.2e}")
    assert err < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_grouped_experts_match_the_reference():
    """torch._scaled_grouped_mm over tokens sorted by expert, against the per-expert reference."""
    g = torch.Generator(device="cuda").manual_seed(0)
    e, n, k = 8, 1536, 2048
    w, scale = fp8.quantize_experts(0.02 * torch.randn(e, n, k, generator=g, device="cuda"))
    counts = [0, 5, 17, 1, 0, 64, 3, 9]
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    xs = torch.randn(sum(counts), k, generator=g, device="cuda").to(torch.bfloat16)
    got = fp8.grouped_matmul(xs, w, scale, offs).float()
    ref = fp8.grouped_matmul_ref(xs.float(), w, scale, offs)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    print(f"fp8 grouped experts: max relative error {err:.2e}")
    assert err < 0.05
