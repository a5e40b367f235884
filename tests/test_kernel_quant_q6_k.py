"""Q6_K quantized weights (strata/kernels/quant/q6_k.py): repack, dequantize, the GEMV and GEMM kernels,
the grouped MoE kernel on Q6_K stacks, the registry and the GGUF loader keeping Q6_K quantized.

CPU: `dequantize` equals gguf's numpy dequantizer bit for bit; the kernels run in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1) at K = 256/512, N ≤ 96, M in {1, 3, 16, 40}, fp32, fp16
and bf16 x. GPU (`pytest -m gpu`): the 8B shapes at M = 1, 8, 512, CUDA-graph replay, and a speed
report (`-s` to see it; printed, never asserted).

Tolerances, relative Frobenius error of the product:
- against `matmul_ref` (the stated semantics: weights rounded to x's dtype, fp32 sums, one final
  rounding): fp32 1e-5 (summation order only); fp16/bf16 one output rounding, ≤ 2^-9 per value:
  fp16 2e-3, bf16 4e-3;
- against the fp32 dequantize-then-matmul reference: fp32 1e-5, fp16 2e-3, bf16 1e-2 (the weights'
  rounding to bf16 adds ~2^-9 relative per weight).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from strata.env import ENV
from strata.kernels.quant import q6_k
from strata.kernels.quant.q6_k import (
    BLOCK_BYTES,
    BLOCK_VALUES,
    GemmConfig,
    GemvConfig,
    dequantize,
    gemm_q6k,
    gemv_q6k,
    gemv_workspace_numel,
    matmul,
    matmul_ref,
    random_raw,
    repack,
)

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
TOL_SEMANTICS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 4e-3}
TOL_FP32_REF = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
QT6 = gguf.GGMLQuantizationType.Q6_K


@pytest.fixture(autouse=True)
def dequantizing_decode(monkeypatch):
    """These are the dequantizing GEMV's tests: its switch's default ('auto') takes the dp4a GEMV at
    a few rows (tested in tests/test_kernel_quant_q6k_dp4a.py)."""
    monkeypatch.setenv(ENV.Q6K_DECODE.name, "dequant")


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def make_weight(n, k, seed, device=DEV):
    raw = random_raw(n, k, seed)
    return raw, repack(torch.from_numpy(raw).to(device))


def rel_frobenius(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def gguf_bits(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, QT6))).view(torch.int32)


def test_constants():
    assert (q6_k.GGML_TYPE, BLOCK_VALUES, BLOCK_BYTES) == ("Q6_K", 256, 210)
    assert gguf.GGML_QUANT_SIZES[QT6] == (BLOCK_VALUES, BLOCK_BYTES)


@pytest.mark.parametrize("n,k", [(1, 256), (7, 512), (33, 1024)])
def test_dequantize_bit_exact_against_gguf(n, k):
    raw, planes = make_weight(n, k, seed_of("deq", n, k), device="cpu")
    assert raw.dtype == np.uint8 and raw.shape == (n, k // 256 * 210)
    got = dequantize(planes, n, k)
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(got.view(torch.int32), gguf_bits(raw))
    ref = gguf.quants.dequantize(raw, QT6)
    assert np.isfinite(ref).all() and 0.005 < ref.std() < 0.05, "random_raw magnitudes"


def test_dequantize_extreme_fields():
    """Every quant bit set or clear, scales ±127 / −128 / 0, and huge, tiny (subnormal), negative and
    signed-zero fp16 d: still gguf's bits, signs of zeros included."""
    n, k = 6, 512
    raw = random_raw(n, k, 5).reshape(n, -1, BLOCK_BYTES)
    raw[0, :, :192] = 0xFF
    raw[1, :, :192] = 0x00
    raw[2, :, 192:208] = np.array([0x80, 0x7F, 0x00, 0x81] * 4, dtype=np.uint8)
    for row, d in zip(range(3, 6), ([60000.0, -0.5], [6e-8, -6e-8], [0.0, -0.0])):
        raw[row, :, 208:210] = np.array(d, dtype=np.float16).view(np.uint8).reshape(2, 2)
    raw = raw.reshape(n, -1)
    got = dequantize(repack(torch.from_numpy(raw)), n, k)
    assert torch.equal(got.view(torch.int32), gguf_bits(raw))


