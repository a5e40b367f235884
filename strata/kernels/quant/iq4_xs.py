"""GGUF IQ4_XS weights kept 4-bit on the device: repack, the fp32 definition, and x @ Wᵀ kernels.

IQ4_XS (ggml): super-blocks of 256 values in 136 bytes — fp16 d, a little-endian uint16 scales_h (the
top 2 bits of each of 8 sub-block scales, sub-block j at bits 2j, 2j+1), scales_l[4] (their low 4 bits,
sub-block j in the low nibble of byte j/2 for even j, the high one for odd j), then qs[128]: 16 bytes
per 32-value sub-block, whose low nibbles are values 0..15 of the sub-block and high nibbles values
16..31. A 4-bit quant q indexes the non-linear table kvalues_iq4nl (16 int8 values, -127 .. 113: gguf's
`IQ4_NL.kvalues`, read at import); value v is (d·(scale − 32))·kvalues[q] with the 6-bit scale of its
sub-block. gguf's numpy dequantizer computes exactly that in fp32, and both products are exact (11 + 5
+ 7 significant bits at most), so any evaluation order gives its bits.

Planes (`repack`, device ops only), 140 bytes per 256 values (+2.9% over the file's 136):
  qs      uint8 [N, K/2]    the file's order
  scales  int8  [N, K/32]   scale − 32 of each sub-block, unpacked
  d       fp32  [N, K/256]  d widened (exactly) from fp16, so that the kernels load a 4-byte word
The kernels read `scales` as int32 words (four sub-blocks, 128 values, a word): 4-byte loads that
Triton's software pipeline issues asynchronously (cp.async), where byte loads it could not. The table
is a 64-byte fp32 [16] tensor on each device (`kvalues_table`), loaded into registers once a program
and gathered from (`lookup`, tl.gather: through shared memory, as IQ3_S's grid).

The kernels read a tile of BLOCK_K values as [rows, BLOCK_K/32, 16] bytes; the low nibbles are the
values k0 + 32g + j and the high nibbles k0 + 32g + 16 + j, so each tile is two tensor-core dots of
depth BLOCK_K/2 against x gathered at those two column sets, as in q4_k.py (there the runs are 32
values long): no nibble interleave in registers.

Rounding (the contract's semantics): each weight is dequantized to fp32 as above (bit for bit the
`dequantize` value), then rounded to nearest even to x's dtype (bf16/fp16) and fed to the dot with
fp32 accumulation; the result is rounded once to x's dtype. fp32 x keeps fp32 weights and an IEEE
(non-TF32) dot. `matmul_ref` is that definition in torch and the path off CUDA. Under TRITON_INTERPRET
the 16-bit dot runs in fp32 on the rounded values (the same products: iq3_s's `_dot`).

Kernels. M ≤ 16 (decode): q4_k.py's GEMV pattern — the weight tile is the MMA's M side ("swap AB"),
x padded to 16 rows, M a runtime argument Triton does not specialise on, so every M ≤ 16 runs one
binary and a row's result does not depend on the other rows; deterministic split-K through
strata/kernels/splitk.py (the zeroed workspace is `gemv_workspace_numel` elements, which `QWeight`
holds). There is no dp4a GEMV for this format: every M ≤ 16 runs the dequantizing one whatever the
kernel choice quant_decode says. M > 16: a tiled GEMM in grouped tile order. Grids depend on shapes
only and nothing is read back to the host (CUDA graphs). The configurations follow q4_k.py's
reasoning for the H200 (the same bytes per value, one table gather per value in place of Q4_K's
min); UNTIMED and not compiled for sm_90 here.
"""

from __future__ import annotations

from functools import lru_cache

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

GGML_TYPE = "IQ4_XS"
BLOCK_BYTES = 136


def _kvalues() -> torch.Tensor:
    """fp32 [16]: gguf's kvalues_iq4nl."""
    from gguf.quants import IQ4_NL

    values = np.asarray(IQ4_NL.kvalues, dtype=np.int8)
    assert values.shape == (16,)
    return torch.from_numpy(values.astype(np.float32))


KVALUES = _kvalues()  # CPU; `kvalues_table` puts it on a device


@lru_cache(maxsize=16)
def kvalues_table(device: torch.device) -> torch.Tensor:
    """The table on `device` (made once per device; `repack` makes it, so never first under capture)."""
    return KVALUES.to(device)


# ----------------------------------------------------------------------------------------------
# Blocks, planes and the definition


