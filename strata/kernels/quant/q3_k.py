"""GGUF Q3_K weights kept 3-bit on the device: repack, the fp32 definition, and x @ Wᵀ kernels.

Q3_K (ggml): super-blocks of 256 values in 110 bytes — hmask[32] (the high bit of each quant), qs[64]
(the low 2 bits), scales[12] (sixteen 6-bit scales, one per 16 values), fp16 d. Each 128-value half h
owns qs[32h .. 32h+31]: value 128h + 32s + j has its low bits at bits 2s, 2s+1 of qs byte 32h + j and
its high bit at bit 4h + s of hmask byte j (s = 0..3, j = 0..31). Scale i (0..15) has its low 4 bits
in byte i mod 8 of scales (low nibble for i < 8, high for i ≥ 8) and its top 2 bits at bits 2(i/4),
2(i/4)+1 of byte 8 + i mod 4. With u = low bits | high bit << 2 (0..7), value v is
(d·(scale − 32))·(u − 4) — ggml stores the high bit inverted: a set bit adds nothing, a clear one −4.
gguf's numpy dequantizer computes that in fp32; every product is exact (11 + 5 + 3 significant bits at
most), so any exact evaluation gives its bits.

Planes (`repack`, device ops only), 116 bytes per 256 values (+5.5% over the file's 110):
  qs      uint8 [N, K/4]     the file's order
  hmask   uint8 [N, K/8]     the file's order
  scales  int8  [N, K/16]    scale − 32 of each 16 values, unpacked
  d       fp32  [N, K/256]   d widened (exactly) from fp16, so that the kernels load a 4-byte word
The kernels read qs, hmask and scales as int32 words: 4-byte and wider loads, which Triton's software
pipeline issues asynchronously (cp.async); byte loads it could not.

Dequantization, four quants per int32 word (the file's layout lines them up, as Q6_K's): qs word w of
half h holds the low bits of values 128h + 32s + 4w .. +3 (one per byte) at bits 2s, 2s+1 of each
byte, and hmask word w of the super-block their high bits at bit 4h + s. So
((qs >> 2s) & 0x03030303) | (((hmask >> (4h + s)) & 0x01010101) << 2) is four 3-bit quants u, one
per byte, in K order. Byte j goes into the mantissa of 0.5 (f = 0.5 + u/256), and ds·(u − 4) =
fma(f, 256·ds, −132·ds) with ds = d·(scale − 32): both terms are exact and so is the result, so the
fma's one rounding changes nothing (the interpreter, whose fma rounds twice, subtracts first). The
four byte planes are interleaved back into K order (join + reshape, as q6_k.py), so a tile of BLOCK_K
values is one K-ordered [rows, BLOCK_K] operand: one tensor-core dot per step against x's contiguous
columns.

Rounding (the contract's semantics): each weight is dequantized to fp32 as above (the `dequantize`
value, up to the sign of a zero: the fma gives +0 where gguf's product gives −0 for a negative
ds), then rounded to nearest even to x's dtype (bf16/fp16) and fed to the dot with fp32 accumulation;
the result is rounded once to x's dtype. fp32 x keeps fp32 weights and an IEEE (non-TF32) dot.
`matmul_ref` is that definition in torch and the path off CUDA. Under TRITON_INTERPRET the 16-bit dot
runs in fp32 on the rounded values (the same products: iq3_s's `_dot`).

Kernels. M ≤ 16 (decode): q4_k.py's GEMV pattern — the weight tile is the MMA's M side ("swap AB"),
x padded to 16 rows, M a runtime argument Triton does not specialise on, so every M ≤ 16 runs one
binary and a row's result does not depend on the other rows; deterministic split-K through
strata/kernels/splitk.py (the zeroed workspace is `gemv_workspace_numel` elements, which `QWeight`
holds). There is no dp4a GEMV for this format: every M ≤ 16 runs the dequantizing one whatever the
kernel choice quant_decode says. M > 16: a tiled GEMM in grouped tile order. Grids depend on shapes
only and nothing is read back to the host (CUDA graphs). The configurations follow q6_k.py's (the
same word-wise dequantization, fewer bytes); UNTIMED and not compiled for sm_90 here.
"""

from __future__ import annotations

import numpy as np
import torch

from strata.kernels import kernels_run
from strata.kernels.pdl import pdl_prologue
from strata.kernels.quant.iq3_s import _dot
from strata.kernels.quant.kquant_host import (
    BLOCK_VALUES,
    GEMV_MAX_ROWS,
    GemmConfig,
    GemvConfig,
    check_planes,
    check_raw,
    check_x_out,
    launch_gemm,
    launch_gemv,
    random_block_bytes,
    reference_matmul,
    split_gemv_config,
    tiled_gemm_config,
)
from strata.kernels.quant.q6_k import _signed_byte_to_f32
from strata.kernels.splitk import split_k_numel, split_k_range, split_k_store
from strata.kernels.tiles import grouped_tile
from strata.kernels.triton_import import jit, tl


