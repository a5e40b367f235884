"""GGUF Q6_K weights kept 6-bit on the device: repack, the fp32 definition, and x @ Wᵀ kernels.

Q6_K (ggml): super-blocks of 256 values in 210 bytes — ql[128] (the low 4 bits of each quant), qh[64]
(the high 2 bits), scales[16] (int8, one per 16 values), fp16 d. Value v is d·scale[v/16]·(q − 32)
with q the 6-bit quant. Each 128-value half h owns ql[64h .. 64h+63] and qh[32h .. 32h+31]: ql byte j
holds value 128h + j in its low nibble and 128h + 64 + j in its high one; qh byte i holds the high
bits of values 128h + 32t + i in bits 2t, 2t+1 (t = 0..3). gguf's numpy dequantizer computes
(d·scale)·(q − 32) in fp32; every product is exact (11 + 7 + 5 significant bits at most), so any
exact evaluation gives its bits.

Planes (`repack`, device ops only), 212 bytes per 256 values (+1% over the file's 210):
  ql      uint8 [N, K/2]     the file's order
  qh      uint8 [N, K/4]     the file's order
  scales  int8  [N, K/16]    the file's order
  d       fp32  [N, K/256]   d widened (exactly) from fp16, so that the kernels load a 4-byte word
The kernels read every plane as int32 words: 4-byte and wider loads, which Triton's software pipeline
issues asynchronously (cp.async); byte loads it could not.

Dequantization, four quants per int32 word (the layout of the file makes it line up): ql word w of a
half holds the low nibbles of values 4w .. 4w+3 (w < 8, run u = 0) or 32 + 4(w−8) .. (u = 1), and their
high nibbles' values sit 64 further on; qh word w mod 8 holds all of their high bits. So
(ql & 0x0F0F0F0F) | ((qh << (4 − 2u)) & 0x30303030) is four low-nibble quants, one per byte, and
((ql >> 4) & 0x0F0F0F0F) | ((qh >> 2u) & 0x30303030) four high-nibble ones. Byte j goes into the
mantissa of 0.5 (f = 0.5 + q/256), and ds·(q − 32) = fma(f, 256·ds, −160·ds) with ds = d·scale: both
terms are exact and so is the result, so the fma's one rounding changes nothing (the interpreter,
whose fma rounds twice, subtracts first). The four byte planes are interleaved back into K order
(join + reshape, as iq3_s.py). A tile of BLOCK_K values gives two halves: the low nibbles' values
k0 + 128h + c and the high nibbles' k0 + 128h + 64 + c (c < 64), each a tensor-core dot of depth
BLOCK_K/2 against x gathered at its columns, as in q4_k.py (there the two runs are 32 apart).

Rounding (the contract's semantics): each weight is dequantized to fp32 as above (the `dequantize`
value, up to the sign of a zero), then rounded to nearest even to x's dtype (bf16/fp16) and fed to
the dot with fp32 accumulation; the result is rounded once to x's dtype. fp32 x keeps fp32 weights
and an IEEE (non-TF32) dot. `matmul_ref` is that definition in torch and the path off CUDA. Under
TRITON_INTERPRET the 16-bit dot runs in fp32 on the rounded values (the same products: iq3_s's `_dot`).

Kernels. M ≤ 16 (decode): q4_k.py's GEMV pattern — the weight tile is the MMA's M side ("swap AB"),
x padded to 16 rows, M a runtime argument Triton does not specialise on, so every M ≤ 16 runs one
binary and a row's result does not depend on the other rows; deterministic split-K through
strata/kernels/splitk.py (the last program of a row tile sums the partials in split order and resets
the ticket; the zeroed workspace is `gemv_workspace_numel` elements, which `QWeight` holds; it also
holds the dp4a GEMV's). M ≤ DP4A_MAX_ROWS with 16-bit x (kernel choice quant_decode=auto, the default): the
packed-int8 GEMV of `q6_k_dp4a.py` instead (x quantized per 32 values; a row's bits then depend on
which side of DP4A_MAX_ROWS its batch is); 'dequant' or 'dp4a' picks one kernel for every M ≤ 16. M > 16:
a tiled GEMM in grouped tile order. Grids depend on shapes only and nothing is read back to the host
(CUDA graphs). The configurations follow q4_k.py's reasoning for the H200, not swept (the dequantizing
GEMV ran at 617-968 GB/s at M = 1 in the dp4a sweep, well under Q4_K's); compiled
for sm_90a here (Triton 3.9, not the target's 3.6): the bf16 GEMV (64x128) at 96 registers, ~7.5 SASS
instructions per weight value in its loop (Q4_K's: ~8.4 in the same compile), wgmma, no spills;
the bf16 GEMM (128x128x128) at 181 registers, 155 KB of shared memory, no spills.
"""

