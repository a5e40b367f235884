"""MoE experts kept quantized (GGUF Q8_0 / Q4_K / IQ3_S / Q6_K / IQ4_XS / Q3_K / Q5_K / Q4_0): one grouped
GEMM over stacked expert planes.

Layout. `QExpertStack` holds E experts' [N, K] weights of one format as that format's planes: its
`repack` of the stack's rows of blocks ([E·N, bytes per row], as the file stores a stacked tensor),
each plane then viewed with a leading expert dim [E, N, ...]. Expert e's weight is rows e·N .. e·N + N - 1
of the flat planes, so the kernel dequantizes through the format modules' `_dequant_tile` helpers
unchanged. IQ3_S's GEMV workspace plane is dropped (nothing here splits K).

Op. `grouped_matmul(xs, stack, offs)`: xs [T, K] token rows sorted by expert, offs int32 [E] the end
row of each expert's group (as `torch._grouped_mm` takes them; `moe_sort.sort_tokens` makes them) →
[T, N] in xs's dtype, row r multiplied by its expert's weight. Rows at or past offs[E-1] are left
unwritten by the kernel (zeros in the reference); MoE layers never have any.

Kernel. One launch over (row tile, column tile) pairs in grouped order. The grid is an upper bound
from shapes only: at most min(E, T) experts have rows, so their row tiles number at most
cdiv(T + min(E, T)·(BLOCK_M - 1), BLOCK_M). A program reads offs (E values), counts every
expert's row tiles, finds by a prefix sum the expert its row tile belongs to and that tile's rows,
and does nothing past the last tile. No host sync, no allocation besides the output, so the launch
can be captured in a CUDA graph. Per K step the [BLOCK_N, BLOCK_K] tile of the expert's weight rows
is dequantized in registers (exact in fp32, then rounded to nearest even to x's dtype, as the format
modules' kernels do; fp32 x keeps fp32 weights and an IEEE dot), multiplied with fp32 accumulation,
and the result is rounded once to x's dtype. Two shapes of tile:
- few rows per expert (decode, T ≤ DECODE_ROWS_PER_EXPERT·E): 16 rows of x, the weight tile as the
  MMA's M side ("swap AB", as the formats' GEMVs), so the dequantized weights feed the MMA from
  registers; the weight bytes of the active experts are the cost;
- more rows: tiled GEMMs, 64- or 128-row x tiles against each dequantized weight tile.
Configurations (`grouped_config`) are functions of (format, T, E, N, K, x dtype), chosen by reasoning
for the H200 from the formats' own GEMV / GEMM choices: NOT timed yet.

Reference. `grouped_matmul_ref`: per expert, `dequantize` and an fp32 matmul rounded once to xs's
dtype (weights unrounded: it differs from the kernel by the rounding of each weight to a 16-bit x's
dtype, ~2⁻⁹ relative per weight). It reads offs on the host. The CPU engine runs it (off CUDA and
outside Triton's interpreter). Under TRITON_INTERPRET the 16-bit dots run in fp32 on the rounded
values (the same products), as in the format modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strata.kernels import device as devices
from strata.kernels import kernels_run, use_pdl
from strata.kernels.device import DeviceSpec
from strata.kernels.pdl import pdl_prologue
from strata.kernels.quant.formats import FORMATS, format_module
from strata.kernels.quant.iq3_s import _dequant_tile as iq3s_dequant_tile
from strata.kernels.quant.iq3_s import _dot as iq3s_dot
from strata.kernels.quant.iq3_s_planes import grid_table, grid_table_words
from strata.kernels.quant.iq4_xs import _dequant_tile as iq4xs_dequant_tile
from strata.kernels.quant.iq4_xs import _low_columns as iq4xs_low_columns
from strata.kernels.quant.iq4_xs import kernel_planes as iq4xs_kernel_planes
from strata.kernels.quant.iq4_xs import kvalues_table as iq4xs_kvalues_table
from strata.kernels.quant.iq4_xs import load_kvalues as iq4xs_load_kvalues
from strata.kernels.quant.q3_k import _dequant_tile as q3k_dequant_tile
from strata.kernels.quant.q3_k import kernel_planes as q3k_kernel_planes
from strata.kernels.quant.q4_0 import _dequant_tile as q40_dequant_tile
from strata.kernels.quant.q4_0 import _low_columns as q40_low_columns
from strata.kernels.quant.q4_k import _dequant_tile as q4k_dequant_tile
from strata.kernels.quant.q4_k import _low_columns as q4k_low_columns
from strata.kernels.quant.q5_k import _dequant_tile as q5k_dequant_tile
from strata.kernels.quant.q5_k import kernel_planes as q5k_kernel_planes
from strata.kernels.quant.q6_k import _dequant_tile as q6k_dequant_tile
from strata.kernels.quant.q6_k import _low_columns as q6k_low_columns
from strata.kernels.quant.q6_k import kernel_planes as q6k_kernel_planes
from strata.kernels.quant.q8_0 import _dequant_tile as q8_dequant_tile
from strata.kernels.tiles import grouped_tile
from strata.kernels.triton_import import jit, tl, triton


SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The kernel's FORMAT constexpr; 4 is moe_decode_q's FP8, so no format here takes it.
_FORMAT_IDS = {"Q8_0": 0, "Q4_K": 1, "IQ3_S": 2, "Q6_K": 3, "IQ4_XS": 5, "Q3_K": 6, "Q5_K": 7, "Q4_0": 8}
# a scale group / a nibble pair run / two sub-blocks / a 128-value half / a scale word / a 128-value half /
# Q4_K's / a block
_MIN_BLOCK_K = {"Q8_0": 32, "Q4_K": 128, "IQ3_S": 64, "Q6_K": 128, "IQ4_XS": 128, "Q3_K": 128, "Q5_K": 128,
                "Q4_0": 32}
# Up to this many rows per expert on average (T ≤ this · E) the decode tiles serve: at batch 16 with
# top-8 of 128 experts, T = 128 pairs, ~1 row per active expert.
DECODE_ROWS_PER_EXPERT = 4
MID_ROWS_PER_EXPERT = 48  # up to this, 64-row tiles (little padding); beyond, 128-row tiles


# ----------------------------------------------------------------------------------------------
# The stack


@dataclass
class QExpertStack:
    """E quantized [N, K] expert weights of one GGUF format: planes [E, N, ...] from the format's `repack`."""

    ggml_type: str
    num_experts: int
    n: int
    k: int
    planes: dict[str, torch.Tensor]

    @classmethod
    def from_raw(cls, ggml_type: str, raw: torch.Tensor) -> "QExpertStack":
        """raw uint8 [E, N, K / BLOCK_VALUES · BLOCK_BYTES]: each expert's rows of blocks as the file
        stores them (block rows are independent, so stacking or concatenating rows is exact)."""
        if ggml_type not in FORMATS:
            raise ValueError(f"no grouped expert kernel for {ggml_type} (kept quantized: {', '.join(FORMATS)})")
        mod = format_module(ggml_type)
        if raw.dtype != torch.uint8 or raw.dim() != 3 or raw.shape[2] % mod.BLOCK_BYTES or raw.shape[2] == 0:
            raise ValueError(f"{ggml_type} expert stack: expected uint8 [E, N, K/{mod.BLOCK_VALUES}*"
                             f"{mod.BLOCK_BYTES}], got {raw.dtype} {tuple(raw.shape)}")
        e, n, row_bytes = raw.shape
        flat = mod.repack(raw.reshape(e * n, row_bytes).contiguous())
        flat.pop("workspace", None)  # IQ3_S's split-K GEMV scratch: the grouped kernel takes none
        planes = {name: p.view(e, n, *p.shape[1:]) for name, p in flat.items()}
        return cls(ggml_type, e, n, row_bytes // mod.BLOCK_BYTES * mod.BLOCK_VALUES, planes)

    @property
    def module(self):
        return format_module(self.ggml_type)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.planes.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.planes.values())).device

    def flat_planes(self) -> dict[str, torch.Tensor]:
        """The planes as the format's [E·N, ...] (views)."""
        return {name: p.view(self.num_experts * self.n, *p.shape[2:]) for name, p in self.planes.items()}

    def expert_planes(self, e: int) -> dict[str, torch.Tensor]:
        return {name: p[e] for name, p in self.planes.items()}

    def dequantize_expert(self, e: int, device: torch.device | None = None) -> torch.Tensor:
        """fp32 [N, K] of expert e (the format's exact `dequantize`), computed on `device` (default: where
        the blocks are)."""
        planes = self.expert_planes(e)
        if device is not None:
            planes = {name: p.to(device, non_blocking=True) for name, p in planes.items()}
        return self.module.dequantize(planes, self.n, self.k)

    def dequantize(self) -> torch.Tensor:
        """fp32 [E, N, K]."""
        return self.module.dequantize(self.flat_planes(), self.num_experts * self.n, self.k).view(
            self.num_experts, self.n, self.k)


