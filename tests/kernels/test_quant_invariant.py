"""Batch-invariant GEMM over weights kept quantized (strata/kernels/quant/invariant.py): Q8_0 and FP8.

CPU: the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), fp32 and
bf16 x (the kernel widens decoded 16-bit operands to fp32 there, exactly, for an "ieee" dot). Small
shapes; K with a tail where the format allows one (Q8_0: K % 64 == 32, one group in the last step;
FP8: any K). Row invariance: the interpreter's own fp32 dot is a BLAS call whose summation order may
follow the tile's shape, so rows are compared under `fma_chain_dot`, the hardware model of the "ieee"
dot (each element's products added into the running fp32 sum one FMA at a time, in K order), which
gives every tile shape the same bits, as the device should. Split K ranges (`invariant_split_k` of a
K of 1100-1152): decode-sized launches run each range as a program of its own (workspace counters
back at zero after each), longer ones walk the ranges in each program, bitwise alike.
GPU (`pytest -m gpu`): Qwen3-8B shapes in bf16, rows of M = 1 ... 2048 bitwise against the same rows
inside an M = 4096 launch (even rows cancelling, so their outputs are fp32 rounding residues),
fp32 on CUDA and CUDA-graph replay (timings: benchmarks/kernels/quant_invariant.py).

Tolerances (max error / max |reference|; reference: dequantized weight, F.linear in fp32): fp32 1e-5
(summation order, FP8's scale applied after the sum); bf16 1e-2 (one final bf16 rounding, up to one
bf16 step apart from the reference's).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from strata.kernels import matmul as k_matmul
from strata.kernels.matmul import (
    DECODE_MAX_M,
    INVARIANT_FALLBACK,
    WIDE_CONFIGS,
    MatmulConfig,
    decode_config,
    invariant_split_k,
    invariant_workspace_parts,
)
from strata.kernels.quant import QWeight, QWeightStack, random_blocks
from strata.kernels.quant import invariant as k_quant_invariant
from strata.kernels.quant.invariant import (
    FORMATS,
    invariant_q_workspace_parts,
    matmul_invariant_q,
    matmul_invariant_q_ref,
    matmul_invariant_q_triton,
    q_config,
    supports,
)

from test_matmul import split_ranges  # noqa: F401 (a fixture)
from test_matmul import CUDA, DEV, needs_cuda, needs_interpreter, rel_err, seed_of

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
FMTS = pytest.mark.parametrize("fmt", FORMATS)


def make_weight(fmt: str, n: int, k: int, seed: int, device=DEV, cancel: bool = False) -> tuple[QWeight, int]:
    """A random Q8_0 or FP8 weight [n, k] and `half`: with `cancel`, columns half .. 2·half repeat
    columns 0 .. half exactly (whole Q8_0 blocks: half is a multiple of 32), else 0."""
    gen = torch.Generator(device=device).manual_seed(seed)
    half = (k // 2) // 32 * 32 if cancel else 0
    if fmt == "FP8":
        dense = torch.randn(n, k, generator=gen, device=device) * k ** -0.5
        dense[:, half : 2 * half] = dense[:, :half]
        return QWeight.from_raw("FP8", dense, n, k), half
    raw = random_blocks("Q8_0", n, k, gen, device)
    blocks = raw.view(n, k // 32, 34)
    blocks[:, half // 32 : 2 * half // 32] = blocks[:, : half // 32].clone()
    return QWeight.from_raw("Q8_0", raw, n, k), half


def make_x(m: int, k: int, dtype, seed: int, device=DEV, half: int = 0) -> torch.Tensor:
    """x with exponents spread over 2^±12 (so that partial sums round). With `half`, even rows negate
    columns 0 .. half in half .. 2·half and are zero beyond: against a `cancel` weight their exact
    products are 0, so what comes out is the residue of the fp32 roundings on the way."""
    gen = torch.Generator(device=device).manual_seed(seed)
    spread = torch.randint(-12, 13, (m, k), generator=gen, device=device).float()
    x = (torch.randn(m, k, generator=gen, device=device) * torch.exp2(spread)).to(dtype)
    if half:
        x[0::2, half : 2 * half] = -x[0::2, :half]
        x[0::2, 2 * half :] = 0
    return x


def run_checked(x, w, bias=None, config=None, out_pad=0):
    """The kernels into a NaN-poisoned out, a column slice of a wider buffer whose extra columns hold a
    sentinel that must survive."""
    m, n = x.shape[0], w.n
    wide = torch.full((m, n + out_pad), 7.0, dtype=x.dtype, device=x.device)
    out = wide[:, :n]
    out.fill_(float("nan"))
    got = matmul_invariant_q_triton(x, w, bias, out, config=config)
    assert got.data_ptr() == out.data_ptr()
    if out_pad:
        assert (wide[:, n:] == 7.0).all(), "write outside out"
    assert torch.isfinite(out).all(), "unwritten NaN poison"
    return out


@pytest.fixture
def fma_chain_dot(monkeypatch):
    """The interpreter's "ieee" dot as the device computes it: per element, acc = fma(a_k, b_k, acc)
    for k in order (each product exact in fp64, one rounding to fp32 per step)."""
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        assert "IEEE" in str(input_precision).upper(), "the CPU kernels widen every dot to fp32 ieee"
        lhs, rhs = a.data.astype(np.float64), b.data.astype(np.float64)
        acc = d.data.astype(np.float32)
        for kk in range(lhs.shape[1]):
            acc = (acc.astype(np.float64) + lhs[:, kk, None] * rhs[None, kk, :]).astype(np.float32)
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


# (fmt, m, n, k, bias, x_pad, out_pad)
CASES = [
    ("Q8_0", 3, 40, 160, True, 0, 3),  # K tail: 160 = 2 x 64 + one group
    ("Q8_0", 17, 72, 128, False, 8, 0),
    ("FP8", 5, 40, 100, True, 8, 0),  # K tail: 100 = 64 + 36
    ("FP8", 66, 48, 128, False, 0, 5),
    ("Q8_0", 3, 40, 1152, True, 8, 2),  # two K ranges of 9 steps as programs of their own
    ("FP8", 2, 40, 1100, True, 0, 3),  # the same for FP8: its scale and bias after the ranges' sum
]


@DTYPES
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-m{c[1]}-n{c[2]}-k{c[3]}")
def test_matches_reference(case, dtype):
    fmt, m, n, k, has_bias, x_pad, out_pad = case
    seed = seed_of(case, dtype)
    w, _ = make_weight(fmt, n, k, seed)
    x = torch.randn(m, k + x_pad, generator=torch.Generator().manual_seed(seed)).to(dtype)[:, :k]
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)).to(dtype) if has_bias else None
    out = run_checked(x, w, bias, out_pad=out_pad)
    err = rel_err(out, matmul_invariant_q_ref(x, w, bias))
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


@needs_interpreter
@FMTS
@DTYPES
def test_rows_invariant_across_m(fma_chain_dot, monkeypatch, fmt, dtype):
    """Under `q_config`'s own choices: rows of M = 1, 3, 8 (the decode tile, 64 x 32) bitwise equal to
    the same rows of an M = 70 launch (past DECODE_MAX_M: the 64 x 128 wide tile), and a row alone
    equal to itself in the second row tile. K has a tail. `min_tiles` is lowered so that a small N
    reaches the wide tiles (at its real value N ≥ 3712 would: minutes in the interpreter)."""
    for module in (k_matmul, k_quant_invariant):
        monkeypatch.setattr(module, "min_tiles", lambda spec: 2)
    n, k, m = 96, 96, 70
    w, _ = make_weight(fmt, n, k, seed_of("inv", fmt))
    x = make_x(m, k, dtype, seed_of("inv-x", fmt, dtype))
    small, big = q_config(fmt, 1, n, k, dtype, False), q_config(fmt, m, n, k, dtype, False)
    assert m > DECODE_MAX_M and (small.block_n, big.block_n) == (32, 128), (small, big)
    full = matmul_invariant_q(x, w)
    for rows in (1, 3, 8):
        assert torch.equal(matmul_invariant_q(x[:rows], w), full[:rows]), f"M={rows}"
    assert torch.equal(matmul_invariant_q(x[66:67], w)[0], full[66]), "row 66 alone"
    assert rel_err(full, matmul_invariant_q_ref(x, w)) <= TOL[dtype]


@needs_interpreter
@FMTS
@DTYPES
def test_rows_invariant_across_configs(fma_chain_dot, fmt, dtype):
    """Every tile the selection can pick (and odd ones) gives bitwise the rows of M = 1 under the
    decode tile. Even rows cancel (`make_x` with `half`): their outputs are rounding residues, which a
    change in the order or grouping of the sums would change."""
    n, k, m = 72, 128, 130
    w, half = make_weight(fmt, n, k, seed_of("cfg", fmt), cancel=True)
    x = make_x(m, k, dtype, seed_of("cfg-x", fmt, dtype), half=half)
    rows = (0, 1, 64, 65, 128, 129)
    alone = {i: run_checked(x[i : i + 1], w)[0] for i in rows}
    assert any(alone[i].abs().max() > 0 for i in rows[0::2]), "no residue: the cancelling rows test nothing"
    configs = {decode_config(n), *WIDE_CONFIGS, INVARIANT_FALLBACK, MatmulConfig(64, 16, num_stages=2),
               MatmulConfig(256, 32, num_warps=8, group_m=1)}
    for cfg in configs:
        out = run_checked(x, w, None, MatmulConfig(cfg.block_m, cfg.block_n, 64, cfg.num_warps, cfg.num_stages,
                                                   cfg.group_m))
        for i in rows:
            assert torch.equal(out[i], alone[i]), f"{cfg}: row {i}"
    assert rel_err(out[1::2], matmul_invariant_q_ref(x[1::2], w)) <= TOL[dtype]


@needs_interpreter
@pytest.mark.parametrize("fmt, dtype", [("Q8_0", torch.float32), ("FP8", torch.bfloat16)],
                         ids=["Q8_0-fp32", "FP8-bf16"])
def test_split_ranges_rows_invariant_across_m(fma_chain_dot, split_ranges, fmt, dtype):
    """A weight whose K takes two ranges (`invariant_split_k`; K with a tail: Q8_0 1120 = 17 steps of
    64 and a group, FP8 1100 = 17 blocks and 12): M = 1 and 3 run each range as a program of its own
    (the last adds them), M = 70 walks the ranges in each program; rows bitwise equal (even rows
    cancel: their outputs are rounding residues, so no other grouping of the sums passes). The calls
    share one workspace (sized by `invariant_q_workspace_parts`), its counters back at zero after
    each. (K = 1152 would put the range boundary on the cancelling half: every residue exactly 0.)"""
    n, k = 40, {"Q8_0": 1120, "FP8": 1100}[fmt]
    assert invariant_split_k(n, k) == 2 and q_config(fmt, 1, n, k, dtype, False).split_k == 2
    w, half = make_weight(fmt, n, k, seed_of("split", fmt), cancel=True)
    x = make_x(70, k, dtype, seed_of("split-x", fmt, dtype), half=half)
    full = run_checked(x, w)
    assert full[0::2].abs().max() > 0, "no residue: the cancelling rows would test nothing"
    assert rel_err(full[1::2], matmul_invariant_q_ref(x[1::2], w)) <= TOL[dtype]
    counters, partials = invariant_q_workspace_parts(w)
    ws = torch.zeros(counters + partials, dtype=torch.int32, device=DEV)
    for start, rows in ((0, 3), (0, 1), (66, 1)):  # the second and third calls find the first's workspace
        got = matmul_invariant_q(x[start : start + rows], w, workspace=ws)
        assert torch.equal(got, full[start : start + rows]), f"M={rows} from row {start}"
        assert not ws[:counters].any(), "counters left non-zero"
    assert ws[counters:].any(), "no partials in the workspace: the ranges did not run as programs"


@needs_interpreter
@FMTS
def test_split_ranges_across_configs(fma_chain_dot, fmt):
    """Under the hardware model, tiles of other shapes with the same four ranges give a row the bits of
    M = 1 (split programs; cancelling rows), and the ranges do change them: one range and four differ
    on some cancelling row. K has a tail in the last, longer range: Q8_0 544 = 8 steps of 64 and one
    group, FP8 540 = 8 blocks of 64 and 28."""
    n, k, m = 40, {"Q8_0": 544, "FP8": 540}[fmt], 70
    w, half = make_weight(fmt, n, k, seed_of("split-cfg", fmt), cancel=True)
    x = make_x(m, k, torch.bfloat16, seed_of("split-cfg-x", fmt), half=half)
    rows = (0, 1, 64, 66)
    base = replace(decode_config(n), split_k=4)
    alone = {i: run_checked(x[i : i + 1], w, None, base)[0] for i in rows}
    for cfg in (base, replace(INVARIANT_FALLBACK, split_k=4), MatmulConfig(128, 64, num_warps=8, split_k=4)):
        out = run_checked(x, w, None, cfg)
        for i in rows:
            assert torch.equal(out[i], alone[i]), f"{cfg}: row {i}"
    assert rel_err(out[1::2], matmul_invariant_q_ref(x[1::2], w)) <= TOL[torch.bfloat16]
    unsplit = run_checked(x, w, None, decode_config(n))
    assert any(not torch.equal(unsplit[i], alone[i]) for i in rows if i % 2 == 0), "ranges changed nothing"


@DTYPES
def test_stack_fills_its_columns(dtype):
    """A stack of Q8_0, FP8 and Q8_0 parts (formats may mix) with a bias: each part's columns equal
    that part alone with its slice of the bias, bitwise, and the whole matches the reference."""
    k, m = 96, 5
    parts = tuple(make_weight(fmt, n, k, seed_of("stack", i))[0] for i, (fmt, n) in
                  enumerate((("Q8_0", 40), ("FP8", 24), ("Q8_0", 32))))
    stack = QWeightStack(parts)
    assert supports(stack) and stack.n == 96
    x = make_x(m, k, dtype, seed_of("stack-x", dtype))
    bias = torch.randn(stack.n, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = run_checked(x, stack, bias, out_pad=4)
    c = 0
    for p in parts:
        assert torch.equal(out[:, c : c + p.n], matmul_invariant_q_triton(x, p, bias[c : c + p.n])), p.ggml_type
        c += p.n
    assert rel_err(out, matmul_invariant_q_ref(x, stack, bias)) <= TOL[dtype]


def test_dispatch_config_and_validation(monkeypatch):
    q8, _ = make_weight("Q8_0", 40, 64, 1)
    fp8, _ = make_weight("FP8", 24, 64, 2)
    q4k = QWeight.from_raw("Q4_K", random_blocks("Q4_K", 16, 256, torch.Generator().manual_seed(0), "cpu"), 16, 256)
    assert supports(q8) and supports(fp8) and supports(QWeightStack((q8, fp8)))
    assert not supports(q4k) and not supports(QWeightStack((q8, q4k))) and not supports(torch.zeros(4, 4))
    x = make_x(3, 64, torch.float32, 4)
    assert rel_err(matmul_invariant_q(x, q8), matmul_invariant_q_ref(x, q8)) <= TOL[torch.float32]
    # The reference takes any leading dimensions and is row-invariant on the CPU (rows padded).
    x3 = make_x(6, 64, torch.float32, 5).view(2, 3, 64)
    ref3 = matmul_invariant_q_ref(x3, fp8)
    assert ref3.shape == (2, 3, 24) and torch.equal(matmul_invariant_q_ref(x3[1, 1:2], fp8)[0], ref3[1, 1])
    with pytest.raises(ValueError, match="Q4_K"):
        matmul_invariant_q_triton(make_x(2, 256, torch.float32, 6), q4k)
    with pytest.raises(ValueError):
        matmul_invariant_q_triton(x[:, :32], q8)  # K mismatch
    with pytest.raises(ValueError):
        matmul_invariant_q_triton(x.t().contiguous().t(), q8)  # columns not contiguous
    with pytest.raises(ValueError):
        matmul_invariant_q_triton(x, q8, torch.zeros(39))
    with pytest.raises(ValueError):
        matmul_invariant_q_triton(x, q8, out=torch.empty(3, 41))
    with pytest.raises(ValueError):
        matmul_invariant_q_triton(x, q8, config=MatmulConfig(64, 32, block_k=32))  # Q8_0 steps two groups
    assert matmul_invariant_q_triton(x[:0], q8).shape == (0, 40)
    # Configurations at the 8B shapes: BLOCK_K 64; Q8_0's accumulator leaves room for its part.
    for fmt in FORMATS:
        for n, k in ((6144, 4096), (4096, 12288), (24576, 4096)):
            for m in (1, 64, 65, 512, 4096, 16384):
                cfg = q_config(fmt, m, n, k, torch.bfloat16, True)
                assert cfg.block_k == 64 and cfg.block_m % 64 == 0 and cfg.num_warps % 4 == 0, (fmt, m, cfg)
                if fmt == "Q8_0":
                    assert cfg.block_m * cfg.block_n // (32 * cfg.num_warps) <= 64, (m, cfg)
                assert cfg.split_k == invariant_split_k(n, k), (fmt, m, cfg)
            # A decode launch's workspace is the 16-bit GEMM's for the same shape (`CausalLM.pack`).
            assert invariant_q_workspace_parts(QWeight(fmt, n, k, {})) == invariant_workspace_parts(n, k)
            one = {q_config(fmt, m, 4096, 4096, torch.float32, True) for m in (1, 64, 65, 4096)}
            assert len(one) == 1, one
    stack = QWeightStack((QWeight("FP8", 4096, 4096, {}), QWeight("Q8_0", 1024, 4096, {})))
    assert invariant_q_workspace_parts(stack) == (0, 0)  # one K range: no workspace
    monkeypatch.setattr(k_matmul, "SPLIT_RANGES", True)
    assert invariant_q_workspace_parts(stack) == (128, 4096 // 32 * 4 * 64 * 32)  # the 4096 part's, the larger
    assert invariant_q_workspace_parts(QWeight("Q8_0", 1024, 4096, {})) == (32, 1024 // 32 * 8 * 64 * 32)


# ---------------------------------------------------------------------------------------------- GPU

GPU_SHAPES = [(6144, 4096), (4096, 12288)]  # Qwen3-8B qkv and down
GPU_MS = (1, 3, 8, 64, 300, 2048)


@pytest.mark.gpu
@needs_cuda
@FMTS
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_rows_invariant_against_m4096(fmt, shape):
    """The decisive test: rows of every M (decode tiles at M ≤ 64, other tiles, hence other wgmma N
    sizes, at 300 and 2048) bitwise equal to the same rows inside an M = 4096 launch, also at an
    offset that puts them elsewhere in their tiles. Even rows cancel; odd rows match the reference."""
    n, k = shape
    w, half = make_weight(fmt, n, k, seed_of("gpu", fmt, shape), device="cuda", cancel=True)
    x = make_x(4096, k, torch.bfloat16, seed_of("gpu-x", fmt, shape), device="cuda", half=half)
    full = matmul_invariant_q(x, w)
    assert full[0::2].abs().max() > 0, "no residue: the cancelling rows would test nothing"
    assert rel_err(full[1::2], matmul_invariant_q_ref(x[1::2], w)) <= TOL[torch.bfloat16]
    configs = {q_config(fmt, m, n, k, x.dtype, True) for m in (*GPU_MS, 4096)}
    assert len(configs) >= 2, "the test would compare one configuration with itself"
    for m in GPU_MS:
        for start in (0, 37):
            got = matmul_invariant_q(x[start : start + m], w)
            same = (got == full[start : start + m]).all(dim=1)
            assert same.all(), (f"{fmt} M={m} at row {start} ({q_config(fmt, m, n, k, x.dtype, True)} vs "
                                f"{q_config(fmt, 4096, n, k, x.dtype, True)}): {(~same).sum().item()} of {m} rows differ")
    assert torch.equal(matmul_invariant_q(x, w), full), "not deterministic run to run"


@pytest.mark.gpu
@needs_cuda
@FMTS
def test_gpu_bias_stack_and_fp32(fmt):
    n, k = 4096, 4096
    w, _ = make_weight(fmt, n, k, seed_of("gpu-bias", fmt), device="cuda")
    x = make_x(512, k, torch.bfloat16, seed_of("gpu-bias-x", fmt), device="cuda")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    full = matmul_invariant_q(x, w, bias)
    assert rel_err(full, matmul_invariant_q_ref(x, w, bias)) <= TOL[torch.bfloat16]
    for m in (1, 8):
        assert torch.equal(matmul_invariant_q(x[:m], w, bias), full[:m]), f"M={m}"
    stack = QWeightStack((w, make_weight("Q8_0", 1024, k, 5, device="cuda")[0]))
    both = matmul_invariant_q(x, stack)
    assert torch.equal(both[:, :n], matmul_invariant_q(x, w)) and torch.equal(both[:1], matmul_invariant_q(x[:1], stack))
    x32 = x[:300].float()
    full32 = matmul_invariant_q(x32, w)
    assert rel_err(full32, matmul_invariant_q_ref(x32, w)) <= TOL[torch.float32]
    assert torch.equal(matmul_invariant_q(x32[5:6], w)[0], full32[5])


@pytest.mark.gpu
@needs_cuda
@FMTS
@pytest.mark.parametrize("m", [8, 512])
def test_gpu_cuda_graph_replay(fmt, m):
    """Captured once (with bias, into a given out), replayed with new inputs in the same tensors."""
    n, k = 6144, 4096
    w, _ = make_weight(fmt, n, k, seed_of("graph", fmt), device="cuda")
    x = make_x(m, k, torch.bfloat16, seed_of("graph-x", fmt, m), device="cuda")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        matmul_invariant_q(x, w, bias, out)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        matmul_invariant_q(x, w, bias, out)
    for step in range(3):
        x.copy_(make_x(m, k, torch.bfloat16, seed_of("graph-x", fmt, m, step), device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, matmul_invariant_q(x, w, bias))
