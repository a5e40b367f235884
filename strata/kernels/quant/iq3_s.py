"""GGUF IQ3_S weights kept quantized on the device: planes, the fp32 definition, and two Triton kernels;
plus `quantize`, a numpy quantizer (fp32 weights to the file's blocks) for fidelity measurements.

Format (per super-block of 256 values, 110 bytes): fp16 d; qs[64], the low 8 bits of 64 grid
indices; qh[8], their 9th bits (bit i of byte b for index 8b + i); signs[32], one bit per value (set =
negative); scales[4], eight 4-bit scales, one per sub-block of 32 values (low nibble first). Value v
of the block is d * (1 + 2 * scale[v // 32]) * grid[index[v // 4]][v % 4] * sign[v], where the grid
(512 entries of 4 magnitudes in {1, 3, ..., 15}) is read from the gguf package at import. Every
factor is a small odd integer times an fp16, so the product is exact in fp32 in any order: the
dequantization is bit for bit gguf's.

Planes (`repack`, 110 bytes per block, exactly the file's size): "qs" uint8 [N, K/4], "signs" int32
[N, K/32] (a sub-block's 32 sign bits as one word, interleaved: bit 8j + t is value 4t + j's, so group
t's four signs sit at bit t of each byte, `interleave_signs`), "qh" uint8 [N, K/32] (one byte per
sub-block), "scales" uint8 [N, K/64], "d" fp16 [N, K/256]; plus "workspace" int32 where the decode
configuration of (N, K) or the dp4a one splits K (counters and fp32 partials for either). The grid is
a 2 KB int32 [512] table (4 magnitudes packed per word) on each device, gathered by the kernels.

Kernels. Both dequantize a [BLOCK_N, BLOCK_K] weight tile in registers one grid word per 4 values:
each of the word's 4 bytes gives a [BLOCK_N, BLOCK_K / 4] plane, and the four are interleaved back
into K order (join + reshape, register-local). The weight is rounded once from its exact fp32 value
to x's dtype (round to nearest even) and multiplied on the tensor cores with fp32 accumulation (fp32
x: IEEE fp32 dot); the result is rounded once to x's dtype.
- M ≤ 16 (decode GEMV): weights as the MMA's M side, xᵀ padded to 16 columns ("swap AB", as in
  strata/kernels/gemv.py), so every M ≤ 16 runs one binary and a row's result does not depend on
  the others. Optional deterministic split-K: the last program of a column tile to arrive (atomic
  ticket) sums the fp32 partials in split order and resets the ticket.
- M ≤ DP4A_MAX_ROWS with 16-bit x (kernel choice quant_decode=auto, the default): the packed-int8 GEMV of
  `iq3_s_dp4a.py` instead; quant_decode=dequant or dp4a picks one kernel for every M ≤ 16. A
  row's bits then depend on which side of DP4A_MAX_ROWS its batch is.
- M > 16 (prompt reads): a tiled GEMM, x tiles [BLOCK_M, BLOCK_K] times dequantized weight tiles
  (each weight tile is dequantized once per BLOCK_M rows of x, so BLOCK_M is large).
Configurations depend on (N, K) (the GEMM's also on x's dtype and M ≤ 128) and the device only; timed
on the H200 by the dp4a sweep and `strata bench quant` (docs/QUANTIZATION.md). Under TRITON_INTERPRET the 16-bit
dot runs in fp32 on the rounded values, and the byte-to-weight step multiplies where the GPU uses an
fma (both exact: the GPU tests check the weights bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from strata.kernels.quant.dp4a import decode_kernel, shared_workspace_numel
from strata.kernels.quant.iq3_s_dp4a import gemv_config as dp4a_gemv_config
from strata.kernels.quant.iq3_s_planes import grid_table, grid_table_words, grid_words, signed_quants
from strata.kernels import device as devices
from strata.kernels import kernels_run, use_pdl
from strata.kernels.device import DeviceSpec
from strata.kernels.pdl import pdl_prologue
from strata.kernels.splitk import split_k_numel, split_k_parts, split_k_reduce, split_k_views
from strata.kernels.tiles import grouped_tile
from strata.kernels.triton_import import jit, tl


GGML_TYPE = "IQ3_S"
BLOCK_VALUES = 256
BLOCK_BYTES = 110
GEMV_MAX_ROWS = 16  # M ≤ this runs the GEMV; its MMA pads x to this many rows
WORKSPACE_MAX_FRACTION = 0.08  # split-K only where its workspace stays this small next to the weight
# Rows up to which quant_decode=auto runs the dp4a GEMV. H200, the four Qwen3-8B shapes, with the
# shared grid and interleaved signs (bench/results/iq3s_dp4a_sweep_cuda.txt): dp4a 13.0-45.9 us
# against 24.1-99.2 at M = 1, but 31.4-126.4 against 24.3-99.3 at M = 8. The dp4a GEMV runs
# next_power_of_2(M) rows, so M = 5-7 cost what M = 8 does; at 3-4 rows (interpolated, not measured)
# it is ahead.
DP4A_MAX_ROWS = 4


def _decode_kernel(rows: int) -> str:
    return decode_kernel(rows, DP4A_MAX_ROWS)


# ----------------------------------------------------------------------------------------------
# Planes, the definition, random blocks


def _check_raw(raw: torch.Tensor) -> tuple[int, int]:
    if raw.dim() != 2 or raw.dtype != torch.uint8 or raw.shape[1] % BLOCK_BYTES:
        raise ValueError(f"IQ3_S raw blocks: expected uint8 [N, K/256*110], got {raw.dtype} {tuple(raw.shape)}")
    return raw.shape[0], raw.shape[1] // BLOCK_BYTES * BLOCK_VALUES


def repack(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    n, k = _check_raw(raw)
    blocks = raw.contiguous().view(n, k // BLOCK_VALUES, BLOCK_BYTES)
    field = lambda lo, hi: blocks[:, :, lo:hi].clone(memory_format=torch.contiguous_format)  # noqa: E731
    planes = {
        "qs": field(2, 66).view(n, k // 4),
        "signs": interleave_signs(field(74, 106).view(torch.int32).view(n, k // 32)),
        "qh": field(66, 74).view(n, k // 32),
        "scales": field(106, 110).view(n, k // 64),
        "d": field(0, 2).view(torch.float16).view(n, k // 256),
    }
    numel = decode_workspace_numel(n, k, devices.current(raw.device))
    if numel:
        planes["workspace"] = torch.zeros(numel, dtype=torch.int32, device=raw.device)
    grid_table(raw.device)
    return planes


def interleave_signs(signs: torch.Tensor) -> torch.Tensor:
    """Sub-blocks' sign words (bit v: value v) with bit 4t + j moved to 8j + t: a group's four signs then
    come out in byte lanes with one shift and one mask (`(word >> t) & 0x01010101`), as the dp4a GEMV
    applies them, instead of a shift and a spread of four bits. For each j the eight bits 4t + j are
    gathered to the low byte by three shift-or-mask folds and placed at byte j, in int32 throughout
    (an 80B-A3B expert stack's signs are 33.5M words); bit 31 (t = 7, j = 3) stays where it is, so no
    shift carries into the sign."""
    out = signs & -(1 << 31)
    for j in range(4):
        y = (signs >> j) & (0x11111111 if j < 3 else 0x01111111)  # bits 4t + j at 4t (t = 7 of j = 3 kept above)
        y |= y >> 3
        y &= 0x03030303
        y |= y >> 6
        y &= 0x000F000F
        y |= y >> 12
        y &= 0xFF
        out |= y << (8 * j)
    return out


def decode_workspace_numel(n: int, k: int, spec: DeviceSpec | None = None) -> int:
    """int32 elements of planes["workspace"]: both decode GEMVs' split-K on `spec` (default: the current
    device), whatever the switch says."""
    spec = spec or devices.current()
    cfg = gemv_config(n, k, spec)
    parts = split_k_parts(n, cfg.block_n, cfg.split_k, GEMV_MAX_ROWS)
    return shared_workspace_numel(n, parts, dp4a_gemv_config(n, k, spec))


def dequantize(planes: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    values, db = signed_quants(planes, n, k)
    return (db.view(n, k // 32, 1) * values).view(n, k)  # products of small integers and an fp16: exact


def random_raw(n: int, k: int, seed: int) -> np.ndarray:
    """Random blocks: every field uniform random bits except d, |normal| * 1.5e-4 (weights of std ~0.02)."""
    if k % BLOCK_VALUES:
        raise ValueError(f"K = {k} is not a multiple of {BLOCK_VALUES}")
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // BLOCK_VALUES, BLOCK_BYTES), dtype=np.uint8)
    d = (np.abs(rng.standard_normal((n, k // BLOCK_VALUES))) * 1.5e-4 + 1e-5).astype(np.float16)
    blocks[:, :, 0:2] = d.view(np.uint8).reshape(n, k // BLOCK_VALUES, 2)
    return blocks.reshape(n, k // BLOCK_VALUES * BLOCK_BYTES)


# ----------------------------------------------------------------------------------------------
# Configurations


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # GEMM rows of x per program (the GEMV always pads to GEMV_MAX_ROWS)
    block_n: int  # weight rows per program, a power of two >= 16
    block_k: int  # K per step: 64, 128 or 256 (whole sub-blocks, ≥ 16 groups of 4)
    split_k: int = 1  # GEMV only: programs per column tile, each over an equal share of the K steps
    num_warps: int = 4
    num_stages: int = 3


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def workspace_numel(n: int, cfg: TileConfig) -> int:
    """int32 elements of GEMV workspace: tile tickets (padded to 128 bytes), then fp32 partials."""
    return split_k_numel(n, cfg.block_n, cfg.split_k, GEMV_MAX_ROWS)


# SASS instructions per weight value and thread of the GEMV loop (bf16, sm_90 compile, 4 warps,
# BLOCK_K 256): the dequantization is ~5.5 of them; the rest moves the tile to the MMA, and 16-row
# tiles do that twice over (the 4 warps duplicate a 16 x 16 MMA).
GEMV_INSTRUCTIONS_PER_VALUE = {32: 11.8, 16: 14.9}


def gemv_config(n: int, k: int, spec: DeviceSpec | None = None) -> TileConfig:
    """Untimed. The dequantization costs more issue slots than its bytes cost time (~3x at 4.8 TB/s),
    so the kernel is compute bound: the estimate is instructions per value times the load imbalance
    of the grid over the SMs, counting an SM with one program as half-rate (all programs resident:
    128 registers and ≤ 36 KB of shared memory each). Candidates: 16- or 32-row tiles (mma.sync;
    wgmma's 64 rows leave too few programs), a whole super-block per step (one d per row), 4 warps,
    K split 1-8 ways with ≥ 4 steps per split and a workspace of at most WORKSPACE_MAX_FRACTION of
    the weight; ties go to less splitting. The SM count is `spec`'s (default: the current device's)."""
    sms = (spec or devices.current()).sm_count
    steps = k // 256
    weight_bytes = n * k // BLOCK_VALUES * BLOCK_BYTES
    best = None
    for block_n, per_value in GEMV_INSTRUCTIONS_PER_VALUE.items():
        for split in (1, 2, 4, 8):
            cfg = TileConfig(GEMV_MAX_ROWS, block_n, 256, split, num_warps=4, num_stages=3)
            too_big = 4 * workspace_numel(n, cfg) > WORKSPACE_MAX_FRACTION * weight_bytes
            if split > 1 and (steps // split < 4 or too_big):
                continue
            programs = cfg.split_k * _cdiv(n, block_n)
            # Time ∝ the busiest SM's share of the work over its issue rate, full from 2 programs
            # (2 warps per scheduler) up: per_value * max(programs on it, 2) / programs.
            cost = per_value * max(_cdiv(programs, sms), 2) * sms / programs * (1 + 0.01 * split)
            if best is None or cost < best[0]:
                best = (cost, cfg)
    return best[1]


def gemm_config(n: int, k: int, dtype: torch.dtype = torch.bfloat16, m: int = 4096,
                spec: DeviceSpec | None = None) -> TileConfig:
    """Untimed. 16-bit x: wgmma tiles with 8 warps, the dequantized tile stored to shared memory once
    per K step of 64 (32 values a thread). Dequantizing costs ~12 instructions a weight value per
    step whatever BLOCK_M is, the MMA grows with it: at BLOCK_M 256 a step is ~800 issue cycles of
    dequantization against ~1000 of MMA (128: ~740 against 500), at 246 registers and 91 KB of
    shared memory (one program per SM), no spills. M ≤ 128 keeps 128-row tiles, and so does every M
    on a device without `wgmma` (`spec`, default: the current one), where the 256-row tile spills.
    fp32 x (an FMA dot): 32 x 32 tiles, which spill ~300 bytes (64 x 64 tiles spill kilobytes)."""
    if dtype == torch.float32:
        return TileConfig(32, 32, 64, 1, num_warps=4, num_stages=2)
    wide = m > 128 and (spec or devices.current()).wgmma  # 256 rows spill with mma.sync's register operands
    return TileConfig(256 if wide else 128, 128, 64, 1, num_warps=8, num_stages=3)


def check_config(cfg: TileConfig, k: int, gemv: bool) -> None:
    pow2 = lambda v: v >= 16 and v & (v - 1) == 0  # noqa: E731
    steps = k // cfg.block_k if cfg.block_k else 0
    if not (pow2(cfg.block_m) and pow2(cfg.block_n) and cfg.block_k in (64, 128, 256) and k % cfg.block_k == 0
            and 1 <= cfg.split_k <= steps and (gemv or cfg.split_k == 1) and (not gemv or cfg.block_m == GEMV_MAX_ROWS)
            and cfg.num_warps in (1, 2, 4, 8) and cfg.num_stages >= 1):
        raise ValueError(f"invalid {'GEMV' if gemv else 'GEMM'} {cfg} for K={k}")


# ----------------------------------------------------------------------------------------------
# Kernels


@jit
def _magnitude_times(db, word, signs, J: tl.constexpr, INTERPRETED: tl.constexpr):
    """db * (byte J of word), negated where bit 8J of signs is set: exact fp32 weights of one byte plane.
    The byte becomes the float 2^23 + byte by or-ing in 2^23's bits (I2F is quarter rate); one fma
    then gives db * byte exactly (the true value fits 20 bits; the interpreter's fma rounds twice).
    The sign is an xor of the sign bit."""
    shifted = (((word >> (8 * J)) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True)
    if INTERPRETED:
        v = db * (shifted - 8388608.0)
    else:
        v = tl.fma(shifted, db, db * -8388608.0)
    return (v.to(tl.int32, bitcast=True) ^ ((signs >> (8 * J)) << 31)).to(tl.float32, bitcast=True)


@jit
def _byte_plane(db, word, signs, J: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                INTERPRETED: tl.constexpr):
    """Byte J's weights of every group, [group in sub-block, sub-block, row] -> [row, group]."""
    w = _magnitude_times(db, word, signs, J, INTERPRETED)
    return tl.reshape(tl.permute(w, (2, 1, 0)), [BLOCK_N, BLOCK_K // 4])


@jit
def _dequant_tile(qs_ptr, signs_ptr, qh_ptr, scales_ptr, d_ptr, table, rows64, k0, k,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 [BLOCK_N, BLOCK_K] weights of rows `rows64` (int64 [BLOCK_N], valid rows), K from k0. The
    grid words are gathered from `table` (`iq3_s_planes.grid_table_words`) through shared memory.

    The groups of 4 are laid out [group in sub-block, sub-block, row] and permuted to rows-first only
    at the end: the grid gather has no contiguity, and the compiler then makes dim 0 the lanes' fastest
    dimension, which must be K for the final tile to be stored to shared memory in vectors."""
    SUBS: tl.constexpr = BLOCK_K // 32
    sub = k0 // 32 + tl.arange(0, SUBS)[:, None]  # global sub-block index [SUBS, 1]
    t = tl.arange(0, 8)[:, None, None]  # group of 4 inside a sub-block
    row = rows64[None, :]
    qs = tl.load(qs_ptr + row[None, :, :] * (k // 4) + sub[None, :, :] * 8 + t).to(tl.int32)
    qh = tl.load(qh_ptr + row * (k // 32) + sub).to(tl.int32)
    signs = tl.load(signs_ptr + row * (k // 32) + sub)
    scale_byte = tl.load(scales_ptr + row * (k // 64) + sub // 2).to(tl.int32)
    d = tl.load(d_ptr + row * (k // 256) + sub // 8).to(tl.float32)
    scale = (scale_byte >> ((sub % 2) * 4)) & 15
    db = (d * (1 + 2 * scale).to(tl.float32))[None, :, :]
    index = qs | (((qh[None, :, :] >> t) & 1) << 8)
    word = grid_words(index, table)
    group_signs = signs[None, :, :] >> t  # bit 8j: value 4t + j (interleaved planes)
    w0 = _byte_plane(db, word, group_signs, 0, BLOCK_N, BLOCK_K, INTERPRETED)
    w1 = _byte_plane(db, word, group_signs, 1, BLOCK_N, BLOCK_K, INTERPRETED)
    w2 = _byte_plane(db, word, group_signs, 2, BLOCK_N, BLOCK_K, INTERPRETED)
    w3 = _byte_plane(db, word, group_signs, 3, BLOCK_N, BLOCK_K, INTERPRETED)
    # [..., a, b] holds byte 2a + b of each group's word: flattened, K order 4g + j.
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK_N, BLOCK_K])


@jit
def _dot(a, b, acc, IEEE_DOT: tl.constexpr, INTERPRETED: tl.constexpr):
    if INTERPRETED:  # the interpreter's 16-bit dot is unusable; exact products of the 16-bit values instead
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE_DOT:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@jit(do_not_specialize=["m"])
def _gemv_kernel(x_ptr, x_stride, qs_ptr, signs_ptr, qh_ptr, scales_ptr, d_ptr, grid_ptr, out_ptr, out_stride,
                 partial_ptr, counter_ptr, m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, IEEE_DOT: tl.constexpr, INTERPRETED: tl.constexpr,
                 USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    table = grid_table_words(grid_ptr, True)
    pid = tl.program_id(0)
    tile = pid // SPLIT_K
    split = pid % SPLIT_K
    steps = k // BLOCK_K
    step_begin = split * steps // SPLIT_K
    step_end = (split + 1) * steps // SPLIT_K
    offs_n = tl.arange(0, BLOCK_N)
    cols = tile * BLOCK_N + offs_n
    col_ok = cols < n
    rows64 = tl.minimum(cols, n - 1).to(tl.int64)  # a ragged last tile reads valid rows, stores none
    xrows = tl.arange(0, BLOCK_M)
    xrow_ok = xrows < m
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(step_begin, step_end):
        k0 = step * BLOCK_K
        w = _dequant_tile(qs_ptr, signs_ptr, qh_ptr, scales_ptr, d_ptr, table, rows64, k0, k, BLOCK_N, BLOCK_K,
                          INTERPRETED)
        xt = tl.load(x_ptr + xrows[None, :] * x_stride + (k0 + offs_k)[:, None], mask=xrow_ok[None, :], other=0.0)
        acc = _dot(w.to(x_ptr.dtype.element_ty), xt, acc, IEEE_DOT, INTERPRETED)

    out_ptrs = out_ptr + xrows[None, :] * out_stride + cols[:, None]
    out_ok = col_ok[:, None] & xrow_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        last, total = split_k_reduce(acc, partial_ptr, counter_ptr, tile, split, xrows, offs_n, xrow_ok,
                                     SPLIT_K, BLOCK_M, BLOCK_N)
        if last:
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_ok)


@jit
def _gemm_kernel(x_ptr, x_stride, qs_ptr, signs_ptr, qh_ptr, scales_ptr, d_ptr, grid_ptr, out_ptr, out_stride,
                 m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, IEEE_DOT: tl.constexpr, INTERPRETED: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    table = grid_table_words(grid_ptr, True)
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, m, n, BLOCK_M, BLOCK_N, GROUP_M)

    xrows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = tl.minimum(cols, n - 1).to(tl.int64)
    x_ptrs = x_ptr + tl.minimum(xrows, m - 1).to(tl.int64)[:, None] * x_stride + tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, k // BLOCK_K):
        k0 = step * BLOCK_K
        xt = tl.load(x_ptrs)
        w = _dequant_tile(qs_ptr, signs_ptr, qh_ptr, scales_ptr, d_ptr, table, rows64, k0, k, BLOCK_N, BLOCK_K,
                          INTERPRETED)
        acc = _dot(xt, tl.trans(w.to(x_ptr.dtype.element_ty)), acc, IEEE_DOT, INTERPRETED)
        x_ptrs += BLOCK_K
    out_ptrs = out_ptr + xrows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(xrows < m)[:, None] & (cols < n)[None, :])


# ----------------------------------------------------------------------------------------------
# Dispatch


def _check_planes(planes: dict[str, torch.Tensor], n: int, k: int) -> None:
    want = {"qs": ((n, k // 4), torch.uint8), "signs": ((n, k // 32), torch.int32), "qh": ((n, k // 32), torch.uint8),
            "scales": ((n, k // 64), torch.uint8), "d": ((n, k // 256), torch.float16)}
    for name, (shape, dtype) in want.items():
        t = planes[name]
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"IQ3_S plane {name}: expected contiguous {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")


def matmul(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
           *, config: TileConfig | None = None, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ Wᵀ -> [M, N] in x's dtype. `config` overrides the (N, K) configuration of the regime
    M selects (given, a GEMV is the dequantizing one; else `quant_decode` may pick dp4a); `workspace` (int32, ≥ workspace_numel, zeroed once) overrides planes["workspace"] for
    a split-K GEMV, and one is allocated only when neither is there (a config override)."""
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x: expected [M, {k}] with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1 or out.device != x.device:
        raise ValueError(f"out: expected [{m}, {n}] {x.dtype} with contiguous rows, got {tuple(out.shape)} {out.dtype}")
    kernels = kernels_run(x, _gemv_kernel)
    if not kernels or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return out.copy_(F.linear(x.float(), dequantize(planes, n, k)).to(x.dtype))
    _check_planes(planes, n, k)
    if m == 0 or n == 0:
        return out
    gemv = m <= GEMV_MAX_ROWS
    spec = devices.current(x)
    cfg = config or (gemv_config(n, k, spec) if gemv else gemm_config(n, k, x.dtype, m, spec))
    check_config(cfg, k, gemv)
    on = use_pdl(x)
    common = dict(IEEE_DOT=x.dtype == torch.float32, INTERPRETED=not x.is_cuda, USE_PDL=on, launch_pdl=on,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    weights = (planes["qs"], planes["signs"], planes["qh"], planes["scales"], planes["d"], grid_table(x.device))
    if not gemv:
        grid = (_cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n),)
        _gemm_kernel[grid](x, x.stride(0), *weights, out, out.stride(0), m, n, k, BLOCK_M=cfg.block_m,
                           BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8, **common)
        return out
    if config is None and x.dtype != torch.float32 and _decode_kernel(m) == "dp4a":
        from strata.kernels.quant.iq3_s_dp4a import iq3s_gemv_dp4a

        ws = workspace if workspace is not None else planes.get("workspace")
        return iq3s_gemv_dp4a(x, planes, grid_table(x.device), n, k, out, workspace=ws)
    tiles = _cdiv(n, cfg.block_n)
    counters = partials = out  # placeholders: never touched without split-K
    if cfg.split_k > 1:
        if workspace is None:
            workspace = planes.get("workspace")
            if workspace is not None and workspace.numel() < workspace_numel(n, cfg):
                workspace = None  # sized for the default configuration, not this one
        counters, partials = split_k_views(workspace, n, cfg.block_n, cfg.split_k, GEMV_MAX_ROWS, x.device)
    _gemv_kernel[(tiles * cfg.split_k,)](
        x, x.stride(0), *weights, out, out.stride(0), partials, counters, m, n, k, BLOCK_M=GEMV_MAX_ROWS,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, **common)
    return out
