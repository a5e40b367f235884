"""Decode GEMV on packed int8 dot products for GGUF Q6_K weights (the Q8_0 one's shape, `dp4a.py`).

The dequantizing Q6_K GEMV reaches 612-818 GB/s of Q6_K bytes on the H200, and a Q4_K_M model keeps
its LM head and some attn_v / ffn_down in Q6_K: 154 tok/s at batch 1 against 292 for pure Q4_K. Here
an ql word and a qh word make four 6-bit quants q (0..63) per word in two operations (`q6_k.py`'s
module docstring: the low and the high nibbles of a 128-value half each serve two of its four
32-value runs, and qh's bit pairs land on bits 4-5 of each byte), and each word feeds a `dp4a`
against x quantized per 32 values (`dp4a.quantize_ref`; Q6_K's 32-value runs line up with x's). The
quants are unsigned, so q − 32 never enters a byte: with value = d·sc·(q − 32) per 16-value
sub-block, a sub-block's dot with x is

    d·sc·dx·(Σ q·xq − 32·Σ xq)        (the sums exact in int32)

the second sum once per row and sub-block of x, shared by every weight row of a program.

Semantics (`gemv_q6k_dp4a_ref`): per sub-block I = Σ q·xq − 32·Σ xq, per 32-value run the integer
T = sc_a·I_a + sc_b·I_b of its two sub-blocks (|T| ≤ 2·128·16·32·127 < 2^24, so its fp32 value is
exact) and the term dx·T (fp32); a step's terms are added by the pairwise tree in K order, the sum
multiplied by the step's d (a step lies inside one super-block), steps added in K order, split-K
partials in split order. Every operation after the integers is one correctly rounded fp32 operation
(no FMA contraction, `dp4a.launch`), so the reference gives the kernel's bits. Each row of x is
quantized and reduced alone: a row's result does not depend on the others.

Timed on the H200 (`benchmarks/kernels/quant_formats.py --dp4a Q6_K`; bench/results/q6k_dp4a_sweep_cuda.txt):
1.4-1.7x the dequantizing GEMV at M = 1, 1.75-2.3x slower at M = 8, so `q6_k.matmul` takes it up to
`q6_k.DP4A_MAX_ROWS` = 2 rows (kernel choice quant_decode=auto, the default).
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
    launch,
    quantize_ref,
    wide_config,
    workspace_for,
)
from strata.kernels.quant.q6_k_planes import kernel_planes, quants
from strata.kernels.splitk import split_k_range, split_k_store
from strata.kernels.triton_import import jit, tl


LM_HEAD_SHAPE = (151936, 4096)  # Qwen3's LM head, Q6_K in a Q4_K_M file


def gemv_config(n: int, k: int, spec: DeviceSpec | None = None) -> Dp4aConfig:
    """128 or 64 rows (`dp4a.wide_config`) x 256 values (one super-block) per step, split-K to about
    four programs per SM, as Q4_K's (the same 64 quant words per row and step): 6144 x 4096 -> 128 rows
    split 8, 24576 x 4096 -> 128 split 2, 4096 x 4096 and 4096 x 12288 -> 64 split 8, the LM head
    151936 x 4096 -> 128 rows, no split. Each within 2.3% of the H200 sweep's best at M = 1."""
    return wide_config(n, k, block_ks=(256,), spec=spec)


def workspace_numel(n: int, k: int, config: Dp4aConfig | None = None, spec: DeviceSpec | None = None) -> int:
    return workspace_for(config or gemv_config(n, k, spec), n)


