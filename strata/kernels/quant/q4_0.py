"""GGUF Q4_0 weights kept 4-bit on the device: repack, the fp32 definition, and x @ Wᵀ kernels.

Q4_0 (ggml): blocks of 32 values in 18 bytes — an fp16 scale d, then 16 bytes of 4-bit quants: byte j
holds value j in its low nibble and value 16 + j in its high one. A value is d·(q − 8), which is exact
in fp32 (11 + 4 significant bits), hence equal to gguf's numpy dequantization bit for bit (the sign of
a zero included: both compute d times +0).

Planes (`repack`, device ops only, by slicing: nothing decoded), the file's 18 bytes per 32 values:
  qs  uint8 [N, K/2]   the quant bytes in the file's order
  d   fp16  [N, K/32]  one scale per 32 values
Splitting the scales off gives both planes contiguous rows, so tiles load with wide asynchronous
copies, which interleaved 18-byte blocks would not allow (Q8_0's reasoning, `q8_0.py`). Where K is a
multiple of 64 the kernels read d as int32 words, two blocks' scales a word (`d_words`): 2-byte loads
the software pipeline issued synchronously inside the loop (seen in the sm_90a compile). K need only
be a multiple of 32: a K step (BLOCK_K) is the largest power of two up to the configuration's that
divides K, at least 32.

Kernels: Q8_0's block shape with Q4_K's nibble handling. A tile of BLOCK_K values is read as [rows,
BLOCK_K/32, 16] quant bytes: the low nibbles are the values k0 + 32g + j and the high ones
k0 + 32g + 16 + j, so each tile is two tensor-core dots of depth BLOCK_K/2 against x gathered at those
two column sets (as `q4_k.py`, whose runs are 32 apart where these are 16), with no nibble interleave
in registers; each [rows, g] scale broadcasts along its 16 bytes. A nibble becomes q − 8 in fp32 by
the 2^23 mantissa trick less 2^23 + 8 (exact, no int→float conversion).

Rounding (the contract's semantics): each weight is d·(q − 8) in fp32 (the `dequantize` value), then
rounded to nearest even to x's dtype (bf16/fp16) and fed to the dot with fp32 accumulation; the result
is rounded once to x's dtype. fp32 x keeps fp32 weights and an IEEE (non-TF32) dot. `matmul_ref` is
that definition in torch and the path off CUDA. Under TRITON_INTERPRET the 16-bit dot runs in fp32 on
the rounded values (the same products: iq3_s's `_dot`).

M ≤ 16 (decode): the K-quant formats' swap-AB GEMV (`kquant_host.launch_gemv`), M not specialised on
(a row's bits do not depend on the other rows), deterministic split-K (strata/kernels/splitk.py) with
the zeroed workspace of `gemv_workspace_numel` elements that `QWeight` holds. There is no packed-int8
(dp4a) GEMV: the kernel choice `quant_decode` does not apply. M > 16: a tiled GEMM in grouped tile
order. Grids depend on shapes only and nothing is read back to the host (CUDA graphs). Configurations
are Q4_K's heuristics, UNTIMED. Compiled for sm_90a here (Triton 3.9, not the target's 3.6): the bf16
GEMV at 6144x4096 (64x128, split 4) ~7.4 SASS instructions per weight value in its loop (Q4_K's ~8.4
in the same compile) on 0.56 bytes of HBM per value, wgmma, every plane load asynchronous, no spills;
the bf16 GEMM (128x128x128) wgmma, no spills.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from strata.kernels import device as devices
from strata.kernels import kernels_run
from strata.kernels.device import DeviceSpec
from strata.kernels.pdl import pdl_prologue
from strata.kernels.quant.iq3_s import _dot
from strata.kernels.quant.kquant_host import (
    GEMV_MAX_ROWS,
    GemmConfig,
    GemvConfig,
    check_x_out,
    launch_gemm,
    launch_gemv,
    reference_matmul,
    split_gemv_config,
    tiled_gemm_config,
)
from strata.kernels.quant.q4_k import _half_to_f32
from strata.kernels.splitk import split_k_numel, split_k_range, split_k_store
from strata.kernels.tiles import grouped_tile
from strata.kernels.triton_import import jit, tl


GGML_TYPE = "Q4_0"
BLOCK_VALUES = 32
BLOCK_BYTES = 18
LEAST_BLOCK_K = 32  # one block: a K step's dots are then 16 deep, the least tl.dot takes


def block_k_for(k: int, preferred: int) -> int:
    """The largest power of two ≤ preferred (and ≥ LEAST_BLOCK_K) dividing K, a multiple of 32."""
    block = preferred
    while block > LEAST_BLOCK_K and k % block:
        block //= 2
    return block


# ----------------------------------------------------------------------------------------------
# Blocks, planes and the definition


def random_raw(n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [N, K/32·18] of valid Q4_0 blocks with weights of std ~0.02: random quant bytes and an
    fp16 d of either sign (llama.cpp's quantizer makes both) and sane size."""
    if k % BLOCK_VALUES:
        raise ValueError(f"K={k} is not a multiple of {BLOCK_VALUES}")
    rng = np.random.default_rng(seed)
    nb = n * (k // BLOCK_VALUES)
    blocks = rng.integers(0, 256, size=(nb, BLOCK_BYTES), dtype=np.uint8)
    # RMS of q − 8 for uniform q ~4.6: |d| ≈ 4.3e-3 gives a spread of ~0.02.
    d = (rng.uniform(0.6, 1.4, nb) * 4.3e-3 * rng.choice([-1.0, 1.0], nb)).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n, k // BLOCK_VALUES * BLOCK_BYTES)


def repack(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """uint8 [N, K/32·18] blocks → {"qs": uint8 [N, K/2], "d": fp16 [N, K/32]}, on raw's device."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % BLOCK_BYTES:
        raise ValueError(f"Q4_0 raw: expected uint8 [N, K/{BLOCK_VALUES}·{BLOCK_BYTES}], got {raw.dtype} "
                         f"{tuple(raw.shape)}")
    n = raw.shape[0]
    blocks = raw.contiguous().view(n, -1, BLOCK_BYTES)
    return {"qs": blocks[:, :, 2:].reshape(n, -1).contiguous(),
            "d": blocks[:, :, :2].contiguous().view(torch.float16).view(n, -1)}


def check_q4_0_planes(planes: dict[str, torch.Tensor], n: int, k: int) -> None:
    """Both planes there, contiguous, of their shape and dtype, on one device; K a multiple of 32."""
    if k % BLOCK_VALUES:
        raise ValueError(f"K={k} is not a multiple of {BLOCK_VALUES}")
    want = {"qs": ((n, k // 2), torch.uint8), "d": ((n, k // BLOCK_VALUES), torch.float16)}
    for name, (shape, dtype) in want.items():
        t = planes.get(name)
        if t is None or tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            got = None if t is None else (tuple(t.shape), t.dtype)
            raise ValueError(f"Q4_0 plane {name!r}: expected contiguous {dtype} {shape}, got {got}")
    if planes["qs"].device != planes["d"].device:
        raise ValueError(f"Q4_0 planes on two devices: {planes['qs'].device}, {planes['d'].device}")


def dequantize(planes: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """fp32 [N, K], equal bit for bit to gguf.quants.dequantize(raw, Q4_0)."""
    check_q4_0_planes(planes, n, k)
    qs = planes["qs"].view(n, k // BLOCK_VALUES, 1, 16)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).view(n, k // BLOCK_VALUES, BLOCK_VALUES).float() - 8.0
    return (planes["d"].float()[:, :, None] * q).view(n, k)


def matmul_ref(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: fp32 product of x and the dequantized weight rounded to x's dtype, rounded once."""
    return reference_matmul(dequantize(planes, n, k), x, out)


# ----------------------------------------------------------------------------------------------
# Kernels


@jit
def _nibble_minus_8(v):
    """int32 in [0, 16) → v − 8 in fp32 without an int→float conversion: v ORed into the mantissa of
    2^23, less 2^23 + 8; both exact."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@jit
def _dequant_tile(qs_ptr, d_ptr, w_rows, k0, k, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
                  D_WORDS: tl.constexpr):
    """Weight rows `w_rows` (int64 [R], all valid), values k0 .. k0+BLOCK_K (k0 a multiple of 32) →
    (low, high) [R, BLOCK_K/2] in DTYPE: low column 16g+j is value k0+32g+j, high column 16g+j is value
    k0+32g+16+j (`_low_columns`). D_WORDS (`d_words`): `d_ptr` is the d plane viewed as int32, two
    blocks' scales a word, which the software pipeline can copy asynchronously (2-byte loads it issues
    synchronously inside the loop)."""
    GROUPS: tl.constexpr = BLOCK_K // 32
    g = tl.arange(0, GROUPS)
    j = tl.arange(0, 16)
    q = tl.load(qs_ptr + (w_rows * (k // 2))[:, None, None] + (k0 // 2 + g * 16)[None, :, None]
                + j[None, None, :]).to(tl.int32)
    if D_WORDS:
        words = tl.load(d_ptr + (w_rows * (k // 64))[:, None] + (k0 // 64 + tl.arange(0, GROUPS // 2))[None, :])
        d = tl.reshape(tl.join(_half_to_f32(words), _half_to_f32(words >> 16)), (ROWS, GROUPS))
    else:
        d = tl.load(d_ptr + (w_rows * (k // 32))[:, None] + (k0 // 32 + g)[None, :]).to(tl.float32)
    w_lo = d[:, :, None] * _nibble_minus_8(q & 15)
    w_hi = d[:, :, None] * _nibble_minus_8(q >> 4)
    return (tl.reshape(w_lo, (ROWS, BLOCK_K // 2)).to(DTYPE), tl.reshape(w_hi, (ROWS, BLOCK_K // 2)).to(DTYPE))


def d_words(k: int, block_k: int) -> bool:
    """Whether the kernels read the d plane as int32 words (`_dequant_tile`'s D_WORDS): two scales a
    word for every K step and every row, so K a multiple of 64 and BLOCK_K ≥ 64."""
    return k % 64 == 0 and block_k >= 64


def kernel_planes(planes: dict[str, torch.Tensor], k: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' plane arguments for K steps of `block_k`: qs, and d as int32 words where `d_words`."""
    d = planes["d"]
    return planes["qs"], d.view(torch.int32) if d_words(k, block_k) else d


@jit
def _low_columns(BLOCK_K: tl.constexpr):
    """Offsets (from k0) of the values the low nibbles of a tile hold; +16 gives the high ones."""
    c = tl.arange(0, BLOCK_K // 2)
    return (c // 16) * 32 + c % 16


@jit(do_not_specialize=["m"])
def _gemv_kernel(x_ptr, x_stride, qs_ptr, d_ptr, out_ptr, out_stride, partial_ptr, counter_ptr, m, n, k,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 IEEE_DOT: tl.constexpr, INTERPRETED: tl.constexpr, D_WORDS: tl.constexpr, USE_PDL: tl.constexpr):
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
        w_lo, w_hi = _dequant_tile(qs_ptr, d_ptr, w_rows, k0, k, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty,
                                   D_WORDS)
        x_lo = tl.load(xt_ptrs + k0, mask=row_ok[None, :], other=0.0)
        x_hi = tl.load(xt_ptrs + (k0 + 16), mask=row_ok[None, :], other=0.0)
        acc = _dot(w_lo, x_lo, acc, IEEE_DOT, INTERPRETED)
        acc = _dot(w_hi, x_hi, acc, IEEE_DOT, INTERPRETED)
    split_k_store(acc, out_ptr, out_stride, partial_ptr, counter_ptr, tile, split, cols, rows, n, m,
                  SPLIT_K, BLOCK_M, BLOCK_N)


@jit(do_not_specialize=["m"])
def _gemm_kernel(x_ptr, x_stride, qs_ptr, d_ptr, out_ptr, out_stride, m, n, k,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 IEEE_DOT: tl.constexpr, INTERPRETED: tl.constexpr, D_WORDS: tl.constexpr, USE_PDL: tl.constexpr):
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
        x_hi = tl.load(x_ptrs + (k0 + 16))
        w_lo, w_hi = _dequant_tile(qs_ptr, d_ptr, w_rows, k0, k, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty,
                                   D_WORDS)
        acc = _dot(x_lo, tl.trans(w_lo), acc, IEEE_DOT, INTERPRETED)
        acc = _dot(x_hi, tl.trans(w_hi), acc, IEEE_DOT, INTERPRETED)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < m)[:, None] & (cols < n)[None, :])


# ----------------------------------------------------------------------------------------------
# Configurations (q4_k.py's heuristics; UNTIMED)


def gemv_config(n: int, k: int, spec: DeviceSpec | None = None) -> GemvConfig:
    """A function of (N, K) only on a device (default: the current one): what makes a row's result
    independent of M ≤ 16. Q4_K's heuristic (64-row tiles, one wgmma warp group; split-K up to about 3
    programs per SM), 128 values a step (256 from K = 8192), shortened to divide K."""
    return split_gemv_config(n, k, block_k_for(k, 256 if k >= 8192 else 128), spec)


def gemm_config(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
                spec: DeviceSpec | None = None) -> GemmConfig:
    """16-bit x: Q4_K's tiles (128x128 outputs, 8 warps, 128 values a step, 64-row tiles for short
    reads; compiled for sm_90a here: wgmma, no spills). fp32 x (IEEE dot on the FMA units, a
    correctness path): 32x32 tiles of 64 values a step on 8 warps, which compile without spills
    (64x64 tiles spill). The K step shortened to divide K."""
    if dtype == torch.float32:
        cfg = GemmConfig(32, 32, 64, num_warps=8, num_stages=2)
    else:
        cfg = tiled_gemm_config(m, dtype, fp32_tile=32, spec=spec)
    return dataclasses.replace(cfg, block_k=block_k_for(k, cfg.block_k))


def gemv_workspace_numel(n: int, k: int, config: GemvConfig | None = None, spec: DeviceSpec | None = None) -> int:
    """int32 elements of the split-K workspace (0 without split-K): tile counters, then fp32 partials,
    for `config` or the (N, K) configuration on `spec` (default: the current device)."""
    cfg = config or gemv_config(n, k, spec)
    return split_k_numel(n, cfg.block_n, cfg.split_k, GEMV_MAX_ROWS)


# ----------------------------------------------------------------------------------------------
# Launchers and dispatch


def _check_call(x: torch.Tensor, planes, n: int, k: int, out: torch.Tensor | None,
                allocate: bool = True) -> torch.Tensor | None:
    check_q4_0_planes(planes, n, k)
    return check_x_out(x, planes["qs"].device, n, k, out, allocate)


def gemv_q4_0(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
              *, workspace: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """The decode kernel, x [M ≤ 16, K]. A split-K configuration uses `workspace` (zeroed int32 of ≥
    `gemv_workspace_numel` elements, left zeroed; not shared by concurrent streams) or allocates one."""
    out = _check_call(x, planes, n, k, out)
    cfg = config or gemv_config(n, k, devices.current(x))
    return launch_gemv(_gemv_kernel, "gemv_q4_0", x, kernel_planes(planes, k, cfg.block_k), n, k, out, workspace,
                       cfg, least_block_k=LEAST_BLOCK_K, INTERPRETED=not x.is_cuda, D_WORDS=d_words(k, cfg.block_k))


def gemm_q4_0(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
              *, config: GemmConfig | None = None) -> torch.Tensor:
    """The prompt-read kernel, any M (used for M > 16)."""
    out = _check_call(x, planes, n, k, out)
    cfg = config or gemm_config(x.shape[0], n, k, x.dtype, devices.current(x))
    return launch_gemm(_gemm_kernel, x, kernel_planes(planes, k, cfg.block_k), n, k, out, cfg,
                       least_block_k=LEAST_BLOCK_K, INTERPRETED=not x.is_cuda, D_WORDS=d_words(k, cfg.block_k))


def matmul(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
           *, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ Wᵀ → [M, N] in x's dtype (semantics: `matmul_ref`). M ≤ 16: the GEMV (a row's bits
    do not depend on M); larger M: the GEMM. Off CUDA (no interpreter): `matmul_ref`."""
    if not kernels_run(x, _gemv_kernel):
        _check_call(x, planes, n, k, out, allocate=False)
        return matmul_ref(x, planes, n, k, out)
    if x.shape[0] <= GEMV_MAX_ROWS:
        return gemv_q4_0(x, planes, n, k, out, workspace=workspace)
    return gemm_q4_0(x, planes, n, k, out)