# ----------------------------------------------------------------------------------------------
# Configurations


@dataclass(frozen=True)
class GroupedConfig:
    block_m: int  # x rows per program (one expert's)
    block_n: int  # weight rows per program
    block_k: int  # values per K step
    swap_ab: bool = False  # weights as the MMA's M side (decode tiles)
    group_m: int = 8  # row tiles that walk the column tiles together (L2 reuse of weight tiles)
    num_warps: int = 4
    num_stages: int = 3


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_k(ggml_type: str, k: int, preferred: int) -> int:
    """The largest power of two ≤ preferred (and ≥ the format's least) dividing K."""
    block = max(preferred, _MIN_BLOCK_K[ggml_type])
    while block > _MIN_BLOCK_K[ggml_type] and k % block:
        block //= 2
    return block


# Tiles by regime and format: (BLOCK_M, BLOCK_N, preferred BLOCK_K, warps, stages). Each compiled for
# sm_90 without register spills (Triton 3.9 on this machine; the target's 3.6 may allocate differently):
# the decode tiles at 168-254 registers, the reads at 213-255 — except Q4_K's 128 x 128 x 128 (96
# bytes of stack, as its own GEMM here); wider K steps or 4 warps on 64-row tiles spilled kilobytes.
# IQ4_XS and Q3_K take Q4_K's and Q6_K's tiles (128-value K steps, dequantizations of like cost); not
# compiled for sm_90 here. Q5_K and Q4_0 take Q4_K's (Q5_K's tile is Q4_K's plus its high bits).
_TILES = {
    "decode": {"Q8_0": (16, 64, 128, 4, 4), "Q4_K": (16, 64, 128, 4, 4), "IQ3_S": (16, 32, 256, 4, 3),
               "Q6_K": (16, 64, 128, 4, 4), "IQ4_XS": (16, 64, 128, 4, 4), "Q3_K": (16, 64, 128, 4, 4),
               "Q5_K": (16, 64, 128, 4, 4), "Q4_0": (16, 64, 128, 4, 4)},
    "mid": {"Q8_0": (64, 128, 64, 8, 3), "Q4_K": (64, 64, 128, 8, 3), "IQ3_S": (64, 128, 64, 8, 3),
            "Q6_K": (64, 64, 128, 8, 3), "IQ4_XS": (64, 64, 128, 8, 3), "Q3_K": (64, 64, 128, 8, 3),
            "Q5_K": (64, 64, 128, 8, 3), "Q4_0": (64, 64, 128, 8, 3)},
    "large": {"Q8_0": (128, 128, 64, 8, 3), "Q4_K": (128, 128, 128, 8, 3), "IQ3_S": (128, 128, 64, 8, 3),
              "Q6_K": (128, 128, 128, 8, 3), "IQ4_XS": (128, 128, 128, 8, 3), "Q3_K": (128, 128, 128, 8, 3),
              "Q5_K": (128, 128, 128, 8, 3), "Q4_0": (128, 128, 128, 8, 3)},
}