def test_repack_planes():
    n, k = 10, 768
    raw, planes = make_weight(n, k, seed_of("planes"))
    total = sum(t.numel() * t.element_size() for t in planes.values())
    assert raw.nbytes <= total <= 1.1 * raw.nbytes
    assert all(t.is_contiguous() and t.device.type == DEV for t in planes.values())
    want = {"ql": ((n, k // 2), torch.uint8), "qh": ((n, k // 4), torch.uint8),
            "scales": ((n, k // 16), torch.int8), "d": ((n, k // 256), torch.float32)}
    assert {name: (tuple(t.shape), t.dtype) for name, t in planes.items()} == want
    blocks = raw.reshape(n, -1, BLOCK_BYTES)
    assert np.array_equal(planes["qh"].cpu().numpy(), blocks[:, :, 128:192].reshape(n, -1))
    assert np.array_equal(planes["d"].cpu().numpy(), blocks[:, :, 208:].copy().view(np.float16)[..., 0])


def run_poisoned(fn, x, n, *args, **kwargs):
    out = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=x.device)
    got = fn(x, *args, out=out, **kwargs)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(out).all(), "unwritten NaN poison"
    return out


def check_product(out, x, planes, n, k):
    dtype = x.dtype
    err = rel_frobenius(out, matmul_ref(x, planes, n, k))
    assert err <= TOL_SEMANTICS[dtype], f"vs matmul_ref: {err:.3g} > {TOL_SEMANTICS[dtype]}"
    err = rel_frobenius(out, x.float() @ dequantize(planes, n, k).t())
    assert err <= TOL_FP32_REF[dtype], f"vs fp32 reference: {err:.3g} > {TOL_FP32_REF[dtype]}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m,n,k", [(1, 96, 512), (3, 40, 256), (16, 64, 512), (40, 72, 256)])
def test_matmul_matches_reference(m, n, k, dtype):
    """Through `matmul` (GEMV for M ≤ 16, GEMM above), N that the tiles do not fill."""
    _, planes = make_weight(n, k, seed_of("mm", m, n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed_of("x", m, n, k))).to(DEV, dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    assert matmul(x, planes, n, k, out).data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all()
    check_product(out, x, planes, n, k)


# (m, n, k, config): split-K even and uneven, wider tiles, 256-value steps
GEMV_CASES = [
    (3, 80, 512, GemvConfig(32, 128, split_k=4)),
    (5, 40, 768, GemvConfig(16, 256, split_k=3)),
    (2, 70, 512, GemvConfig(64, 128, split_k=3)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", GEMV_CASES, ids=lambda c: f"m{c[0]}-n{c[1]}-k{c[2]}-s{c[3].split_k}")
def test_gemv_split_k(case, dtype):
    m, n, k, cfg = case
    _, planes = make_weight(n, k, seed_of("gemv", case))
    wide = torch.randn(m, k + 32, generator=torch.Generator().manual_seed(seed_of("gx", case))).to(DEV, dtype)
    x = wide[:, 16:k + 16]  # a row stride wider than K
    ws = torch.zeros(gemv_workspace_numel(n, k, cfg), dtype=torch.int32, device=DEV)
    out = run_poisoned(gemv_q6k, x, n, planes, n, k, workspace=ws, config=cfg)
    assert (ws[:-(-n // cfg.block_n)] == 0).all(), "split counters not reset"
    check_product(out, x, planes, n, k)


@pytest.mark.parametrize("config,ms", [(None, range(1, 16)), (GemvConfig(16, 128, split_k=2), (1, 6, 15))],
                         ids=["auto", "split2"])
def test_gemv_batch_invariant(config, ms):
    """Each of the m rows of a batch of m ≤ 16 has the bits it has in the batch of 16 (every m with
    the default configuration; a few with split-K)."""
    n, k = 32, 256
    _, planes = make_weight(n, k, seed_of("inv"))
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(7)).to(DEV, torch.bfloat16)
    ws = torch.zeros(max(1, gemv_workspace_numel(n, k, config)), dtype=torch.int32, device=DEV)
    full = gemv_q6k(x, planes, n, k, workspace=ws, config=config)
    for m in ms:
        assert torch.equal(gemv_q6k(x[:m], planes, n, k, workspace=ws, config=config), full[:m]), m


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m", [16, 40], ids=["gemv", "gemm"])
def test_kernels_dequantize_exactly(m, dtype):
    """One-hot rows of x pick single weight columns (low and high nibbles, every run, several
    super-blocks): the product is then the kernel's own dequantized weight in x's dtype, which must
    equal `dequantize` rounded to that dtype bit for bit."""
    n, k = 48, 512
    _, planes = make_weight(n, k, seed_of("onehot", m))
    cols = torch.randperm(k, generator=torch.Generator().manual_seed(m))[:m]
    x = torch.zeros(m, k, dtype=dtype, device=DEV)
    x[torch.arange(m), cols.to(DEV)] = 1
    out = matmul(x, planes, n, k)
    expect = dequantize(planes, n, k)[:, cols.to(DEV)].t().to(dtype)
    assert torch.equal(out, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemm_configs(dtype):
    """The GEMM with small tiles and 256-value steps: row and column tiles cut by M and N, several K
    steps, a row stride wider than K (x a column slice)."""
    m, n, k = 40, 72, 512
    _, planes = make_weight(n, k, seed_of("gemm"))
    wide = torch.randn(m, k + 16, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)
    x = wide[:, :k]
    out = run_poisoned(gemm_q6k, x, n, planes, n, k, config=GemmConfig(32, 32, 256, group_m=2, num_warps=4))
    check_product(out, x, planes, n, k)


def test_rejects_bad_arguments():
    n, k = 16, 256
    _, planes = make_weight(n, k, 1)
    x = torch.randn(2, k, device=DEV)
    with pytest.raises(ValueError):
        matmul(x[:, :128], planes, n, k)
    with pytest.raises(ValueError):
        matmul(x, {**planes, "scales": planes["scales"][:, :4]}, n, k)
    with pytest.raises(ValueError):
        matmul(x, planes, n, k, out=torch.empty(2, n, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError):
        repack(torch.zeros(2, 200, dtype=torch.uint8))


def test_reference_path_off_the_kernels(monkeypatch):
    """Where the kernels do not run (CPU without the interpreter), `matmul` is `matmul_ref`."""
    n, k = 24, 256
    _, planes = make_weight(n, k, 2, device="cpu")
    x = torch.randn(3, k).to(torch.bfloat16)
    monkeypatch.setattr(q6_k, "kernels_run", lambda t, kernel: False)
    assert torch.equal(matmul(x, planes, n, k), matmul_ref(x, planes, n, k))


def test_registered_format():
    """Q6_K is kept quantized: in FORMATS, a QWeight with its split-K workspace, `random_blocks` valid."""
    from strata.kernels.quant import FORMATS, QWeight, format_module, random_blocks

    assert "Q6_K" in FORMATS and format_module("Q6_K") is q6_k
    n, k = 4096, 4096
    assert gemv_workspace_numel(n, k) > 0  # the default 8B configuration splits K
    raw = torch.from_numpy(random_raw(8, 256, 3))
    w = QWeight.from_raw("Q6_K", raw, 8, 256)
    assert torch.equal(w.dequantize().view(torch.int32), gguf_bits(raw.numpy()))
    blocks = random_blocks("Q6_K", 32, 512, torch.Generator().manual_seed(0), "cpu")
    values = gguf.quants.dequantize(blocks.numpy(), QT6)
    assert np.isfinite(values).all() and 0.005 < values.std() < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_moe_grouped_kernel_on_q6_k_stacks(dtype):
    """moe_q's grouped kernel takes Q6_K stacks: decode (swap AB) and 64-row tiles, empty experts,
    uneven groups, against the reference."""
    from strata.kernels.quant.moe_q import GroupedConfig, QExpertStack, grouped_matmul_ref, grouped_matmul_triton

    e, n, k = 4, 48, 256
    raw = torch.from_numpy(random_raw(e * n, k, seed_of("moe"))).view(e, n, -1)
    stack = QExpertStack.from_raw("Q6_K", raw)
    assert torch.equal(stack.dequantize().view(e * n, k).view(torch.int32), gguf_bits(raw.view(e * n, -1).numpy()))
    offs = torch.tensor([0, 5, 5, 21], dtype=torch.int32)  # each expert's end row: experts 0 and 2 empty
    xs = torch.randn(21, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = grouped_matmul_ref(xs, stack, offs)
    if dtype == torch.float32:  # the FMA dot's tiles (`grouped_config`)
        configs = (GroupedConfig(16, 32, 128), GroupedConfig(32, 32, 256, num_warps=8))
    else:
        configs = (GroupedConfig(16, 64, 128, swap_ab=True), GroupedConfig(64, 32, 256, num_warps=8))
    for cfg in configs:
        got = grouped_matmul_triton(xs, stack, offs, config=cfg)
        assert rel_frobenius(got, ref) <= TOL_FP32_REF[dtype], cfg


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_gguf_loader_keeps_q6_k_quantized(tmp_path):
    """A qwen3 GGUF whose ffn_down is Q6_K: with keep_quantized the MLP's down projection is a Q6_K
    QWeight from the file's own blocks (its float weight never made), and the logits match the
    dequantized load's (fp32: the kernels against dequantize-then-matmul)."""
    from safetensors.torch import load_file
    from test_gguf import _hf_config, _logits, _write_with_raw
    from tiny_models import save_tiny_model

    from strata.kernels.quant import QWeight
    from strata.loaders import load_model

    src = str(tmp_path / "hf")
    save_tiny_model("qwen3", src)
    c = _hf_config(src)
    tensors = load_file(f"{src}/model.safetensors")
    tensors.pop("model.layers.0.mlp.down_proj.weight")
    blob = random_raw(c["hidden_size"], 256, 9)
    path = str(tmp_path / "q6.gguf")
    _write_with_raw(path, c, tensors, {"blk.0.ffn_down.weight": (blob, QT6)}, intermediate=256)
    floats = load_model(path)
    kept = load_model(path, keep_quantized=True)
    mlp = kept.model.model.layers[0].mlp
    assert isinstance(mlp.down_q, QWeight) and mlp.down_q.ggml_type == "Q6_K" and mlp.down_proj.weight.is_meta
    assert torch.equal(mlp.down_q.dequantize().view(torch.int32), gguf_bits(blob))
    for t in (20, 3):  # a prompt-sized GEMM and decode-sized GEMVs
        ids = torch.randint(0, c["vocab_size"], (1, t), generator=torch.Generator().manual_seed(t))
        got, want = _logits(kept, ids), _logits(floats, ids)
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4, t


# ----------------------------------------------------------------------------------------------
# GPU (pytest -m gpu)

GPU_SHAPES = [(4096, 4096), (4096, 12288), (12288, 4096)]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 512])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_real_shapes(n, k, m):
    _, planes = make_weight(n, k, seed_of("gpu", n, k), device="cuda")
    ws = torch.zeros(max(1, gemv_workspace_numel(n, k)), dtype=torch.int32, device="cuda")
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).to(dtype)
        out = matmul(x, planes, n, k, workspace=ws)
        check_product(out, x, planes, n, k)
        assert torch.equal(matmul(x, planes, n, k, workspace=ws), out), "run to run"
        assert torch.equal(matmul(x, planes, n, k), out), "with and without a workspace"
    x = torch.randn(m, k, device="cuda") * 0.5
    check_product(matmul(x, planes, n, k, workspace=ws), x, planes, n, k)  # fp32 x through the IEEE dot


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 512], ids=["gemv", "gemm"])
def test_gpu_kernels_dequantize_exactly(m):
    """One-hot x at a real shape: the kernels' weights are `dequantize` rounded to bf16, bit for bit."""
    n, k = 4096, 4096
    _, planes = make_weight(n, k, 12, device="cuda")
    cols = torch.randperm(k, device="cuda")[:m]
    x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
    x[torch.arange(m, device="cuda"), cols] = 1
    assert torch.equal(matmul(x, planes, n, k), dequantize(planes, n, k)[:, cols].t().to(torch.bfloat16))


@needs_cuda
@pytest.mark.gpu
def test_gpu_batch_invariant_and_graph():
    n, k = 4096, 4096
    _, planes = make_weight(n, k, 11, device="cuda")
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    ws = torch.zeros(gemv_workspace_numel(n, k), dtype=torch.int32, device="cuda")
    full = matmul(x, planes, n, k, workspace=ws)
    for m in range(1, 16):
        assert torch.equal(matmul(x[:m].clone(), planes, n, k, workspace=ws), full[:m]), m
    out = torch.empty(16, n, device="cuda", dtype=torch.bfloat16)
    cfg = GemvConfig(64, 128, split_k=5)
    ws = torch.zeros(gemv_workspace_numel(n, k, cfg), dtype=torch.int32, device="cuda")
    expect = gemv_q6k(x, planes, n, k, workspace=ws, config=cfg)
    check_product(expect, x, planes, n, k)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv_q6k(x, planes, n, k, out, workspace=ws, config=cfg)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)


@needs_cuda
@pytest.mark.gpu
def test_gpu_speed_report():
    """Prints GB/s of weight bytes at M = 1 and TFLOP/s at M = 4096 (no assertion)."""
    rows = q6_k.bench(ms=(1, 4096), shapes=[("", n, k) for n, k in GPU_SHAPES])
    for r in rows:
        print(f"Q6_K {r['n']}x{r['k']} M={r['m']}: {r['q6k_gbs']:.0f} GB/s, {r['q6k_tflops']:.1f} TFLOP/s "
              f"(bf16 dense {r['bf16_gbs']:.0f} GB/s, {r['bf16_tflops']:.1f} TFLOP/s)")


def test_the_writer_makes_blocks_gguf_reads_back():
    """writers.quantize_q6_k: gguf's own dequantization of the written blocks is within 6-bit precision
    of the input (RMS error < 3%, every value within half a step of its sub-block's scale), and each
    sub-block's largest value comes back to within its scale's rounding."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from strata.kernels.quant.writers import quantize

    rng = np.random.default_rng(6)
    w = (rng.standard_normal((6, 512)) * 0.02).astype(np.float32)
    w[0, :16] = 0.0  # an all-zero sub-block
    raw = quantize("Q6_K", w)
    assert raw.shape == (6, 2 * 210) and raw.dtype == np.uint8
    back = gguf_dequantize(raw, GGMLQuantizationType.Q6_K).reshape(w.shape)
    assert np.linalg.norm(back - w) / np.linalg.norm(w) < 0.03
    assert not back[0, :16].any()
    sub = np.abs(w).reshape(-1, 16).max(-1)
    worst = (np.abs(back - w).reshape(-1, 16).max(-1) / np.where(sub > 0, sub, 1)).max()
    assert worst < 0.05  # half a step (1/64 of the peak) plus the int8 scale's and fp16 d's rounding
