"""Quantized weights dequantized into a bf16/fp16 buffer, for prompt reads through cuBLAS.

The fused dequantize-GEMM kernels of the format modules reach ~100-290 TFLOP/s on the H200 against
~750 for cuBLAS bf16, so reads of many rows are to run as "dequantize the layer's weight once into a
preallocated buffer, then torch.mm". This module is the first half: one Triton kernel per format
writing W [N, K] into the first N·K elements of `out`.

Each kernel calls its format module's own tile dequantizer (`_dequant_tile` of q8_0, q4_k, iq3_s,
q6_k, iq4_xs, q3_k, q5_k, q4_0) on exactly the planes, and views of them, that the module's GEMM
passes, so the bit layout is derived in one place. A tile's weights are the module's exact fp32
values rounded once, to nearest even, to out's dtype: the same bits as `dequantize(planes).to(dtype)`
(`dequantize_into_ref`), up to the sign of a zero (Q6_K's and Q3_K's fma gives +0 where the
reference's product gives -0 for a negative scale).

Grid: (row tiles of BLOCK_N weight rows, K tiles of BLOCK_K values). BLOCK_K is a power of two that
divides K (256 for every model shape; Q8_0 and Q4_0 halve it down to 32 for a K that 256 does not
divide), so there is no K tail. Rows past N re-read row N-1 (`tl.minimum`) and are not stored. The
kernels allocate nothing and their grids depend on shapes only (CUDA-graph safe); each begins with the
PDL prologue. Tile sizes are chosen by reasoning, UNTIMED: `python benchmarks/kernels/quant_dequant.py
[--sweep]` on the device times them and the fused GEMMs against dequantize + torch.mm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels import kernels_run, use_pdl
from strata.kernels.pdl import pdl_prologue
from strata.kernels.quant.formats import format_module
from strata.kernels.quant.iq3_s import _check_planes as iq3_s_check_planes, _dequant_tile as iq3_s_tile
from strata.kernels.quant.iq3_s_planes import grid_table, grid_table_words
from strata.kernels.quant.iq4_xs import _check_planes as iq4_xs_check_planes, _dequant_tile as iq4_xs_tile
from strata.kernels.quant.iq4_xs import _low_columns as iq4_xs_low_columns, kernel_planes as iq4_xs_kernel_planes
from strata.kernels.quant.iq4_xs import load_kvalues
from strata.kernels.quant.q3_k import _check_planes as q3_k_check_planes, _dequant_tile as q3_k_tile
from strata.kernels.quant.q3_k import kernel_planes as q3_k_kernel_planes
from strata.kernels.quant.q4_0 import _dequant_tile as q4_0_tile, _low_columns as q4_0_low_columns
from strata.kernels.quant.q4_0 import check_q4_0_planes, d_words as q4_0_d_words, kernel_planes as q4_0_kernel_planes
from strata.kernels.quant.q4_k import _dequant_tile as q4_k_tile, _low_columns as q4_k_low_columns
from strata.kernels.quant.q4_k import _planes_args as q4_k_planes_args
from strata.kernels.quant.q4_k_planes import check_q4k_planes
from strata.kernels.quant.q5_k import _dequant_tile as q5_k_tile, check_q5k_planes
from strata.kernels.quant.q5_k import kernel_planes as q5_k_kernel_planes
from strata.kernels.quant.q6_k import _dequant_tile as q6_k_tile, _low_columns as q6_k_low_columns
from strata.kernels.quant.q6_k_planes import check_q6k_planes, kernel_planes as q6_k_kernel_planes
from strata.kernels.quant.q8_0 import _check_planes as q8_0_check_planes, _dequant_tile as q8_0_tile
from strata.kernels.triton_import import jit, tl


OUT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class DequantConfig:
    block_n: int  # weight rows per program, a power of two
    block_k: int  # values per program: the largest power of two <= this (and >= the format's least) dividing K
    num_warps: int = 8


# 64 x 256 values a program, 64 a thread over 8 warps: Q8_0 reads 16.5 KB and writes 32 KB of bf16;
# 384 x 16 programs at 24576 x 4096. Compiled for sm_90a here (Triton 3.9, K and pointers 16-divisible
# as real launches specialise them): 44-63 registers (eight programs resident per SM, ~130 KB of Q8_0
# loads in flight), 128-bit stores, no spills, 8-11 SASS instructions a value (IQ3_S the most) against
# ~18 that the issue rate allows at 4.8 TB/s and ~2.5-3 bytes of HBM traffic a value. UNTIMED.
CONFIGS = {t: DequantConfig(64, 256) for t in ("Q8_0", "Q4_K", "IQ3_S", "Q6_K", "IQ4_XS", "Q3_K", "Q5_K",
                                                 "Q4_0")}
# The least BLOCK_K each tile function takes: whole scale groups, and a power-of-two arange of them.
MIN_BLOCK_K = {"Q8_0": 32, "Q4_K": 64, "IQ3_S": 64, "Q6_K": 128, "IQ4_XS": 128, "Q3_K": 128, "Q5_K": 64,
               "Q4_0": 32}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_k_for(ggml_type: str, k: int, preferred: int) -> int:
    """The largest power of two <= preferred that divides K, at least the format's least."""
    block = preferred
    while block > MIN_BLOCK_K[ggml_type] and k % block:
        block //= 2
    if k % block or block < MIN_BLOCK_K[ggml_type] or block & (block - 1):
        raise ValueError(f"{ggml_type}: no BLOCK_K <= {preferred} divides K={k}")
    return block