from __future__ import annotations


import numpy as np
import torch

from strata.kernels import device as devices
from strata.kernels import kernels_run
from strata.kernels.device import DeviceSpec
from strata.kernels.pdl import pdl_prologue
from strata.kernels.quant.dp4a import decode_kernel
from strata.kernels.quant.iq3_s import _dot
from strata.kernels.quant.kquant_host import (
    BLOCK_VALUES,
    GEMV_MAX_ROWS,
    SUPPORTED_DTYPES,
    GemmConfig,
    GemvConfig,
    check_raw,
    check_x_out,
    decode_workspace_numel,
    launch_gemm,
    launch_gemv,
    random_block_bytes,
    reference_matmul,
    split_gemv_config,
    tiled_gemm_config,
)
from strata.kernels.quant.q6_k_dp4a import gemv_config as dp4a_gemv_config
from strata.kernels.quant.q6_k_planes import check_q6k_planes as _check_planes
from strata.kernels.quant.q6_k_planes import kernel_planes, quants
from strata.kernels.splitk import split_k_range, split_k_store
from strata.kernels.tiles import grouped_tile
from strata.kernels.triton_import import jit, tl


GGML_TYPE = "Q6_K"
BLOCK_BYTES = 210

# Rows up to which quant_decode=auto runs the dp4a GEMV (`q6_k_dp4a.py`). H200, the four Qwen3-8B
# shapes and the 151,936-row head (`python benchmarks/kernels/quant_formats.py --dp4a Q6_K`): dp4a 15.4-318 us against
# 22.3-528 at M = 1, 38.7-1191 against 22.1-542 at M = 8; the linear interpolation crosses at M = 2.3-3.0.
# Rows 2-7 were interpolated, not measured.
DP4A_MAX_ROWS = 2


# ----------------------------------------------------------------------------------------------
# Blocks, planes and the definition


