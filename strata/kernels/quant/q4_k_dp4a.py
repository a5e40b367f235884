"""Decode GEMV on packed int8 dot products for GGUF Q4_K weights (the Q8_0 one's shape, `dp4a.py`).

The dequantizing Q4_K GEMV costs ~8 instructions per weight (nibble extraction, fp32 dequantization,
bf16 packing, MMA operand shuffles) and reaches 519-779 GB/s of Q4_K bytes on the H200. Here a word
of 8 nibbles becomes two words of four int8 quants with one AND and one shift + AND, and each feeds a
`dp4a` against x quantized per 32 values (`dp4a.quantize_ref`; Q4_K's 32-value sub-blocks line up
with x's runs). With value = d·sc·q − dmin·m per sub-block, a sub-block's dot with x is

    d·sc·dx·Σ q·xq − dmin·m·dx·Σ xq        (the sums exact in int32)

the second sum once per row and run of x, as llama.cpp's q8_1 activations carry it.

Semantics (`gemv_q4k_dp4a_ref`): per 64-value pair of sub-blocks (2p: the low nibbles, 2p + 1: the
high ones) the term is d·(sc_lo·dx_lo·S_lo + sc_hi·dx_hi·S_hi) − dmin·(m_lo·dx_lo·X_lo + m_hi·dx_hi·X_hi)
in fp32 in that order (the GPU may fuse a multiply and an add into an FMA: the GPU tests use a
tolerance); a step's pairs are added by the pairwise tree, steps in K order, split-K partials in split
order. Each row of x is quantized and reduced alone: a row's result does not depend on the others.

STATUS: timed on the H200 against the dequantizing GEMV (`benchmarks/kernels/quant_formats.py --dp4a`, the Qwen3-8B shapes): 1.9-2.5x
faster at M = 1, 1.35-2.3x slower at M = 8; whole-model decode at batch 1: 292 tok/s, 171 without it.
`q4_k.matmul` takes it up to `q4_k.DP4A_MAX_ROWS` rows by default (kernel choice quant_decode=auto).
"""

from __future__ import annotations

import torch

from strata.kernels import device as devices
from strata.kernels.device import DeviceSpec
from strata.kernels.pdl import pdl_prologue
from strata.kernels.quant.dp4a import (
    Dp4aConfig,
    _dp4a_words,
    _pairwise_sum,
    _quantize_row,
    accumulate_ref,
    launch,
    quantize_ref,
    wide_config,
    workspace_for,
)
from strata.kernels.quant.q4_k_planes import pair_fields
from strata.kernels.splitk import split_k_range, split_k_store
from strata.kernels.triton_import import jit, tl


def gemv_config(n: int, k: int, spec: DeviceSpec | None = None) -> Dp4aConfig:
    """128 or 64 rows (`dp4a.wide_config`) x 256 values per step, split-K to about four programs per
    SM: 6144 x 4096 -> 128 rows split 8, 24576 x 4096 -> 128 split 2 (the sweep's best at M = 1),
    4096 x 4096 -> 64 split 8 (the best too), 4096 x 12288 -> 64 split 8 (the best had 128 rows)."""
    return wide_config(n, k, spec=spec)


def workspace_numel(n: int, k: int, config: Dp4aConfig | None = None, spec: DeviceSpec | None = None) -> int:
    return workspace_for(config or gemv_config(n, k, spec), n)


