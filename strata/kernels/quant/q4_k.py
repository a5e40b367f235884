"""GGUF Q4_K weights kept 4-bit on the device: repack, the fp32 definition, and x @ Wᵀ kernels.

Q4_K (ggml): super-blocks of 256 values in 144 bytes — fp16 d, fp16 dmin, 12 bytes packing a 6-bit
scale and a 6-bit min for each of 8 sub-blocks of 32, then 128 bytes of 4-bit quants. In the quant
bytes, each run of 32 bytes serves two sub-blocks: low nibbles the first, high nibbles the second.
A value is (d·scale)·q − dmin·min, computed in fp32 exactly as gguf's numpy dequantizer does: both
products are exact in fp32 (11 + 6 + 4 significant bits), so the one rounding is the subtraction
and a fused multiply-add gives the same bits.

Planes (`repack`, device ops only), 148 bytes per 256 values (+2.8% over the file's 144):
  qs      uint8 [N, K/2]    the quant bytes in the file's order (no shuffle needed: see below)
  scales  uint8 [N, K/16]   per 64 values (sub-blocks 2g, 2g+1): scale 2g, scale 2g+1, min 2g, min
                            2g+1, the 6-bit fields unpacked
  d_dmin  fp16  [N, K/128]  per 256 values: d, dmin (the block's first 4 bytes as they are)
The kernels read `scales` and `d_dmin` as int32 words: 4-byte loads that Triton's software pipeline
can issue asynchronously (cp.async) a few steps ahead, like the quants, where byte loads could not.
The kernels read a tile of BLOCK_K values as [rows, BLOCK_K/64, 32] bytes; the low nibbles are the
values k0 + 64g + j and the high nibbles k0 + 64g + 32 + j, so each tile is two tensor-core dots of
depth BLOCK_K/2 against x gathered at those two column sets — no nibble interleave in registers,
and each [rows, g] scale broadcasts along the 32 bytes it covers.

Rounding (the contract's semantics): each weight is dequantized to fp32 as above (bit for bit the
`dequantize` value), then rounded to nearest even to x's dtype (bf16/fp16) and fed to the dot with
fp32 accumulation; the result is rounded once to x's dtype. fp32 x keeps fp32 weights and an IEEE
(non-TF32) dot. `matmul_ref` is that definition in torch and the path off CUDA.

Kernels. M ≤ 16 (decode): the GEMV pattern of strata/kernels/gemv.py — the weight tile is the MMA's
M side ("swap AB"), x is padded to 16 rows, M is a runtime argument Triton does not specialise on,
so every M ≤ 16 runs one binary and a row's result does not depend on the other rows. Triton
dequantizes straight into the MMA's register operand layout (wgmma at 64 rows, one warp group), so
the weights never pass through shared memory; quants, scales and xᵀ stream in through the
cp.async pipeline. Split-K: the last-arriving program of a row tile sums the fp32 partials in split
order (deterministic, no float atomics) and resets the tile's ticket, so one zeroed workspace
(`gemv_workspace_numel`) serves every call on a stream; `matmul(..., workspace=)` takes it, and
without it a split-K shape allocates a zeroed one per call (from the graph pool under capture).
M ≤ DP4A_MAX_ROWS with 16-bit x (kernel choice quant_decode=auto, the default): the packed-int8 GEMV of
`q4_k_dp4a.py` instead (x quantized per 32 values); quant_decode=dequant or dp4a picks one kernel
for every M ≤ 16. A row's bits then depend on which side of DP4A_MAX_ROWS its batch is.
M > 16 (prompt reads): a tiled GEMM in grouped tile order; each weight tile is dequantized in
registers, stored to shared memory and read by wgmma. Grids depend on shapes only and nothing is
read back to the host: both are CUDA-graph safe.

Configurations are chosen by reasoning for the H200 and checked only by compiling for sm_90 (no
spills, wgmma, every load pipelined); they are UNTIMED (see the notes at the tables).
"""

from __future__ import annotations


import numpy as np
import torch

from strata.kernels import device as devices
from strata.kernels import kernels_run
from strata.kernels.device import DeviceSpec
from strata.kernels.pdl import pdl_prologue
from strata.kernels.quant.dp4a import decode_kernel
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
from strata.kernels.quant.q4_k_dp4a import gemv_config as dp4a_gemv_config
from strata.kernels.quant.q4_k_planes import check_q4k_planes as _check_planes
from strata.kernels.quant.q4_k_planes import pair_fields
from strata.kernels.splitk import split_k_reduce
from strata.kernels.tiles import grouped_tile
from strata.kernels.triton_import import jit, tl