def random_raw(n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [N, K/256·210] of valid Q6_K blocks with weights of std ~0.02: random quant bytes and
    int8 scales, a positive fp16 d of sane size."""
    rng, blocks = random_block_bytes(n, k, seed, BLOCK_BYTES)
    nb = len(blocks)
    # RMS of a random int8 scale ~74 and of q − 32 ~18.5: d ≈ 1.5e-5 gives a spread of ~0.02 (an fp16
    # subnormal, which the kernels must widen exactly too).
    d = (rng.uniform(0.6, 1.4, nb) * 1.5e-5).astype(np.float16)
    blocks[:, 208:210] = d.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n, k // BLOCK_VALUES * BLOCK_BYTES)


def repack(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The file's blocks → the kernels' planes (module docstring), on raw's device, torch ops only."""
    n, nb = check_raw(GGML_TYPE, raw, BLOCK_BYTES)
    blocks = raw.contiguous().view(n, nb, BLOCK_BYTES)
    return {"ql": blocks[:, :, 0:128].reshape(n, nb * 128).contiguous(),
            "qh": blocks[:, :, 128:192].reshape(n, nb * 64).contiguous(),
            "scales": blocks[:, :, 192:208].reshape(n, nb * 16).contiguous().view(torch.int8),
            "d": blocks[:, :, 208:210].contiguous().view(torch.float16).reshape(n, nb).float()}


def dequantize(planes: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """fp32 [N, K], equal bit for bit to gguf.quants.dequantize(raw, Q6_K)."""
    q = quants(planes, n, k).float() - 32.0
    ds = planes["d"].repeat_interleave(16, dim=1) * planes["scales"].float()  # [N, K/16]
    return (ds[:, :, None] * q.view(n, k // 16, 16)).view(n, k)


def matmul_ref(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: fp32 product of x and the dequantized weight rounded to x's dtype, rounded once."""
    return reference_matmul(dequantize(planes, n, k), x, out)


# ----------------------------------------------------------------------------------------------
# Kernels


@jit
def _signed_byte_to_f32(words, shift):
    """The int8 at bit `shift` of each int32 word → fp32 without an int→float conversion (a slow
    instruction class): its value + 128 ORed into the mantissa of 2^23, less 2^23 + 128; both exact."""
    biased = ((words >> shift) & 0xFF) ^ 0x80
    return (biased | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


@jit
def _byte_weights(words, ds256, neg_bias, J: tl.constexpr, INTERPRETED: tl.constexpr):
    """Byte J of each word, a 6-bit quant q, → ds·(q − 32), exact in fp32. q goes into the mantissa of
    0.5 (bits 16-21): f = 0.5 + q/256, and ds·(q − 32) = 256ds·f − 160ds, both terms exact (`neg_bias`
    is −160ds): one fma, whose single rounding of an exactly representable value changes nothing."""
    if J == 2:
        bits = words & 0x00FF0000
    elif J == 3:
        bits = (words >> 8) & 0x00FF0000
    else:
        bits = (words << (16 - 8 * J)) & 0x00FF0000
    f = (bits | 0x3F000000).to(tl.float32, bitcast=True)
    if INTERPRETED:  # the interpreter's fma rounds twice: the same exact value by a subtraction first
        return (f - 0.625) * ds256
    return tl.fma(f, ds256, neg_bias)


@jit
def _words_to_weights(words, ds, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    """[R, H, 2, 2, 4] words of 4 quants (bytes in K order) and their scales ds [R, H, 2, 2, 1] →
    [R, BLOCK_K/2] weights in DTYPE, K order."""
    ds256 = ds * 256.0
    neg_bias = ds * -160.0
    w0 = _byte_weights(words, ds256, neg_bias, 0, INTERPRETED)
    w1 = _byte_weights(words, ds256, neg_bias, 1, INTERPRETED)
    w2 = _byte_weights(words, ds256, neg_bias, 2, INTERPRETED)
    w3 = _byte_weights(words, ds256, neg_bias, 3, INTERPRETED)
    # [..., a, b] holds byte 2a + b of each word: flattened, the K order 4w + J.
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (ROWS, BLOCK_K // 2)).to(DTYPE)


@jit
def _dequant_tile(ql_ptr, qh_ptr, scales_ptr, d_ptr, w_rows, k0, k,
                  ROWS: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Weight rows `w_rows` (int64 [R], all valid), values k0 .. k0+BLOCK_K (k0 a multiple of 128) →
    (low, high) [R, BLOCK_K/2] in DTYPE: low column 64h+c is value k0+128h+c, high column 64h+c value
    k0+128h+64+c (`_low_columns`). The planes are viewed as int32 words (`kernel_planes`)."""
    HALVES: tl.constexpr = BLOCK_K // 128
    r = w_rows[:, None, None, None, None]
    h = tl.arange(0, HALVES)[None, :, None, None, None]
    u = tl.arange(0, 2)[None, None, :, None, None]  # 32-value run of the nibble half
    g = tl.arange(0, 2)[None, None, None, :, None]  # 16-value scale group within the run
    w = tl.arange(0, 4)[None, None, None, None, :]  # word of 4 quants within the group
    # K is a multiple of 256: rows of ql and qh words start 16-byte aligned, so the loads vectorise.
    ql_row = tl.multiple_of(k // 8, 32)
    qh_row = tl.multiple_of(k // 16, 16)
    ql = tl.load(ql_ptr + r * ql_row + (k0 // 8 + 16 * h + 8 * u + 4 * g + w))
    qh = tl.load(qh_ptr + r * qh_row + (k0 // 16 + 8 * h + 4 * g + w))  # [R, H, 1, 2, 4]: serves both runs
    # Four quants per word: qh bits 2u, 2u+1 of each byte are the low nibble's high bits (value
    # 128h + 32u + i), bits 4+2u, 5+2u the high nibble's; each lands on bits 4-5 of its byte.
    lo = (ql & 0x0F0F0F0F) | ((qh << (4 - 2 * u)) & 0x30303030)
    hi = ((ql >> 4) & 0x0F0F0F0F) | ((qh >> (2 * u)) & 0x30303030)
    # Scale word 2h: the low nibbles' 4 scales (byte 2u + g), word 2h + 1: the high nibbles'.
    words = scales_ptr + r * (k // 64) + (k0 // 64 + 2 * h)
    byte_shift = 8 * (2 * u + g)
    d = tl.load(d_ptr + r * (k // 256) + (k0 + 128 * h) // 256)
    ds_lo = d * _signed_byte_to_f32(tl.load(words), byte_shift)
    ds_hi = d * _signed_byte_to_f32(tl.load(words + 1), byte_shift)
    return (_words_to_weights(lo, ds_lo, ROWS, BLOCK_K, DTYPE, INTERPRETED),
            _words_to_weights(hi, ds_hi, ROWS, BLOCK_K, DTYPE, INTERPRETED))


@jit
def _low_columns(BLOCK_K: tl.constexpr):
    """Offsets (from k0) of the values the low nibbles of a tile hold; +64 gives the high ones."""
    c = tl.arange(0, BLOCK_K // 2)
    return (c // 64) * 128 + c % 64


@jit(do_not_specialize=["m"])
def _gemv_kernel(x_ptr, x_stride, ql_ptr, qh_ptr, scales_ptr, d_ptr, out_ptr, out_stride, partial_ptr,
                 counter_ptr, m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, IEEE_DOT: tl.constexpr, INTERPRETED: tl.constexpr,
                 USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    tile, split, kb_begin, kb_end = split_k_range(k // BLOCK_K, SPLIT_K)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.minimum(cols, n - 1).to(tl.int64)  # past-the-end rows re-read the last one, never stored
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < m
    xt_ptrs = x_ptr + rows[None, :] * x_stride + _low_columns(BLOCK_K)[:, None]  # xᵀ [BLOCK_K/2, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(kb_begin, kb_end):
        k0 = kb * BLOCK_K
        w_lo, w_hi = _dequant_tile(ql_ptr, qh_ptr, scales_ptr, d_ptr, w_rows, k0, k, BLOCK_N, BLOCK_K,
                                   x_ptr.dtype.element_ty, INTERPRETED)
        x_lo = tl.load(xt_ptrs + k0, mask=row_ok[None, :], other=0.0)
        x_hi = tl.load(xt_ptrs + (k0 + 64), mask=row_ok[None, :], other=0.0)
        acc = _dot(w_lo, x_lo, acc, IEEE_DOT, INTERPRETED)
        acc = _dot(w_hi, x_hi, acc, IEEE_DOT, INTERPRETED)
    split_k_store(acc, out_ptr, out_stride, partial_ptr, counter_ptr, tile, split, cols, rows, n, m,
                  SPLIT_K, BLOCK_M, BLOCK_N)


@jit(do_not_specialize=["m"])
def _gemm_kernel(x_ptr, x_stride, ql_ptr, qh_ptr, scales_ptr, d_ptr, out_ptr, out_stride, m, n, k,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 IEEE_DOT: tl.constexpr, INTERPRETED: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    pid_m, pid_n = grouped_tile(tl.program_id(0), m, n, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = tl.minimum(rows, m - 1).to(tl.int64)
    w_rows = tl.minimum(cols, n - 1).to(tl.int64)
    x_ptrs = x_ptr + x_rows[:, None] * x_stride + _low_columns(BLOCK_K)[None, :]  # [BLOCK_M, BLOCK_K/2]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, k // BLOCK_K):
        k0 = kb * BLOCK_K
        x_lo = tl.load(x_ptrs + k0)
        x_hi = tl.load(x_ptrs + (k0 + 64))
        w_lo, w_hi = _dequant_tile(ql_ptr, qh_ptr, scales_ptr, d_ptr, w_rows, k0, k, BLOCK_N, BLOCK_K,
                                   x_ptr.dtype.element_ty, INTERPRETED)
        acc = _dot(x_lo, tl.trans(w_lo), acc, IEEE_DOT, INTERPRETED)
        acc = _dot(x_hi, tl.trans(w_hi), acc, IEEE_DOT, INTERPRETED)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < m)[:, None] & (cols < n)[None, :])


# ----------------------------------------------------------------------------------------------
# Configurations (q4_k.py's reasoning for the H200; not swept)


def gemv_config(n: int, k: int, spec: DeviceSpec | None = None) -> GemvConfig:
    """A function of (N, K) only on a device (`spec`, default: the current one): what makes a row's
    result independent of M ≤ 16. As Q4_K's decode loop, this one should be bound by instructions,
    not bytes (0.82 bytes per value against ~7.5 instructions in the sm_90a compile), so the tiles aim
    at busy schedulers: 64-row tiles (one wgmma warp group; 128 rows once those alone give two
    programs per SM), 128 values per step (one 128-value half per row; 53 KB of shared memory at 4
    stages, 96 registers), split-K up to about 3 programs per SM with ≥ 2 steps each: 384 programs at
    4096x4096, 4096x12288 and 12288x4096 on 132 SMs."""
    return split_gemv_config(n, k, block_k=128, spec=spec)


def gemm_config(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
                spec: DeviceSpec | None = None) -> GemmConfig:
    """16-bit x: Q4_K's tiles — 128x128 outputs, 8 warps (two wgmma warp groups), 128 values per step
    (per stage 32 KB of x and ~14 KB of weight planes), 64-row tiles for short reads. fp32 x (IEEE
    dot on the FMA units, a correctness path): 32x32 tiles, 8 warps (64x64 spilled 1.5 KB in the
    sm_90a compile; this one 176 bytes)."""
    return tiled_gemm_config(m, dtype, fp32_tile=32, spec=spec)


def gemv_workspace_numel(n: int, k: int, config: GemvConfig | None = None, spec: DeviceSpec | None = None) -> int:
    """int32 elements of the split-K workspace (0 without split-K): tile counters, then fp32 partials;
    without a config, one that the dequantizing GEMV and the dp4a GEMV can both use in their (N, K)
    configurations, whatever the kernel choice `quant_decode` says: it is read per call, the workspace made once."""
    return decode_workspace_numel(n, k, config, gemv_config, dp4a_gemv_config, spec)


def _decode_kernel(rows: int) -> str:
    return decode_kernel(rows, DP4A_MAX_ROWS)


# ----------------------------------------------------------------------------------------------
# Launchers and dispatch


def _check_call(x: torch.Tensor, planes, n: int, k: int, out: torch.Tensor | None,
                allocate: bool = True) -> torch.Tensor | None:
    _check_planes(planes, n, k)
    return check_x_out(x, planes["ql"].device, n, k, out, allocate)


def gemv_q6k(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
             *, workspace: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """The decode kernel, x [M ≤ 16, K]. A split-K configuration uses `workspace` (zeroed int32 of ≥
    `gemv_workspace_numel` elements, left zeroed; not shared by concurrent streams) or allocates one."""
    out = _check_call(x, planes, n, k, out)
    return launch_gemv(_gemv_kernel, "gemv_q6k", x, kernel_planes(planes), n, k, out, workspace,
                       config or gemv_config(n, k, devices.current(x)), INTERPRETED=not x.is_cuda)


def gemm_q6k(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
             *, config: GemmConfig | None = None) -> torch.Tensor:
    """The prompt-read kernel, any M (used for M > 16)."""
    out = _check_call(x, planes, n, k, out)
    return launch_gemm(_gemm_kernel, x, kernel_planes(planes), n, k, out,
                       config or gemm_config(x.shape[0], n, k, x.dtype, devices.current(x)),
                       INTERPRETED=not x.is_cuda)


def matmul(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
           *, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ Wᵀ → [M, N] in x's dtype (semantics: `matmul_ref`). M ≤ 16: the GEMV (a row's bits
    do not depend on M; `quant_decode` picks it or, up to DP4A_MAX_ROWS rows of 16-bit x, the dp4a
    GEMV, whose semantics are `q6_k_dp4a.gemv_q6k_dp4a_ref`); larger M: the GEMM. Off CUDA (no
    interpreter): `matmul_ref`."""
    if not kernels_run(x, _gemv_kernel):
        _check_call(x, planes, n, k, out, allocate=False)
        return matmul_ref(x, planes, n, k, out)
    m = x.shape[0]
    if m <= GEMV_MAX_ROWS:
        if m > 0 and x.dtype != torch.float32 and _decode_kernel(m) == "dp4a":
            from strata.kernels.quant.q6_k_dp4a import q6k_gemv_dp4a

            out = _check_call(x, planes, n, k, out)
            return out if n == 0 else q6k_gemv_dp4a(x, planes, n, k, out, workspace=workspace)
        return gemv_q6k(x, planes, n, k, out, workspace=workspace)
    return gemm_q6k(x, planes, n, k, out)