def grouped_config(ggml_type: str, t: int, num_experts: int, n: int, k: int,
                   dtype: torch.dtype = torch.bfloat16, spec: DeviceSpec | None = None) -> GroupedConfig:
    """Untimed, by reasoning for the H200 (132 SMs) and the sm_90 compile (`_TILES`).
    - decode (T ≤ 4E): 16 rows of x against the weights as the MMA's M side; 64 weight rows per
      program for Q8_0 / Q4_K (one wgmma warp group, one warp per 16 rows, so no warp repeats the
      dequantization), 32 for IQ3_S (its GEMV's pick: dequantization-bound, so more, smaller
      programs; mma.sync). Qwen3-30B-A3B at batch 1: 8 experts x 1536 / 64 = 192 programs for
      gate|up, 8 x 2048 / 64 = 256 for down (IQ3_S: twice as many).
    - reads: 64-row x tiles up to 48 rows per expert on average (little padding), else 128; 8 warps
      (two wgmma warp groups), 3 stages, as the formats' GEMMs. On a device without `wgmma` (`spec`,
      default: the current device), whose mma.sync keeps the dequantized halves and the accumulator
      in registers, the formats of 128-value steps take 64-row read tiles, 2 stages at mid sizes (the
      sm_90 tiles spill there: Q4_K 60-170 spill instructions compiled for sm_86), in the stages that
      fit its shared memory.
    - fp32 x (a correctness path, FMA dot): 16- or 32-row x 32 tiles at the formats' least K step."""
    if dtype == torch.float32:
        block_m = 16 if t <= DECODE_ROWS_PER_EXPERT * num_experts else 32
        warps = 8 if block_m == 32 and ggml_type != "Q8_0" else 4  # 4 warps spill there
        return GroupedConfig(block_m, 32, _block_k(ggml_type, k, _MIN_BLOCK_K[ggml_type]), num_warps=warps,
                             num_stages=2)
    regime = ("decode" if t <= DECODE_ROWS_PER_EXPERT * num_experts else
              "mid" if t <= MID_ROWS_PER_EXPERT * num_experts else "large")
    block_m, block_n, block_k, warps, stages = _TILES[regime][ggml_type]
    spec = spec or devices.current()
    if not spec.wgmma and regime != "decode" and block_k >= 128:
        block_m, stages = 64, 3 if regime == "large" else 2
        stages = devices.fit_stages(spec, stages, block_m * block_k * 2 + block_n * block_k)
    return GroupedConfig(block_m, block_n, _block_k(ggml_type, k, block_k), swap_ab=regime == "decode",
                         num_warps=warps, num_stages=stages)