def gemv_q6k_dp4a_ref(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, block_k: int = 256,
                      split_k: int = 1) -> torch.Tensor:
    """fp32 [M, N]: the kernel's result before its rounding to x's dtype, under a configuration of
    `block_k` values per step and `split_k` splits (the module docstring's definition)."""
    m = x.shape[0]
    xq, dx = quantize_ref(x)
    xq = xq.view(m, k // 16, 16).float()
    q = quants(planes, n, k).view(n, k // 16, 16).float()
    # Integer sums of at most 16 · 63 · 127 are exact in fp32.
    sums = torch.einsum("msj,nsj->mns", xq, q).long() - 32 * xq.sum(-1).long()[:, None, :]
    runs = (planes["scales"].long()[None] * sums).view(m, n, k // 32, 2).sum(-1)  # T, |T| < 2^24
    terms = runs.float() * dx[:, None, :]
    per_step = block_k // 32
    steps = terms.view(m, n, k // block_k, per_step)
    while steps.shape[-1] > 1:
        steps = steps[..., 0::2] + steps[..., 1::2]
    d = planes["d"].repeat_interleave(256 // block_k, dim=1)  # [N, K / block_k]: each step's d
    steps = steps[..., 0] * d[None]
    total = None
    count = k // block_k
    for s in range(split_k):  # `splitk.split_k_range`'s shares, each summed from zero, then in split order
        part = torch.zeros(m, n, dtype=torch.float32, device=x.device)
        for i in range(s * count // split_k, (s + 1) * count // split_k):
            part = part + steps[:, :, i]
        total = part if total is None else total + part
    return total


@jit
def _run_pairs(qw, sc, xw, dx, ones, EMULATE: tl.constexpr):
    """One nibble plane of a step: qw int32 [BN, H, 2, 2, 4] (run u of each half, sub-block s, four
    quants a word), sc int32 [BN, H, 2, 2] their scales, xw [2H, 8] and dx [2H] x's runs there ->
    [BN, H]: per half, the terms dx·T of its two runs added."""
    BN: tl.constexpr = qw.shape[0]
    H: tl.constexpr = qw.shape[1]
    xw = tl.reshape(xw, (H, 2, 2, 4))
    xs = _dp4a_words(xw, ones, EMULATE)  # [H, 2, 2]: Σ xq of each sub-block
    s = _dp4a_words(qw, tl.broadcast_to(xw[None, :, :, :, :], qw.shape), EMULATE)  # [BN, H, 2, 2]: Σ q·xq, exact
    t = tl.sum(sc * (s - 32 * xs[None, :, :, :]), axis=3)  # [BN, H, 2]: T of each run, exact
    terms = t.to(tl.float32) * tl.reshape(dx, (H, 2))[None, :, :]
    return tl.sum(terms, axis=2)  # two terms: one addition


@jit(do_not_specialize=["m"])
def _q6k_gemv_dp4a_kernel(x_ptr, x_stride, ql_ptr, qh_ptr, sc_ptr, d_ptr, out_ptr, out_stride, partial_ptr,
                          counter_ptr, m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLIT_K: tl.constexpr, EMULATE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    H: tl.constexpr = BLOCK_K // 128  # 128-value halves of a super-block per step
    tile, split, kb_begin, kb_end = split_k_range(k // BLOCK_K, SPLIT_K)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.minimum(cols, n - 1).to(tl.int64)  # rows past N re-read the last one, never stored
    # Weight side [BN, H, u, s, w]: run u of a nibble plane (values 32u .. 32u+31 of its 64), 16-value
    # sub-block s, word w of four quants.
    r5 = w_rows[:, None, None, None, None]
    h5 = tl.arange(0, H)[None, :, None, None, None]
    u5 = tl.arange(0, 2)[None, None, :, None, None]
    s5 = tl.arange(0, 2)[None, None, None, :, None]
    w5 = tl.arange(0, 4)[None, None, None, None, :]
    r4 = w_rows[:, None, None, None]
    h4 = tl.arange(0, H)[None, :, None, None]
    byte = 8 * (2 * tl.arange(0, 2)[None, None, :, None] + tl.arange(0, 2)[None, None, None, :])  # [1, 1, u, s]
    # x side [H, u, 32]: the low nibbles' values 128h + 32u + j; the high nibbles' are 64 further on.
    x_offs = (128 * tl.arange(0, H)[:, None, None] + 32 * tl.arange(0, 2)[None, :, None]
              + tl.arange(0, 32)[None, None, :])
    ones = tl.full((H, 2, 2, 4), 0x01010101, tl.int32)
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(kb_begin, kb_end):
        half = kb * H + h5  # absolute 128-value halves
        ql = tl.load(ql_ptr + r5 * (k // 8) + half * 16 + u5 * 8 + s5 * 4 + w5)  # [BN, H, 2, 2, 4]
        qh = tl.load(qh_ptr + r5 * (k // 16) + half * 8 + s5 * 4 + w5)  # [BN, H, 1, 2, 4]: serves both runs
        q_lo = (ql & 0x0F0F0F0F) | ((qh << (4 - 2 * u5)) & 0x30303030)  # run u's high bits: qh bits 2u, 2u+1
        q_hi = ((ql >> 4) & 0x0F0F0F0F) | ((qh >> (2 * u5)) & 0x30303030)  # run 2 + u's: bits 4+2u, 5+2u
        # Scale word 2·half: the low nibbles' runs' four scales (byte 2u + s); word 2·half + 1: the high ones'.
        sc_words = sc_ptr + r4 * (k // 64) + 2 * (kb * H + h4)  # [BN, H, 1, 1]
        sc_lo = (tl.load(sc_words) << (24 - byte)) >> 24  # [BN, H, 2, 2], the int8 scales sign-extended
        sc_hi = (tl.load(sc_words + 1) << (24 - byte)) >> 24
        d = tl.load(d_ptr + w_rows * (k // 256) + (kb * BLOCK_K) // 256)  # [BN]
        for r in tl.static_range(BLOCK_M):
            # A tensor mask, not the scalar `r < m`: triton 3.9's interpreter rejects a scalar mask.
            in_batch = tl.full((H, 2, 32), r, tl.int32) < m
            x_row = x_ptr + r * x_stride + kb * BLOCK_K + x_offs
            xv_lo = tl.load(x_row, mask=in_batch, other=0.0).to(tl.float32)
            xv_hi = tl.load(x_row + 64, mask=in_batch, other=0.0).to(tl.float32)
            xw_lo, dx_lo = _quantize_row(tl.reshape(xv_lo, (2 * H, 32)))
            xw_hi, dx_hi = _quantize_row(tl.reshape(xv_hi, (2 * H, 32)))
            # K order within a half: runs lo0, lo1, hi0, hi1, so the tree's first level is each plane's pair.
            halves = (_run_pairs(q_lo, sc_lo, xw_lo, dx_lo, ones, EMULATE)
                      + _run_pairs(q_hi, sc_hi, xw_hi, dx_hi, ones, EMULATE))
            step = _pairwise_sum(halves, H) * d
            acc = tl.where(rows[None, :] == r, acc + step[:, None], acc)
    split_k_store(acc, out_ptr, out_stride, partial_ptr, counter_ptr, tile, split, cols, rows, n, m,
                  SPLIT_K, BLOCK_M, BLOCK_N)


def q6k_gemv_dp4a(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
                  *, workspace: torch.Tensor | None = None, config: Dp4aConfig | None = None) -> torch.Tensor:
    """x [M ≤ 16, K] (16-bit or fp32, contiguous rows) @ Q6_K planes (`q6_k.repack`) -> [M, N] in x's
    dtype. Split-K uses `workspace` (zeroed int32 of >= `workspace_numel`, left zeroed) or allocates one."""
    cfg = config or gemv_config(n, k, devices.current(x))
    if cfg.block_k not in (128, 256):
        raise ValueError(f"Q6_K dp4a GEMV: block_k={cfg.block_k}, expected 128 or 256")
    return launch(_q6k_gemv_dp4a_kernel, x, kernel_planes(planes), n, k, out, workspace, cfg, 256)