# ----------------------------------------------------------------------------------------------
# Kernels


@jit
def _store_rows(out_ptr, w, rows, n, k, cols):
    """w [R, C] to out[rows, cols] of the row-major [N, K] destination, rows >= N left out."""
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * k + cols[None, :]
    tl.store(ptrs, w, mask=(rows < n)[:, None])


@jit
def _q8_0_kernel(qs_ptr, d_ptr, out_ptr, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    GROUPS: tl.constexpr = BLOCK_K // 32
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w_rows = tl.minimum(rows, n - 1).to(tl.int64)
    q_ptrs = (qs_ptr + w_rows[:, None, None] * k + k0 + tl.arange(0, GROUPS)[None, :, None] * 32
              + tl.arange(0, 32)[None, None, :])
    d_ptrs = d_ptr + w_rows[:, None] * (k // 32) + k0 // 32 + tl.arange(0, GROUPS)[None, :]
    w = q8_0_tile(q_ptrs, d_ptrs, BLOCK_N, BLOCK_K, out_ptr.dtype.element_ty)
    _store_rows(out_ptr, w, rows, n, k, k0 + tl.arange(0, BLOCK_K))


@jit
def _q4_k_kernel(qs_ptr, scales_ptr, d_dmin_ptr, out_ptr, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w_rows = tl.minimum(rows, n - 1).to(tl.int64)
    w_lo, w_hi = q4_k_tile(qs_ptr, scales_ptr, d_dmin_ptr, w_rows, k0, k, BLOCK_N, BLOCK_K,
                           out_ptr.dtype.element_ty)
    cols = k0 + q4_k_low_columns(BLOCK_K)
    _store_rows(out_ptr, w_lo, rows, n, k, cols)
    _store_rows(out_ptr, w_hi, rows, n, k, cols + 32)


@jit
def _iq3_s_kernel(qs_ptr, signs_ptr, qh_ptr, scales_ptr, d_ptr, grid_ptr, out_ptr, n, k, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    table = grid_table_words(grid_ptr, True)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w_rows = tl.minimum(rows, n - 1).to(tl.int64)
    w = iq3_s_tile(qs_ptr, signs_ptr, qh_ptr, scales_ptr, d_ptr, table, w_rows, k0, k, BLOCK_N, BLOCK_K, INTERPRETED)
    _store_rows(out_ptr, w.to(out_ptr.dtype.element_ty), rows, n, k, k0 + tl.arange(0, BLOCK_K))


@jit
def _q6_k_kernel(ql_ptr, qh_ptr, scales_ptr, d_ptr, out_ptr, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 INTERPRETED: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w_rows = tl.minimum(rows, n - 1).to(tl.int64)
    w_lo, w_hi = q6_k_tile(ql_ptr, qh_ptr, scales_ptr, d_ptr, w_rows, k0, k, BLOCK_N, BLOCK_K,
                           out_ptr.dtype.element_ty, INTERPRETED)
    cols = k0 + q6_k_low_columns(BLOCK_K)
    _store_rows(out_ptr, w_lo, rows, n, k, cols)
    _store_rows(out_ptr, w_hi, rows, n, k, cols + 64)


@jit
def _iq4_xs_kernel(qs_ptr, scales_ptr, d_ptr, kv_ptr, out_ptr, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    table = load_kvalues(kv_ptr, True)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w_rows = tl.minimum(rows, n - 1).to(tl.int64)
    w_lo, w_hi = iq4_xs_tile(qs_ptr, scales_ptr, d_ptr, table, w_rows, k0, k, BLOCK_N, BLOCK_K,
                             out_ptr.dtype.element_ty)
    cols = k0 + iq4_xs_low_columns(BLOCK_K)
    _store_rows(out_ptr, w_lo, rows, n, k, cols)
    _store_rows(out_ptr, w_hi, rows, n, k, cols + 16)


@jit
def _q3_k_kernel(qs_ptr, hmask_ptr, scales_ptr, d_ptr, out_ptr, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 INTERPRETED: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w_rows = tl.minimum(rows, n - 1).to(tl.int64)
    w = q3_k_tile(qs_ptr, hmask_ptr, scales_ptr, d_ptr, w_rows, k0, k, BLOCK_N, BLOCK_K, out_ptr.dtype.element_ty,
                  INTERPRETED)
    _store_rows(out_ptr, w, rows, n, k, k0 + tl.arange(0, BLOCK_K))


@jit
def _q5_k_kernel(qs_ptr, scales_ptr, d_dmin_ptr, qh_ptr, out_ptr, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w_rows = tl.minimum(rows, n - 1).to(tl.int64)
    w_lo, w_hi = q5_k_tile(qs_ptr, scales_ptr, d_dmin_ptr, qh_ptr, w_rows, k0, k, BLOCK_N, BLOCK_K,
                           out_ptr.dtype.element_ty)
    cols = k0 + q4_k_low_columns(BLOCK_K)  # Q5_K's tile has Q4_K's column order
    _store_rows(out_ptr, w_lo, rows, n, k, cols)
    _store_rows(out_ptr, w_hi, rows, n, k, cols + 32)


@jit
def _q4_0_kernel(qs_ptr, d_ptr, out_ptr, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, D_WORDS: tl.constexpr,
                 USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w_rows = tl.minimum(rows, n - 1).to(tl.int64)
    w_lo, w_hi = q4_0_tile(qs_ptr, d_ptr, w_rows, k0, k, BLOCK_N, BLOCK_K, out_ptr.dtype.element_ty, D_WORDS)
    cols = k0 + q4_0_low_columns(BLOCK_K)
    _store_rows(out_ptr, w_lo, rows, n, k, cols)
    _store_rows(out_ptr, w_hi, rows, n, k, cols + 16)


# ----------------------------------------------------------------------------------------------
# Public ops


def _destination(ggml_type: str, planes: dict[str, torch.Tensor], n: int, k: int,
                 out: torch.Tensor) -> torch.Tensor:
    """out's first N·K elements as [N, K], after checking the call."""
    if ggml_type not in CONFIGS:
        raise ValueError(f"dequantize_into: no kernel for {ggml_type} (have {', '.join(CONFIGS)})")
    device = next(iter(planes.values())).device
    if out.dtype not in OUT_DTYPES or not out.is_contiguous() or out.numel() < n * k or out.device != device:
        raise ValueError(f"out: expected a contiguous bf16/fp16 tensor of >= {n * k} elements on {device}, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}")
    return out.view(-1)[: n * k].view(n, k)


def dequantize_into_ref(ggml_type: str, planes: dict[str, torch.Tensor], n: int, k: int,
                        out: torch.Tensor) -> torch.Tensor:
    """The definition: the format's fp32 `dequantize`, rounded to out's dtype into out's first N·K
    elements; returns that [N, K] view."""
    dest = _destination(ggml_type, planes, n, k, out)
    return dest.copy_(format_module(ggml_type).dequantize(planes, n, k))


def dequantize_into_triton(ggml_type: str, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor,
                           *, config: DequantConfig | None = None) -> torch.Tensor:
    """The kernels (semantics: `dequantize_into_ref`); `config` overrides the format's tile."""
    dest = _destination(ggml_type, planes, n, k, out)
    cfg = config or CONFIGS[ggml_type]
    if cfg.block_n < 1 or cfg.block_n & (cfg.block_n - 1) or cfg.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"invalid {cfg}")
    mod = format_module(ggml_type)
    if k % mod.BLOCK_VALUES:
        raise ValueError(f"{ggml_type}: K={k} is not a multiple of {mod.BLOCK_VALUES}")
    if n == 0 or k == 0:
        return dest
    block_k = block_k_for(ggml_type, k, cfg.block_k)
    on = use_pdl(out)
    grid = (_cdiv(n, cfg.block_n), k // block_k)
    common = dict(BLOCK_N=cfg.block_n, BLOCK_K=block_k, USE_PDL=on, launch_pdl=on, num_warps=cfg.num_warps)
    interpreted = not out.is_cuda
    if ggml_type == "Q8_0":
        qs, d = q8_0_check_planes(planes, n, k)
        _q8_0_kernel[grid](qs, d, dest, n, k, **common)
    elif ggml_type == "Q4_K":
        check_q4k_planes(planes, n, k)
        _q4_k_kernel[grid](*q4_k_planes_args(planes), dest, n, k, **common)
    elif ggml_type == "IQ3_S":
        iq3_s_check_planes(planes, n, k)
        weights = (planes["qs"], planes["signs"], planes["qh"], planes["scales"], planes["d"], grid_table(out.device))
        _iq3_s_kernel[grid](*weights, dest, n, k, INTERPRETED=interpreted, **common)
    elif ggml_type == "Q6_K":
        check_q6k_planes(planes, n, k)
        _q6_k_kernel[grid](*q6_k_kernel_planes(planes), dest, n, k, INTERPRETED=interpreted, **common)
    elif ggml_type == "IQ4_XS":
        iq4_xs_check_planes(planes, n, k)
        _iq4_xs_kernel[grid](*iq4_xs_kernel_planes(planes), dest, n, k, **common)
    elif ggml_type == "Q5_K":
        check_q5k_planes(planes, n, k)
        _q5_k_kernel[grid](*q5_k_kernel_planes(planes), dest, n, k, **common)
    elif ggml_type == "Q4_0":
        check_q4_0_planes(planes, n, k)
        _q4_0_kernel[grid](*q4_0_kernel_planes(planes, k, block_k), dest, n, k, D_WORDS=q4_0_d_words(k, block_k),
                           **common)
    else:
        q3_k_check_planes(planes, n, k)
        _q3_k_kernel[grid](*q3_k_kernel_planes(planes), dest, n, k, INTERPRETED=interpreted, **common)
    return dest


def dequantize_into(ggml_type: str, planes: dict[str, torch.Tensor], n: int, k: int,
                    out: torch.Tensor) -> torch.Tensor:
    """W [N, K] of a weight of a format in CONFIGS (its `repack` planes) written into the
    first N·K elements of `out` (contiguous bf16/fp16, >= N·K elements; the rest untouched), rounded
    once to out's dtype; returns that [N, K] view. The kernel on CUDA and in the interpreter, with
    no allocation (graph-capturable); `dequantize_into_ref` elsewhere."""
    if kernels_run(out, _q8_0_kernel):
        return dequantize_into_triton(ggml_type, planes, n, k, out)
    return dequantize_into_ref(ggml_type, planes, n, k, out)
