"""GGUF Q5_K weights kept 5-bit on the device: repack, the fp32 definition, and x @ Wᵀ kernels.

Q5_K (ggml): super-blocks of 256 values in 176 bytes — fp16 d, fp16 dmin, 12 bytes of 6-bit scales and
mins packed as Q4_K's, qh[32], then 128 bytes of low 4-bit quants laid out as Q4_K's (each run of 32
bytes serves two sub-blocks: low nibbles the first, high nibbles the second). qh byte i holds the fifth
bit of value i of sub-block j in bit j. A value is (d·scale)·q − dmin·min with q in 0..31, computed in
fp32 as gguf's numpy dequantizer does: both products are exact in fp32 (11 + 6 + 5 significant bits),
so the one rounding is the subtraction and a fused multiply-add gives the same bits.

So a Q5_K block is a Q4_K block with qh inserted after the scales, and the planes are Q4_K's (`repack`
reuses `q4_k.repack`) plus the high bits, 180 bytes per 256 values (+2.3% over the file's 176):
  qs      uint8 [N, K/2]    Q4_K's: the low quant bits in the file's order
  scales  uint8 [N, K/16]   Q4_K's: per 64 values scale 2g, scale 2g+1, min 2g, min 2g+1, unpacked
  d_dmin  fp16  [N, K/128]  Q4_K's: per 256 values d, dmin
  qh      uint8 [N, K/8]    the file's qh, 32 bytes per 256 values
The kernels read every plane as int32 words: 4-byte and wider loads, which Triton's software pipeline
issues asynchronously (cp.async); byte loads it could not.

Dequantization, four quants per int32 word (q6_k.py's scheme): word w of a pair's 32 quant bytes holds
the low nibbles of positions 4w .. 4w+3 (sub-block 2p of the super-block, p the pair's index in it)
and their high nibbles (sub-block 2p+1), and word w of the super-block's qh holds the fifth bits of
the same positions for all 8 sub-blocks. So (qs & 0x0F0F0F0F) | (((qh >> 2p) << 4) & 0x10101010) is
four 5-bit quants of sub-block 2p, one per byte, and ((qs >> 4) & 0x0F0F0F0F) | (((qh >> (2p+1)) << 4)
& 0x10101010) four of sub-block 2p+1. Each byte becomes fp32 by the 2^23 mantissa trick
(`q4_k._byte_to_f32`), then scale·q − offset; the four byte planes are interleaved back into K order
(join + reshape, as q6_k.py). A tile of BLOCK_K values gives Q4_K's two halves: the low nibbles'
values k0 + 64g + j and the high nibbles' k0 + 64g + 32 + j (j < 32), each a tensor-core dot of depth
BLOCK_K/2 against x gathered at its columns (`q4_k._low_columns`).

Rounding (the contract's semantics): each weight is dequantized to fp32 as above (bit for bit the
`dequantize` value), then rounded to nearest even to x's dtype (bf16/fp16) and fed to the dot with
fp32 accumulation; the result is rounded once to x's dtype. fp32 x keeps fp32 weights and an IEEE
(non-TF32) dot. `matmul_ref` is that definition in torch and the path off CUDA. Under TRITON_INTERPRET
the 16-bit dot runs in fp32 on the rounded values (the same products: iq3_s's `_dot`).

Kernels: q4_k.py's. M ≤ 16 (decode): the swap-AB GEMV, M not specialised on (a row's bits do not
depend on the other rows), deterministic split-K through strata/kernels/splitk.py with the zeroed
workspace of `gemv_workspace_numel` elements that `QWeight` holds. There is no packed-int8 (dp4a)
GEMV: the kernel choice `quant_decode` does not apply. M > 16: a tiled GEMM in grouped tile order.
Grids depend on shapes only and nothing is read back to the host (CUDA graphs). Configurations are
Q4_K's heuristics, UNTIMED. Compiled for sm_90a here (Triton 3.9, not the target's 3.6): the bf16
GEMV at 6144x4096 (64x128, split 4) ~9.1 SASS instructions per weight value in its loop (Q4_K's: ~8.4
in the same compile) on 0.69 bytes of HBM per value (Q4_K's 0.58), wgmma, every plane load
asynchronous, no spills; the bf16 GEMM (128x128x128) wgmma, no spills.
"""

from __future__ import annotations

import numpy as np
import torch