GGML_TYPE = "Q4_K"
BLOCK_BYTES = 144

# Rows up to which quant_decode=auto runs the dp4a GEMV. H200, the four Qwen3-8B shapes: dp4a
# 9.9-28.1 us against 18.4-52.1 at M = 1, 25.4-122.5 against 18.8-52.3 at M = 8; the linear
# interpolation crosses at M = 2.8-5.2. Rows 2-7 were interpolated, not measured.
DP4A_MAX_ROWS = 2


# ----------------------------------------------------------------------------------------------
# Blocks, planes and the definition


def random_raw(n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [N, K/256·144] of valid Q4_K blocks with weights of std ~0.02: positive fp16 d and dmin
    of sane size, random bytes for the packed scales/mins and the quants."""
    rng, blocks = random_block_bytes(n, k, seed, BLOCK_BYTES)
    nb = len(blocks)
    # E[scale·q] ≈ 31.5·7.5 and E[min] ≈ 31.5: dmin ≈ 7.5·d centres the values on ~0, and d ≈ 1e-4
    # gives a spread of ~0.02.
    d = (rng.uniform(0.6, 1.4, nb) * 1.0e-4).astype(np.float16)
    dmin = (d.astype(np.float32) * rng.uniform(6.0, 9.0, nb)).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    blocks[:, 2:4] = dmin.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n, k // BLOCK_VALUES * BLOCK_BYTES)


def repack(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The file's blocks → the kernels' planes (module docstring), on raw's device, torch ops only."""
    n, nb = check_raw(GGML_TYPE, raw, BLOCK_BYTES)
    blocks = raw.contiguous().view(n, nb, BLOCK_BYTES)
    # Packed 6-bit fields, bytes 0-3: scales 0-3 (low 6 bits) + top 2 bits of scales 4-7; bytes 4-7:
    # mins 0-3 + top 2 bits of mins 4-7; bytes 8-11: low 4 bits of scales 4-7 | of mins 4-7 << 4.
    packed = blocks[:, :, 4:16]
    lo_sc, lo_mn, hi = packed[:, :, 0:4], packed[:, :, 4:8], packed[:, :, 8:12]
    sc = torch.cat([lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 2) & 0x30)], dim=-1)
    mn = torch.cat([lo_mn & 0x3F, (hi >> 4) | ((lo_mn >> 2) & 0x30)], dim=-1)
    scales = torch.cat([sc.view(n, nb, 4, 2), mn.view(n, nb, 4, 2)], dim=-1)
    return {"qs": blocks[:, :, 16:].reshape(n, nb * 128).contiguous(),
            "scales": scales.reshape(n, nb * 16).contiguous(),
            "d_dmin": blocks[:, :, 0:4].contiguous().view(torch.float16).reshape(n, nb * 2)}


