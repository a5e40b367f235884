"""GGUF Q8_0 weights kept quantized on the device: x [M, K] @ Wᵀ with W [N, K] read as int8.

Format. A block is 32 values: an fp16 scale d, then 32 int8 quants q (34 bytes); value = d * q.

Layout ("planes", built by `repack` on the device from the file's bytes by slicing and
reinterpreting, nothing decoded): "qs" int8 [N, K] (the quants, row-major) and "d" fp16 [N, K/32]
(block j of row n scales qs[n, 32j : 32j+32]). Same byte count as the file's blocks. Splitting the
scales off gives both planes contiguous, aligned rows (for K % 256 == 0, 16-byte aligned), so every
tile loads with wide asynchronous copies, which interleaved 34-byte blocks would not allow.

Semantics. `dequantize` is d * q in fp32, which is exact (8 × 11 significant bits), hence equal to
gguf's numpy dequantization bit for bit. `matmul` (kernels): each weight is d * q computed exactly in
fp32 and rounded to nearest even to x's dtype (bf16 / fp16; no rounding for fp32 x), multiplied by x
in its dtype with fp32 accumulation, the result rounded once to x's dtype. The fallback off CUDA and
outside the interpreter (`matmul_ref`) is the contract's F.linear(x.float(), dequantize(...)), whose
weights are not rounded: the two differ by that rounding only (~2⁻⁹ relative per bf16 weight).

Kernels.
- M ≤ 16 (decode): a GEMV. Each program owns BLOCK_N weight rows for all M rows and streams their
  [BLOCK_N, BLOCK_K] quant tiles and scale tiles through the software pipeline; the quants are
  loaded as [BLOCK_N, BLOCK_K/32, 32] so each scale multiplies its 32 values by broadcasting, with
  no gather; the tile is rounded to x's dtype and multiplied on the tensor cores with xᵀ padded to
  16 rows (weights on the MMA's M side, "swap AB"). Split-K (`gemv_config`): the last-arriving
  program of a row tile sums the fp32 partials in split order (`strata.kernels.splitk`), so the
  bits never depend on arrival order; the workspace (`gemv_workspace_numel`) is the caller's
  (`QWeight` keeps one per weight) or allocated per call. M is not specialised on and the
  tile never depends on M, so every M ≤ 16 runs one binary and a row's result is bit-identical
  whatever else is in the batch, and from run to run.
- M ≤ DP4A_MAX_ROWS with 16-bit x and K % 64 == 0 (kernel choice quant_decode=auto, the default): the
  packed-int8 GEMV of `dp4a.py` instead (x quantized per 32 values); quant_decode=dequant or dp4a
  picks one kernel for every M ≤ 16. A row's bits then depend on which side of DP4A_MAX_ROWS its batch is.
- M > 16 (prompt reads): a tiled GEMM over (BLOCK_M, BLOCK_N) output tiles in grouped order (a
  group of M tiles shares each weight tile through L2); each weight tile is dequantized in registers
  the same way and fed transposed to tl.dot with the x tile.
The configurations are functions of (N, K) (GEMV) or (M, N, K) (GEMM), chosen by reasoning for the
H200 (132 SMs, 227 KB shared memory per SM), NOT timed yet: see `gemv_config` / `gemm_config`.

Every kernel begins with the PDL prologue and is launched with `launch_pdl` where supported. The
grid depends on shapes only and nothing is read back to the host (CUDA graphs).

The interpreter (TRITON_INTERPRET=1) cannot multiply bf16 tiles (it stores them as uint16), so
there the rounded 16-bit operands are widened to fp32 before an IEEE fp32 dot: the same products
(a product of two 16-bit floats is exact in fp32) with fp32 accumulation, so the CPU tests check the
kernels' roundings; only the summation order differs from the GPU's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from strata.kernels.quant.dp4a import decode_kernel, shared_workspace_numel
from strata.kernels.quant.dp4a import gemv_config as dp4a_gemv_config
from strata.kernels import device as devices
from strata.kernels import kernels_run, use_pdl
from strata.kernels.device import DeviceSpec
from strata.kernels.pdl import pdl_prologue
from strata.kernels.splitk import split_k_numel, split_k_parts, split_k_range, split_k_store, split_k_views
from strata.kernels.tiles import grouped_tile
from strata.kernels.triton_import import jit, tl


GGML_TYPE = "Q8_0"
BLOCK_VALUES = 32
BLOCK_BYTES = 34

GEMV_MAX_ROWS = 16  # M up to this runs the GEMV, whose MMA pads x to 16 rows
SMEM_BUDGET = 110 << 10  # fp32 GEMV pipeline buffers: two programs fit the H200's 227 KB (`fp32_gemv_config`)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Rows up to which quant_decode=auto runs the dp4a GEMV. H200, the four Qwen3-8B shapes: dp4a
# 11.1-33.9 us against 18.1-61.1 at M = 1, 21.2-98.5 against 18.1-61.9 at M = 8; the linear
# interpolation crosses at M = 3.9-5.8. Rows 2-7 were interpolated, not measured.
DP4A_MAX_ROWS = 3


@dataclass(frozen=True)
class Q8Config:
    block_m: int  # GEMV: 16 always (x padded to it); GEMM: output rows per program
    block_n: int  # weight rows per program, a power of two >= 16
    block_k: int  # K per pipeline stage, a power of two >= 32 dividing K
    num_warps: int = 4
    num_stages: int = 4
    group_m: int = 8  # GEMM only: M tiles that visit the same weight tiles back to back
    split_k: int = 1  # GEMV only: programs per row tile, each over an equal share (±1) of the K steps


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_k(k: int, preferred: int) -> int:
    """The largest power of two <= preferred, and >= 32, that divides K (a multiple of 32)."""
    block = preferred
    while block > 32 and k % block:
        block //= 2
    return block


# The GEMV for 16-bit x (the decode path): 128-row tiles on 4 warps, 128 or 256 values per step, 4
# stages, and split-K up to about three programs per SM, at most MAX_SPLIT_K. One-program-per-SM tiles
# without split-K give 88 tok/s at 8B shapes; an int8-activation variant (x quantized per 32 values,
# int8 MMAs per scale group) measures 443-829 GB/s, no better (bench/results/q8_0_int8_gemv_sweep_cuda.txt).
# The table holds the sweep's picks on the H200 (`python benchmarks/kernels/quant_formats.py --sweep Q8_0`,
# bench/results/q8_0_gemv_sweep_cuda.txt: 979-1734 GB/s of weight bytes at M = 1 and 8, against 791-1275
# for the 64-row tiles), for the reference device (`devices.tuned`); others take `_heuristic_gemv`.
MAX_SPLIT_K = 8
GEMV_CONFIGS: dict[tuple[int, int], Q8Config] = {
    (4096, 4096): Q8Config(GEMV_MAX_ROWS, 128, 256, num_warps=4, num_stages=4, split_k=4),  # o_proj, 18.2 us
    (4096, 12288): Q8Config(GEMV_MAX_ROWS, 128, 256, num_warps=4, num_stages=4, split_k=4),  # down, 36.9 us
}


def _heuristic_gemv(n: int, k: int, spec: DeviceSpec) -> Q8Config:
    """qkv 6144 x 4096 (split 8, 23.1 us) and gate_up 24576 x 4096 (split 2, 61.7 us) are its picks too
    on the H200; the split follows the device's SM count and the stages its shared memory."""
    block_n = 128
    block_k = _block_k(k, 128)
    steps, tiles = k // block_k, _cdiv(n, block_n)
    split = max(1, min(3 * spec.sm_count // tiles, steps // 2, MAX_SPLIT_K))
    stages = devices.fit_stages(spec, 4, _gemv_stage_bytes(block_n, block_k))
    return Q8Config(GEMV_MAX_ROWS, block_n, block_k, num_warps=4, num_stages=stages, split_k=split)


def _gemv_stage_bytes(block_n: int, block_k: int, x_bytes: int = 2) -> int:
    """A GEMV pipeline stage: int8 quants, fp16 scales and the x tile."""
    return block_n * block_k + block_n * block_k // 16 + block_k * GEMV_MAX_ROWS * x_bytes


def gemv_config(n: int, k: int, spec: DeviceSpec | None = None) -> Q8Config:
    """M ≤ 16 with 16-bit x: a function of (N, K) only on a device (default: the current one), so a
    row's result does not depend on M."""
    spec = spec or devices.current()
    if devices.tuned(spec) and (n, k) in GEMV_CONFIGS:
        return GEMV_CONFIGS[(n, k)]
    return _heuristic_gemv(n, k, spec)


def gemv_workspace_numel(n: int, k: int, config: Q8Config | None = None, spec: DeviceSpec | None = None) -> int:
    """int32 elements of the GEMV's split-K workspace (0 without split-K); without a config, one that
    the dequantizing GEMV and (K % 64 == 0) the dp4a GEMV can both use in their (N, K) configurations,
    whatever the kernel choice `quant_decode` says: it is read per call, the workspace made once."""
    if config is not None:
        return split_k_numel(n, config.block_n, config.split_k, GEMV_MAX_ROWS)
    spec = spec or devices.current()
    cfg = gemv_config(n, k, spec)
    parts = split_k_parts(n, cfg.block_n, cfg.split_k, GEMV_MAX_ROWS)
    return shared_workspace_numel(n, parts, dp4a_gemv_config(n, k, spec) if k % 64 == 0 else None)


def _decode_kernel(rows: int) -> str:
    return decode_kernel(rows, DP4A_MAX_ROWS)


def fp32_gemv_config(n: int, k: int, spec: DeviceSpec | None = None) -> Q8Config:
    """M ≤ 16 with fp32 x (a correctness path: weights dequantized to fp32, IEEE dot, no split-K): the
    widest tile (BLOCK_N 64, then 32, then 16) that still gives about one program per SM (64 where N
    is too small for any to); BLOCK_K 256; 64 weight values per thread; as many stages as fit
    SMEM_BUDGET, at most half the device's shared memory per block."""
    spec = spec or devices.current()
    sms = spec.sm_count
    block_n = 64 if _cdiv(n, 64) >= sms else 32 if _cdiv(n, 32) >= 0.9 * sms else 16
    if n < 2048:  # no tile size fills the GPU: the widest (fewest programs; the CPU tests interpret them)
        block_n = 64
    block_k = _block_k(k, 256)
    num_warps = 8 if block_n * block_k > 8192 else 4
    budget = min(SMEM_BUDGET, spec.smem_per_block // 2)
    num_stages = max(2, min(6, budget // _gemv_stage_bytes(block_n, block_k)))
    return Q8Config(GEMV_MAX_ROWS, block_n, block_k, num_warps, num_stages)


def gemm_config(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
                spec: DeviceSpec | None = None) -> Q8Config:
    """M > 16, bf16 / fp16 x: wgmma tiles. Beyond M = 64, 128 x 128 outputs over 8 warps (two warp
    groups), BLOCK_K 128, 3 stages of x (32 KB) + quants (16 KB), plus the dequantized tile's 32 KB
    staging; where that gives fewer tiles than SMs, 128 x 64 over 4 warps; where even that does, and
    up to M = 64, 64-row tiles (little padding for the tensor cores) of 64 or 32 weight rows, so
    N = 4096 still spreads over 128 programs: at such M the weight stream is most of the cost.
    Every tile keeps >= 2 scales (4 bytes) per thread, which the pipeliner copies asynchronously (at
    2 bytes it loads them synchronously inside the loop). fp32 x runs an FMA dot (no tensor cores; a correctness path):
    32 x 64 x 32 is the largest tile tried that compiles for sm_90 without spills. Untimed."""
    if dtype == torch.float32:
        return Q8Config(32, 64, 32, num_warps=4, num_stages=2)
    spec = spec or devices.current()
    sms = spec.sm_count
    if m <= 64 or _cdiv(m, 128) * _cdiv(n, 64) < sms:
        block_n = 64 if _cdiv(n, 64) >= sms else 32
        cfg = Q8Config(64, block_n, _block_k(k, 8192 // block_n), num_warps=4, num_stages=3)
    elif _cdiv(m, 128) * _cdiv(n, 128) >= sms:
        cfg = Q8Config(128, 128, _block_k(k, 128), num_warps=8, num_stages=3)
    else:
        cfg = Q8Config(128, 64, _block_k(k, 128), num_warps=4, num_stages=3)
    return fit_gemm(cfg, spec)


def fit_gemm(cfg: Q8Config, spec: DeviceSpec) -> Q8Config:
    """A GEMM tile with as many of its stages (x, quants and scales each) as fit `spec`'s shared memory."""
    stage = cfg.block_m * cfg.block_k * 2 + cfg.block_n * cfg.block_k + cfg.block_n * cfg.block_k // 16
    stages = devices.fit_stages(spec, cfg.num_stages, stage)
    return cfg if stages == cfg.num_stages else replace(cfg, num_stages=stages)


def check_config(cfg: Q8Config, k: int, gemv: bool) -> None:
    pow2 = lambda v, lo: v >= lo and v & (v - 1) == 0  # noqa: E731
    if not (pow2(cfg.block_m, 16) and pow2(cfg.block_n, 16) and pow2(cfg.block_k, 32) and k % cfg.block_k == 0
            and (cfg.block_m == GEMV_MAX_ROWS or not gemv) and cfg.num_warps in (1, 2, 4, 8)
            and cfg.num_stages >= 1 and cfg.group_m >= 1 and 1 <= cfg.split_k <= k // cfg.block_k
            and (cfg.split_k == 1 or gemv)):
        raise ValueError(f"invalid {'GEMV' if gemv else 'GEMM'} {cfg} for K={k}")


# ----------------------------------------------------------------------------------------------
# Layout, definition, test data


def repack(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """uint8 [N, K/32 * 34] blocks -> {"qs": int8 [N, K], "d": fp16 [N, K/32]}, on raw's device."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % BLOCK_BYTES:
        raise ValueError(f"Q8_0 raw: expected uint8 [N, K/32*{BLOCK_BYTES}], got {raw.dtype} {tuple(raw.shape)}")
    n = raw.shape[0]
    blocks = raw.contiguous().view(n, -1, BLOCK_BYTES)
    d = blocks[:, :, :2].contiguous().view(torch.float16).view(n, -1)
    qs = blocks[:, :, 2:].contiguous().view(torch.int8).view(n, -1)
    return {"qs": qs, "d": d}


def _check_planes(planes: dict[str, torch.Tensor], n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    qs, d = planes.get("qs"), planes.get("d")
    if k % BLOCK_VALUES or qs is None or d is None:
        raise ValueError(f"Q8_0 planes: expected 'qs' and 'd' and K % 32 == 0, got keys {sorted(planes)}, K={k}")
    if (qs.dtype != torch.int8 or tuple(qs.shape) != (n, k) or not qs.is_contiguous() or d.dtype != torch.float16
            or tuple(d.shape) != (n, k // BLOCK_VALUES) or not d.is_contiguous() or d.device != qs.device):
        raise ValueError(f"Q8_0 planes for [{n}, {k}]: expected contiguous qs int8 [{n}, {k}] and d fp16 "
                         f"[{n}, {k // BLOCK_VALUES}] on one device, got qs {qs.dtype} {tuple(qs.shape)}, "
                         f"d {d.dtype} {tuple(d.shape)}")
    return qs, d


def dequantize(planes: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """fp32 [N, K] on the planes' device; equal to gguf's numpy dequantization bit for bit."""
    qs, d = _check_planes(planes, n, k)
    w = qs.view(n, k // BLOCK_VALUES, BLOCK_VALUES).to(torch.float32) * d.to(torch.float32)[:, :, None]
    return w.view(n, k)


def random_raw(n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [N, K/32 * 34]: gguf's own Q8_0 quantization of normal values of std 0.02."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if k % BLOCK_VALUES:
        raise ValueError(f"K={k} is not a multiple of {BLOCK_VALUES}")
    values = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * np.float32(0.02)
    return np.ascontiguousarray(quantize(values, GGMLQuantizationType.Q8_0))


# ----------------------------------------------------------------------------------------------
# Kernels


@jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr):
    if FP32_DOT:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@jit
def _dequant_tile(q_ptrs, d_ptrs, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """q_ptrs [ROWS, BLOCK_K/32, 32] int8, d_ptrs [ROWS, BLOCK_K/32] fp16 -> d*q [ROWS, BLOCK_K] in
    `dtype` (exact in fp32, then one rounding to nearest even)."""
    # q + 128 in [1, 255] ORed into the mantissa of 2^23, less 2^23 + 128: q in fp32 exactly, without
    # an int->float conversion (those issue at 16 per clock per SM, a quarter of the integer ops' rate).
    u = tl.load(q_ptrs).to(tl.int32) + 128
    q = (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    d = tl.load(d_ptrs).to(tl.float32)
    return tl.reshape((q * d[:, :, None]).to(dtype), ROWS, BLOCK_K)


@jit(do_not_specialize=["m"])
def _q8_gemv_kernel(x_ptr, x_stride, qs_ptr, d_ptr, out_ptr, out_stride, partial_ptr, counter_ptr, m, n, k,
                    k_groups, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT_K: tl.constexpr, FP32_DOT: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    GROUPS: tl.constexpr = BLOCK_K // 32
    tile, split, kb_begin, kb_end = split_k_range(k // BLOCK_K, SPLIT_K)
    offs_n = tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    offs_k = kb_begin * BLOCK_K + tl.arange(0, BLOCK_K)
    # Weight rows past N re-read row N-1, so the loads need no mask; their sums are never stored.
    w_rows = tl.minimum(offs_n, n - 1 - tile * BLOCK_N)
    tile_row0 = (tile * BLOCK_N).to(tl.int64)  # an lm_head's N*K nears 2^31; in-tile offsets stay int32
    q_ptrs = (qs_ptr + tile_row0 * k + w_rows[:, None, None] * k + kb_begin * BLOCK_K
              + tl.arange(0, GROUPS)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :])
    d_ptrs = (d_ptr + tile_row0 * k_groups + w_rows[:, None] * k_groups + kb_begin * GROUPS
              + tl.arange(0, GROUPS)[None, :])
    xt_ptrs = x_ptr + rows[None, :] * x_stride + offs_k[:, None]  # xᵀ tile [BLOCK_K, BLOCK_M]
    row_ok = rows < m
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(kb_begin, kb_end):
        w = _dequant_tile(q_ptrs, d_ptrs, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty)
        xt = tl.load(xt_ptrs, mask=row_ok[None, :], other=0.0)
        acc = _dot(w, xt, acc, FP32_DOT)
        q_ptrs += BLOCK_K
        d_ptrs += GROUPS
        xt_ptrs += BLOCK_K
    split_k_store(acc, out_ptr, out_stride, partial_ptr, counter_ptr, tile, split, tile * BLOCK_N + offs_n, rows,
                  n, m, SPLIT_K, BLOCK_M, BLOCK_N)


@jit
def q8_tile_product(x_ptr, x_stride, qs_ptr, d_ptr, m, n, k, k_groups, tile_m, tile_n, kb0, kb1,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] product of output tile (tile_m, tile_n) over K blocks kb0 .. kb1 - 1, each
    weight tile dequantized and rounded to x's dtype (rows clamped, so no load needs a mask). Shared by
    the tiled GEMM (all K blocks) and the stream-K GEMM (a program's share of a tile)."""
    GROUPS: tl.constexpr = BLOCK_K // 32
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = tl.minimum(tile_m * BLOCK_M + offs_m, m - 1)
    w_rows = tl.minimum(offs_n, n - 1 - tile_n * BLOCK_N)
    tile_row0 = (tile_n * BLOCK_N).to(tl.int64)
    x_ptrs = x_ptr + x_rows.to(tl.int64)[:, None] * x_stride + kb0 * BLOCK_K + offs_k[None, :]
    q_ptrs = (qs_ptr + tile_row0 * k + w_rows[:, None, None] * k + kb0 * BLOCK_K
              + tl.arange(0, GROUPS)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :])
    d_ptrs = (d_ptr + tile_row0 * k_groups + w_rows[:, None] * k_groups + kb0 * GROUPS
              + tl.arange(0, GROUPS)[None, :])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(kb0, kb1):
        w = _dequant_tile(q_ptrs, d_ptrs, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty)
        a = tl.load(x_ptrs)
        acc = _dot(a, tl.trans(w), acc, FP32_DOT)
        q_ptrs += BLOCK_K
        d_ptrs += GROUPS
        x_ptrs += BLOCK_K
    return acc


@jit
def _q8_gemm_kernel(x_ptr, x_stride, qs_ptr, d_ptr, out_ptr, out_stride, m, n, k, k_groups,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    FP32_DOT: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    tile_m, tile_n = grouped_tile(pid, m, n, BLOCK_M, BLOCK_N, GROUP_M)
    acc = q8_tile_product(x_ptr, x_stride, qs_ptr, d_ptr, m, n, k, k_groups, tile_m, tile_n, 0, k // BLOCK_K,
                          BLOCK_M, BLOCK_N, BLOCK_K, FP32_DOT)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    out_rows = tile_m * BLOCK_M + offs_m
    cols = tile_n * BLOCK_N + offs_n
    tl.store(out_ptr + out_rows.to(tl.int64)[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(out_rows < m)[:, None] & (cols < n)[None, :])


# ----------------------------------------------------------------------------------------------
# Public ops


def matmul_ref(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x.float(), dequantize(planes)) rounded once to x's dtype."""
    y = F.linear(x.float(), dequantize(planes, n, k)).to(x.dtype)
    return y if out is None else out.copy_(y)


def matmul_triton(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int,
                  out: torch.Tensor | None = None, *, config: Q8Config | None = None,
                  workspace: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels: the GEMV for M ≤ 16, the GEMM above. x [M, K] bf16/fp16/fp32 with contiguous rows
    (any row stride) on the planes' device; out [M, N] in x's dtype with contiguous rows, or None.
    `config` overrides the regime's configuration (a GEMV one must have block_m 16; given, the GEMV is
    the dequantizing one, else `quant_decode` may pick dp4a)."""
    qs, d = _check_planes(planes, n, k)
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or x.dtype not in SUPPORTED_DTYPES or x.device != qs.device:
        raise ValueError(f"x: expected [M, {k}] bf16/fp16/fp32 with contiguous rows on {qs.device}, got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()} on {x.device}")
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif (out.dim() != 2 or tuple(out.shape) != (m, n) or out.dtype != x.dtype or out.stride(1) != 1
          or out.device != x.device):
        raise ValueError(f"out: expected [{m}, {n}] {x.dtype} with contiguous rows on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()} on {out.device}")
    if m == 0 or n == 0:
        return out
    gemv = m <= GEMV_MAX_ROWS
    spec = devices.current(x)
    cfg = config or (gemm_config(m, n, k, x.dtype, spec) if not gemv else fp32_gemv_config(n, k, spec)
                     if x.dtype == torch.float32 else gemv_config(n, k, spec))
    check_config(cfg, k, gemv)
    on = use_pdl(x)
    fp32_dot = x.dtype == torch.float32 or not x.is_cuda
    common = dict(FP32_DOT=fp32_dot, USE_PDL=on, launch_pdl=on, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if gemv and x.dtype != torch.float32 and config is None and k % 64 == 0 and _decode_kernel(m) == "dp4a":
        from strata.kernels.quant.dp4a import q8_gemv_dp4a

        return q8_gemv_dp4a(x, qs, d, out, workspace=workspace)
    if gemv:
        counters = partials = out  # placeholders, untouched without split-K
        if cfg.split_k > 1:
            counters, partials = split_k_views(workspace, n, cfg.block_n, cfg.split_k, GEMV_MAX_ROWS, x.device)
        _q8_gemv_kernel[(_cdiv(n, cfg.block_n) * cfg.split_k,)](
            x, x.stride(0), qs, d, out, out.stride(0), partials, counters, m, n, k, k // BLOCK_VALUES,
            BLOCK_M=GEMV_MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, **common)
    else:
        _q8_gemm_kernel[(_cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n),)](
            x, x.stride(0), qs, d, out, out.stride(0), m, n, k, k // BLOCK_VALUES,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, **common)
    return out


def matmul(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int,
           out: torch.Tensor | None = None, *, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ Wᵀ -> [M, N] in x's dtype: the kernels on CUDA (no gradient) and in the interpreter,
    `matmul_ref` elsewhere. The GEMV's split-K uses `workspace` (zeroed int32 of ≥
    `gemv_workspace_numel` elements, left zeroed; not shared by concurrent streams) or allocates one."""
    if kernels_run(x, _q8_gemv_kernel):
        return matmul_triton(x, planes, n, k, out, workspace=workspace)
    return matmul_ref(x, planes, n, k, out)
