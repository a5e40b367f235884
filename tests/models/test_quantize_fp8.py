"""FP8 weights made at load (`--quantize fp8`): e4m3 with a scale per output channel, against the
dequantize-then-matmul reference and the float model. Reads: activations quantized per token, through
torch._scaled_mm (on the CPU too). Decode (1-16 rows): the weight-only GEMV, in the interpreter on the
CPU; on the GPU (`pytest -m gpu`) at 8B shapes, with CUDA-graph replay (timings:
benchmarks/kernels/fp8.py)."""

from __future__ import annotations

import time

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.kernels.gemv import GemvConfig
from strata.kernels.quant import QWeight, fp8
from strata.loaders import load_model
from strata.attention import CausalBatch
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
    # The down projection from gate|up (n = 2 x 768): bitwise the two steps.
    from strata.kernels.activation import silu_mul

    w2, s2 = fp8.quantize_experts(0.02 * torch.randn(e, 512, n // 2, generator=g, device="cuda"))
    h13 = torch.randn(sum(counts), n, generator=g, device="cuda").to(torch.bfloat16)
    assert torch.equal(fp8.grouped_silu_mul_matmul(h13, w2, s2, offs), fp8.grouped_matmul(silu_mul(h13), w2, s2, offs))


def test_grouped_silu_mul_matmul_is_the_two_steps_here():
    """Off CUDA (and in fp32) the experts' down projection from gate|up is the two steps."""
    from strata.kernels.activation import silu_mul

    g = torch.Generator().manual_seed(1)
    w2, s2 = fp8.quantize_experts(0.1 * torch.randn(3, 16, 32, generator=g))
    offs = torch.tensor([4, 4, 9], dtype=torch.int32)
    h13 = torch.randn(9, 64, generator=g)
    got = fp8.grouped_silu_mul_matmul(h13, w2, s2, offs)
    assert got.shape == (9, 16) and torch.equal(got, fp8.grouped_matmul(silu_mul(h13), w2, s2, offs))


# ---------------------------------------------------------------------------------------------------
# The weight-only decode GEMV (`fp8.gemv`, the scaled 8-bit path of strata.kernels.gemv). On the CPU
# it runs in the interpreter (tests/conftest.py), whose dot is an fp32 one over the same exact products.
# Tolerance against `matmul_ref` (x.float() @ (w.float() * scale).T, rounded once): one rounding step of
# x's dtype, elementwise (rtol 2^-7 for bf16, 2^-10 for fp16, atol 1e-5 of the largest |reference|),
# since only the fp32 summation order and where the scale is applied differ (on the GPU: 1e-2 of the
# largest |reference|, the bf16 GEMV's own tolerance, for the tensor cores' fp32 sums over 4-12K terms).

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
RTOL = {torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _fp8_planes(n, k, seed, device=DEV):
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=device) * k ** -0.5
    w[::7] *= 40  # rows of very different ranges keep their own scales
    return fp8.repack(w)


def _x(m, k, dtype, seed, device=DEV):
    return (torch.randn(m, k, generator=torch.Generator(device=device).manual_seed(seed), device=device) * 1.5).to(dtype)


def _assert_close_to_ref(got, x, planes, n, k):
    ref = fp8.matmul_ref(x, planes, n, k).float()
    assert got.dtype == x.dtype and torch.isfinite(got).all()
    atol = 1e-5 * ref.abs().max().item()
    assert torch.allclose(got.float(), ref, rtol=RTOL[x.dtype], atol=atol), \
        f"max error {(got.float() - ref).abs().max().item():.3g} of max |ref| {ref.abs().max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k,config", [
    (96, 256, None),  # gemv_config's choice
    (200, 256, GemvConfig(64, 64, split_k=3)),  # uneven split (4 K blocks / 3), a column tile N does not fill
    (48, 512, GemvConfig(16, 128, split_k=2, num_stages=2)),
], ids=["auto", "split3-ragged", "split2"])
def test_decode_gemv_matches_the_reference(n, k, config, m, dtype):
    planes = _fp8_planes(n, k, seed=n + k)
    x = _x(m, k, dtype, seed=m)
    cfg = config or fp8.gemv_config(n, k)
    ws = torch.zeros(max(1, fp8.k_gemv.gemv_workspace_numel(n, k, cfg)), dtype=torch.int32, device=DEV)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    got = fp8.gemv(x, planes, n, k, out, workspace=ws, config=config)
    assert got.data_ptr() == out.data_ptr()
    _assert_close_to_ref(got, x, planes, n, k)
    assert (ws[: -(-n // cfg.block_n)] == 0).all(), "split-K counters not reset"


def _every_e4m3_code(k: int, device=DEV) -> dict[str, torch.Tensor]:
    """Planes with scale 1 whose every column holds all 254 finite e4m3 codes (±0, subnormals, normals,
    ±448), one per row, shifted from column to column so the four bytes of a word all differ."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8, device=device)
    index = (torch.arange(len(codes), device=device)[:, None] + 37 * torch.arange(k, device=device)) % len(codes)
    return {"w": codes[index].view(torch.float8_e4m3fn), "scale": torch.ones(len(codes), device=device)}


def _one_hot_rows(k, dtype, cols, device=DEV):
    x = torch.zeros(len(cols), k, dtype=dtype, device=device)
    x[torch.arange(len(cols)), torch.tensor(cols)] = 1
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_gemv_converts_every_e4m3_code_exactly(dtype):
    """One-hot x rows pick weight columns, so each output is one weight value times 1: it must be the
    e4m3 value itself (all exactly representable in bf16 and fp16), subnormals and signs included."""
    k = 256
    planes = _every_e4m3_code(k)
    n = planes["w"].shape[0]
    cols = [0, 1, 2, 3, 130, 255]  # every byte position of a word
    got = fp8.gemv(_one_hot_rows(k, dtype, cols), planes, n, k)
    assert torch.equal(got, planes["w"][:, cols].to(dtype).t())


def test_decode_gemv_is_batch_invariant():
    """A row's result is the same bits alone, among M = 1..16 rows, and among other rows (split-K over
    an uneven 3 K blocks, and a column tile N does not fill)."""
    n, k, config = 80, 192, GemvConfig(64, 64, split_k=3)
    planes = _fp8_planes(n, k, seed=5)
    x = _x(16, k, torch.bfloat16, seed=6)
    full = fp8.gemv(x, planes, n, k, config=config)
    for m in range(1, 17):
        assert torch.equal(fp8.gemv(x[:m], planes, n, k, config=config), full[:m]), f"M={m}"
    other = _x(5, k, torch.bfloat16, seed=7)
    other[3] = x[9]
    assert torch.equal(fp8.gemv(other, planes, n, k, config=config)[3], full[9])


def test_matmul_dispatch_and_workspace():
    """QWeight.matmul: up to 16 bf16/fp16 rows through the GEMV with the weight's own workspace (kept at
    zero), leading dimensions kept; 17 rows and fp32 x through the per-token path, as before."""
    n, k = 128, 1024  # split-K under the rule (gemv_config), so the weight carries a workspace
    g = torch.Generator().manual_seed(11)
    q = QWeight.from_raw("FP8", 0.02 * torch.randn(n, k, generator=g), n, k)
    assert fp8.gemv_config(n, k).split_k > 1 and q.workspace is not None
    assert q.workspace.numel() == fp8.gemv_workspace_numel(n, k)
    x = _x(16, k, torch.bfloat16, seed=12)
    assert torch.equal(q.matmul(x[:6].view(2, 3, k)), fp8.gemv(x[:6], q.planes, n, k).view(2, 3, n))
    out = torch.empty(16, n, dtype=torch.bfloat16)
    assert q.matmul(x, out) is out and torch.equal(out, fp8.gemv(x, q.planes, n, k))
    assert (q.workspace[: -(-n // fp8.gemv_config(n, k).block_n)] == 0).all()
    x17 = torch.cat([x, x[:1]])
    assert torch.equal(q.matmul(x17), fp8.scaled_mm_matmul(x17, q.planes, n, k))
    assert torch.equal(q.matmul(x.float()[:3]), fp8.scaled_mm_matmul(x.float()[:3], q.planes, n, k))
    assert fp8.gemv_workspace_numel(n, 100) == 0  # K the GEMV does not serve


def test_decode_gemv_configs():
    """Per (N, K) only: the swept table's entry, else the bf16 GEMV's grid and split-K; BLOCK_K >= 64,
    pipeline buffers (e4m3 tiles, x tiles, x's even/odd halves) that leave room for two programs per SM,
    and a workspace sized for the configuration that runs."""
    qwen3 = {(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (5120, 2048), (2048, 4096)}
    shapes = qwen3 | set(fp8.GEMV_CONFIGS) | {(8192, 2048)}
    for n, k in sorted(shapes):
        cfg, base = fp8.gemv_config(n, k), fp8.k_gemv.gemv_config(n, k)
        fp8.k_gemv.check_config(cfg, k)
        if (n, k) in fp8.GEMV_CONFIGS:
            assert cfg == fp8.GEMV_CONFIGS[(n, k)]
        else:
            assert (cfg.block_n, cfg.split_k) == (base.block_n, base.split_k), (n, k, cfg)
        assert cfg.block_k >= 64 and k % cfg.block_k == 0
        assert cfg.smem_bytes(w_bytes=1) + 32 * cfg.block_k <= 113 << 10, (n, k, cfg)
        assert fp8.gemv_workspace_numel(n, k) == fp8.k_gemv.gemv_workspace_numel(n, k, cfg)


# ---------------------------------------------------------------------------------------------- GPU

GPU_SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_decode_gemv_matches_and_is_batch_invariant(shape):
    n, k = shape
    planes = _fp8_planes(n, k, seed=n + k, device="cuda")
    ws = torch.zeros(max(1, fp8.gemv_workspace_numel(n, k)), dtype=torch.int32, device="cuda")
    for dtype in (torch.bfloat16, torch.float16):
        x = _x(16, k, dtype, seed=1, device="cuda")
        full = fp8.gemv(x, planes, n, k, workspace=ws)
        ref = fp8.matmul_ref(x, planes, n, k).float()
        err = ((full.float() - ref).abs().max() / ref.abs().max()).item()
        assert err <= 1e-2, f"{dtype}: relative error {err:.3g}"
        for m in (1, 3, 8):
            assert torch.equal(fp8.gemv(x[:m], planes, n, k, workspace=ws), full[:m]), f"M={m}"
        assert torch.equal(fp8.gemv(x[5:6], planes, n, k, workspace=ws)[0], full[5])
        assert torch.equal(fp8.gemv(x, planes, n, k, workspace=ws), full), "not deterministic run to run"
        assert torch.equal(fp8.gemv(x, planes, n, k), full)  # a workspace allocated per call
        # The PTX conversion and the portable one give the MMA the same values: the same bits.
        assert torch.equal(fp8.gemv(x, planes, n, k, workspace=ws, w8_conversion="int"), full)
        assert (ws[: -(-n // fp8.gemv_config(n, k).block_n)] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("conversion", ["asm", "int"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_converts_every_e4m3_code_exactly(dtype, conversion):
    """The PTX conversion (bit moves, then a bf16x2 / f16x2 multiply by 2^120 / 2^8) on every finite
    code, subnormals included: a multiply that flushed subnormals would fail here."""
    k = 1024
    planes = _every_e4m3_code(k, device="cuda")
    n = planes["w"].shape[0]
    cols = [0, 1, 2, 3, 500, 1021, 1022, 1023]  # every byte position of a word
    got = fp8.gemv(_one_hot_rows(k, dtype, cols, device="cuda"), planes, n, k, w8_conversion=conversion)
    assert torch.equal(got, planes["w"][:, cols].to(dtype).t())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_decode_gemv_cuda_graph_replay(shape):
    """A QWeight's decode call (its own split-K workspace) captured once, replayed on new x."""
    n, k = shape
    g = torch.Generator(device="cuda").manual_seed(3)
    q = QWeight.from_raw("FP8", torch.randn(n, k, generator=g, device="cuda") * k ** -0.5, n, k)
    x = _x(8, k, torch.bfloat16, seed=4, device="cuda")
    out = torch.empty(8, n, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        q.matmul(x, out)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q.matmul(x, out)
    for step in range(3):
        x.copy_(_x(8, k, torch.bfloat16, seed=10 + step, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fp8.gemv(x, q.planes, n, k))