def check_config(cfg: GroupedConfig, ggml_type: str, k: int) -> None:
    pow2 = lambda v, lo: v >= lo and v & (v - 1) == 0  # noqa: E731
    ok = (pow2(cfg.block_m, 16) and pow2(cfg.block_n, 16) and pow2(cfg.block_k, _MIN_BLOCK_K[ggml_type])
          and k % cfg.block_k == 0 and (ggml_type != "IQ3_S" or cfg.block_k <= 256) and cfg.group_m >= 1
          and cfg.num_warps in (1, 2, 4, 8) and cfg.num_stages >= 1)
    if not ok:
        raise ValueError(f"invalid grouped {ggml_type} {cfg} for K={k}")


# ----------------------------------------------------------------------------------------------
# Kernel


@jit
def _expert_of_tile(offs_ptr, num_experts, tile_m, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, end row) of row tile `tile_m` when experts' groups are cut into BLOCK_M-row
    tiles in expert order; expert ≥ num_experts past the last tile."""
    e = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + e, mask=e < num_experts, other=0)
    starts = tl.load(offs_ptr + e - 1, mask=(e > 0) & (e < num_experts), other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, axis=0)
    # Tile ends never decrease, so the experts ending at or before tile_m are exactly those before its owner.
    expert = tl.sum((tile_ends <= tile_m).to(tl.int32), axis=0)
    mine = e == expert
    first_tile = tl.sum(tl.where(mine, tile_ends - tiles, 0), axis=0)
    row0 = tl.sum(tl.where(mine, starts, 0), axis=0) + (tile_m - first_tile) * BLOCK_M
    return expert, row0, tl.sum(tl.where(mine, ends, 0), axis=0)


@jit
def _load_x(x_ptr, x_stride, x_rows, cols, TRANSPOSED: tl.constexpr):
    """x[x_rows][:, cols] as [rows, cols], or as [cols, rows] when TRANSPOSED (rows are valid: no mask)."""
    if TRANSPOSED:
        return tl.load(x_ptr + x_rows[None, :] * x_stride + cols[:, None])
    else:
        return tl.load(x_ptr + x_rows[:, None] * x_stride + cols[None, :])


@jit
def _mma(x, w, acc, SWAP_AB: tl.constexpr, IEEE_DOT: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc + x·wᵀ ([BLOCK_M, BLOCK_N]); with SWAP_AB, x comes transposed and acc + w·xᵀ is [BLOCK_N, BLOCK_M]."""
    if SWAP_AB:
        return iq3s_dot(w, x, acc, IEEE_DOT, INTERPRETED)
    else:  # Triton 3.9 also compiles statements after a constexpr-true branch's return: keep them apart
        return iq3s_dot(x, tl.trans(w), acc, IEEE_DOT, INTERPRETED)


