"""Batch-invariant dense GEMM (strata/kernels/matmul.py) against its torch reference.

CPU: the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at small
shapes (K 64-256 with a tail, N ≤ 96, M in 1, 3, 17, 64, 130), fp32 and bf16. The interpreter's own
bf16 dot multiplies raw bit patterns, so `_bf16_dot` widens bf16 operands to fp32 first (exact).
Its fp32 dot is a BLAS call whose order per element depends on the tile shape, so row invariance
under one configuration is checked with it as is, and across configurations with `_kstep_dot`, a
model of the hardware the kernel's construction targets: each element's K products added into the
running fp32 sum one k16 step at a time (16-bit) or one FMA at a time (fp32 "ieee"), in K order.
GPU (`pytest -m gpu`): the Qwen3-8B shapes in bf16, rows of M = 1 ... 2048 bitwise against the same
rows inside an M = 4096 launch (the test that decides whether per-M configurations are allowed),
every configuration `invariant_config` can pick against each other, bias and CUDA-graph replay
(timings: benchmarks/kernels/matmul.py).

Tolerances (max error / max |reference|, reference F.linear in fp32): fp32 1e-5 (summation order
only); bf16 1e-2 (one final bf16 rounding, ~4e-3 of the value, can differ from the reference's).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from strata.kernels import matmul as k_matmul
from strata.kernels.matmul import (
    BLOCK_K,
    FP32_CONFIG,
    INVARIANT_FALLBACK,
    WIDE_CONFIGS,
    MatmulConfig,
    check_config,
    decode_config,
    invariant_config,
    invariant_split_k,
    invariant_workspace_parts,
    matmul_invariant,
    matmul_ref,
    matmul_triton,
)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="models the interpreter's dot")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
CPU_MS = (1, 3, 17, 64, 130)
SHAPES_8B = [  # (name, N, K), Qwen3-8B
    ("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288),
    ("lm_head", 151936, 4096),
]


@pytest.fixture
def split_ranges(monkeypatch):
    """Split K ranges on (`matmul.SPLIT_RANGES`: off in the product, where walking them costs reads)."""
    monkeypatch.setattr(k_matmul, "SPLIT_RANGES", True)


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def make_inputs(seed, m, n, k, dtype, *, bias=False, x_pad=0, device=DEV):
    """x [m, k] (a column slice of a wider NaN-filled buffer when x_pad > 0), weight, bias."""
    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
    x = randn(m, k).to(dtype)
    w = (randn(n, k) * k ** -0.5).to(dtype)
    b = randn(n).to(dtype) if bias else None
    if x_pad:
        wide = torch.full((m, k + x_pad), float("nan"), dtype=dtype, device=device)
        wide[:, :k] = x
        x = wide[:, :k]
    return x, w, b


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def make_cancelling(x: torch.Tensor, weight: torch.Tensor) -> None:
    """In place: weight's second half of K repeats its first half and x's even rows negate theirs
    there, so those rows' exact products are 0 and what comes out is the residue of the fp32 roundings
    on the way. A 16-bit output rounds away nearly every fp32 difference of an ordinary row; these
    rows show any difference in the order or rounding of the sums."""
    half = x.shape[1] // 2
    weight[:, half:2 * half] = weight[:, :half]
    x[0::2, half:2 * half] = -x[0::2, :half]


def cancelling_inputs(seed, m, n, k, dtype, device=DEV):
    """x [m, k], weight [n, k] whose even rows cancel (`make_cancelling`): their outputs are rounding
    residues that show any fp32 difference. x's exponents spread over 2^±12 so that partial sums round."""
    x, w, _ = make_inputs(seed, m, n, k, torch.float32, device=device)
    spread = torch.randint(-12, 13, (m, k), generator=torch.Generator().manual_seed(seed)).to(device)
    x = (x * torch.exp2(spread.float())).to(dtype)
    w = w.to(dtype)
    make_cancelling(x, w)
    return x, w


