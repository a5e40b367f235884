"""Q4_K quantized weights (strata/kernels/quant/q4_k.py): repack, dequantize, the GEMV and GEMM kernels.

CPU: `dequantize` equals gguf's numpy dequantizer bit for bit; the kernels run in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1) at K = 256/512, N ≤ 96, M in {1, 3, 16, 40}, fp32, fp16
and bf16 (the interpreter multiplies bf16 operands as raw uint16 integers, so a fixture here widens
them to fp32 first, as the GPU's tensor cores do exactly). GPU (`pytest -m gpu`): the 8B shapes at
M = 1, 8, 512 and CUDA-graph replay (timings: benchmarks/kernels/quant_formats.py).

Tolerances, relative Frobenius error of the product:
- against `matmul_ref` (the stated semantics: weights rounded to x's dtype, fp32 sums, one final
  rounding): fp32 1e-5 (summation order only); fp16/bf16 one output rounding, ≤ 2^-9 per value:
  fp16 2e-3, bf16 4e-3;
- against the fp32 dequantize-then-matmul reference: fp32 1e-5, fp16 2e-3, bf16 1e-2 (the weights'
  rounding to bf16 adds ~2^-9 relative per weight).

Q6_K's tests (tests/kernels/test_quant_q6_k.py) share these helpers and the tests that take the
`kquant` fixture: imported there, they run on the format that module's fixture gives.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import numpy as np
import pytest
import torch

from strata.kernels import choices
from strata.kernels.quant import q4_k
from strata.kernels.quant.q4_k import (
    BLOCK_BYTES,
    BLOCK_VALUES,
    GemmConfig,
    GemvConfig,
    dequantize,
    gemm_q4k,
    gemv_q4k,
    gemv_workspace_numel,
    matmul,
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


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def rel_frobenius(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@dataclass(frozen=True)
class KQuantFormat:
    """A K-quant format under test: its kernel module and what the shared tests call it by."""

    module: ModuleType
    gemv: Callable  # the dequantizing GEMV (`gemv_q4k`, ...)
    gemm: Callable
    qtype: gguf.GGMLQuantizationType
    gemm_block_k: int  # values per K step of `test_gemm_configs`' small tiles

    def weight(self, n, k, seed, device=DEV):
        raw = self.module.random_raw(n, k, seed)
        return raw, self.module.repack(torch.from_numpy(raw).to(device))

    def gguf_bits(self, raw: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, self.qtype))).view(torch.int32)

    def check_product(self, out, x, planes, n, k):
        dtype = x.dtype
        err = rel_frobenius(out, self.module.matmul_ref(x, planes, n, k))
        assert err <= TOL_SEMANTICS[dtype], f"vs matmul_ref: {err:.3g} > {TOL_SEMANTICS[dtype]}"
        err = rel_frobenius(out, x.float() @ self.module.dequantize(planes, n, k).t())
        assert err <= TOL_FP32_REF[dtype], f"vs fp32 reference: {err:.3g} > {TOL_FP32_REF[dtype]}"


Q4K = KQuantFormat(q4_k, gemv_q4k, gemm_q4k, gguf.GGMLQuantizationType.Q4_K, gemm_block_k=128)
make_weight = Q4K.weight
check_product = Q4K.check_product


@pytest.fixture
def kquant() -> KQuantFormat:
    return Q4K


@pytest.fixture(autouse=True)
def dequantizing_decode():
    """These are the dequantizing GEMV's tests: the kernel choice quant_decode's default ('auto') takes
    the dp4a GEMV at a few rows (tested in tests/kernels/test_quant_dp4a.py and test_quant_q6k_dp4a.py)."""
    with choices.using(quant_decode="dequant"):
        yield


@pytest.fixture(autouse=True)
def _interpreter_dot_reads_bf16(monkeypatch):
    """Triton 3.6's interpreter stores bf16 as uint16 and np.matmul's them as integers: widen bf16
    operands to fp32 (exact) before its dot."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widen(t):
        if t.dtype.scalar != tl.bfloat16:
            return t
        data = (t.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(builder, "create_dot", create_dot)


def test_constants():
    assert (q4_k.GGML_TYPE, BLOCK_VALUES, BLOCK_BYTES) == ("Q4_K", 256, 144)
    qt = gguf.GGMLQuantizationType.Q4_K
    assert gguf.GGML_QUANT_SIZES[qt] == (BLOCK_VALUES, BLOCK_BYTES)


@pytest.mark.parametrize("n,k", [(1, 256), (7, 512), (33, 1024)])
def test_dequantize_bit_exact_against_gguf(kquant, n, k):
    raw, planes = kquant.weight(n, k, seed_of("deq", n, k), device="cpu")
    assert raw.dtype == np.uint8 and raw.shape == (n, k // 256 * kquant.module.BLOCK_BYTES)
    got = kquant.module.dequantize(planes, n, k)
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(got.view(torch.int32), kquant.gguf_bits(raw))
    ref = gguf.quants.dequantize(raw, kquant.qtype)
    assert np.isfinite(ref).all() and 0.005 < ref.std() < 0.05, "random_raw magnitudes"


def test_dequantize_extreme_fields():
    """Every scale/min/quant bit set or clear, and large/tiny/negative fp16 d and dmin."""
    n, k = 4, 512
    raw = random_raw(n, k, 5).reshape(n, -1, BLOCK_BYTES)
    raw[0, :, 4:] = 0xFF
    raw[1, :, 4:] = 0x00
    raw[2, :, 4:16] = np.array([0xC0, 0x3F] * 6, dtype=np.uint8)
    fields = np.array([[60000.0, -1e-7], [-0.5, 6e-8]], dtype=np.float16).view(np.uint8).reshape(2, 4)
    raw[3, :, 0:4] = fields
    raw = raw.reshape(n, -1)
    got = dequantize(repack(torch.from_numpy(raw)), n, k)
    assert torch.equal(got.view(torch.int32), Q4K.gguf_bits(raw))


def repacked(fmt: KQuantFormat, n, k):
    """A random weight's raw blocks and planes, checked for what every format's planes share: at most
    10% over the file's bytes, contiguous, on DEV."""
    raw, planes = fmt.weight(n, k, seed_of("planes"))
    total = sum(t.numel() * t.element_size() for t in planes.values())
    assert raw.nbytes <= total <= 1.1 * raw.nbytes
    assert all(t.is_contiguous() and t.device.type == DEV for t in planes.values())
    return raw, planes


def test_repack_planes():
    n, k = 10, 768
    _, planes = repacked(Q4K, n, k)
    assert planes["qs"].shape == (n, k // 2) and planes["scales"].shape == (n, k // 16)
    assert planes["d_dmin"].shape == (n, k // 128) and planes["d_dmin"].dtype == torch.float16
    assert int(planes["scales"].max()) < 64


def run_poisoned(fn, x, n, *args, **kwargs):
    out = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=x.device)
    got = fn(x, *args, out=out, **kwargs)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(out).all(), "unwritten NaN poison"
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m,n,k", [(1, 96, 512), (3, 40, 256), (16, 64, 512), (40, 72, 256)])
def test_matmul_matches_reference(kquant, m, n, k, dtype):
    """Through `matmul` (GEMV for M ≤ 16, GEMM above), N that the tiles do not fill."""
    _, planes = kquant.weight(n, k, seed_of("mm", m, n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed_of("x", m, n, k))).to(DEV, dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    assert kquant.module.matmul(x, planes, n, k, out).data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all()
    kquant.check_product(out, x, planes, n, k)


# (m, n, k, config): split-K even and uneven, wider tiles, 128-value steps
GEMV_CASES = [
    (3, 80, 512, GemvConfig(32, 128, split_k=4)),
    (5, 40, 768, GemvConfig(16, 256, split_k=3)),
    (2, 70, 512, GemvConfig(64, 128, split_k=3)),
    (16, 48, 256, GemvConfig(16, 128, split_k=2)),
]


def gemv_case_id(case) -> str:
    return f"m{case[0]}-n{case[1]}-k{case[2]}-s{case[3].split_k}"


def check_gemv_split_k(fmt: KQuantFormat, case, dtype):
    m, n, k, cfg = case
    _, planes = fmt.weight(n, k, seed_of("gemv", case))
    wide = torch.randn(m, k + 32, generator=torch.Generator().manual_seed(seed_of("gx", case))).to(DEV, dtype)
    x = wide[:, 16:k + 16]  # a row stride wider than K
    ws = torch.zeros(fmt.module.gemv_workspace_numel(n, k, cfg), dtype=torch.int32, device=DEV)
    out = run_poisoned(fmt.gemv, x, n, planes, n, k, workspace=ws, config=cfg)
    assert (ws[:-(-n // cfg.block_n)] == 0).all(), "split counters not reset"
    fmt.check_product(out, x, planes, n, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", GEMV_CASES, ids=gemv_case_id)
def test_gemv_split_k(case, dtype):
    check_gemv_split_k(Q4K, case, dtype)


@pytest.mark.parametrize("config", [None, GemvConfig(32, 128, split_k=2)], ids=["auto", "split2"])
def test_gemv_batch_invariant(config):
    """A row alone and among other rows gives the same bits (one binary for every M ≤ 16)."""
    n, k = 64, 512
    _, planes = make_weight(n, k, seed_of("inv"))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(7)).to(DEV, torch.float16)
    ws = torch.zeros(max(1, gemv_workspace_numel(n, k, config)), dtype=torch.int32, device=DEV)
    full = gemv_q4k(x, planes, n, k, workspace=ws, config=config)
    for row in (0, 3):
        alone = gemv_q4k(x[row:row + 1], planes, n, k, workspace=ws, config=config)
        assert torch.equal(alone[0], full[row])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m", [16, 40], ids=["gemv", "gemm"])
def test_kernels_dequantize_exactly(kquant, m, dtype):
    """One-hot rows of x pick single weight columns (low and high nibbles, every sub-block, several
    super-blocks): the product is then the kernel's own dequantized weight in x's dtype, which must
    equal `dequantize` rounded to that dtype bit for bit."""
    n, k = 48, 512
    _, planes = kquant.weight(n, k, seed_of("onehot", m))
    cols = torch.randperm(k, generator=torch.Generator().manual_seed(m))[:m]
    x = torch.zeros(m, k, dtype=dtype, device=DEV)
    x[torch.arange(m), cols.to(DEV)] = 1
    out = kquant.module.matmul(x, planes, n, k)
    expect = kquant.module.dequantize(planes, n, k)[:, cols.to(DEV)].t().to(dtype)
    assert torch.equal(out, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemm_configs(kquant, dtype):
    """The GEMM with small tiles: row and column tiles cut by M and N, several K steps, a row stride
    wider than K (x a column slice)."""
    m, n, k = 40, 72, 512
    _, planes = kquant.weight(n, k, seed_of("gemm"))
    wide = torch.randn(m, k + 16, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)
    x = wide[:, :k]
    cfg = GemmConfig(32, 32, kquant.gemm_block_k, group_m=2, num_warps=4)
    out = run_poisoned(kquant.gemm, x, n, planes, n, k, config=cfg)
    kquant.check_product(out, x, planes, n, k)


def test_rejects_bad_arguments(kquant):
    n, k = 16, 256
    _, planes = kquant.weight(n, k, 1)
    x = torch.randn(2, k, device=DEV)
    matmul = kquant.module.matmul
    with pytest.raises(ValueError):
        matmul(x[:, :128], planes, n, k)
    with pytest.raises(ValueError):
        matmul(x, {**planes, "scales": planes["scales"][:, :4]}, n, k)
    with pytest.raises(ValueError):
        matmul(x, planes, n, k, out=torch.empty(2, n, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError):
        kquant.module.repack(torch.zeros(2, 200, dtype=torch.uint8))


@pytest.mark.parametrize("choice", ["auto", "dp4a", "dequant"])
def test_an_empty_batch_under_every_decode_kernel(kquant, choice):
    """No rows (or no weight rows) give an empty product, whichever decode kernel quant_decode picks."""
    n, k = 16, 256
    _, planes = kquant.weight(n, k, 2)
    with choices.using(quant_decode=choice):
        out = kquant.module.matmul(torch.empty(0, k, dtype=torch.bfloat16, device=DEV), planes, n, k)
    assert out.shape == (0, n) and out.dtype == torch.bfloat16


def test_reference_path_off_the_kernels(kquant, monkeypatch):
    """Where the kernels do not run (CPU without the interpreter), `matmul` is `matmul_ref`."""
    n, k = 24, 256
    _, planes = kquant.weight(n, k, 2, device="cpu")
    x = torch.randn(3, k).to(torch.bfloat16)
    monkeypatch.setattr(kquant.module, "kernels_run", lambda t, kernel: False)
    assert torch.equal(kquant.module.matmul(x, planes, n, k), kquant.module.matmul_ref(x, planes, n, k))


# ----------------------------------------------------------------------------------------------
# GPU (pytest -m gpu)

GPU_SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288)]


def check_real_shape(fmt: KQuantFormat, n, k, m):
    """16-bit x at a real shape: the product, run to run and with and without a workspace. Returns the
    planes and the workspace."""
    _, planes = fmt.weight(n, k, seed_of("gpu", n, k), device="cuda")
    ws = torch.zeros(max(1, fmt.module.gemv_workspace_numel(n, k)), dtype=torch.int32, device="cuda")
    matmul = fmt.module.matmul
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).to(dtype)
        out = matmul(x, planes, n, k, workspace=ws)
        fmt.check_product(out, x, planes, n, k)
        assert torch.equal(matmul(x, planes, n, k, workspace=ws), out), "run to run"
        assert torch.equal(matmul(x, planes, n, k), out), "with and without a workspace"
    return planes, ws


def check_one_hot_gives_dequantized(fmt: KQuantFormat, m):
    """One-hot x at a real shape: the kernels' weights are `dequantize` rounded to bf16, bit for bit."""
    n, k = 4096, 4096
    _, planes = fmt.weight(n, k, 12, device="cuda")
    cols = torch.randperm(k, device="cuda")[:m]
    x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
    x[torch.arange(m, device="cuda"), cols] = 1
    want = fmt.module.dequantize(planes, n, k)[:, cols].t().to(torch.bfloat16)
    assert torch.equal(fmt.module.matmul(x, planes, n, k), want)


def check_batch_invariant_and_graph(fmt: KQuantFormat):
    """Rows 1..15 of a 16-row x give the bits they have in the whole batch; then the split GEMV's graph."""
    n, k = 4096, 4096
    _, planes = fmt.weight(n, k, 11, device="cuda")
    matmul = fmt.module.matmul
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    ws = torch.zeros(fmt.module.gemv_workspace_numel(n, k), dtype=torch.int32, device="cuda")
    full = matmul(x, planes, n, k, workspace=ws)
    for m in range(1, 16):
        assert torch.equal(matmul(x[:m].clone(), planes, n, k, workspace=ws), full[:m]), m
    check_split_gemv_graph(fmt, x, planes, n, k)


def check_split_gemv_graph(fmt: KQuantFormat, x, planes, n, k):
    """A split-K GEMV of x [16, K] at a real shape: the product, and its CUDA-graph replay's bits."""
    out = torch.empty(16, n, device="cuda", dtype=torch.bfloat16)
    cfg = GemvConfig(64, 128, split_k=5)
    ws = torch.zeros(fmt.module.gemv_workspace_numel(n, k, cfg), dtype=torch.int32, device="cuda")
    expect = fmt.gemv(x, planes, n, k, workspace=ws, config=cfg)
    fmt.check_product(expect, x, planes, n, k)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fmt.gemv(x, planes, n, k, out, workspace=ws, config=cfg)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 512])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_real_shapes(n, k, m):
    planes, _ = check_real_shape(Q4K, n, k, m)
    if m > 16:
        x = torch.randn(m, k, device="cuda") * 0.5
        check_product(matmul(x, planes, n, k), x, planes, n, k)  # fp32 x through the IEEE dot


@needs_cuda
@pytest.mark.gpu
def test_gpu_batch_invariant_and_graph():
    n, k = 4096, 4096
    _, planes = make_weight(n, k, 11, device="cuda")
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    full = matmul(x, planes, n, k)
    for rows in (slice(5, 6), slice(2, 9)):
        assert torch.equal(matmul(x[rows].clone(), planes, n, k), full[rows])
    check_split_gemv_graph(Q4K, x, planes, n, k)