@jit(do_not_specialize=["tiles_m"])
def _grouped_kernel(x_ptr, x_stride, offs_ptr, out_ptr, out_stride, p0, p1, p2, p3, p4, grid_ptr, tiles_m, n, k,
                    num_experts, FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr,
                    IEEE_DOT: tl.constexpr, INTERPRETED: tl.constexpr, USE_PDL: tl.constexpr,
                    SHARED_GRID: tl.constexpr):
    pdl_prologue(USE_PDL)
    GROUPS: tl.constexpr = BLOCK_K // 32  # Q8_0's scale groups per K step
    table = grid_table_words(grid_ptr, SHARED_GRID)  # IQ3_S only: its grid table, gathered through shared memory
    kvalues = iq4xs_load_kvalues(grid_ptr, FORMAT == 5)  # IQ4_XS only: its 16-value table, in the grid's slot
    dtype = x_ptr.dtype.element_ty
    tile_m, tile_n = grouped_tile(tl.program_id(0), tiles_m * BLOCK_M, n, BLOCK_M, BLOCK_N, GROUP_M)
    expert, row0, row_end = _expert_of_tile(offs_ptr, num_experts, tile_m, BLOCK_M, BLOCK_E)
    if expert < num_experts:
        rows = row0 + tl.arange(0, BLOCK_M)
        x_rows = tl.minimum(rows, row_end - 1).to(tl.int64)  # rows past the group re-read its last, never stored
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = expert.to(tl.int64) * n + tl.minimum(cols, n - 1)  # rows of the flat [E·N, ...] planes
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(0, k // BLOCK_K):
            k0 = step * BLOCK_K
            if FORMAT == 1:  # Q4_K: the low and high nibbles' halves, against x at their columns
                w_lo, w_hi = q4k_dequant_tile(p0, p1, p2, w_rows, k0, k, BLOCK_N, BLOCK_K, dtype)
                low = k0 + q4k_low_columns(BLOCK_K)
                acc = _mma(_load_x(x_ptr, x_stride, x_rows, low, SWAP_AB), w_lo, acc, SWAP_AB, IEEE_DOT, INTERPRETED)
                acc = _mma(_load_x(x_ptr, x_stride, x_rows, low + 32, SWAP_AB), w_hi, acc, SWAP_AB, IEEE_DOT,
                           INTERPRETED)
            elif FORMAT == 3:  # Q6_K: as Q4_K, the high nibbles' values 64 past the low ones'
                w_lo, w_hi = q6k_dequant_tile(p0, p1, p2, p3, w_rows, k0, k, BLOCK_N, BLOCK_K, dtype, INTERPRETED)
                low = k0 + q6k_low_columns(BLOCK_K)
                acc = _mma(_load_x(x_ptr, x_stride, x_rows, low, SWAP_AB), w_lo, acc, SWAP_AB, IEEE_DOT, INTERPRETED)
                acc = _mma(_load_x(x_ptr, x_stride, x_rows, low + 64, SWAP_AB), w_hi, acc, SWAP_AB, IEEE_DOT,
                           INTERPRETED)
            elif FORMAT == 5:  # IQ4_XS: as Q4_K, the high nibbles' values 16 past the low ones'
                w_lo, w_hi = iq4xs_dequant_tile(p0, p1, p2, kvalues, w_rows, k0, k, BLOCK_N, BLOCK_K, dtype)
                low = k0 + iq4xs_low_columns(BLOCK_K)
                acc = _mma(_load_x(x_ptr, x_stride, x_rows, low, SWAP_AB), w_lo, acc, SWAP_AB, IEEE_DOT, INTERPRETED)
                acc = _mma(_load_x(x_ptr, x_stride, x_rows, low + 16, SWAP_AB), w_hi, acc, SWAP_AB, IEEE_DOT,
                           INTERPRETED)
            elif FORMAT == 7:  # Q5_K: Q4_K's halves and columns, the high bits in p3
                w_lo, w_hi = q5k_dequant_tile(p0, p1, p2, p3, w_rows, k0, k, BLOCK_N, BLOCK_K, dtype)
                low = k0 + q4k_low_columns(BLOCK_K)
                acc = _mma(_load_x(x_ptr, x_stride, x_rows, low, SWAP_AB), w_lo, acc, SWAP_AB, IEEE_DOT, INTERPRETED)
                acc = _mma(_load_x(x_ptr, x_stride, x_rows, low + 32, SWAP_AB), w_hi, acc, SWAP_AB, IEEE_DOT,
                           INTERPRETED)
            elif FORMAT == 8:  # Q4_0: as Q4_K, the high nibbles' values 16 past the low ones'
                w_lo, w_hi = q40_dequant_tile(p0, p1, w_rows, k0, k, BLOCK_N, BLOCK_K, dtype, False)
                low = k0 + q40_low_columns(BLOCK_K)
                acc = _mma(_load_x(x_ptr, x_stride, x_rows, low, SWAP_AB), w_lo, acc, SWAP_AB, IEEE_DOT, INTERPRETED)
                acc = _mma(_load_x(x_ptr, x_stride, x_rows, low + 16, SWAP_AB), w_hi, acc, SWAP_AB, IEEE_DOT,
                           INTERPRETED)
            else:
                if FORMAT == 0:  # Q8_0: p0 qs int8 [E·N, K], p1 d fp16 [E·N, K/32]
                    q_ptrs = (p0 + w_rows[:, None, None] * k + k0 + tl.arange(0, GROUPS)[None, :, None] * 32
                              + tl.arange(0, 32)[None, None, :])
                    d_ptrs = p1 + w_rows[:, None] * (k // 32) + k0 // 32 + tl.arange(0, GROUPS)[None, :]
                    w = q8_dequant_tile(q_ptrs, d_ptrs, BLOCK_N, BLOCK_K, dtype)
                elif FORMAT == 6:  # Q3_K: qs, hmask and scales as int32 words, d; one K-ordered tile
                    w = q3k_dequant_tile(p0, p1, p2, p3, w_rows, k0, k, BLOCK_N, BLOCK_K, dtype, INTERPRETED)
                else:  # IQ3_S: qs, signs, qh, scales, d and the grid table
                    w = iq3s_dequant_tile(p0, p1, p2, p3, p4, table, w_rows, k0, k, BLOCK_N, BLOCK_K,
                                          INTERPRETED).to(dtype)
                xk = _load_x(x_ptr, x_stride, x_rows, k0 + tl.arange(0, BLOCK_K), SWAP_AB)
                acc = _mma(xk, w, acc, SWAP_AB, IEEE_DOT, INTERPRETED)
        if SWAP_AB:
            result = tl.trans(acc)
        else:
            result = acc
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=(rows < row_end)[:, None] & (cols < n)[None, :])


# ----------------------------------------------------------------------------------------------
# Public ops


def _kernel_planes(stack: QExpertStack, device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
    """The kernel's five plane pointers and grid table (unused slots repeat the first plane). The tables
    (IQ3_S's grid, IQ4_XS's kvalues) are `device`'s, where the kernel runs (default: the stack's), so a
    stack read in place from pinned host memory still finds them in the GPU's."""
    p = stack.flat_planes()
    device = device or stack.device
    if stack.ggml_type == "Q8_0":
        return p["qs"], p["d"], p["qs"], p["qs"], p["qs"], p["qs"]
    if stack.ggml_type == "Q4_K":
        return p["qs"], p["scales"].view(torch.int32), p["d_dmin"].view(torch.int32), p["qs"], p["qs"], p["qs"]
    if stack.ggml_type == "Q6_K":
        return (*q6k_kernel_planes(p), p["d"], p["d"])
    if stack.ggml_type == "IQ4_XS":  # the kvalues table in the grid's slot
        qs, scales, d, _ = iq4xs_kernel_planes(p)
        return qs, scales, d, qs, qs, iq4xs_kvalues_table(device)
    if stack.ggml_type == "Q3_K":
        return (*q3k_kernel_planes(p), p["d"], p["d"])
    if stack.ggml_type == "Q5_K":
        return (*q5k_kernel_planes(p), p["qs"], p["qs"])
    if stack.ggml_type == "Q4_0":
        return p["qs"], p["d"], p["qs"], p["qs"], p["qs"], p["qs"]
    return p["qs"], p["signs"], p["qh"], p["scales"], p["d"], grid_table(device)


def _check_call(xs: torch.Tensor, stack: QExpertStack, offs: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if (xs.dim() != 2 or xs.shape[1] != stack.k or xs.stride(1) != 1 or xs.dtype not in SUPPORTED_DTYPES
            or xs.device != stack.device):
        raise ValueError(f"xs: expected [T, {stack.k}] bf16/fp16/fp32 with contiguous rows on {stack.device}, got "
                         f"{tuple(xs.shape)} {xs.dtype} strides {xs.stride()} on {xs.device}")
    if (offs.dtype != torch.int32 or tuple(offs.shape) != (stack.num_experts,) or not offs.is_contiguous()
            or offs.device != xs.device):
        raise ValueError(f"offs: expected contiguous int32 [{stack.num_experts}] on {xs.device}, got "
                         f"{offs.dtype} {tuple(offs.shape)} on {offs.device}")
    t = xs.shape[0]
    if out is None:
        return torch.empty((t, stack.n), dtype=xs.dtype, device=xs.device)
    if tuple(out.shape) != (t, stack.n) or out.dtype != xs.dtype or out.stride(1) != 1 or out.device != xs.device:
        raise ValueError(f"out: expected [{t}, {stack.n}] {xs.dtype} with contiguous rows, got {tuple(out.shape)} "
                         f"{out.dtype} strides {out.stride()}")
    return out


def grouped_matmul_triton(xs: torch.Tensor, stack: QExpertStack, offs: torch.Tensor,
                          out: torch.Tensor | None = None, *, config: GroupedConfig | None = None) -> torch.Tensor:
    """The kernel (one launch). `config` overrides `grouped_config`."""
    out = _check_call(xs, stack, offs, out)
    t, e, n, k = xs.shape[0], stack.num_experts, stack.n, stack.k
    if t == 0 or n == 0:
        return out
    cfg = config or grouped_config(stack.ggml_type, t, e, n, k, xs.dtype, devices.current(xs))
    check_config(cfg, stack.ggml_type, k)
    tiles_m = _cdiv(t + min(e, t) * (cfg.block_m - 1), cfg.block_m)
    on = use_pdl(xs)
    _grouped_kernel[(tiles_m * _cdiv(n, cfg.block_n),)](
        xs, xs.stride(0), offs, out, out.stride(0), *_kernel_planes(stack), tiles_m, n, k, e,
        FORMAT=_FORMAT_IDS[stack.ggml_type], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_E=max(16, triton.next_power_of_2(e)), GROUP_M=cfg.group_m, SWAP_AB=cfg.swap_ab,
        IEEE_DOT=xs.dtype == torch.float32, INTERPRETED=not xs.is_cuda, USE_PDL=on, launch_pdl=on,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        SHARED_GRID=stack.ggml_type == "IQ3_S")
    return out


def grouped_matmul_ref(xs: torch.Tensor, stack: QExpertStack, offs: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Per expert: its rows of xs in fp32 times its dequantized weight, rounded once to xs's dtype."""
    y = xs.new_zeros(xs.shape[0], stack.n)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            y[start:end] = F.linear(xs[start:end].float(), stack.dequantize_expert(e)).to(xs.dtype)
        start = end
    return y if out is None else out.copy_(y)


def grouped_matmul(xs: torch.Tensor, stack: QExpertStack, offs: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """xs [T, K] sorted by expert, offs int32 [E] the groups' ends → [T, N] in xs's dtype: the kernel on
    CUDA (no gradient) and in the interpreter, the reference elsewhere."""
    if xs.dtype in SUPPORTED_DTYPES and kernels_run(xs, _grouped_kernel):
        return grouped_matmul_triton(xs, stack, offs, out)
    return grouped_matmul_ref(xs, stack, offs, out)