def _as_float(handle) -> np.ndarray:
    import triton.language as tl

    if handle.dtype == tl.bfloat16:  # stored as uint16 bit patterns
        return (handle.data.astype(np.uint32) << 16).view(np.float32)
    return handle.data.astype(np.float32)


@pytest.fixture(autouse=True)
def _bf16_dot(monkeypatch):
    """The interpreter's dot with bf16 operands widened to fp32 (exact) before np.matmul."""
    if not INTERPRETED:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype != tl.bfloat16 and b.dtype != tl.bfloat16:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        prod = np.matmul(_as_float(a), _as_float(b), dtype=np.float32)
        return interpreter.TensorHandle(prod + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture
def kstep_dot(monkeypatch):
    """The interpreter's dot as the hardware model of the module docstring: per element, the running
    fp32 sum takes its K products in K order, 16 at a time (the 16-bit MMA's k16 step, summed
    exactly in fp64 and rounded into fp32 once) or one at a time ("ieee" fp32: an FMA chain, each
    product exact in fp64). Any tile shape then gives the same bits, as the device should."""
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        lhs, rhs = _as_float(a).astype(np.float64), _as_float(b).astype(np.float64)
        step = 1 if input_precision is not None and "IEEE" in str(input_precision).upper() else 16
        acc = d.data.astype(np.float32)
        for k0 in range(0, lhs.shape[1], step):
            part = np.zeros(acc.shape, dtype=np.float64)
            for kk in range(k0, min(k0 + step, lhs.shape[1])):
                part += lhs[:, kk, None] * rhs[None, kk, :]
            acc = (acc.astype(np.float64) + part).astype(np.float32)
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def run_checked(x, w, b, config=None, out_pad=0):
    """matmul_triton into a NaN-poisoned out, a column slice of a wider buffer whose extra columns hold
    a sentinel that must survive."""
    m, n = x.shape[0], w.shape[0]
    wide = torch.full((m, n + out_pad), 7.0, dtype=x.dtype, device=x.device)
    out = wide[:, :n]
    out.fill_(float("nan"))
    got = matmul_triton(x, w, b, out, config=config)
    assert got.data_ptr() == out.data_ptr()
    if out_pad:
        assert (wide[:, n:] == 7.0).all(), "write outside out"
    assert torch.isfinite(out).all(), "unwritten NaN poison"
    return out


# (m, n, k, config or None for invariant_config, bias, x_pad, out_pad)
CASES = [
    (1, 96, 64, None, True, 0, 0),
    (3, 40, 256, None, False, 8, 3),
    (17, 96, 200, None, True, 0, 0),  # K tail: 200 = 3 x 64 + 8
    (64, 72, 128, MatmulConfig(64, 16, num_stages=2), False, 0, 0),
    (130, 96, 192, MatmulConfig(128, 64, num_warps=8, num_stages=3, group_m=2), True, 0, 5),
    (130, 50, 128, MatmulConfig(64, 128, block_k=32), True, 16, 0),
    (5, 40, 1100, MatmulConfig(64, 32, split_k=4), True, 0, 2),  # split programs, K tail in the last range
    (70, 40, 1100, MatmulConfig(64, 32, split_k=4), True, 8, 0),  # the same ranges walked in-program
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[0]}-n{c[1]}-k{c[2]}-{'cfg' if c[3] else 'auto'}")
def test_matches_reference(case, dtype):
    m, n, k, config, bias, x_pad, out_pad = case
    x, w, b = make_inputs(seed_of(case, dtype), m, n, k, dtype, bias=bias, x_pad=x_pad)
    out = run_checked(x, w, b, config, out_pad)
    assert out.dtype == dtype
    err = rel_err(out, matmul_ref(x, w, b))
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_invariant_across_m(dtype):
    """With the configurations `invariant_config` picks (the interpreter's own dot): rows of every M
    bitwise equal to the same rows of the largest launch, and a row among other neighbours. (The
    interpreter's BLAS dot depends on a row's place in the tile, so rows moved to another offset are
    checked on the k-step model below; on the device by the GPU test.)"""
    n, k = 96, 200
    x, w, b = make_inputs(seed_of("inv", dtype), max(CPU_MS), n, k, dtype, bias=True)
    full = matmul_invariant(x, w, b)
    for m in CPU_MS[:-1]:
        assert torch.equal(matmul_invariant(x[:m], w, b), full[:m]), f"M={m}"
    other, _, _ = make_inputs(seed_of("inv-other", dtype), 5, n, k, dtype)
    other[2] = x[66]  # row 2 of the second 64-row tile
    assert torch.equal(matmul_invariant(other, w, b)[2], full[66]), "a row among different neighbours"


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_invariant_across_configs_on_the_kstep_model(kstep_dot, dtype):
    """Under the hardware model (fixture `kstep_dot`), every configuration the selection can pick,
    the fallback and odd tiles (other BLOCK_K too) give bitwise the same rows as M = 1 under the
    decode configuration: the kernel keeps K order, chains the accumulator and keeps rows and columns
    apart. K = 136 has a tail, and 72 columns leave tiles part empty.

    Even rows cancel (`cancelling_inputs`): a kernel that added per-block partial sums
    (`acc += tl.dot(a, b)`) fails here in fp32 and in bf16."""
    n, k, m = 72, 136, 130
    x, w = cancelling_inputs(seed_of("kstep", dtype), m, n, k, dtype)
    rows = (0, 64, 65, 129)
    alone = {i: run_checked(x[i:i + 1], w, None)[0] for i in rows}
    assert alone[0].abs().max() > 0, "no residue: the cancelling rows would test nothing"
    configs = {decode_config(n), *WIDE_CONFIGS, INVARIANT_FALLBACK, MatmulConfig(64, 16, num_stages=2),
               MatmulConfig(256, 32, num_warps=8, group_m=1), MatmulConfig(64, 32, block_k=128),
               MatmulConfig(128, 64, block_k=32)}
    if dtype == torch.float32:
        configs.add(FP32_CONFIG)
    for cfg in configs:
        out = run_checked(x, w, None, cfg)
        for i in rows:
            assert torch.equal(out[i], alone[i]), f"{cfg}: row {i}"
    shifted = run_checked(x[37:], w, None, WIDE_CONFIGS[0])  # rows elsewhere in their tiles
    for i in rows[1:]:
        assert torch.equal(shifted[i - 37], alone[i]), f"row {i} at offset 37"
    assert rel_err(out[1::2], matmul_ref(x[1::2], w)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_ranges_rows_invariant_across_m(split_ranges, dtype):
    """A weight whose K takes split ranges (`invariant_split_k` = 2 here): decode-sized launches run
    each range as a program of its own and the last adds them; a 70-row launch walks the ranges in each
    program. Rows bitwise equal either way, bias included, and near F.linear. A second launch reuses
    the workspace (its counters back at zero)."""
    n, k = 40, 1100  # 18 K blocks, the last one 12 wide
    assert invariant_split_k(n, k) == 2
    x, w, b = make_inputs(seed_of("split", dtype), 70, n, k, dtype, bias=True)
    full = matmul_invariant(x, w, b)
    assert rel_err(full, matmul_ref(x, w, b)) <= TOL[dtype]
    counters, partials = invariant_workspace_parts(n, k)
    ws = torch.zeros(counters + partials, dtype=torch.int32, device=DEV)
    for m in (1, 3, 64):
        for _ in range(2):
            assert torch.equal(matmul_invariant(x[:m], w, b, workspace=ws), full[:m]), f"M={m}"
    assert not ws[:counters].any(), "counters left non-zero"


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_ranges_across_configs_on_the_kstep_model(kstep_dot, dtype):
    """Under the hardware model, tiles of every shape with the same ranges give a row the bits of M = 1
    (cancelling rows), and the ranges do change them: 1 and 4 ranges differ on some cancelling row."""
    n, k, m = 40, 1100, 130
    x, w = cancelling_inputs(seed_of("kstep-split", dtype), m, n, k, dtype)
    rows = (0, 2, 64, 66, 129)
    base = replace(decode_config(n), split_k=4)
    alone = {i: run_checked(x[i:i + 1], w, None, base)[0] for i in rows}
    for cfg in (base, replace(WIDE_CONFIGS[0], split_k=4), replace(INVARIANT_FALLBACK, split_k=4),
                MatmulConfig(128, 64, num_warps=8, split_k=4)):
        out = run_checked(x, w, None, cfg)
        for i in rows:
            assert torch.equal(out[i], alone[i]), f"{cfg}: row {i}"
    unsplit = run_checked(x, w, None, decode_config(n))
    assert any(not torch.equal(unsplit[i], alone[i]) for i in rows if i % 2 == 0), "ranges changed nothing"


def test_config_selection():
    """Every configuration for the 8B shapes and M up to 16384 keeps BLOCK_K, stays on wgmma
    (BLOCK_M % 64, whole warp groups), fits the shared memory and gives enough programs at decode."""
    for _, n, k in SHAPES_8B:
        for m in (1, 8, 16, 64, 65, 100, 300, 512, 2048, 4096, 8192, 16384):
            cfg = invariant_config(m, n, k)
            check_config(cfg, torch.bfloat16)
            assert cfg.block_k == BLOCK_K and cfg.block_m % 64 == 0 and cfg.num_warps % 4 == 0
            assert cfg.smem_bytes() <= 220 << 10, (m, n, cfg)
        dec = invariant_config(1, n, k)
        assert dec == invariant_config(64, n, k) and dec.block_m == 64
        assert dec.tiles(1, n) >= 128, (n, dec)
    assert {invariant_config(m, n, k).split_k for _, n, k in SHAPES_8B for m in (1, 8192)} == {1}
    assert invariant_config(8192, 4096, 4096) == WIDE_CONFIGS[0]
    assert invariant_config(512, 4096, 4096).tiles(512, 4096) >= 116
    assert decode_config(4096).block_n == 32 and decode_config(24576).block_n == 64
    assert decode_config(151936).block_n == 128
    for cfg in (*WIDE_CONFIGS, INVARIANT_FALLBACK):
        check_config(cfg, torch.bfloat16)
    check_config(FP32_CONFIG, torch.float32)


def test_split_range_policy(split_ranges):
    """With ranges on: from the weight's shape only, whatever M, enough programs at decode."""
    splits = {name: invariant_split_k(n, k) for name, n, k in SHAPES_8B}
    assert splits == {"qkv": 2, "o_proj": 4, "gate_up": 1, "down": 4, "lm_head": 1}
    for _, n, k in SHAPES_8B:
        assert {invariant_config(m, n, k).split_k for m in (1, 64, 65, 8192)} == {invariant_split_k(n, k)}
    assert invariant_config(8192, 4096, 4096) == replace(WIDE_CONFIGS[0], split_k=4)


def test_dispatch_and_validation():
    x, w, b = make_inputs(seed_of("dispatch"), 3, 40, 64, torch.float32, bias=True)
    assert rel_err(matmul_invariant(x, w, b), matmul_ref(x, w, b)) <= TOL[torch.float32]
    with pytest.raises(ValueError):
        matmul_triton(x, w[:, :32])  # K mismatch
    with pytest.raises(ValueError):
        matmul_triton(x, w.to(torch.bfloat16))  # dtype mismatch
    with pytest.raises(ValueError):
        matmul_triton(x.t().contiguous().t(), w)  # columns not contiguous
    with pytest.raises(ValueError):
        matmul_triton(x, w, b[:10])
    with pytest.raises(ValueError):
        matmul_triton(x, w, out=torch.empty(3, 41, device=DEV))
    with pytest.raises(ValueError):
        matmul_triton(x.to(torch.bfloat16), w.to(torch.bfloat16), config=MatmulConfig(32, 32))  # not wgmma
    assert matmul_triton(x[:0], w).shape == (0, 40)


# ---------------------------------------------------------------------------------------------- GPU

GPU_SHAPES = [(n, k) for _, n, k in SHAPES_8B]
GPU_MS = (1, 3, 8, 64, 300, 2048)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_rows_invariant_against_m4096(shape):
    """The decisive test: rows of every M (decode tiles at M ≤ 64, other tile shapes, hence other
    wgmma N sizes, at 300 and 2048) bitwise equal to the same rows inside an M = 4096 launch, also at
    an offset that puts them elsewhere in their tiles. Even rows cancel (`cancelling_inputs`), so
    their outputs are rounding residues that show any difference in the fp32 sums; odd rows match
    F.linear."""
    n, k = shape
    x, w = cancelling_inputs(seed_of("gpu-inv", shape), 4096, n, k, torch.bfloat16, device="cuda")
    full = matmul_invariant(x, w)
    assert full[0::2].abs().max() > 0, "no residue: the cancelling rows would test nothing"
    assert rel_err(full[1::2], F.linear(x[1::2].float(), w.float())) <= TOL[torch.bfloat16]
    configs = {invariant_config(m, n, k) for m in (*GPU_MS, 4096)}
    assert len(configs) >= 2, "the test would compare one configuration with itself"
    for m in GPU_MS:
        for start in (0, 37):
            got = matmul_invariant(x[start:start + m], w)
            same = (got == full[start:start + m]).all(dim=1)
            assert same.all(), (f"M={m} at row {start} ({invariant_config(m, n, k)} vs {invariant_config(4096, n, k)}):"
                                f" {(~same).sum().item()} of {m} rows differ")
    assert torch.equal(matmul_invariant(x, w), full), "not deterministic run to run"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_every_config_agrees(dtype):
    """Diagnostic for the test above: each configuration the selection can pick, and the fallback,
    against the decode configuration on the same 512 rows (half of them cancelling), all reported."""
    n, k = 4096, 4096
    x, w = cancelling_inputs(seed_of("gpu-configs", dtype), 512, n, k, dtype, device="cuda")
    base = matmul_triton(x, w, config=decode_config(n))
    differ = []
    for cfg in (*WIDE_CONFIGS, INVARIANT_FALLBACK, decode_config(24576), decode_config(151936)):
        same = (matmul_triton(x, w, config=cfg) == base).all(dim=1)
        if not same.all():
            differ.append(f"{cfg}: {(~same).sum().item()} of 512 rows")
    assert not differ, "configurations whose rows differ from the decode one:\n" + "\n".join(differ)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_bias_matches_linear(shape):
    n, k = shape
    x, w, b = make_inputs(seed_of("gpu-bias", shape), 512, n, k, torch.bfloat16, bias=True, device="cuda")
    full = matmul_invariant(x, w, b)
    assert rel_err(full, F.linear(x.float(), w.float(), b.float())) <= TOL[torch.bfloat16]
    for m in (1, 8):
        assert torch.equal(matmul_invariant(x[:m], w, b), full[:m]), f"M={m}"


@pytest.mark.gpu
@needs_cuda
def test_gpu_fp32():
    x, w, b = make_inputs(seed_of("gpu-fp32"), 300, 512, 1024, torch.float32, bias=True, device="cuda")
    full = matmul_invariant(x, w, b)
    assert rel_err(full, matmul_ref(x, w, b)) <= TOL[torch.float32]
    assert torch.equal(matmul_invariant(x[5:6], w, b)[0], full[5])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [8, 512])
def test_gpu_cuda_graph_replay(m):
    """Captured once (with bias, into a given out), replayed with new inputs in the same tensors."""
    n, k = 6144, 4096
    x, w, b = make_inputs(seed_of("graph", m), m, n, k, torch.bfloat16, bias=True, device="cuda")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        matmul_invariant(x, w, b, out)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        matmul_invariant(x, w, b, out)
    for step in range(3):
        new_x, _, _ = make_inputs(seed_of("graph", m, step), m, n, k, torch.bfloat16, device="cuda")
        x.copy_(new_x)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, matmul_invariant(x, w, b))
        assert rel_err(out, matmul_ref(x, w, b)) <= TOL[torch.bfloat16]
