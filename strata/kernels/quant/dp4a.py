"""Decode GEMV on packed int8 dot products (`dp4a`) for GGUF Q8_0 weights: no tensor cores, no
padding of x to 16 MMA columns, no per-weight conversion.

Why. The dequantizing GEMVs spend ~5 instructions per weight on the H200 (int8 -> fp32 -> scale ->
bf16, then an MMA whose x side is padded to 16 columns) and reach 0.8-1.7 TB/s of Q8_0 bytes; an
int8-MMA variant with x quantized in every program did not do better (docs/QUANTIZATION.md). This
kernel is llama.cpp's MMVQ shape in Triton: x is quantized per 32 values to int8 (`quantize_groups`),
four int8 pairs multiply-add in one `dp4a` (inline PTX), a 32-value group's exact int32 sum is scaled
once by d_w · dx. At batch 1 that is ~0.6 instructions per weight; each further row of x adds ~0.4.

Semantics (`gemv_dp4a_ref`): per row of x and run of 32 values along K, amax = max |x| (fp32),
dx = amax / 127, q = round_half_even(x · (127 / amax)) (each a correctly rounded fp32 operation; a zero
run has dx = q = 0); out[m, n] = Σ_groups (Σ_j w_q[j] · q[j]) · d_w · dx, the inner sums exact. The
kernel adds a step's groups by a fixed pairwise tree (each addition of two terms, so the bits do not
depend on how Triton lays the tile out) and the steps in K order; split-K partials are summed in split
order (`strata.kernels.splitk`). Each row of x is quantized and reduced alone, so a row's result does
not depend on M or on the other rows, from run to run.

The interpreter (TRITON_INTERPRET=1, the only way the kernel runs on CPU tensors) cannot run inline
PTX: there `dp4a` is emulated with shifts and integer multiplies, which give the same integers.

From two rows on, each thread adds the dp4a products of the words it holds (`_dp4a_words`): a
tl.sum over the word axis of a [rows, groups, 8] tile lets Triton spread the words over a warp's lanes
and add them with shuffles. Timed on the H200 against the lane sum (two sweeps whose dequantizing GEMV
times agree within 2%): at M = 8 the in-thread sums run 0.78-0.92x the time (Q6_K 0.61-0.75x), at
M = 1 1.01-1.11x (Q6_K 0.84-0.91x), though the sm_90 compile counts fewer instructions per weight at
both. So Q8_0 and Q4_K keep the lane sum at M = 1 (IN_THREAD = BLOCK_M > 1); Q6_K adds in
the thread at every M. Both give the same integers.

STATUS: timed on the H200 against the dequantizing GEMV (`benchmarks/kernels/quant_formats.py --dp4a`, the Qwen3-8B shapes): 1.6-1.8x
faster at M = 1, 1.2-1.6x slower at M = 8; whole-model decode at batch 1: 279 tok/s, 175 without it.
`q8_0.matmul` takes it up to `q8_0.DP4A_MAX_ROWS` rows by default (kernel choice `quant_decode`=auto).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels import choices
from strata.kernels import device as devices
from strata.kernels.device import DeviceSpec
from strata.kernels.pdl import pdl_prologue
from strata.kernels.splitk import (
    shared_split_k_numel,
    split_k_numel,
    split_k_parts,
    split_k_range,
    split_k_store,
    split_k_views,
)
from strata.kernels.triton_import import jit, tl, triton


GROUP = 32
MAX_ROWS = 16
# `config_for`'s split-K rule: about PROGRAMS_PER_SM programs per SM, at least MIN_STEPS_PER_SPLIT
# K steps per program, at most MAX_SPLIT parts.
PROGRAMS_PER_SM = 4
MIN_STEPS_PER_SPLIT = 2
MAX_SPLIT = 8


@dataclass(frozen=True)
class Dp4aConfig:
    block_n: int  # weight rows per program, a power of two
    block_k: int  # values per step: 64, 128 or 256 (2-8 groups of 32), dividing K
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def config_for(n: int, k: int, block_ks=(256, 128, 64), block_n: int = 64,
               spec: DeviceSpec | None = None) -> Dp4aConfig:
    """`block_n` rows per program, the first of `block_ks` dividing K per step, and split-K to about
    four programs per SM of `spec` (default: the current device): the largest power of two
    <= min(4 · SMs / tiles, steps / 2, 8), at least 1 (the H200 sweeps' best configurations ran 2-4
    programs per SM with power-of-two splits). With 64 rows and 256 values on 132 SMs: 4096 x 4096 -> 8,
    6144 x 4096 -> 4, 24576 x 4096 -> 1, 4096 x 12288 -> 8."""
    sms = (spec or devices.current()).sm_count
    block_k = next(b for b in block_ks if k % b == 0)
    tiles, steps = -(-n // block_n), k // block_k
    limit = max(1, min(PROGRAMS_PER_SM * sms // tiles, steps // MIN_STEPS_PER_SPLIT, MAX_SPLIT))
    return Dp4aConfig(block_n, block_k, 1 << (limit.bit_length() - 1))


def wide_config(n: int, k: int, block_ks=(256, 128, 64), spec: DeviceSpec | None = None) -> Dp4aConfig:
    """128 rows per program where that still leaves >= 2 programs per SM after split-K, else 64 (the
    Q4_K and IQ3_S sweeps' best M = 1 configurations mostly had 128 rows)."""
    spec = spec or devices.current()
    wide = config_for(n, k, block_ks, block_n=128, spec=spec)
    if -(-n // 128) * wide.split_k >= 2 * spec.sm_count:
        return wide
    return config_for(n, k, block_ks, spec=spec)


def gemv_config(n: int, k: int, spec: DeviceSpec | None = None) -> Dp4aConfig:
    """Q8_0: 64 rows x 256 values per step (16 KB of quants, 32 registers of them per thread)."""
    return config_for(n, k, spec=spec)


def workspace_for(cfg: Dp4aConfig, n: int) -> int:
    """int32 elements of a dp4a GEMV's split-K workspace for N rows under `cfg` (0 without split-K)."""
    return split_k_numel(n, cfg.block_n, cfg.split_k, MAX_ROWS)


def workspace_numel(n: int, k: int, config: Dp4aConfig | None = None, spec: DeviceSpec | None = None) -> int:
    return workspace_for(config or gemv_config(n, k, spec), n)


def decode_kernel(rows: int, max_rows: int) -> str:
    """The decode GEMV ('dequant' or 'dp4a') for a call of `rows` <= MAX_ROWS rows under the kernel
    choice `quant_decode`: 'dequant' and 'dp4a' name one; 'auto' takes dp4a up to the format's
    `max_rows` (its DP4A_MAX_ROWS) and the dequantizing GEMV above. The limits come from H200 sweeps
    at M = 1 and 8 only (dp4a faster at M = 1 for all three formats, slower at M = 8 for Q8_0 and
    Q4_K); rows 2-7 were interpolated linearly between the two, not measured."""
    choice = choices.current().quant_decode
    if choice == "auto":
        return "dp4a" if rows <= max_rows else "dequant"
    return choice


def shared_workspace_numel(n: int, dequant_parts: tuple[int, int], cfg: Dp4aConfig | None) -> int:
    """int32 elements of one split-K workspace for a weight's dequantizing GEMV (its `split_k_parts`)
    and its dp4a GEMV under `cfg` (None: no dp4a): both may run on it, one after the other, so it
    holds the larger counter region and the larger partial region (`splitk.shared_split_k_numel`),
    not just the larger total, with which one kernel's partials could land on the other's counters."""
    parts = [dequant_parts]
    if cfg is not None:
        parts.append(split_k_parts(n, cfg.block_n, cfg.split_k, MAX_ROWS))
    return shared_split_k_numel(parts)


# ----------------------------------------------------------------------------------------------
# Definition


def quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 32 == 0) -> (q int8 [M, K], dx fp32 [M, K/32]), the definition above."""
    m, k = x.shape
    v = x.float().view(m, k // GROUP, GROUP)
    amax = v.abs().amax(-1)
    c127 = torch.full_like(amax, 127.0)
    # Tensor / tensor: one correctly rounded division (torch computes `127.0 / t` as 127 · (1 / t)).
    inv = torch.where(amax > 0, c127 / amax, torch.zeros_like(amax))
    q = torch.round(v * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(m, k), amax / c127


def accumulate_ref(terms: torch.Tensor, per_step: int) -> torch.Tensor:
    """terms [M, N, T] fp32 (one per group along K) -> [M, N] in the kernels' order: each step's
    `per_step` terms by the pairwise tree (element 2i + (2i+1), level by level), steps in K order."""
    m, n, t = terms.shape
    steps = terms.view(m, n, t // per_step, per_step)
    while steps.shape[-1] > 1:
        steps = steps[..., 0::2] + steps[..., 1::2]
    acc = torch.zeros(m, n, dtype=torch.float32, device=terms.device)
    for s in range(steps.shape[2]):
        acc = acc + steps[:, :, s, 0]
    return acc


def group_terms_ref(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """fp32 [M, N, K/32]: each group's (isum · d) · dx, the kernel's term before any addition."""
    n, k = qs.shape
    xq, dx = quantize_ref(x)
    groups = k // GROUP
    # Integer sums of at most 32 · 127² are exact in fp32.
    sums = torch.einsum("mgj,ngj->mng", xq.view(-1, groups, GROUP).float(), qs.view(n, groups, GROUP).float())
    return sums * d.float()[None] * dx[:, None, :]


def gemv_dp4a_ref(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, block_k: int) -> torch.Tensor:
    """fp32 [M, N]: the kernel's result before its rounding to x's dtype, with its summation order
    (steps of `block_k` values in K order, groups in a step by the pairwise tree; no split-K)."""
    return accumulate_ref(group_terms_ref(x, qs, d), block_k // GROUP)


# ----------------------------------------------------------------------------------------------
# Kernel


@jit
def _dp4a(a, b, EMULATE: tl.constexpr):
    """Σ over the four byte lanes of int32 words a and b of a.byte · b.byte (signed)."""
    if EMULATE:
        total = ((a << 24) >> 24) * ((b << 24) >> 24)
        total += ((a << 16) >> 24) * ((b << 16) >> 24)
        total += ((a << 8) >> 24) * ((b << 8) >> 24)
        total += (a >> 24) * (b >> 24)
        return total
    else:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)


@jit
def _pairwise_sum(t, G: tl.constexpr):
    """Sum over the last axis of t [R, G] (G in 1, 2, 4, 8) by adding element pairs (2i, 2i + 1) level
    by level: every addition has two operands, so the bits do not depend on the layout Triton picks."""
    R: tl.constexpr = t.shape[0]
    if G == 8:
        t = tl.sum(tl.reshape(t, (R, 4, 2)), axis=2)
    if G >= 4:
        t = tl.sum(tl.reshape(t, (R, 2, 2)), axis=2)
    if G >= 2:
        t = tl.sum(tl.reshape(t, (R, 1, 2)), axis=2)
    return tl.reshape(t, (R,))


@jit
def _dp4a_words4(a, b, EMULATE: tl.constexpr):
    """Σ over the last axis (4 words) of `_dp4a(a, b)`: `_dp4a_words` for four."""
    a_even, a_odd = tl.split(tl.reshape(a, a.shape[:-1] + [2, 2]))
    b_even, b_odd = tl.split(tl.reshape(b, b.shape[:-1] + [2, 2]))
    a0, a2 = tl.split(a_even)
    a1, a3 = tl.split(a_odd)
    b0, b2 = tl.split(b_even)
    b1, b3 = tl.split(b_odd)
    return (_dp4a(a0, b0, EMULATE) + _dp4a(a1, b1, EMULATE)) + (_dp4a(a2, b2, EMULATE) + _dp4a(a3, b3, EMULATE))


@jit
def _dp4a_words(a, b, EMULATE: tl.constexpr, IN_THREAD: tl.constexpr = True):
    """Σ over the last axis (4 or 8 words) of `_dp4a(a, b)`, a and b of one shape. IN_THREAD: the words
    taken apart first (tl.split halves a trailing axis of 2), so each thread adds the products of the
    elements it holds; otherwise a tl.sum over the axis, which Triton spreads over a warp's lanes and
    adds with shuffles (faster at M = 1, see the module docstring). Exact in int32: the order does not
    matter."""
    if not IN_THREAD:
        return tl.sum(_dp4a(a, b, EMULATE), axis=len(a.shape) - 1)
    if a.shape[-1] == 8:
        a_even, a_odd = tl.split(tl.reshape(a, a.shape[:-1] + [4, 2]))
        b_even, b_odd = tl.split(tl.reshape(b, b.shape[:-1] + [4, 2]))
        return _dp4a_words4(a_even, b_even, EMULATE) + _dp4a_words4(a_odd, b_odd, EMULATE)
    else:
        return _dp4a_words4(a, b, EMULATE)


@jit
def _quantize_row(xv):
    """xv fp32 [G, 32] -> (int32 words [G, 8] of the int8 quants, four per word in memory order; dx
    fp32 [G]): `quantize_ref` element for element."""
    G: tl.constexpr = xv.shape[0]
    amax = tl.max(tl.abs(xv), axis=1)
    inv = tl.where(amax > 0, tl.div_rn(tl.full((G,), 127.0, tl.float32), amax), 0.0)
    v = xv * inv[:, None]
    # Adding and subtracting 1.5 · 2²³ rounds |v| < 2²² to the nearest integer, ties to even. No FMA can
    # fuse into it: v is a finished product before the addition.
    q = ((v + 12582912.0) - 12582912.0).to(tl.int32)
    lanes = tl.reshape(q & 255, (G, 8, 4))
    shifts = tl.arange(0, 4) * 8
    words = tl.sum(lanes << shifts[None, None, :], axis=2)  # disjoint bytes: the sum is their OR
    return words, tl.div_rn(amax, tl.full((G,), 127.0, tl.float32))


@jit(do_not_specialize=["m"])
def _q8_gemv_dp4a_kernel(x_ptr, x_stride, qw_ptr, d_ptr, out_ptr, out_stride, partial_ptr, counter_ptr, m, n, k,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT_K: tl.constexpr, EMULATE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    G: tl.constexpr = BLOCK_K // 32
    IN_THREAD: tl.constexpr = BLOCK_M > 1
    tile, split, kb_begin, kb_end = split_k_range(k // BLOCK_K, SPLIT_K)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.minimum(cols, n - 1).to(tl.int64)  # rows past N re-read the last one, never stored
    g = tl.arange(0, G)
    word = tl.arange(0, 8)
    j = tl.arange(0, 32)
    rows = tl.arange(0, BLOCK_M)
    k0 = kb_begin * BLOCK_K
    w_ptrs = qw_ptr + w_rows[:, None, None] * (k // 4) + (k0 // 4 + g * 8)[None, :, None] + word[None, None, :]
    d_ptrs = d_ptr + w_rows[:, None] * (k // 32) + (k0 // 32 + g)[None, :]
    x_ptrs = x_ptr + (k0 + g * 32)[:, None] + j[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(kb_begin, kb_end):
        wq = tl.load(w_ptrs)  # int32 [BLOCK_N, G, 8]: 32 quants of a group in 8 words
        dw = tl.load(d_ptrs).to(tl.float32)  # [BLOCK_N, G]
        for r in tl.static_range(BLOCK_M):
            # A tensor mask, not the scalar `r < m`: triton 3.9's interpreter rejects a scalar mask.
            in_batch = tl.full((G, 32), r, tl.int32) < m
            xv = tl.load(x_ptrs + r * x_stride, mask=in_batch, other=0.0).to(tl.float32)  # [G, 32]
            xw, dx = _quantize_row(xv)
            isum = _dp4a_words(wq, tl.broadcast_to(xw[None, :, :], wq.shape), EMULATE, IN_THREAD)  # [BLOCK_N, G]
            term = isum.to(tl.float32) * dw * dx[None, :]
            step = _pairwise_sum(term, G)  # [BLOCK_N]
            acc = tl.where(rows[None, :] == r, acc + step[:, None], acc)
        w_ptrs += BLOCK_K // 4
        d_ptrs += G
        x_ptrs += BLOCK_K
    split_k_store(acc, out_ptr, out_stride, partial_ptr, counter_ptr, tile, split, cols, rows, n, m,
                  SPLIT_K, BLOCK_M, BLOCK_N)


def launch(kernel, x: torch.Tensor, weights: tuple, n: int, k: int, out: torch.Tensor | None,
           workspace: torch.Tensor | None, cfg: Dp4aConfig, k_multiple: int, **constexprs) -> torch.Tensor:
    """Checks x [M ≤ 16, K] (contiguous rows, K a multiple of `k_multiple`) and the configuration, makes
    `out` when None, takes the split-K views of `workspace` (zeroed int32; None allocates one) and runs
    a dp4a GEMV kernel of this family: (x, x_stride, *weights, out, out_stride, partials, counters, m, n,
    k) and the constexprs BLOCK_M/N/K, SPLIT_K, EMULATE, USE_PDL (and the kernel's own `constexprs`)."""
    from strata.kernels import use_pdl

    m = x.shape[0]
    if not 1 <= m <= MAX_ROWS or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or k % k_multiple:
        raise ValueError(f"dp4a GEMV: x {tuple(x.shape)} for K={k} (M in 1..{MAX_ROWS}, contiguous rows, "
                         f"K % {k_multiple} == 0)")
    if cfg.block_k not in (64, 128, 256) or k % cfg.block_k or not 1 <= cfg.split_k <= k // cfg.block_k:
        raise ValueError(f"invalid {cfg} for K={k}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    counters = partials = out  # placeholders, untouched without split-K
    if cfg.split_k > 1:
        counters, partials = split_k_views(workspace, n, cfg.block_n, cfg.split_k, MAX_ROWS, x.device)
    on = use_pdl(x)
    kernel[(-(-n // cfg.block_n) * cfg.split_k,)](
        x, x.stride(0), *weights, out, out.stride(0), partials, counters, m, n, k,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        EMULATE=not x.is_cuda, USE_PDL=on, launch_pdl=on, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        # No FMA contraction: the scaled group sums and their tree are the correctly rounded operations the
        # reference states. Contracted, the compiler fused them differently per BLOCK_M (= M rounded up),
        # and a row's bits changed with the batch on the H200.
        enable_fp_fusion=False, **constexprs)
    return out


def q8_gemv_dp4a(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, out: torch.Tensor | None = None, *,
                 workspace: torch.Tensor | None = None, config: Dp4aConfig | None = None) -> torch.Tensor:
    """x [M ≤ 16, K] (16-bit or fp32, contiguous rows) @ Q8_0 planes (qs int8 [N, K], d fp16 [N, K/32])
    -> [M, N] in x's dtype. Split-K uses `workspace` (zeroed int32 of >= `workspace_numel`) or allocates."""
    n, k = qs.shape
    return launch(_q8_gemv_dp4a_kernel, x, (qs.view(torch.int32), d), n, k, out, workspace,
                  config or gemv_config(n, k, devices.current(x)), 64)
