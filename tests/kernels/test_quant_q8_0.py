"""GGUF Q8_0 kept quantized: layout, definition and kernels (strata/kernels/quant/q8_0.py).

CPU: `dequantize` against gguf's numpy dequantization bit for bit (gguf-quantized blocks and
arbitrary bytes: every int8 value, negative, zero and subnormal scales); the kernels in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 and makes its fp32 -> bf16 casts round to
nearest even, like the GPU) at K = 256 / 512, N <= 96, M in {1, 3, 16, 40} (GEMV for M <= 16, GEMM
above), with forced configurations for several K steps, partial tiles and grouped tile order, NaN-
poisoned outputs written through column slices, and x with a row stride wider than K.
GPU (`pytest -m gpu`): the real sizes, device repacking, batch invariance of the GEMV and CUDA-graph
replay (timings: benchmarks/kernels/quant_formats.py).

Tolerances, as the relative Frobenius error of the product:
- against the fp32 reference F.linear(x.float(), dequantize(W)): fp32 x 1e-5 (summation order only);
  bf16 / fp16 x 1e-2 (the kernel rounds each weight to x's dtype, ~2^-9 relative, and the result once);
- against the reference with the weights rounded to x's dtype first (the kernels' stated semantics):
  1e-3 for 16-bit x, where only the fp32 summation order differs and may flip an output's last bit.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from strata.kernels import choices
from strata.kernels.device import PRESETS
from strata.kernels.quant import q8_0
from strata.kernels.quant.q8_0 import Q8Config

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
TOL_FP32_REF = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
TOL_ROUNDED_REF = 1e-3


@pytest.fixture(autouse=True)
def dequantizing_decode():
    """These are the dequantizing GEMV's tests: the kernel choice quant_decode's default ('auto') takes
    the dp4a GEMV at a few rows (tested in tests/kernels/test_quant_dp4a.py)."""
    with choices.using(quant_decode="dequant"):
        yield


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def gguf_reference(raw: np.ndarray) -> np.ndarray:
    return gguf_dequantize(raw, GGMLQuantizationType.Q8_0)


def planes_of(n, k, seed, device=DEV):
    raw = q8_0.random_raw(n, k, seed)
    return raw, q8_0.repack(torch.from_numpy(raw).to(device))


def make_x(m, k, dtype, seed, device=DEV, pad=0):
    """x [m, k]; with pad > 0 a column slice of a NaN-filled wider buffer (row stride k + pad)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    if pad:
        wide = torch.full((m, k + pad), float("nan"), dtype=dtype, device=device)
        wide[:, :k] = x
        x = wide[:, :k]
    return x


def rel_fro(out, ref) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def references(x, planes, n, k):
    """(fp32 reference, reference with the weights rounded to x's dtype first)."""
    w = q8_0.dequantize(planes, n, k)
    return F.linear(x.float(), w), F.linear(x.float(), w.to(x.dtype).float()).to(x.dtype)


def check_product(got, x, planes, n, k):
    assert got.shape == (x.shape[0], n) and got.dtype == x.dtype
    assert torch.isfinite(got).all()
    exact, rounded = references(x, planes, n, k)
    assert rel_fro(got, exact) <= TOL_FP32_REF[x.dtype]
    if x.dtype != torch.float32:
        assert rel_fro(got, rounded) <= TOL_ROUNDED_REF


def run_into_slice(x, planes, n, k, config=None, out_pad=3):
    """matmul_triton into a NaN-poisoned column slice of a wider buffer whose extra columns hold a
    sentinel; checks nothing outside the slice was written."""
    wide = torch.full((x.shape[0], n + out_pad), 7.0, dtype=x.dtype, device=x.device)
    out = wide[:, :n]
    out.fill_(float("nan"))
    got = q8_0.matmul_triton(x, planes, n, k, out, config=config)
    assert got.data_ptr() == out.data_ptr()
    assert (wide[:, n:] == 7.0).all()
    return got


# ----------------------------------------------------------------------------------------------
# Layout and definition


