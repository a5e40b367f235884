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

STATUS: timed on the H200 against the dequantizing GEMV (`benchmarks/kernels/quant_formats.py --dp4a`, the Qwen3-8B shapes, both with the
shared grid and interleaved signs): 1.9-2.2x faster at M = 1, 0.74-0.85x at M = 8; whole-model decode
at batch 1: 230 tok/s, 74 with the dequantizing GEMV alone.
`iq3_s.matmul` takes it up to `iq3_s.DP4A_MAX_ROWS` rows by default (kernel choice quant_decode=auto).

Measured on the H200 and not taken: the eight grid words of a
sub-block unrolled inside the thread that holds it, tensors [rows, sub-blocks], eight warps. It cuts
the sm_90 loop from 9.3 to 5.8 SASS instructions per weight and gives the same bits, yet runs
1.22-1.38x slower at M = 1 (0.75-0.99x at M = 8), batch-1 decode 120 tok/s against 202: at M = 1 this
GEMV waits on memory, and the count of instructions does not predict it.

Grid words are gathered from the table in shared memory (`iq3_s_planes.grid_words`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from strata.kernels import device as devices
from strata.kernels.device import DeviceSpec
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
    workspace_for,
)
from strata.kernels.quant.iq3_s_planes import grid_table_words, grid_words, signed_quants
from strata.kernels.splitk import split_k_range, split_k_store
from strata.kernels.triton_import import jit, tl


def gemv_config(n: int, k: int, spec: DeviceSpec | None = None) -> Dp4aConfig:
    """128 rows x 256 values (one super-block) per step, split-K to about four programs per SM
    (`dp4a.config_for`): 6144 x 4096 -> split 8, 24576 x 4096 -> 2, 4096 x 4096 and 4096 x 12288 -> 8.
    On the H200, with the grid gathered from shared memory, those ran 1.04-1.10x faster with 128 rows
    than with 64 (the sweeps' best at M = 1 also had 128)."""
    spec = spec or devices.current()
    cfg = config_for(n, k, block_ks=(256,), block_n=128, spec=spec)
    # Elsewhere than the reference, 8 warps over the 128 rows: 4 spill at M > 1 (on sm_90 too, where the
    # 4-warp tile is the one timed); 8 compile without spills up to M = 8.
    return cfg if devices.tuned(spec) else replace(cfg, num_warps=8)


def workspace_numel(n: int, k: int, config: Dp4aConfig | None = None, spec: DeviceSpec | None = None) -> int:
    return workspace_for(config or gemv_config(n, k, spec), n)


def gemv_iq3s_dp4a_ref(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int,
                       block_k: int = 256) -> torch.Tensor:
    """fp32 [M, N], the kernel's result before its rounding to x's dtype (no split-K)."""
    m = x.shape[0]
    values, db = signed_quants(planes, n, k)
    xq, dx = quantize_ref(x)
    # Integer sums of at most 32 · 15 · 127 are exact in fp32.
    sums = torch.einsum("mgj,ngj->mng", xq.view(m, k // 32, 32).float(), values)
    return accumulate_ref(db[None] * dx[:, None, :] * sums, block_k // 32)


@jit
def weight_words(qs_ptr, qh_ptr, signs_ptr, scales_ptr, d_ptr, table, w_rows, sub, k):
    """Rows `w_rows` (int64 [R]) at sub-blocks `sub` (int32 [G], 32 values each) → (wq int32 [R, G, 8]: the
    signed 8-bit weights four to a word, in K order; db fp32 [R, G]: each sub-block's scale, exact)."""
    word = tl.arange(0, 8)
    idx = tl.load(qs_ptr + w_rows[:, None, None] * (k // 4) + (sub * 8)[None, :, None]
                  + word[None, None, :]).to(tl.int32)  # [R, G, 8]: a grid index per 4 values
    qh = tl.load(qh_ptr + w_rows[:, None] * (k // 32) + sub[None, :]).to(tl.int32)  # [R, G]
    idx |= ((qh << 8)[:, :, None] >> word[None, None, :]) & 256
    mags = grid_words(idx, table)  # four magnitudes per word, one per byte lane
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
                           EMULATE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    table = grid_table_words(grid_ptr, True)
    G: tl.constexpr = BLOCK_K // 32
    tile, split, kb_begin, kb_end = split_k_range(k // BLOCK_K, SPLIT_K)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.minimum(cols, n - 1).to(tl.int64)  # rows past N re-read the last one, never stored
    g = tl.arange(0, G)
    j = tl.arange(0, 32)
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(kb_begin, kb_end):
        wq, db = weight_words(qs_ptr, qh_ptr, signs_ptr, scales_ptr, d_ptr, table, w_rows, kb * G + g, k)
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


def iq3s_gemv_dp4a(x: torch.Tensor, planes: dict[str, torch.Tensor], grid: torch.Tensor, n: int, k: int,
                   out: torch.Tensor | None = None, *, workspace: torch.Tensor | None = None,
                   config: Dp4aConfig | None = None) -> torch.Tensor:
    """x [M ≤ 16, K] (contiguous rows) @ IQ3_S planes (`grid`: iq3_s_planes.grid_table on x's device) ->
    [M, N] in x's dtype. Split-K uses `workspace` (zeroed int32 of >= `workspace_numel`) or allocates one."""
    weights = (planes["qs"], planes["qh"], planes["signs"], planes["scales"], planes["d"], grid)
    return launch(_iq3s_gemv_dp4a_kernel, x, weights, n, k, out, workspace,
                  config or gemv_config(n, k, devices.current(x)), 256)
