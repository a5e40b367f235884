"""Decode GEMV on packed int8 dot products for GGUF IQ3_S weights (the Q8_0 one's shape, `dp4a.py`).

The dequantizing IQ3_S GEMV spends ~12-15 instructions per weight (grid gather, sign, fp32
dequantization, bf16 packing, MMA operand moves) and decodes at 74 tok/s at 8B shapes on the H200.
Here a grid word already holds its four magnitudes (odd integers 1-15) as bytes, so it goes to
`dp4a` as it is once its signs are applied lane by lane: with the four sign bits as a byte mask `m`
(0x01 per negative lane), (word ^ 0xFF·m) + m negates exactly those lanes (255 − g + 1 = 256 − g never
carries into the next lane for g ≥ 1). The planes keep a sub-block's signs interleaved
(`iq3_s.interleave_signs`: group t's four at bit t of each byte), so `m` is one shift and one mask;
spreading four adjacent bits to the lanes took the file's order ~7 more instructions a word. Per
32-value sub-block the exact int32 sum against x's int8 quants (`dp4a.quantize_ref`) is scaled once by
d·(1 + 2·scale)·dx.

Semantics (`gemv_iq3s_dp4a_ref`): term = (d·(1 + 2·scale)) · dx · S per sub-block (fp32, in that order;
the first product is exact), a step's sub-blocks added by the pairwise tree, steps in K order,
split-K partials in split order. A row's result does not depend on the other rows.

STATUS: timed on the H200 against the dequantizing GEMV (`sweep`, the Qwen3-8B shapes; the seventh
round, both with the shared grid and interleaved signs): 1.9-2.2x faster at M = 1, 0.74-0.85x at M = 8;
whole-model decode at batch 1 went from 74 to 180, then 202, 207 and 230 tok/s.
`iq3_s.matmul` takes it up to `iq3_s.DP4A_MAX_ROWS` rows by default (STRATA_IQ3S_DECODE=auto).

Tried and measured (the fifth H200 round, bench/results/dp4a_sweep_round5_cuda.txt): the eight grid
words of a sub-block unrolled inside the thread that holds it, tensors [rows, sub-blocks], eight warps.
It cut the sm_90 loop from 9.3 to 5.8 SASS instructions per weight and gave the same bits, yet ran
1.22-1.38x slower at M = 1 (0.75-0.99x at M = 8) and took batch-1 decode from 202 to 120 tok/s: at
M = 1 this GEMV waits on memory, and the count of instructions did not predict it. Reverted.

Grid words through shared memory (`grid_words`, STRATA_IQ3S_GRID=shared, the default): the 512-word
table is loaded once a program and gathered with tl.gather, which Triton lowers through shared memory,
instead of 64 random global loads a thread per step through L1. Same words, same bits. The sixth H200
round: this GEMV 1.04-1.07x at 128-row tiles (bench/results/iq3s_grid_cuda.txt), batch-1 decode 201.7
-> 205.0 tok/s; the grouped MoE kernel's dequantizing tile, which shares `grid_words`, 1.22x at the
30B-A3B shape (docs/QUANTIZATION.md).
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from strata.env import ENV
from strata.kernels.pdl import pdl_prologue
from strata.kernels.quant.dp4a import (
    Dp4aConfig,
    _dp4a,
    _pairwise_sum,
    _quantize_row,
    accumulate_ref,
    config_for,
    launch,
    quantize_ref,
    sweep_against,
    workspace_for,
)
from strata.kernels.splitk import split_k_range, split_k_store
from strata.kernels.triton_import import jit, tl


def gemv_config(n: int, k: int) -> Dp4aConfig:
    """128 rows x 256 values (one super-block) per step, split-K to about four programs per SM
    (`dp4a.config_for`): 6144 x 4096 -> split 8, 24576 x 4096 -> 2, 4096 x 4096 and 4096 x 12288 -> 8.
    The H200 comparison of the sixth round (`--shared-grid`) ran those with 128 rows 1.04-1.10x faster
    than with 64 when the grid is gathered from shared memory (the sweeps' best at M = 1 also had 128)."""
    return config_for(n, k, block_ks=(256,), block_n=128)


def workspace_numel(n: int, k: int, config: Dp4aConfig | None = None) -> int:
    return workspace_for(config or gemv_config(n, k), n)


def gemv_iq3s_dp4a_ref(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int,
                       block_k: int = 256) -> torch.Tensor:
    """fp32 [M, N], the kernel's result before its rounding to x's dtype (no split-K)."""
    from strata.kernels.quant.iq3_s import signed_quants

    m = x.shape[0]
    values, db = signed_quants(planes, n, k)
    xq, dx = quantize_ref(x)
    # Integer sums of at most 32 · 15 · 127 are exact in fp32.
    sums = torch.einsum("mgj,ngj->mng", xq.view(m, k // 32, 32).float(), values)
    return accumulate_ref(db[None] * dx[:, None, :] * sums, block_k // 32)


@jit
def grid_table_words(grid_ptr, SHARED_GRID: tl.constexpr):
    """The 512 grid words in registers, once a program, for `grid_words` to gather from (0 when unused)."""
    if SHARED_GRID:
        return tl.load(grid_ptr + tl.arange(0, 512))
    else:
        return 0


@jit
def grid_words(grid_ptr, idx, table, SHARED_GRID: tl.constexpr):
    """The grid words at `idx` (int32, any shape, 0..511). SHARED_GRID: gathered from `table`
    (`grid_table_words`), which Triton lowers through shared memory; else loaded from the global table
    (through L1, where 32 lanes' random words touch ~14 of its 16 lines)."""
    if SHARED_GRID:
        flat = tl.reshape(idx, (idx.numel,))
        return tl.reshape(tl.gather(table, flat, 0), idx.shape)
    else:
        return tl.load(grid_ptr + idx)


@jit
def weight_words(qs_ptr, qh_ptr, signs_ptr, scales_ptr, d_ptr, grid_ptr, table, w_rows, sub, k,
                 SHARED_GRID: tl.constexpr):
    """Rows `w_rows` (int64 [R]) at sub-blocks `sub` (int32 [G], 32 values each) → (wq int32 [R, G, 8]: the
    signed 8-bit weights four to a word, in K order; db fp32 [R, G]: each sub-block's scale, exact)."""
    word = tl.arange(0, 8)
    idx = tl.load(qs_ptr + w_rows[:, None, None] * (k // 4) + (sub * 8)[None, :, None]
                  + word[None, None, :]).to(tl.int32)  # [R, G, 8]: a grid index per 4 values
    qh = tl.load(qh_ptr + w_rows[:, None] * (k // 32) + sub[None, :]).to(tl.int32)  # [R, G]
    idx |= ((qh << 8)[:, :, None] >> word[None, None, :]) & 256
    mags = grid_words(grid_ptr, idx, table, SHARED_GRID)  # four magnitudes per word, one per byte lane
    bits = tl.load(signs_ptr + w_rows[:, None] * (k // 32) + sub[None, :])  # one bit per value
    lanes = (bits[:, :, None] >> word[None, None, :]) & 0x01010101  # interleaved: 0x01 per negative lane
    wq = (mags ^ (lanes * 255)) + lanes  # the negative lanes negated
    sc = tl.load(scales_ptr + w_rows[:, None] * (k // 64) + (sub // 2)[None, :]).to(tl.int32)
    sc = (sc >> ((sub % 2) * 4)[None, :]) & 15
    d = tl.load(d_ptr + w_rows[:, None] * (k // 256) + (sub // 8)[None, :]).to(tl.float32)
    return wq, d * (1 + 2 * sc).to(tl.float32)


@jit(do_not_specialize=["m"])
def _iq3s_gemv_dp4a_kernel(x_ptr, x_stride, qs_ptr, qh_ptr, signs_ptr, scales_ptr, d_ptr, grid_ptr, out_ptr,
                           out_stride, partial_ptr, counter_ptr, m, n, k, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                           EMULATE: tl.constexpr, USE_PDL: tl.constexpr, SHARED_GRID: tl.constexpr):
    pdl_prologue(USE_PDL)
    table = grid_table_words(grid_ptr, SHARED_GRID)
    G: tl.constexpr = BLOCK_K // 32
    tile, split, kb_begin, kb_end = split_k_range(k // BLOCK_K, SPLIT_K)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.minimum(cols, n - 1).to(tl.int64)  # rows past N re-read the last one, never stored
    g = tl.arange(0, G)
    j = tl.arange(0, 32)
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(kb_begin, kb_end):
        wq, db = weight_words(qs_ptr, qh_ptr, signs_ptr, scales_ptr, d_ptr, grid_ptr, table, w_rows, kb * G + g, k,
                              SHARED_GRID)
        for r in tl.static_range(BLOCK_M):
            in_batch = tl.full((G, 32), r, tl.int32) < m
            xv = tl.load(x_ptr + r * x_stride + kb * BLOCK_K + g[:, None] * 32 + j[None, :], mask=in_batch,
                         other=0.0).to(tl.float32)  # [G, 32]
            xw, dx = _quantize_row(xv)
            s = tl.sum(_dp4a(wq, xw[None, :, :], EMULATE), axis=2).to(tl.float32)  # [BLOCK_N, G], exact
            step = _pairwise_sum(db * dx[None, :] * s, G)
            acc = tl.where(rows[None, :] == r, acc + step[:, None], acc)
    split_k_store(acc, out_ptr, out_stride, partial_ptr, counter_ptr, tile, split, cols, rows, n, m,
                  SPLIT_K, BLOCK_M, BLOCK_N)


def grid_in_shared() -> bool:
    """STRATA_IQ3S_GRID: whether IQ3_S kernels gather grid words through shared memory."""
    where = ENV.IQ3S_GRID.get()
    if where not in ("shared", "global"):
        raise ValueError(f"STRATA_IQ3S_GRID={where!r}: expected 'shared' or 'global'")
    return where == "shared"


def iq3s_gemv_dp4a(x: torch.Tensor, planes: dict[str, torch.Tensor], grid: torch.Tensor, n: int, k: int,
                   out: torch.Tensor | None = None, *, workspace: torch.Tensor | None = None,
                   config: Dp4aConfig | None = None, shared_grid: bool | None = None) -> torch.Tensor:
    """x [M ≤ 16, K] (contiguous rows) @ IQ3_S planes (`grid`: iq3_s.grid_table on x's device) -> [M, N]
    in x's dtype. Split-K uses `workspace` (zeroed int32 of >= `workspace_numel`) or allocates one.
    `shared_grid`: the grid gathered from shared memory or from the global table (the same words); None
    asks STRATA_IQ3S_GRID."""
    if shared_grid is None:
        shared_grid = grid_in_shared()
    weights = (planes["qs"], planes["qh"], planes["signs"], planes["scales"], planes["d"], grid)
    return launch(_iq3s_gemv_dp4a_kernel, x, weights, n, k, out, workspace, config or gemv_config(n, k), 256,
                  SHARED_GRID=shared_grid)


def sweep() -> None:
    """The dequantizing IQ3_S GEMV against the dp4a configurations (CUDA)."""
    from strata.kernels.quant import iq3_s

    grid = iq3_s.grid_table(torch.device("cuda"))
    sweep_against("IQ3_S", lambda n, k: iq3_s.repack(torch.from_numpy(iq3_s.random_raw(n, k, seed=n + k)).cuda()),
                  # The configuration given: the dequantizing GEMV whatever STRATA_IQ3S_DECODE says.
                  lambda x, p, n, k, out, ws: iq3_s.matmul(x, p, n, k, out, config=iq3_s.gemv_config(n, k)),
                  lambda x, p, n, k, out, ws, cfg: iq3s_gemv_dp4a(x, p, grid, n, k, out, workspace=ws, config=cfg),
                  lambda n, k, cfg: 1 if cfg is None else workspace_numel(n, k, cfg), 110 / 256)


def compare_shared_grid(shapes=None, ms=(1, 8), runs: int = 30) -> None:
    """Per Qwen3-8B shape and M (CUDA): µs of the grid gathered from the global table (L1) against
    from shared memory, at the shipped configuration and its 64-row twin, interleaved, weight copies
    cycled past L2; whether the two give the same bits."""
    from strata.kernels.quant import iq3_s
    from strata.kernels.quant.dp4a import SWEEP_SHAPES
    from strata.kernels.timing import time_us

    grid = iq3_s.grid_table(torch.device("cuda"))
    for n, k in shapes or SWEEP_SHAPES:
        planes = iq3_s.repack(torch.from_numpy(iq3_s.random_raw(n, k, seed=n + k)).cuda())
        copies = [planes] + [{key: t.clone() for key, t in planes.items()} for _ in range(max(1, (300 << 20) // (n * k)))]
        qbytes = n * k * 110 / 256
        base = gemv_config(n, k)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            for cfg in (base, replace(base, block_n=64)):
                ws = torch.zeros(max(1, workspace_numel(n, k, cfg)), dtype=torch.int32, device="cuda")
                same = torch.equal(iq3s_gemv_dp4a(x, planes, grid, n, k, workspace=ws, config=cfg, shared_grid=False),
                                   iq3s_gemv_dp4a(x, planes, grid, n, k, workspace=ws, config=cfg, shared_grid=True))
                t = {sh: [] for sh in (False, True)}
                for _ in range(2):
                    for sh in (False, True):
                        t[sh].append(time_us([lambda p=p, sh=sh: iq3s_gemv_dp4a(x, p, grid, n, k, out, workspace=ws,
                                                                                 config=cfg, shared_grid=sh)
                                              for p in copies], runs))
                g, s = min(t[False]), min(t[True])
                print(f"IQ3_S {n}x{k} M={m} {cfg.block_n}x{cfg.block_k} split {cfg.split_k}: global {g:7.2f} us "
                      f"{qbytes / g / 1e3:5.0f} GB/s | shared {s:7.2f} us {qbytes / s / 1e3:5.0f} GB/s | "
                      f"{g / s:4.2f}x | same bits {same}", flush=True)
        del copies, planes
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("the IQ3_S dp4a micro-benchmark needs a CUDA device")
    compare_shared_grid() if "--shared-grid" in sys.argv else sweep()