def test_format_constants():
    assert (q8_0.GGML_TYPE, q8_0.BLOCK_VALUES, q8_0.BLOCK_BYTES) == ("Q8_0", 32, 34)
    assert GGMLQuantizationType[q8_0.GGML_TYPE] == GGMLQuantizationType.Q8_0


def test_repack_layout():
    n, k = 24, 256
    raw, planes = planes_of(n, k, 1, device="cpu")
    assert sorted(planes) == ["d", "qs"]
    qs, d = planes["qs"], planes["d"]
    assert qs.dtype == torch.int8 and tuple(qs.shape) == (n, k) and qs.is_contiguous()
    assert d.dtype == torch.float16 and tuple(d.shape) == (n, k // 32) and d.is_contiguous()
    assert qs.numel() + 2 * d.numel() == raw.size  # the file's bytes, rearranged
    blocks = raw.reshape(n, k // 32, 34)
    assert np.array_equal(d.numpy(), blocks[:, :, :2].copy().view(np.float16)[:, :, 0])
    assert np.array_equal(qs.numpy(), blocks[:, :, 2:].reshape(n, k).view(np.int8))
    with pytest.raises(ValueError):
        q8_0.repack(torch.zeros(4, 35, dtype=torch.uint8))


def arbitrary_raw(n, k, seed) -> np.ndarray:
    """Blocks from arbitrary bytes: every int8 quant value, finite fp16 scales of either sign,
    including zero and subnormals (no inf/nan)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // 32, 34), dtype=np.uint8)
    scales = blocks[:, :, :2].copy().view(np.uint16)
    scales[..., 0] &= np.uint16(0xBBFF)  # exponent <= 14: finite, magnitude < 1
    scales.flat[:4] = [0x0000, 0x8000, 0x0001, 0x83FF]  # +0, -0, the smallest and largest subnormals
    blocks[:, :, :2] = scales.view(np.uint8)
    blocks[0, 0, 2:4] = [0x80, 0x7F]  # -128 and 127
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("kind", ["gguf_quantized", "arbitrary_bytes"])
def test_dequantize_bit_exact(kind):
    n, k = 40, 512
    raw = q8_0.random_raw(n, k, 2) if kind == "gguf_quantized" else arbitrary_raw(n, k, 3)
    got = q8_0.dequantize(q8_0.repack(torch.from_numpy(raw)), n, k)
    want = gguf_reference(raw)
    assert got.dtype == torch.float32 and tuple(got.shape) == (n, k) == want.shape
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


def test_random_raw():
    n, k = 64, 512
    raw = q8_0.random_raw(n, k, 5)
    assert raw.dtype == np.uint8 and raw.shape == (n, k // 32 * 34) and raw.flags.c_contiguous
    assert np.array_equal(raw, q8_0.random_raw(n, k, 5))
    assert not np.array_equal(raw, q8_0.random_raw(n, k, 6))
    scales = raw.reshape(n, k // 32, 34)[:, :, :2].copy().view(np.float16)
    assert np.isfinite(scales).all() and (scales > 0).all()
    assert 0.018 < float(gguf_reference(raw).std()) < 0.022
    with pytest.raises(ValueError):
        q8_0.random_raw(4, 48, 0)


# ----------------------------------------------------------------------------------------------
# Kernels (interpreted on the CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 16, 40])
@pytest.mark.parametrize("n,k", [(96, 256), (40, 512)])
def test_matmul_matches_reference(n, k, m, dtype):
    _, planes = planes_of(n, k, seed_of("w", n, k))
    x = make_x(m, k, dtype, seed_of("x", n, k, m), pad=8 if m == 3 else 0)
    got = q8_0.matmul(x, planes, n, k)
    check_product(got, x, planes, n, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("m,config", [
    (5, Q8Config(16, 16, 64)),  # GEMV: 4 K steps, 3 row tiles with the last one partial
    (16, Q8Config(16, 32, 32, num_warps=2, num_stages=2)),  # GEMV: 8 K steps, one partial tile
    (40, Q8Config(32, 16, 64, group_m=2)),  # GEMM: 2 x 3 tiles in groups of 2 M tiles, all partial
    (17, Q8Config(16, 32, 128, group_m=1)),  # GEMM: one row past a full M tile
])
def test_forced_configs(m, config, dtype):
    n, k = 40, 256
    _, planes = planes_of(n, k, seed_of("w", n, k))
    x = make_x(m, k, dtype, seed_of("x", m, config), pad=5)
    got = run_into_slice(x, planes, n, k, config)
    check_product(got, x, planes, n, k)


def test_dispatch_and_validation():
    n, k = 32, 256
    _, planes = planes_of(n, k, 9)
    x = make_x(2, k, torch.float32, 10)
    assert torch.equal(q8_0.matmul(x, planes, n, k), q8_0.matmul_triton(x, planes, n, k))
    ref = q8_0.matmul_ref(x, planes, n, k)
    assert torch.equal(ref, F.linear(x, q8_0.dequantize(planes, n, k)))
    x_grad = x.clone().requires_grad_(True)  # the kernels have no backward: the reference runs
    assert q8_0.matmul(x_grad, planes, n, k).requires_grad
    out = torch.empty(2, n)
    assert q8_0.matmul(x, planes, n, k, out=out) is out
    assert q8_0.matmul(x[:0], planes, n, k).shape == (0, n)
    bad_calls = [
        lambda: q8_0.matmul_triton(x[:, :128], planes, n, k),  # K mismatch
        lambda: q8_0.matmul_triton(x.t().contiguous().t(), planes, n, k),  # columns not contiguous
        lambda: q8_0.matmul_triton(x.to(torch.int32), planes, n, k),
        lambda: q8_0.matmul_triton(x, planes, n, k, out=torch.empty(2, n + 1)),
        lambda: q8_0.matmul_triton(x, planes, n, k, out=torch.empty(2, n, dtype=torch.float16)),
        lambda: q8_0.matmul_triton(x, planes, n + 1, k),
        lambda: q8_0.matmul_triton(x, {"qs": planes["qs"]}, n, k),
        lambda: q8_0.matmul_triton(x, planes, n, k, config=Q8Config(32, 32, 256)),  # GEMV needs block_m 16
        lambda: q8_0.matmul_triton(x, planes, n, k, config=Q8Config(16, 32, 48)),
        lambda: q8_0.matmul_triton(x.bfloat16(), planes, n, k, config=Q8Config(16, 32, 64, split_k=2),
                                   workspace=torch.zeros(3, dtype=torch.int32)),  # workspace too small
        lambda: q8_0.matmul_triton(make_x(20, k, torch.bfloat16, 11), planes, n, k,
                                   config=Q8Config(32, 32, 64, split_k=2)),  # split-K is the GEMV's only
        lambda: q8_0.dequantize(planes, n, k + 32),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()


@pytest.mark.parametrize("spec", PRESETS.values(), ids=PRESETS.keys())
@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (151936, 4096),
                                 (2048, 1536), (96, 256), (40, 96)])
def test_configs_valid(n, k, spec):
    sms = spec.sm_count
    gemv = q8_0.gemv_config(n, k, spec)
    q8_0.check_config(gemv, k, gemv=True)
    assert gemv.block_m == q8_0.GEMV_MAX_ROWS
    for m in (17, 40, 64, 65, 128, 512, 4096):
        for dtype in (torch.bfloat16, torch.float32):
            q8_0.check_config(q8_0.gemm_config(m, n, k, dtype, spec), k, gemv=False)
    fp32 = q8_0.fp32_gemv_config(n, k, spec)
    q8_0.check_config(fp32, k, gemv=True)
    assert fp32.split_k == 1
    if n >= 2048:  # ~one program per SM or more at decode
        assert -(-n // fp32.block_n) >= 0.9 * sms
        # (about) every SM busy, unless K is too short to split further (each split keeps >= 2 steps)
        assert (0.9 * sms <= -(-n // gemv.block_n) * gemv.split_k
                or gemv.split_k in (k // gemv.block_k // 2, q8_0.MAX_SPLIT_K))
    assert -(-n // gemv.block_n) * gemv.split_k <= max(3 * sms, -(-n // gemv.block_n))
    assert q8_0.gemv_workspace_numel(n, k, spec=spec) >= q8_0.gemv_workspace_numel(n, k, gemv)  # and room for dp4a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("m,config", [
    (1, Q8Config(16, 32, 64, split_k=3)),  # 8 K steps over 3 splits (3, 3, 2), 2 row tiles, one partial
    (7, Q8Config(16, 16, 128, split_k=4)),  # one K step per split
])
def test_gemv_split_k_reuses_its_workspace(m, config, dtype):
    n, k = 40, 512
    _, planes = planes_of(n, k, seed_of("w", n, k))
    workspace = torch.zeros(q8_0.gemv_workspace_numel(n, k, config), dtype=torch.int32)
    for rep in range(2):  # the counters are back at zero after a call: the second one must agree
        x = make_x(m, k, dtype, seed_of("split", m, config, rep), pad=3)
        got = q8_0.matmul_triton(x, planes, n, k, config=config, workspace=workspace)
        check_product(got, x, planes, n, k)
        unsplit = q8_0.matmul_triton(x, planes, n, k, config=Q8Config(16, config.block_n, config.block_k))
        assert rel_fro(got, unsplit) <= TOL_ROUNDED_REF
    tiles = -(-n // config.block_n)
    assert not workspace[:tiles].any()


# ----------------------------------------------------------------------------------------------
# GPU (pytest -m gpu)

GPU_SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288)]


@pytest.fixture(scope="module")
def gpu_weights():
    """{(N, K): (raw numpy, planes on the GPU)}, built on first use."""
    cache = {}

    def get(n, k):
        if (n, k) not in cache:
            raw = q8_0.random_raw(n, k, seed_of("gpu", n, k))
            cache[(n, k)] = raw, q8_0.repack(torch.from_numpy(raw).cuda())
        return cache[(n, k)]

    return get


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_repack_and_dequantize_bit_exact(gpu_weights, n, k):
    raw, planes = gpu_weights(n, k)
    assert all(t.is_cuda for t in planes.values())
    got = q8_0.dequantize(planes, n, k)
    assert got.is_cuda
    assert np.array_equal(got.cpu().numpy().view(np.uint32), gguf_reference(raw).view(np.uint32))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("m", [1, 8, 512])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_matches_reference(gpu_weights, n, k, m, dtype):
    if dtype != torch.bfloat16 and (n, k) != (4096, 4096):
        pytest.skip("fp16 / fp32 x on one shape only")
    _, planes = gpu_weights(n, k)
    x = make_x(m, k, dtype, seed_of("gx", n, k, m), device="cuda", pad=64 if m == 8 else 0)
    got = q8_0.matmul(x, planes, n, k, out=torch.full((m, n), float("nan"), dtype=dtype, device="cuda"))
    check_product(got, x, planes, n, k)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_gemv_batch_invariant_and_deterministic(gpu_weights, n, k):
    _, planes = gpu_weights(n, k)
    x = make_x(16, k, torch.bfloat16, seed_of("inv", n, k), device="cuda")
    full = q8_0.matmul(x, planes, n, k)
    assert torch.equal(full, q8_0.matmul(x, planes, n, k))
    for m in (1, 3, 8):
        assert torch.equal(q8_0.matmul(x[:m].contiguous(), planes, n, k), full[:m])
    assert torch.equal(q8_0.matmul(x[9:10].contiguous(), planes, n, k), full[9:10])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 512])
def test_gpu_cuda_graph_replay(gpu_weights, m):
    n, k = 4096, 4096
    _, planes = gpu_weights(n, k)
    x = make_x(m, k, torch.bfloat16, seed_of("graph", m), device="cuda")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        q8_0.matmul(x, planes, n, k, out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q8_0.matmul(x, planes, n, k, out)
    x.copy_(make_x(m, k, torch.bfloat16, seed_of("graph2", m), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, q8_0.matmul(x, planes, n, k))
