"""Q8_0 GEMM on int8 tensor cores with the dp4a GEMV's arithmetic, so that its rows are bitwise the
GEMV's: the same x rows give the same bits at any M (issue 15 over Q8_0 weights, at decode speed).

The dp4a GEMV (`dp4a.py`) already gives a row the same bits at any M up to 16: x quantized to int8 per
32 values (`dp4a.quantize_ref`), exact int32 sums per group, each scaled (`(isum · d) · dx`, fp32),
a step's groups added by the pairwise tree, steps in K order from zero, and split-K ranges fixed by the
weight's shape (`dp4a.gemv_config(n, k)`) added in range order. This kernel computes the same values
for any M: x is quantized once (`quantize_rows`, `dp4a._quantize_row` row by row), each group's sum is
one int8 MMA of K = 32 from zero (exact, whatever the instruction's internal order), and the epilogue
is the GEMV's, operation for operation, with the ranges walked in each program. So a request can run
its decode steps through the default GEMV and its prompt through this kernel, and no row depends on
what else is in the batch (`matmul`: ≤ MAX_ROWS rows the GEMV, more this kernel).

It is not the invariant kernel that `--batch-invariant` runs today (`invariant.py`, x in 16 bits
against the dequantized weight); the arithmetic differs (x rounded to int8 per group, as llama.cpp's
MMQ and the default decode path do). STATUS: bitwise the GEMV's rows in the interpreter and on the
H200 (tests/kernels/test_quant_mmq.py; `python -m strata.kernels.quant.q8_0_mmq` at the Qwen3-8B shapes,
M = 17 … 4096), but slow: 52-69 TFLOP/s, 13.6x cuBLAS on the bf16 weight at M = 4096
(bench/results/q8_0_mmq_bench_cuda.txt). Each group's fp32 epilogue over the whole output tile runs on
the CUDA cores and bounds it; `--batch-invariant` does not use it (docs/DETERMINISM.md).

Launched without FMA contraction, as the GEMV is: a contracted `(isum · d) · dx + …` would round
differently from it. PDL prologue first, launched with `launch_pdl`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels.pdl import pdl_prologue
from strata.kernels.quant import dp4a
from strata.kernels.quant.dp4a import GROUP, MAX_ROWS, _quantize_row
from strata.kernels.tiles import grouped_tile
from strata.kernels.triton_import import jit, tl, triton


@dataclass(frozen=True)
class MmqConfig:
    block_m: int  # x rows per program
    block_n: int  # weight rows per program
    block_k: int  # values per step: the GEMV's (its pairwise tree spans one step)
    split_k: int  # K ranges: the GEMV's
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8


def mmq_config(n: int, k: int) -> MmqConfig:
    """The GEMV's step and ranges (`dp4a.gemv_config(n, k)`, which fix the bits) over 64 x 128 tiles on
    eight warps: of the tiles compiled for sm_90 (`tests/sm90_cases.py`), the one with the fewest
    spilled instructions (~400; 128 x 128 ~1,400). Not swept on the device (module docstring)."""
    gemv = dp4a.gemv_config(n, k)
    return MmqConfig(64, 128, gemv.block_k, gemv.split_k, num_warps=8)


# ----------------------------------------------------------------------------------------------
# Definition


def mmq_ref(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, block_k: int, split_k: int) -> torch.Tensor:
    """fp32 [M, N]: the GEMV's value before its rounding to x's dtype, split-K ranges included (range
    s covers steps [s · S / split_k, (s + 1) · S / split_k) of S = K / block_k; their sums added in
    range order)."""
    k = qs.shape[1]
    terms = dp4a.group_terms_ref(x, qs, d)
    per_step, steps = block_k // GROUP, k // block_k
    total = None
    for s in range(split_k):
        lo, hi = s * steps // split_k, (s + 1) * steps // split_k
        part = dp4a.accumulate_ref(terms[:, :, lo * per_step : hi * per_step].contiguous(), per_step)
        total = part if total is None else total + part
    return total


# ----------------------------------------------------------------------------------------------
# Kernels


@jit
def _quantize_kernel(x_ptr, x_stride, words_ptr, dx_ptr, k, BLOCK_G: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (row, block of BLOCK_G groups): `dp4a._quantize_row` on them; int8 quants as int32 words
    (four per word, memory order) and one fp32 scale per group."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    ok = g < k // 32
    j = tl.arange(0, 32)
    xv = tl.load(x_ptr + row * x_stride + g[:, None] * 32 + j[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    words, dx = _quantize_row(xv)
    w = tl.arange(0, 8)
    tl.store(words_ptr + row * (k // 4) + g[:, None] * 8 + w[None, :], words, mask=ok[:, None])
    tl.store(dx_ptr + row * (k // 32) + g, dx, mask=ok)


@jit
def _term(xq_ptrs, q_ptrs, dx_ptrs, d_ptrs, row_ok, col_ok, g):
    """Group g of the step: ((isum · d) · dx) [BLOCK_M, BLOCK_N] fp32, isum one exact int8 MMA."""
    a = tl.load(xq_ptrs + g * 32, mask=row_ok[:, None], other=0)
    b = tl.load(q_ptrs + g * 32, mask=col_ok[:, None], other=0)
    isum = tl.dot(a, tl.trans(b), out_dtype=tl.int32)
    dw = tl.load(d_ptrs + g, mask=col_ok, other=0.0).to(tl.float32)
    dx = tl.load(dx_ptrs + g, mask=row_ok, other=0.0)
    return (isum.to(tl.float32) * dw[None, :]) * dx[:, None]


@jit(do_not_specialize=["m"])
def _mmq_kernel(xq_ptr, dx_ptr, qs_ptr, d_ptr, out_ptr, out_stride, m, n, k, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
                USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    G: tl.constexpr = BLOCK_K // 32
    tile_m, tile_n = grouped_tile(tl.program_id(0), m, n, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    col_ok = cols < n
    j = tl.arange(0, 32)
    steps = k // BLOCK_K
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    pend1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    pend2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    pend4 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(SPLIT_K):  # the GEMV's K ranges, in range order (`split_k_range`, `split_k_reduce`)
        first = s * steps // SPLIT_K
        xq_ptrs = xq_ptr + rows.to(tl.int64)[:, None] * k + first * BLOCK_K + j[None, :]
        q_ptrs = qs_ptr + cols.to(tl.int64)[:, None] * k + first * BLOCK_K + j[None, :]
        dx_ptrs = dx_ptr + rows.to(tl.int64) * (k // 32) + first * G
        d_ptrs = d_ptr + cols.to(tl.int64) * (k // 32) + first * G
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(first, (s + 1) * steps // SPLIT_K):
            # One group an iteration, the step's pairwise tree (`dp4a._pairwise_sum`) carried in three
            # pending tiles: unrolled, the G MMAs were all in flight at once and their int32 tiles
            # spilled (thousands of local loads and stores in the sm_90 compile).
            for g in range(G):
                t = _term(xq_ptrs, q_ptrs, dx_ptrs, d_ptrs, row_ok, col_ok, g)
                top = t
                if G >= 2:
                    pair = pend1 + t  # t(g-1) + t(g), used at odd g
                    pend1 = tl.where(g % 2 == 0, t, pend1)
                    top = pair
                if G >= 4:
                    quad = pend2 + pair  # the two pairs of a quad, used at g % 4 == 3
                    pend2 = tl.where(g % 4 == 1, pair, pend2)
                    top = quad
                if G == 8:
                    top = pend4 + quad  # the two quads, at g == 7
                    pend4 = tl.where(g % 8 == 3, quad, pend4)
                acc = tl.where(g == G - 1, acc + top, acc)
            xq_ptrs += BLOCK_K
            q_ptrs += BLOCK_K
            dx_ptrs += G
            d_ptrs += G
        # The first range's sum as it is (not 0 + it: the sign of a zero), the others added in order.
        total = tl.where(s == 0, acc, total + acc)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Host side


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (contiguous rows, K % 32 == 0) -> (xq int8 [M, K], dx fp32 [M, K/32]): `dp4a.quantize_ref`
    bit for bit."""
    from strata.kernels import use_pdl

    m, k = x.shape
    if k % GROUP or x.stride(1) != 1:
        raise ValueError(f"quantize_rows: x {tuple(x.shape)} needs K % 32 == 0 and contiguous rows")
    xq = torch.empty(m, k, dtype=torch.int8, device=x.device)
    dx = torch.empty(m, k // GROUP, dtype=torch.float32, device=x.device)
    block_g = 8
    on = use_pdl(x)
    _quantize_kernel[(m, triton.cdiv(k // GROUP, block_g))](x, x.stride(0), xq.view(torch.int32), dx, k,
                                                            BLOCK_G=block_g, USE_PDL=on, launch_pdl=on,
                                                            enable_fp_fusion=False)
    return xq, dx


def q8_mmq(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, out: torch.Tensor | None = None, *,
           config: MmqConfig | None = None) -> torch.Tensor:
    """x [M, K] (16-bit or fp32, contiguous rows) @ Q8_0 planes (qs int8 [N, K], d fp16 [N, K/32]) ->
    [M, N] in x's dtype, each row bitwise `dp4a.q8_gemv_dp4a`'s for that row under the same step and
    ranges (`mmq_config`)."""
    from strata.kernels import use_pdl

    m, k = x.shape
    n = qs.shape[0]
    if k % 64:  # the GEMV's steps are 64-256 values
        raise ValueError(f"q8_mmq: K={k} is not a multiple of 64")
    cfg = config or mmq_config(n, k)
    if k % cfg.block_k or qs.shape[1] != k or not 1 <= cfg.split_k <= k // cfg.block_k:
        raise ValueError(f"q8_mmq: x {tuple(x.shape)}, qs {tuple(qs.shape)}, {cfg}")
    xq, dx = quantize_rows(x)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    on = use_pdl(x)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _mmq_kernel[grid](xq, dx, qs, d, out, out.stride(0), m, n, k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, GROUP_M=cfg.group_m, USE_PDL=on, launch_pdl=on,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False)
    return out


def matmul(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, out: torch.Tensor | None = None, *,
           workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ Q8_0 planes with one arithmetic for every M: the dp4a GEMV up to MAX_ROWS rows (its
    split-K in `workspace`, zeroed int32 of >= `dp4a.workspace_numel(n, k)`; None allocates), this
    kernel beyond. A row's bits do not depend on M or on the other rows."""
    if x.shape[0] <= MAX_ROWS:
        return dp4a.q8_gemv_dp4a(x, qs, d, out, workspace=workspace, config=dp4a.gemv_config(*qs.shape))
    return q8_mmq(x, qs, d, out)


# ----------------------------------------------------------------------------------------------
# Device check and timing (CUDA): python -m strata.kernels.quant.q8_0_mmq


def bench(shapes=dp4a.SWEEP_SHAPES, ms=(17, 64, 512, 2048, 4096), runs: int = 30) -> None:
    """Per Qwen3-8B shape and M: whether the rows are bitwise the GEMV's (M's first rows against the
    GEMV on them), and the µs of this kernel (quantization included) against the default Q8_0 path
    (`q8_0.matmul`: dequantize + cuBLAS at these sizes) and cuBLAS on the bf16 weight."""
    from strata.kernels.quant import q8_0
    from strata.kernels.timing import time_us

    print(f"{'N x K':>12} {'M':>5} | {'bitwise':>7} | {'mmq us':>8} {'q8_0 us':>8} {'bf16 us':>8} | TFLOP/s", flush=True)
    for n, k in shapes:
        planes = q8_0.repack(torch.from_numpy(q8_0.random_raw(n, k, seed=n + k)).cuda())
        qs, d = planes["qs"], planes["d"]
        dense = q8_0.dequantize(planes, n, k).to(torch.bfloat16)
        ws = torch.zeros(max(1, dp4a.workspace_numel(n, k)), dtype=torch.int32, device="cuda")
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            rows = min(m, MAX_ROWS)
            same = torch.equal(q8_mmq(x, qs, d)[:rows], dp4a.q8_gemv_dp4a(x[:rows], qs, d, workspace=ws))
            t_mmq = time_us([lambda: q8_mmq(x, qs, d, out)], runs)
            t_own = time_us([lambda: q8_0.matmul(x, planes, n, k, out)], runs)
            t_bf16 = time_us([lambda: torch.matmul(x, dense.t(), out=out)], runs)
            print(f"{n:>6}x{k:<5} {m:>5} | {str(same):>7} | {t_mmq:8.2f} {t_own:8.2f} {t_bf16:8.2f} | "
                  f"{2 * m * n * k / t_mmq / 1e6:6.1f}", flush=True)
        del planes, qs, d, dense, ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("the MMQ benchmark needs a CUDA device")
    bench()