def dequantize(planes: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """fp32 [N, K], equal bit for bit to gguf.quants.dequantize(raw, Q4_K)."""
    q, fields, d, dmin = pair_fields(planes, n, k)
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
def _byte_to_f32(v):
    """int32 in [0, 256) → fp32 without an int→float conversion (a slow instruction class): OR it
    into the mantissa of 2^23 and subtract 2^23, both exact."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@jit
def _half_to_f32(v):
    """The fp16 in the low 16 bits of an int32 → fp32."""
    return v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@jit
def _dequant_tile(qs_ptr, scales_ptr, d_dmin_ptr, w_rows, k0, k,
                  ROWS: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """Weight rows `w_rows` (int64 [R], all valid), values k0 .. k0+BLOCK_K → (low, high) [R, BLOCK_K/2]
    in DTYPE: low column 32g+j is value k0+64g+j, high column 32g+j is value k0+64g+32+j.
    `scales_ptr` and `d_dmin_ptr` are the planes viewed as int32 (one word per 64 / 256 values)."""
    PAIRS: tl.constexpr = BLOCK_K // 64
    g = tl.arange(0, PAIRS)
    j = tl.arange(0, 32)
    q = tl.load(qs_ptr + (w_rows * (k // 2))[:, None, None] + (k0 // 2 + g * 32)[None, :, None]
                + j[None, None, :]).to(tl.int32)
    fields = tl.load(scales_ptr + (w_rows * (k // 64))[:, None] + (k0 // 64 + g)[None, :])
    d_dmin = tl.load(d_dmin_ptr + (w_rows * (k // 256))[:, None] + ((k0 + 64 * g) // 256)[None, :])
    d = _half_to_f32(d_dmin)
    dmin = _half_to_f32(d_dmin >> 16)
    scale_lo = d * _byte_to_f32(fields & 0xFF)
    scale_hi = d * _byte_to_f32((fields >> 8) & 0xFF)
    offset_lo = dmin * _byte_to_f32((fields >> 16) & 0xFF)
    offset_hi = dmin * _byte_to_f32((fields >> 24) & 0xFF)
    q_lo = _byte_to_f32(q & 15)
    q_hi = _byte_to_f32(q >> 4)
    w_lo = scale_lo[:, :, None] * q_lo - offset_lo[:, :, None]
    w_hi = scale_hi[:, :, None] * q_hi - offset_hi[:, :, None]
    w_lo = tl.reshape(w_lo, (ROWS, BLOCK_K // 2)).to(DTYPE)
    w_hi = tl.reshape(w_hi, (ROWS, BLOCK_K // 2)).to(DTYPE)
    return w_lo, w_hi


@jit
def _low_columns(BLOCK_K: tl.constexpr):
    """Offsets (from k0) of the values the low nibbles of a tile hold; +32 gives the high ones."""
    c = tl.arange(0, BLOCK_K // 2)
    return (c // 32) * 64 + c % 32


@jit(do_not_specialize=["m"])
def _gemv_kernel(x_ptr, x_stride, qs_ptr, scales_ptr, d_dmin_ptr, out_ptr, out_stride, partial_ptr,
                 counter_ptr, m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, IEEE_DOT: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    tile = pid // SPLIT_K
    split = pid % SPLIT_K
    k_blocks = k // BLOCK_K
    kb_begin = split * k_blocks // SPLIT_K
    kb_end = (split + 1) * k_blocks // SPLIT_K

    offs_n = tl.arange(0, BLOCK_N)
    cols = tile * BLOCK_N + offs_n
    col_ok = cols < n
    w_rows = tl.minimum(cols, n - 1).to(tl.int64)  # past-the-end rows re-read the last one, never stored
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < m
    xt_ptrs = x_ptr + rows[None, :] * x_stride + _low_columns(BLOCK_K)[:, None]  # xᵀ [BLOCK_K/2, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(kb_begin, kb_end):
        k0 = kb * BLOCK_K
        w_lo, w_hi = _dequant_tile(qs_ptr, scales_ptr, d_dmin_ptr, w_rows, k0, k, BLOCK_N,
                                   BLOCK_K, x_ptr.dtype.element_ty)
        x_lo = tl.load(xt_ptrs + k0, mask=row_ok[None, :], other=0.0)
        x_hi = tl.load(xt_ptrs + (k0 + 32), mask=row_ok[None, :], other=0.0)
        if IEEE_DOT:
            acc = tl.dot(w_lo, x_lo, acc, input_precision="ieee")
            acc = tl.dot(w_hi, x_hi, acc, input_precision="ieee")
        else:
            acc = tl.dot(w_lo, x_lo, acc)
            acc = tl.dot(w_hi, x_hi, acc)

    out_ptrs = out_ptr + rows[None, :] * out_stride + cols[:, None]
    out_ok = col_ok[:, None] & row_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        last, total = split_k_reduce(acc, partial_ptr, counter_ptr, tile, split, rows, offs_n, row_ok,
                                     SPLIT_K, BLOCK_M, BLOCK_N)
        if last:
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_ok)


@jit(do_not_specialize=["m"])
def _gemm_kernel(x_ptr, x_stride, qs_ptr, scales_ptr, d_dmin_ptr, out_ptr, out_stride, m, n, k,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 IEEE_DOT: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, m, n, BLOCK_M, BLOCK_N, GROUP_M)

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
        w_lo, w_hi = _dequant_tile(qs_ptr, scales_ptr, d_dmin_ptr, w_rows, k0, k, BLOCK_N,
                                   BLOCK_K, x_ptr.dtype.element_ty)
        if IEEE_DOT:
            acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision="ieee")
            acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision="ieee")
        else:
            acc = tl.dot(x_lo, tl.trans(w_lo), acc)
            acc = tl.dot(x_hi, tl.trans(w_hi), acc)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < m)[:, None] & (cols < n)[None, :])


# ----------------------------------------------------------------------------------------------
# Configurations (by reasoning for the H200; UNTIMED)


# GEMV. The loop body costs 7.7-8.3 instructions per weight value in the sm_90 SASS (nibble
# extraction, the 2^23 trick, the FMA, bf16 packing, shared-memory reads) against 0.58 bytes of HBM:
# at 4.8 TB/s that is ~2x the H200's ~33 T lane-instructions/s, so batch 1 is ALU-bound (about half
# the HBM bandwidth at best, still ~2x fewer µs than a bf16 GEMV), and the tiles aim
# at keeping every SM's four schedulers busy: 64-row tiles (4 warps, one warp group: wgmma with the
# weights from registers; 72 registers and 31 KB at 128 values per step, 132 and 44 KB at 256; no
# spills) and split-K up to about 3 programs
# per SM (≤ 396 programs: one wave). Per program and stage: BLOCK_N·BLOCK_K/2 quant bytes, BLOCK_K·32
# bytes of xᵀ. Split-K needs a workspace (`gemv_workspace_numel`): pass one to `matmul`. The table is
# the reference device's (`devices.tuned`); others take `split_gemv_config` on their SM count.
GEMV_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    (4096, 4096): GemvConfig(64, 128, split_k=6),  # 384 programs, 5-6 steps each
    (6144, 4096): GemvConfig(64, 128, split_k=4),  # 384 programs, 8 steps
    (12288, 4096): GemvConfig(64, 128, split_k=2),  # 384 programs, 16 steps
    (24576, 4096): GemvConfig(64, 256, split_k=1, num_stages=3),  # 384 programs, 16 steps
    (4096, 12288): GemvConfig(64, 128, split_k=6),  # 384 programs, 16 steps
    (5120, 2048): GemvConfig(64, 128, split_k=4),  # 320 programs, 4 steps
}


def gemv_config(n: int, k: int, spec: DeviceSpec | None = None) -> GemvConfig:
    """A function of (N, K) only on a device (default: the current one): what makes a row's result
    independent of M ≤ 16."""
    spec = spec or devices.current()
    if devices.tuned(spec) and (n, k) in GEMV_CONFIGS:
        return GEMV_CONFIGS[(n, k)]
    return split_gemv_config(n, k, 256 if k % 256 == 0 and k >= 8192 else 128, spec)


def gemm_config(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
                spec: DeviceSpec | None = None) -> GemmConfig:
    """16-bit x: 128x128 output tiles, 8 warps (two wgmma warp groups), 128 values per step — per
    stage 32 KB of x and 8 KB of quants, plus the dequantized tiles the wgmma reads from shared
    memory (~150 KB, 176 registers, no spills when compiled for sm_90); 64-row tiles for short reads.
    fp32 x (IEEE dot on the FMA units, a correctness path): 64x64 tiles, which do not spill."""
    return tiled_gemm_config(m, dtype, fp32_tile=64, spec=spec)


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
    return check_x_out(x, planes["qs"].device, n, k, out, allocate)


def _planes_args(planes):
    return planes["qs"], planes["scales"].view(torch.int32), planes["d_dmin"].view(torch.int32)


def gemv_q4k(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
             *, workspace: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """The decode kernel, x [M ≤ 16, K]. A split-K configuration uses `workspace` (zeroed int32 of ≥
    `gemv_workspace_numel` elements, left zeroed; not shared by concurrent streams) or allocates one."""
    out = _check_call(x, planes, n, k, out)
    return launch_gemv(_gemv_kernel, "gemv_q4k", x, _planes_args(planes), n, k, out, workspace,
                       config or gemv_config(n, k, devices.current(x)))


def gemm_q4k(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
             *, config: GemmConfig | None = None) -> torch.Tensor:
    """The prompt-read kernel, any M (used for M > 16)."""
    out = _check_call(x, planes, n, k, out)
    return launch_gemm(_gemm_kernel, x, _planes_args(planes), n, k, out,
                       config or gemm_config(x.shape[0], n, k, x.dtype, devices.current(x)))


def matmul(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
           *, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ Wᵀ → [M, N] in x's dtype (semantics: `matmul_ref`). M ≤ 16: the GEMV (a row's bits
    do not depend on M; `quant_decode` picks it or, up to DP4A_MAX_ROWS rows, the dp4a GEMV);
    larger M: the GEMM. Off CUDA (no interpreter): `matmul_ref`."""
    if not kernels_run(x, _gemv_kernel):
        _check_call(x, planes, n, k, out, allocate=False)
        return matmul_ref(x, planes, n, k, out)
    m = x.shape[0]
    if m <= GEMV_MAX_ROWS:
        if m > 0 and x.dtype != torch.float32 and _decode_kernel(m) == "dp4a":
            from strata.kernels.quant.q4_k_dp4a import q4k_gemv_dp4a

            out = _check_call(x, planes, n, k, out)
            return out if n == 0 else q4k_gemv_dp4a(x, planes, n, k, out, workspace=workspace)
        return gemv_q4k(x, planes, n, k, out, workspace=workspace)
    return gemm_q4k(x, planes, n, k, out)