def random_raw(n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [N, K/256·136] of valid IQ4_XS blocks with weights of std ~0.02: random bytes for the
    scales and the quants, a positive fp16 d of sane size."""
    rng, blocks = random_block_bytes(n, k, seed, BLOCK_BYTES)
    nb = len(blocks)
    # RMS of a random scale − 32 ~18.5 and of a table value ~66: d ≈ 1.6e-5 gives a spread of ~0.02.
    d = (rng.uniform(0.6, 1.4, nb) * 1.6e-5).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n, k // BLOCK_VALUES * BLOCK_BYTES)


def repack(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The file's blocks → the kernels' planes (module docstring), on raw's device, torch ops only."""
    n, nb = check_raw(GGML_TYPE, raw, BLOCK_BYTES)
    blocks = raw.contiguous().view(n, nb, BLOCK_BYTES)
    device = raw.device
    high = blocks[:, :, 2:3].int() | (blocks[:, :, 3:4].int() << 8)  # scales_h, [N, nb, 1]
    high = (high >> torch.arange(0, 16, 2, device=device, dtype=torch.int32)) & 3  # [N, nb, 8]
    low = (blocks[:, :, 4:8, None].int() >> torch.arange(0, 8, 4, device=device, dtype=torch.int32)) & 15
    scales = (low.view(n, nb, 8) | (high << 4)) - 32
    kvalues_table(device)
    return {"qs": blocks[:, :, 8:].reshape(n, nb * 128).contiguous(),
            "scales": scales.to(torch.int8).view(n, nb * 8).contiguous(),
            "d": blocks[:, :, 0:2].contiguous().view(torch.float16).reshape(n, nb).float()}


def _check_planes(planes: dict[str, torch.Tensor], n: int, k: int) -> None:
    check_planes(GGML_TYPE, planes, k, {"qs": ((n, k // 2), torch.uint8), "scales": ((n, k // 32), torch.int8),
                                        "d": ((n, k // 256), torch.float32)})


def dequantize(planes: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """fp32 [N, K], equal bit for bit to gguf.quants.dequantize(raw, IQ4_XS)."""
    _check_planes(planes, n, k)
    qs = planes["qs"].view(n, k // 32, 16)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).long()  # [N, K/32, 32] in K order
    ds = planes["d"].repeat_interleave(8, dim=1) * planes["scales"].float()  # [N, K/32]
    return (ds[:, :, None] * kvalues_table(qs.device)[q]).view(n, k)


def matmul_ref(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: fp32 product of x and the dequantized weight rounded to x's dtype, rounded once."""
    return reference_matmul(dequantize(planes, n, k), x, out)


# ----------------------------------------------------------------------------------------------
# Kernels


@jit
def load_kvalues(kv_ptr, LOAD: tl.constexpr):
    """The 16 table values (fp32) in registers, once a program, for `lookup` to gather from; 0 without
    LOAD (a kernel serving several formats loads the table for IQ4_XS only)."""
    if LOAD:
        return tl.load(kv_ptr + tl.arange(0, 16))
    else:
        return 0


@jit
def lookup(q, table):
    """table[q] for int32 quants q (any shape, 0..15), gathered from `table` (`load_kvalues`)."""
    flat = tl.reshape(q, (q.numel,))
    return tl.reshape(tl.gather(table, flat, 0), q.shape)


@jit
def _dequant_tile(qs_ptr, scales_ptr, d_ptr, table, w_rows, k0, k,
                  ROWS: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """Weight rows `w_rows` (int64 [R], all valid), values k0 .. k0+BLOCK_K (k0 a multiple of 128) →
    (low, high) [R, BLOCK_K/2] in DTYPE: low column 16g+j is value k0+32g+j, high column 16g+j is value
    k0+32g+16+j (`_low_columns`). `scales_ptr` is the scales plane viewed as int32 (one word per 128
    values); `table` the kvalues (`load_kvalues`)."""
    WORDS: tl.constexpr = BLOCK_K // 128
    r = w_rows[:, None, None, None]
    a = tl.arange(0, WORDS)[None, :, None, None]  # scale word: 128 values
    s = tl.arange(0, 4)[None, None, :, None]  # sub-block of 32 values within the word
    j = tl.arange(0, 16)[None, None, None, :]  # byte within the sub-block
    q = tl.load(qs_ptr + r * (k // 2) + (k0 // 2 + 64 * a + 16 * s + j)).to(tl.int32)
    words = tl.load(scales_ptr + r * (k // 128) + (k0 // 128 + a))
    d = tl.load(d_ptr + r * (k // 256) + (k0 + 128 * a) // 256)
    ds = d * _signed_byte_to_f32(words, 8 * s)  # [R, WORDS, 4, 1]: d · (scale − 32), exact
    w_lo = ds * lookup(q & 15, table)
    w_hi = ds * lookup(q >> 4, table)
    return (tl.reshape(w_lo, (ROWS, BLOCK_K // 2)).to(DTYPE), tl.reshape(w_hi, (ROWS, BLOCK_K // 2)).to(DTYPE))


@jit
def _low_columns(BLOCK_K: tl.constexpr):
    """Offsets (from k0) of the values the low nibbles of a tile hold; +16 gives the high ones."""
    c = tl.arange(0, BLOCK_K // 2)
    return (c // 16) * 32 + c % 16


@jit(do_not_specialize=["m"])
def _gemv_kernel(x_ptr, x_stride, qs_ptr, scales_ptr, d_ptr, kv_ptr, out_ptr, out_stride, partial_ptr,
                 counter_ptr, m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, IEEE_DOT: tl.constexpr, INTERPRETED: tl.constexpr,
                 USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    table = load_kvalues(kv_ptr, True)
    tile, split, kb_begin, kb_end = split_k_range(k // BLOCK_K, SPLIT_K)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.minimum(cols, n - 1).to(tl.int64)  # past-the-end rows re-read the last one, never stored
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < m
    xt_ptrs = x_ptr + rows[None, :] * x_stride + _low_columns(BLOCK_K)[:, None]  # xᵀ [BLOCK_K/2, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(kb_begin, kb_end):
        k0 = kb * BLOCK_K
        w_lo, w_hi = _dequant_tile(qs_ptr, scales_ptr, d_ptr, table, w_rows, k0, k, BLOCK_N, BLOCK_K,
                                   x_ptr.dtype.element_ty)
        x_lo = tl.load(xt_ptrs + k0, mask=row_ok[None, :], other=0.0)
        x_hi = tl.load(xt_ptrs + (k0 + 16), mask=row_ok[None, :], other=0.0)
        acc = _dot(w_lo, x_lo, acc, IEEE_DOT, INTERPRETED)
        acc = _dot(w_hi, x_hi, acc, IEEE_DOT, INTERPRETED)
    split_k_store(acc, out_ptr, out_stride, partial_ptr, counter_ptr, tile, split, cols, rows, n, m,
                  SPLIT_K, BLOCK_M, BLOCK_N)


@jit(do_not_specialize=["m"])
def _gemm_kernel(x_ptr, x_stride, qs_ptr, scales_ptr, d_ptr, kv_ptr, out_ptr, out_stride, m, n, k,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 IEEE_DOT: tl.constexpr, INTERPRETED: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    table = load_kvalues(kv_ptr, True)
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
        w_lo, w_hi = _dequant_tile(qs_ptr, scales_ptr, d_ptr, table, w_rows, k0, k, BLOCK_N, BLOCK_K,
                                   x_ptr.dtype.element_ty)
        acc = _dot(x_lo, tl.trans(w_lo), acc, IEEE_DOT, INTERPRETED)
        acc = _dot(x_hi, tl.trans(w_hi), acc, IEEE_DOT, INTERPRETED)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < m)[:, None] & (cols < n)[None, :])


# ----------------------------------------------------------------------------------------------
# Configurations (q4_k.py's reasoning for the H200; UNTIMED)


def gemv_config(n: int, k: int) -> GemvConfig:
    """A function of (N, K) only: what makes a row's result independent of M ≤ 16. Q4_K's tiles (the
    same 0.53-0.58 bytes per value, a decode loop bound by instructions): 64-row tiles (one wgmma warp
    group; 128 rows once those alone give two programs per SM), 128 values per step, split-K up to
    about 3 programs per SM with ≥ 2 steps each."""
    return split_gemv_config(n, k, block_k=128)


def gemm_config(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> GemmConfig:
    """16-bit x: Q4_K's tiles — 128x128 outputs, 8 warps (two wgmma warp groups), 128 values per step,
    64-row tiles for short reads. fp32 x (IEEE dot on the FMA units, a correctness path): 32x32 tiles,
    as Q6_K's (the table gather adds registers to Q4_K's 64x64)."""
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
    """The kernels' plane arguments: qs, scales as int32 words, d, and the kvalues table."""
    return planes["qs"], planes["scales"].view(torch.int32), planes["d"], kvalues_table(planes["qs"].device)


def gemv_iq4xs(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
               *, workspace: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """The decode kernel, x [M ≤ 16, K]. A split-K configuration uses `workspace` (zeroed int32 of ≥
    `gemv_workspace_numel` elements, left zeroed; not shared by concurrent streams) or allocates one."""
    out = _check_call(x, planes, n, k, out)
    return launch_gemv(_gemv_kernel, "gemv_iq4xs", x, kernel_planes(planes), n, k, out, workspace,
                       config or gemv_config(n, k), INTERPRETED=not x.is_cuda)


def gemm_iq4xs(x: torch.Tensor, planes: dict[str, torch.Tensor], n: int, k: int, out: torch.Tensor | None = None,
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
        return gemv_iq4xs(x, planes, n, k, out, workspace=workspace)
    return gemm_iq4xs(x, planes, n, k, out)