def gemv_q4k_dp4a_ref(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int,
                      block_k: int) -> torch.Tensor:
    """fp32 [M, N], the kernel's result before its rounding to x's dtype (no split-K, no FMA)."""
    m = x.shape[0]
    q, f, d, dmin = pair_fields(planes, n, k)
    q_lo, q_hi = q[:, :, 0], q[:, :, 1]
    xq, dx = quantize_ref(x)
    xq = xq.view(m, k // 64, 2, 32).float()
    dx = dx.view(m, k // 64, 2)
    xs = xq.sum(-1)  # [M, K/64, 2], exact
    # Integer sums of at most 32 · 15 · 127 are exact in fp32.
    s_lo = torch.einsum("mpj,npj->mnp", xq[:, :, 0], q_lo)
    s_hi = torch.einsum("mpj,npj->mnp", xq[:, :, 1], q_hi)
    dx_lo, dx_hi = dx[:, None, :, 0], dx[:, None, :, 1]
    xs_lo, xs_hi = xs[:, None, :, 0], xs[:, None, :, 1]
    a = f[None, :, :, 0] * dx_lo * s_lo
    b = f[None, :, :, 1] * dx_hi * s_hi
    c = f[None, :, :, 2] * dx_lo * xs_lo
    e = f[None, :, :, 3] * dx_hi * xs_hi
    return accumulate_ref(d[None] * (a + b) - dmin[None] * (c + e), block_k // 64)


@jit
def _half_lo(v):
    """The fp16 in the low 16 bits of an int32 -> fp32."""
    return v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@jit(do_not_specialize=["m"])
def _q4k_gemv_dp4a_kernel(x_ptr, x_stride, qw_ptr, sw_ptr, dw_ptr, out_ptr, out_stride, partial_ptr, counter_ptr,
                          m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLIT_K: tl.constexpr, EMULATE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    G: tl.constexpr = BLOCK_K // 32
    P: tl.constexpr = BLOCK_K // 64
    IN_THREAD: tl.constexpr = BLOCK_M > 1  # the lane sum at M = 1 (dp4a.py)
    tile, split, kb_begin, kb_end = split_k_range(k // BLOCK_K, SPLIT_K)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.minimum(cols, n - 1).to(tl.int64)  # rows past N re-read the last one, never stored
    p = tl.arange(0, P)
    word = tl.arange(0, 8)
    g = tl.arange(0, G)
    j = tl.arange(0, 32)
    rows = tl.arange(0, BLOCK_M)
    ones = tl.full((G, 8), 0x01010101, tl.int32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(kb_begin, kb_end):
        pair = kb * P + p  # the step's 64-value pairs
        qw = tl.load(qw_ptr + w_rows[:, None, None] * (k // 8) + (pair * 8)[None, :, None] + word[None, None, :])
        q_lo = qw & 0x0F0F0F0F  # int32 [BLOCK_N, P, 8]: four quants of sub-block 2p per word
        q_hi = (qw >> 4) & 0x0F0F0F0F  # ... and of sub-block 2p + 1
        fields = tl.load(sw_ptr + w_rows[:, None] * (k // 64) + pair[None, :])  # sc_lo, sc_hi, m_lo, m_hi bytes
        sc_lo = (fields & 255).to(tl.float32)
        sc_hi = ((fields >> 8) & 255).to(tl.float32)
        m_lo = ((fields >> 16) & 255).to(tl.float32)
        m_hi = ((fields >> 24) & 255).to(tl.float32)
        d_dmin = tl.load(dw_ptr + w_rows[:, None] * (k // 256) + (pair // 4)[None, :])
        d = _half_lo(d_dmin)
        dmin = _half_lo(d_dmin >> 16)
        for r in tl.static_range(BLOCK_M):
            in_batch = tl.full((G, 32), r, tl.int32) < m
            xv = tl.load(x_ptr + r * x_stride + kb * BLOCK_K + g[:, None] * 32 + j[None, :], mask=in_batch,
                         other=0.0).to(tl.float32)  # [G, 32]
            xw, dx = _quantize_row(xv)  # words [G, 8], dx [G]
            xs = _dp4a_words(xw, ones, EMULATE, IN_THREAD)  # [G]: Σ xq of each run
            xw_lo, xw_hi = tl.split(tl.permute(tl.reshape(xw, (P, 2, 8)), (0, 2, 1)))  # [P, 8] each
            dx_lo, dx_hi = tl.split(tl.reshape(dx, (P, 2)))
            xs_lo, xs_hi = tl.split(tl.reshape(xs.to(tl.float32), (P, 2)))
            s_lo = _dp4a_words(q_lo, tl.broadcast_to(xw_lo[None, :, :], q_lo.shape), EMULATE, IN_THREAD)
            s_hi = _dp4a_words(q_hi, tl.broadcast_to(xw_hi[None, :, :], q_hi.shape), EMULATE, IN_THREAD)
            a = sc_lo * dx_lo[None, :] * s_lo.to(tl.float32)
            b = sc_hi * dx_hi[None, :] * s_hi.to(tl.float32)
            c = m_lo * dx_lo[None, :] * xs_lo[None, :]
            e = m_hi * dx_hi[None, :] * xs_hi[None, :]
            term = d * (a + b) - dmin * (c + e)
            step = _pairwise_sum(term, P)
            acc = tl.where(rows[None, :] == r, acc + step[:, None], acc)
    split_k_store(acc, out_ptr, out_stride, partial_ptr, counter_ptr, tile, split, cols, rows, n, m,
                  SPLIT_K, BLOCK_M, BLOCK_N)


def q4k_gemv_dp4a(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
                  *, workspace: torch.Tensor | None = None, config: Dp4aConfig | None = None) -> torch.Tensor:
    """x [M ≤ 16, K] (contiguous rows) @ Q4_K planes -> [M, N] in x's dtype. Split-K uses `workspace`
    (zeroed int32 of >= `workspace_numel`) or allocates one."""
    weights = (planes["qs"].view(torch.int32), planes["scales"].view(torch.int32), planes["d_dmin"].view(torch.int32))
    return launch(_q4k_gemv_dp4a_kernel, x, weights, n, k, out, workspace,
                  config or gemv_config(n, k, devices.current(x)), 256)