GGML_TYPE = "Q3_K"
BLOCK_BYTES = 110


# ----------------------------------------------------------------------------------------------
# Blocks, planes and the definition


def random_raw(n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [N, K/256·110] of valid Q3_K blocks with weights of std ~0.02: random bytes for the quants
    and the packed scales, a positive fp16 d of sane size."""
    rng, blocks = random_block_bytes(n, k, seed, BLOCK_BYTES)
    nb = len(blocks)
    # RMS of a random scale − 32 ~18.5 and of u − 4 ~2.3: d ≈ 4.7e-4 gives a spread of ~0.02.
    d = (rng.uniform(0.6, 1.4, nb) * 4.7e-4).astype(np.float16)
    blocks[:, 108:110] = d.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n, k // BLOCK_VALUES * BLOCK_BYTES)


def repack(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The file's blocks → the kernels' planes (module docstring), on raw's device, torch ops only."""
    n, nb = check_raw(GGML_TYPE, raw, BLOCK_BYTES)
    blocks = raw.contiguous().view(n, nb, BLOCK_BYTES)
    device = raw.device
    packed = blocks[:, :, 96:108].int()
    # Scale i: low nibble of byte i mod 8 (shifted by 4 for i ≥ 8), top bits of byte 8 + i mod 4 at 2(i/4).
    low = (packed[:, :, None, 0:8] >> torch.arange(0, 8, 4, device=device, dtype=torch.int32)[:, None]) & 15
    high = (packed[:, :, None, 8:12] >> torch.arange(0, 8, 2, device=device, dtype=torch.int32)[:, None]) & 3
    scales = (low.reshape(n, nb, 16) | (high.reshape(n, nb, 16) << 4)) - 32
    return {"qs": blocks[:, :, 32:96].reshape(n, nb * 64).contiguous(),
            "hmask": blocks[:, :, 0:32].reshape(n, nb * 32).contiguous(),
            "scales": scales.to(torch.int8).view(n, nb * 16).contiguous(),
            "d": blocks[:, :, 108:110].contiguous().view(torch.float16).reshape(n, nb).float()}


def _check_planes(planes: dict[str, torch.Tensor], n: int, k: int) -> None:
    check_planes(GGML_TYPE, planes, k, {"qs": ((n, k // 4), torch.uint8), "hmask": ((n, k // 8), torch.uint8),
                                        "scales": ((n, k // 16), torch.int8), "d": ((n, k // 256), torch.float32)})


def quants(planes: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """The 3-bit quants u (0..7; the value is ds·(u − 4)), uint8 [N, K] in K order."""
    _check_planes(planes, n, k)
    device = planes["qs"].device
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=device).view(1, 1, 4, 1)
    low = (planes["qs"].view(n, k // 128, 1, 32) >> shifts) & 3  # [N, halves, s, j]
    bits = torch.arange(8, dtype=torch.uint8, device=device).view(1, 1, 8, 1)
    high = (planes["hmask"].view(n, k // 256, 1, 32) >> bits) & 1  # [N, blocks, 4h + s, j]
    return (low.view(n, k) | (high.view(n, k) << 2)).view(n, k)


def dequantize(planes: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """fp32 [N, K], equal bit for bit to gguf.quants.dequantize(raw, Q3_K)."""
    q = quants(planes, n, k).float() - 4.0
    ds = planes["d"].repeat_interleave(16, dim=1) * planes["scales"].float()  # [N, K/16]
    return (ds[:, :, None] * q.view(n, k // 16, 16)).view(n, k)


def matmul_ref(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: fp32 product of x and the dequantized weight rounded to x's dtype, rounded once."""
    return reference_matmul(dequantize(planes, n, k), x, out)


# ----------------------------------------------------------------------------------------------
# Kernels


@jit
def _byte_weights(words, ds256, neg_bias, J: tl.constexpr, INTERPRETED: tl.constexpr):
    """Byte J of each word, a 3-bit quant u, → ds·(u − 4), exact in fp32. u goes into the mantissa of
    0.5 (bits 16-23): f = 0.5 + u/256, and ds·(u − 4) = 256ds·f − 132ds, both terms exact (`neg_bias`
    is −132ds): one fma, whose single rounding of an exactly representable value changes nothing."""
    if J == 2:
        bits = words & 0x00FF0000
    elif J == 3:
        bits = (words >> 8) & 0x00FF0000
    else:
        bits = (words << (16 - 8 * J)) & 0x00FF0000
    f = (bits | 0x3F000000).to(tl.float32, bitcast=True)
    if INTERPRETED:  # the interpreter's fma rounds twice: the same exact value by a subtraction first
        return (f - 0.515625) * ds256
    return tl.fma(f, ds256, neg_bias)


@jit
def _dequant_tile(qs_ptr, hmask_ptr, scales_ptr, d_ptr, w_rows, k0, k,
                  ROWS: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Weight rows `w_rows` (int64 [R], all valid), values k0 .. k0+BLOCK_K (k0 a multiple of 128) →
    [R, BLOCK_K] in DTYPE, K order. qs, hmask and scales are the planes viewed as int32 words
    (`kernel_planes`)."""
    HALVES: tl.constexpr = BLOCK_K // 128
    r = w_rows[:, None, None, None, None]
    h = tl.arange(0, HALVES)[None, :, None, None, None]
    s = tl.arange(0, 4)[None, None, :, None, None]  # 32-value run of the half (2-bit field of a qs byte)
    g = tl.arange(0, 2)[None, None, None, :, None]  # 16-value scale group within the run
    w = tl.arange(0, 4)[None, None, None, None, :]  # word of 4 quants within the group
    half = k0 // 128 + h  # the half's index along the row
    # K is a multiple of 256: rows of qs and hmask words start 16-byte aligned, so the loads vectorise.
    qs_row = tl.multiple_of(k // 16, 16)
    hm_row = tl.multiple_of(k // 32, 8)
    qs = tl.load(qs_ptr + r * qs_row + (8 * half + 4 * g + w))  # [R, H, 1, 2, 4]: serves all four runs
    hm = tl.load(hmask_ptr + r * hm_row + (8 * (half // 2) + 4 * g + w))
    u = ((qs >> (2 * s)) & 0x03030303) | (((hm >> (4 * (half % 2) + s)) & 0x01010101) << 2)
    # Scale words 2·half, 2·half + 1: the groups of runs 0-1, then 2-3 (byte 2(s mod 2) + g).
    scale_words = tl.load(scales_ptr + r * (k // 64) + (2 * half + s // 2))
    d = tl.load(d_ptr + r * (k // 256) + half // 2)
    ds = d * _signed_byte_to_f32(scale_words, 8 * (2 * (s % 2) + g))  # [R, H, 4, 2, 1]
    ds256 = ds * 256.0
    neg_bias = ds * -132.0
    w0 = _byte_weights(u, ds256, neg_bias, 0, INTERPRETED)
    w1 = _byte_weights(u, ds256, neg_bias, 1, INTERPRETED)
    w2 = _byte_weights(u, ds256, neg_bias, 2, INTERPRETED)
    w3 = _byte_weights(u, ds256, neg_bias, 3, INTERPRETED)
    # [..., a, b] holds byte 2a + b of each word: flattened, the K order 128h + 32s + 16g + 4w + J.
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (ROWS, BLOCK_K)).to(DTYPE)


@jit(do_not_specialize=["m"])
def _gemv_kernel(x_ptr, x_stride, qs_ptr, hmask_ptr, scales_ptr, d_ptr, out_ptr, out_stride, partial_ptr,
                 counter_ptr, m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, IEEE_DOT: tl.constexpr, INTERPRETED: tl.constexpr,
                 USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    tile, split, kb_begin, kb_end = split_k_range(k // BLOCK_K, SPLIT_K)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.minimum(cols, n - 1).to(tl.int64)  # past-the-end rows re-read the last one, never stored
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < m
    xt_ptrs = x_ptr + rows[None, :] * x_stride + tl.arange(0, BLOCK_K)[:, None]  # xᵀ [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(kb_begin, kb_end):
        k0 = kb * BLOCK_K
        w = _dequant_tile(qs_ptr, hmask_ptr, scales_ptr, d_ptr, w_rows, k0, k, BLOCK_N, BLOCK_K,
                          x_ptr.dtype.element_ty, INTERPRETED)
        xt = tl.load(xt_ptrs + k0, mask=row_ok[None, :], other=0.0)
        acc = _dot(w, xt, acc, IEEE_DOT, INTERPRETED)
    split_k_store(acc, out_ptr, out_stride, partial_ptr, counter_ptr, tile, split, cols, rows, n, m,
                  SPLIT_K, BLOCK_M, BLOCK_N)


@jit(do_not_specialize=["m"])
def _gemm_kernel(x_ptr, x_stride, qs_ptr, hmask_ptr, scales_ptr, d_ptr, out_ptr, out_stride, m, n, k,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 IEEE_DOT: tl.constexpr, INTERPRETED: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    pid_m, pid_n = grouped_tile(tl.program_id(0), m, n, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = tl.minimum(rows, m - 1).to(tl.int64)
    w_rows = tl.minimum(cols, n - 1).to(tl.int64)
    x_ptrs = x_ptr + x_rows[:, None] * x_stride + tl.arange(0, BLOCK_K)[None, :]  # [BLOCK_M, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, k // BLOCK_K):
        k0 = kb * BLOCK_K
        xk = tl.load(x_ptrs + k0)
        w = _dequant_tile(qs_ptr, hmask_ptr, scales_ptr, d_ptr, w_rows, k0, k, BLOCK_N, BLOCK_K,
                          x_ptr.dtype.element_ty, INTERPRETED)
        acc = _dot(xk, tl.trans(w), acc, IEEE_DOT, INTERPRETED)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < m)[:, None] & (cols < n)[None, :])


# ----------------------------------------------------------------------------------------------
# Configurations (q6_k.py's reasoning for the H200; UNTIMED)


def gemv_config(n: int, k: int) -> GemvConfig:
    """A function of (N, K) only: what makes a row's result independent of M ≤ 16. Q6_K's tiles (the
    same word-wise dequantization, so a decode loop bound by instructions rather than its 0.45 bytes per
    value): 64-row tiles (one wgmma warp group; 128 rows once those alone give two programs per SM),
    128 values per step, split-K up to about 3 programs per SM with ≥ 2 steps each."""
    return split_gemv_config(n, k, block_k=128)


def gemm_config(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> GemmConfig:
    """16-bit x: Q6_K's tiles — 128x128 outputs, 8 warps (two wgmma warp groups), 128 values per step,
    64-row tiles for short reads. fp32 x (IEEE dot on the FMA units, a correctness path): 32x32 tiles,
    as Q6_K's."""
    return tiled_gemm_config(m, dtype, fp32_tile=32)


def gemv_workspace_numel(n: int, k: int, config: GemvConfig | None = None) -> int:
    """int32 elements of the split-K workspace (0 without split-K): tile counters, then fp32 partials."""
    cfg = config or gemv_config(n, k)
    return split_k_numel(n, cfg.block_n, cfg.split_k, GEMV_MAX_ROWS)


# ----------------------------------------------------------------------------------------------
# Launchers and dispatch


def _check_call(x: torch.Tensor, planes, n: int, k: int, out: torch.Tensor | None,
                allocate: bool = True) -> torch.Tensor | None:
    _check_planes(planes, n, k)
    return check_x_out(x, planes["qs"].device, n, k, out, allocate)


def kernel_planes(planes: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The kernels' plane arguments: qs, hmask and scales as int32 words, d."""
    return (planes["qs"].view(torch.int32), planes["hmask"].view(torch.int32), planes["scales"].view(torch.int32),
            planes["d"])


def gemv_q3k(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
             *, workspace: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """The decode kernel, x [M ≤ 16, K]. A split-K configuration uses `workspace` (zeroed int32 of ≥
    `gemv_workspace_numel` elements, left zeroed; not shared by concurrent streams) or allocates one."""
    out = _check_call(x, planes, n, k, out)
    return launch_gemv(_gemv_kernel, "gemv_q3k", x, kernel_planes(planes), n, k, out, workspace,
                       config or gemv_config(n, k), INTERPRETED=not x.is_cuda)


def gemm_q3k(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
             *, config: GemmConfig | None = None) -> torch.Tensor:
    """The prompt-read kernel, any M (used for M > 16)."""
    out = _check_call(x, planes, n, k, out)
    return launch_gemm(_gemm_kernel, x, kernel_planes(planes), n, k, out,
                       config or gemm_config(x.shape[0], n, k, x.dtype), INTERPRETED=not x.is_cuda)


def matmul(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
           *, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ Wᵀ → [M, N] in x's dtype (semantics: `matmul_ref`). M ≤ 16: the GEMV (a row's bits
    do not depend on M); larger M: the GEMM. Off CUDA (no interpreter): `matmul_ref`."""
    if not kernels_run(x, _gemv_kernel):
        _check_call(x, planes, n, k, out, allocate=False)
        return matmul_ref(x, planes, n, k, out)
    if x.shape[0] <= GEMV_MAX_ROWS:
        return gemv_q3k(x, planes, n, k, out, workspace=workspace)
    return gemm_q3k(x, planes, n, k, out)