from strata.kernels import device as devices
from strata.kernels import kernels_run
from strata.kernels.device import DeviceSpec
from strata.kernels.pdl import pdl_prologue
from strata.kernels.quant import q4_k
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
from strata.kernels.quant.q4_k import _byte_to_f32, _half_to_f32, _low_columns
from strata.kernels.quant.q4_k_planes import pair_fields
from strata.kernels.splitk import split_k_numel, split_k_range, split_k_store
from strata.kernels.tiles import grouped_tile
from strata.kernels.triton_import import jit, tl

GGML_TYPE = "Q5_K"
BLOCK_BYTES = 176


# ----------------------------------------------------------------------------------------------
# Blocks, planes and the definition


def random_raw(n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [N, K/256·176] of valid Q5_K blocks with weights of std ~0.02: positive fp16 d and dmin
    of sane size, random bytes for the packed scales/mins, the high bits and the quants."""
    rng, blocks = random_block_bytes(n, k, seed, BLOCK_BYTES)
    nb = len(blocks)
    # E[scale·q] ≈ 31.5·15.5 and E[min] ≈ 31.5: dmin ≈ 15.5·d centres the values on ~0, and d ≈ 5e-5
    # gives a spread of ~0.02.
    d = (rng.uniform(0.6, 1.4, nb) * 5.0e-5).astype(np.float16)
    dmin = (d.astype(np.float32) * rng.uniform(13.0, 18.0, nb)).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    blocks[:, 2:4] = dmin.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n, k // BLOCK_VALUES * BLOCK_BYTES)


def repack(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The file's blocks → the kernels' planes (module docstring), on raw's device, torch ops only."""
    n, nb = check_raw(GGML_TYPE, raw, BLOCK_BYTES)
    blocks = raw.contiguous().view(n, nb, BLOCK_BYTES)
    as_q4_k = torch.cat([blocks[:, :, 0:16], blocks[:, :, 48:]], dim=-1).view(n, nb * q4_k.BLOCK_BYTES)
    return {**q4_k.repack(as_q4_k), "qh": blocks[:, :, 16:48].reshape(n, nb * 32).contiguous()}


def check_q5k_planes(planes: dict[str, torch.Tensor], n: int, k: int) -> None:
    check_planes(GGML_TYPE, planes, k, {"qs": ((n, k // 2), torch.uint8), "scales": ((n, k // 16), torch.uint8),
                                        "d_dmin": ((n, k // 128), torch.float16), "qh": ((n, k // 8), torch.uint8)})


def dequantize(planes: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """fp32 [N, K], equal bit for bit to gguf.quants.dequantize(raw, Q5_K)."""
    check_q5k_planes(planes, n, k)
    q, fields, d, dmin = pair_fields(planes, n, k)  # q: the low 4 bits, [N, K/64, 2, 32]
    shifts = torch.arange(8, dtype=torch.uint8, device=q.device).view(1, 1, 8, 1)
    high = (planes["qh"].view(n, k // 256, 1, 32) >> shifts) & 1  # [N, K/256, sub-block, 32]
    q = q + 16.0 * high.view(n, k // 64, 2, 32).float()
    scale = d[..., None] * fields[..., 0:2]  # [N, K/64, 2]: one per sub-block
    offset = dmin[..., None] * fields[..., 2:4]
    return (scale[..., None] * q - offset[..., None]).view(n, k)


def matmul_ref(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: fp32 product of x and the dequantized weight rounded to x's dtype, rounded once."""
    return reference_matmul(dequantize(planes, n, k), x, out)


# ----------------------------------------------------------------------------------------------
# Kernels


@jit
def _byte_weights(words, scale, offset, J: tl.constexpr):
    """Byte J of each int32 word, a quant q < 32, → scale·q − offset in fp32 (scale·q exact, one
    rounding): q goes into the mantissa of 2^23 (`q4_k._byte_to_f32`)."""
    if J == 0:
        q = words & 0xFF
    else:
        q = (words >> (8 * J)) & 0xFF
    return scale * _byte_to_f32(q) - offset


@jit
def _words_to_weights(words, scale, offset, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """[R, PAIRS, 8] words of 4 quants (bytes in K order) and their fields [R, PAIRS, 1] → [R, BLOCK_K/2]
    weights in DTYPE, K order within each 32-value run (q6_k's interleave)."""
    w0 = _byte_weights(words, scale, offset, 0)
    w1 = _byte_weights(words, scale, offset, 1)
    w2 = _byte_weights(words, scale, offset, 2)
    w3 = _byte_weights(words, scale, offset, 3)
    # [..., a, b] holds byte 2a + b of each word: flattened, the K order 4w + J.
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (ROWS, BLOCK_K // 2)).to(DTYPE)


@jit
def _dequant_tile(qs_ptr, scales_ptr, d_dmin_ptr, qh_ptr, w_rows, k0, k,
                  ROWS: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """Weight rows `w_rows` (int64 [R], all valid), values k0 .. k0+BLOCK_K (k0 a multiple of 64) →
    (low, high) [R, BLOCK_K/2] in DTYPE: low column 32g+j is value k0+64g+j, high column 32g+j is value
    k0+64g+32+j (`q4_k._low_columns`). Every plane is viewed as int32 words (`kernel_planes`)."""
    PAIRS: tl.constexpr = BLOCK_K // 64
    pair = k0 // 64 + tl.arange(0, PAIRS)  # the pairs' indices in the row
    r = w_rows[:, None, None]
    g = pair[None, :, None]
    w = tl.arange(0, 8)[None, None, :]  # word of 4 quant bytes: positions 4w .. 4w+3 of the pair's 32
    # K is a multiple of 256: rows of qs and qh words start 16-byte aligned, so the loads vectorise.
    qs = tl.load(qs_ptr + r * tl.multiple_of(k // 8, 32) + (8 * g + w))
    # qh word w of a super-block holds the fifth bits of positions 4w .. 4w+3 of all its 8 sub-blocks:
    # the pairs of one super-block load the same words.
    qh = tl.load(qh_ptr + r * tl.multiple_of(k // 32, 8) + ((g // 4) * 8 + w))
    fields = tl.load(scales_ptr + w_rows[:, None] * (k // 64) + pair[None, :])
    d_dmin = tl.load(d_dmin_ptr + w_rows[:, None] * (k // 256) + (pair // 4)[None, :])
    d = _half_to_f32(d_dmin)
    dmin = _half_to_f32(d_dmin >> 16)
    scale_lo = (d * _byte_to_f32(fields & 0xFF))[:, :, None]
    scale_hi = (d * _byte_to_f32((fields >> 8) & 0xFF))[:, :, None]
    offset_lo = (dmin * _byte_to_f32((fields >> 16) & 0xFF))[:, :, None]
    offset_hi = (dmin * _byte_to_f32((fields >> 24) & 0xFF))[:, :, None]
    # Four quants per word: the low nibbles (sub-block 2·(pair mod 4)) take qh bit 2·(pair mod 4) of each
    # byte, the high nibbles the next bit; each lands on bit 4 of its byte.
    bit = 2 * (g % 4)
    lo = (qs & 0x0F0F0F0F) | (((qh >> bit) << 4) & 0x10101010)
    hi = ((qs >> 4) & 0x0F0F0F0F) | (((qh >> (bit + 1)) << 4) & 0x10101010)
    return (_words_to_weights(lo, scale_lo, offset_lo, ROWS, BLOCK_K, DTYPE),
            _words_to_weights(hi, scale_hi, offset_hi, ROWS, BLOCK_K, DTYPE))


@jit(do_not_specialize=["m"])
def _gemv_kernel(x_ptr, x_stride, qs_ptr, scales_ptr, d_dmin_ptr, qh_ptr, out_ptr, out_stride, partial_ptr,
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
        w_lo, w_hi = _dequant_tile(qs_ptr, scales_ptr, d_dmin_ptr, qh_ptr, w_rows, k0, k, BLOCK_N, BLOCK_K,
                                   x_ptr.dtype.element_ty)
        x_lo = tl.load(xt_ptrs + k0, mask=row_ok[None, :], other=0.0)
        x_hi = tl.load(xt_ptrs + (k0 + 32), mask=row_ok[None, :], other=0.0)
        acc = _dot(w_lo, x_lo, acc, IEEE_DOT, INTERPRETED)
        acc = _dot(w_hi, x_hi, acc, IEEE_DOT, INTERPRETED)
    split_k_store(acc, out_ptr, out_stride, partial_ptr, counter_ptr, tile, split, cols, rows, n, m,
                  SPLIT_K, BLOCK_M, BLOCK_N)


@jit(do_not_specialize=["m"])
def _gemm_kernel(x_ptr, x_stride, qs_ptr, scales_ptr, d_dmin_ptr, qh_ptr, out_ptr, out_stride, m, n, k,
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
        x_hi = tl.load(x_ptrs + (k0 + 32))
        w_lo, w_hi = _dequant_tile(qs_ptr, scales_ptr, d_dmin_ptr, qh_ptr, w_rows, k0, k, BLOCK_N, BLOCK_K,
                                   x_ptr.dtype.element_ty)
        acc = _dot(x_lo, tl.trans(w_lo), acc, IEEE_DOT, INTERPRETED)
        acc = _dot(x_hi, tl.trans(w_hi), acc, IEEE_DOT, INTERPRETED)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < m)[:, None] & (cols < n)[None, :])


# ----------------------------------------------------------------------------------------------
# Configurations (q4_k.py's heuristics; UNTIMED)


def gemv_config(n: int, k: int, spec: DeviceSpec | None = None) -> GemvConfig:
    """A function of (N, K) only on a device (default: the current one): what makes a row's result
    independent of M ≤ 16. Q4_K's heuristic (64-row tiles, one wgmma warp group; split-K up to about 3
    programs per SM), 128 values a step (256 from K = 8192)."""
    return split_gemv_config(n, k, 256 if k % 256 == 0 and k >= 8192 else 128, spec)


def gemm_config(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
                spec: DeviceSpec | None = None) -> GemmConfig:
    """16-bit x: Q4_K's tiles (128x128 outputs, 8 warps, 128 values a step; 64-row tiles for short
    reads; compiled for sm_90a here: wgmma, no spills). fp32 x (IEEE dot on the FMA units, a
    correctness path): 32x32 tiles of 64 values a step on 8 warps, the largest tried that compiles
    without spills (128 values a step spill)."""
    if dtype == torch.float32:
        return GemmConfig(32, 32, 64, num_warps=8, num_stages=2)
    return tiled_gemm_config(m, dtype, fp32_tile=32, spec=spec)


def gemv_workspace_numel(n: int, k: int, config: GemvConfig | None = None, spec: DeviceSpec | None = None) -> int:
    """int32 elements of the split-K workspace (0 without split-K): tile counters, then fp32 partials,
    for `config` or the (N, K) configuration on `spec` (default: the current device)."""
    cfg = config or gemv_config(n, k, spec)
    return split_k_numel(n, cfg.block_n, cfg.split_k, GEMV_MAX_ROWS)


# ----------------------------------------------------------------------------------------------
# Launchers and dispatch


def _check_call(x: torch.Tensor, planes, n: int, k: int, out: torch.Tensor | None,
                allocate: bool = True) -> torch.Tensor | None:
    check_q5k_planes(planes, n, k)
    return check_x_out(x, planes["qs"].device, n, k, out, allocate)


def kernel_planes(planes: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The kernels' plane arguments: qs, scales, d_dmin and qh, each viewed as int32 words."""
    return tuple(planes[name].view(torch.int32) for name in ("qs", "scales", "d_dmin", "qh"))


def gemv_q5k(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
             *, workspace: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """The decode kernel, x [M ≤ 16, K]. A split-K configuration uses `workspace` (zeroed int32 of ≥
    `gemv_workspace_numel` elements, left zeroed; not shared by concurrent streams) or allocates one."""
    out = _check_call(x, planes, n, k, out)
    return launch_gemv(_gemv_kernel, "gemv_q5k", x, kernel_planes(planes), n, k, out, workspace,
                       config or gemv_config(n, k, devices.current(x)), INTERPRETED=not x.is_cuda)


def gemm_q5k(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
             *, config: GemmConfig | None = None) -> torch.Tensor:
    """The prompt-read kernel, any M (used for M > 16)."""
    out = _check_call(x, planes, n, k, out)
    return launch_gemm(_gemm_kernel, x, kernel_planes(planes), n, k, out,
                       config or gemm_config(x.shape[0], n, k, x.dtype, devices.current(x)), least_block_k=64,
                       INTERPRETED=not x.is_cuda)


def matmul(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
           *, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ Wᵀ → [M, N] in x's dtype (semantics: `matmul_ref`). M ≤ 16: the GEMV (a row's bits
    do not depend on M); larger M: the GEMM. Off CUDA (no interpreter): `matmul_ref`."""
    if not kernels_run(x, _gemv_kernel):
        _check_call(x, planes, n, k, out, allocate=False)
        return matmul_ref(x, planes, n, k, out)
    if x.shape[0] <= GEMV_MAX_ROWS:
        return gemv_q5k(x, planes, n, k, out, workspace=workspace)
    return gemm_q5k(x, planes, n, k, out)
