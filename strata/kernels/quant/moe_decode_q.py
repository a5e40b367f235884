"""Routed MoE experts kept quantized (GGUF Q8_0 / Q4_K / IQ3_S / Q6_K / Q5_K / Q4_0 / IQ4_XS / Q3_K, or
`--quantize fp8`), decode-sized batches, in two launches.

The quantized twin of `strata.kernels.moe_decode`: the same two kernels, the same rounding points
(`moe_experts_decode_ref`), the weights read as their blocks from `QExpertStack`s (or e4m3 with a scale
per row, `Fp8Experts`) and dequantized in registers. It replaces, at T ≤ 16 tokens, the grouped path's
sort, gather, two grouped launches (over 16-row tiles, or `torch._scaled_grouped_mm` after quantizing
the activations for FP8), SiLU·mul, weighting, scatter and sum (12 launches a layer on the H200).

- `_gate_up_kernel`, grid (T·k pairs, I / BLOCK_I): one pair's BLOCK_I gate rows and the matching up
  rows of its expert, over H in BLOCK_K steps; writes silu(gate)·up for the pair to act [T·k, I].
- `_down_kernel`, grid (T, H / BLOCK_H): per token and row block, the k experts' down rows in slot
  order j = 0..k-1, each term rounded and weighted as the reference does, summed in fp32.

Per K step a weight tile [rows, BLOCK_K] comes out of the format's `_dequant_tile` in fp32, exact (the
GGUF values are small integers times fp16 scales; e4m3 values convert exactly, their row scale is
applied once to the row's sum), and is multiplied elementwise with the activation row, each lane
keeping its partial sums until the end (one row of x a pair: tensor cores would pad it to 16). So the
products are those of the exact weights, and only the fp32 summation order (and, for FP8, where the
scale is applied) differs from the reference.

A pair's expert is read from `topk_ids` on the device; the grid comes from shapes only and nothing
goes to the host, so the launches can be captured in a CUDA graph. Each program serves one pair
(kernel 1) or one token (kernel 2) and the k-sum has a fixed order: a token's result does not depend
on the other tokens.

Q8_0 takes `dp4a` tiles by default (`QMoeDecodeConfig.dp4a`): x quantized per 32 values and packed int8
dot products, the dense Q8_0 decode GEMV's arithmetic (`strata.kernels.quant.dp4a`), against
`moe_decode_dp4a_ref`; `reference` picks the definition a configuration follows. IQ3_S has dp4a tiles
too (its dense GEMV's `weight_words`), tested; on the H200 they run level with its dequantizing tiles
(docs/QUANTIZATION.md) with x's int8 rounding on top, so they are not its default.

STATUS: correct against the references in the interpreter and on the H200 (tests); configurations
from `python benchmarks/kernels/quant_moe.py --decode` on the H200 (`_CONFIGS`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from strata.kernels import choices, kernels_run, use_pdl
from strata.kernels import moe_decode as k_moe
from strata.kernels.pdl import pdl_prologue
from strata.kernels.quant.dp4a import _dp4a_words as dp4a_words
from strata.kernels.quant.dp4a import _quantize_row as dp4a_quantize_row
from strata.kernels.quant.iq3_s import _dequant_tile as iq3s_dequant_tile
from strata.kernels.quant.iq3_s_dp4a import weight_words as iq3s_weight_words
from strata.kernels.quant.iq3_s_planes import grid_table_words
from strata.kernels.quant.iq4_xs import _dequant_tile as iq4xs_dequant_tile
from strata.kernels.quant.iq4_xs import _low_columns as iq4xs_low_columns
from strata.kernels.quant.iq4_xs import load_kvalues as iq4xs_load_kvalues
from strata.kernels.quant.moe_q import _FORMAT_IDS, _MIN_BLOCK_K, _kernel_planes
from strata.kernels.quant.q3_k import _dequant_tile as q3k_dequant_tile
from strata.kernels.quant.q4_0 import _dequant_tile as q40_dequant_tile
from strata.kernels.quant.q4_0 import _low_columns as q40_low_columns
from strata.kernels.quant.q4_k import _dequant_tile as q4k_dequant_tile
from strata.kernels.quant.q4_k import _low_columns as q4k_low_columns
from strata.kernels.quant.q5_k import _dequant_tile as q5k_dequant_tile
from strata.kernels.quant.q6_k import _dequant_tile as q6k_dequant_tile
from strata.kernels.quant.q6_k import _low_columns as q6k_low_columns
from strata.kernels.quant.q8_0 import _dequant_tile as q8_dequant_tile
from strata.kernels.triton_import import jit, tl, triton

log = logging.getLogger("strata")
MAX_TOKENS = k_moe.MAX_TOKENS
SUPPORTED_DTYPES = k_moe.SUPPORTED_DTYPES
# The kernels' FORMAT constexpr: moe_q's ids of the formats these kernels have tiles for, then e4m3.
FORMAT_IDS = {**{f: _FORMAT_IDS[f] for f in ("Q8_0", "Q4_K", "IQ3_S", "Q6_K", "Q5_K", "Q4_0", "IQ4_XS", "Q3_K")},
              "FP8": 4}
MIN_BLOCK_K = {**_MIN_BLOCK_K, "FP8": 16}
FORMATS = tuple(FORMAT_IDS)


@dataclass
class Fp8Experts:
    """`--quantize fp8` experts as the kernels read them: e4m3 [E, N, K] and an fp32 scale per row [E, N]
    (`fp8.quantize_experts`), with the members of `QExpertStack` the kernels and the reference use."""

    w: torch.Tensor
    scale: torch.Tensor
    ggml_type: str = "FP8"

    @property
    def num_experts(self) -> int:
        return self.w.shape[0]

    @property
    def n(self) -> int:
        return self.w.shape[1]

    @property
    def k(self) -> int:
        return self.w.shape[2]

    @property
    def device(self) -> torch.device:
        return self.w.device

    def dequantize_expert(self, e: int, device: torch.device | None = None) -> torch.Tensor:
        return self.w[e].to(device).float() * self.scale[e].to(device).float()[:, None]


def _planes(stack, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The kernels' five plane pointers and grid table (unused slots repeat a plane); the tables on
    `device`, where the kernels run."""
    if stack.ggml_type == "FP8":
        w = stack.w.view(stack.num_experts * stack.n, stack.k)
        scale = stack.scale.reshape(-1)
        return w, scale, w, w, w, scale
    planes = _kernel_planes(stack, device)
    if stack.ggml_type == "Q8_0":  # the qs plane again as int32 words, for the dp4a tiles
        return planes[0], planes[1], planes[0].view(torch.int32), *planes[3:]
    return planes


@dataclass(frozen=True)
class QMoeDecodeConfig:
    gate_up_block_i: int  # gate (and up) rows per kernel-1 program
    gate_up_block_k: int  # H per kernel-1 step
    gate_up_warps: int
    gate_up_stages: int
    down_block_h: int  # output rows per kernel-2 program
    down_block_k: int  # I per kernel-2 step
    down_warps: int
    down_stages: int
    dp4a: bool = False  # Q8_0, IQ3_S: x quantized per 32 values and packed int8 dots (`dp4a`), as the dense GEMVs


def _block_k(ggml_type: str, k: int, preferred: int) -> int:
    """The largest power of two ≤ preferred (and ≥ the format's least) dividing K."""
    block = max(preferred, MIN_BLOCK_K[ggml_type])
    while block > MIN_BLOCK_K[ggml_type] and k % block:
        block //= 2
    return block


# Per format (gate_up rows, K step; down rows, K step; warps of each; dp4a), the fastest correct row of
# `benchmarks/kernels/quant_moe.py --decode` on the H200 at the 30B-A3B shape (bench/results/qmoe_decode_bench_cuda.txt),
# µs for both launches at T = 1 / 8 against the grouped path's: Q8_0 dp4a 36.1 / 132.4 (81.0 / 259.7),
# Q4_K 38.9 / 170.8 (65.7 / 178.0), IQ3_S 40.6 / 181.0 (76.9 / 288.5), Q6_K 51.0 / 166.6 (78.9 / 235.7),
# FP8 26.0 / 89.9 (78.0 / 170.9).
_CONFIGS = {"Q8_0": (16, 256, 8, 256, 4, 4, True), "Q4_K": (16, 256, 8, 256, 4, 4, False),
            "IQ3_S": (8, 256, 4, 256, 4, 2, False), "Q6_K": (32, 128, 16, 128, 4, 4, False),
            "FP8": (16, 256, 8, 256, 4, 4, False),
            # Untimed: Q4_K's rows (Q5_K's tile is Q4_K's with the high bits, Q4_0's a lighter one), Q5_K's
            # gate_up at 128 values a step, where 256 spilled in the sm_90a compile.
            "Q5_K": (16, 128, 8, 256, 4, 4, False), "Q4_0": (16, 256, 8, 256, 4, 4, False),
            # Untimed: IQ4_XS takes Q4_K's row (its tile is built like Q4_K's), Q3_K Q6_K's (like Q6_K's).
            "IQ4_XS": (16, 256, 8, 256, 4, 4, False), "Q3_K": (32, 128, 16, 128, 4, 4, False)}
# Past these many tokens the grouped path is faster (Q4_K at T = 16: 318 µs fused against 245 grouped):
# the fused kernels stream each pair's weights, so tokens sharing an expert each read it.
MAX_TOKENS_BY_FORMAT = {"Q4_K": 8, "Q5_K": 8, "IQ4_XS": 8}  # Q5_K, IQ4_XS: Q4_K's, untimed


def decode_config(ggml_type: str, hidden: int, inter: int) -> QMoeDecodeConfig:
    """A function of (format, H, I) only, so a token's result does not depend on T (`_CONFIGS`, K steps
    shortened to divide H and I)."""
    rows_i, k_i, rows_h, k_h, warps_i, warps_h, dp4a = _CONFIGS[ggml_type]
    return QMoeDecodeConfig(gate_up_block_i=rows_i, gate_up_block_k=_block_k(ggml_type, hidden, k_i),
                            gate_up_warps=warps_i, gate_up_stages=3, down_block_h=rows_h,
                            down_block_k=_block_k(ggml_type, inter, k_h), down_warps=warps_h, down_stages=3,
                            dp4a=dp4a and hidden % 64 == 0 and inter % 64 == 0)


# K steps of two super-blocks for reads from pinned host memory over PCIe (`--host-expert-decode pcie`):
# a one-block step reads 64-byte runs of each row's qs plane, short requests for PCIe; two blocks
# double every run. Longer steps spill in gate_up on sm_90. A candidate only: the start-up probe times
# it against `decode_config`'s and checks its sum (`strata.runner.host_offload`).
PCIE_BLOCK_K = {"IQ3_S": 512}


def pcie_configs(ggml_type: str, hidden: int, inter: int) -> list[QMoeDecodeConfig]:
    """`decode_config`'s configuration, then the longer-K one for reads over PCIe where the format has
    one that fits these shapes."""
    base = decode_config(ggml_type, hidden, inter)
    block = PCIE_BLOCK_K.get(ggml_type)
    if block is None:
        return [base]
    longer = replace(base, gate_up_block_k=_block_k(ggml_type, hidden, block),
                     down_block_k=_block_k(ggml_type, inter, block))
    return [base] if longer == base else [base, longer]


def supported(num_tokens: int, top_k: int, ggml_type: str, hidden: int, inter: int, dtype) -> bool:
    least = MIN_BLOCK_K.get(ggml_type)
    return (ggml_type in FORMAT_IDS and 1 <= num_tokens <= MAX_TOKENS_BY_FORMAT.get(ggml_type, MAX_TOKENS)
            and 1 <= top_k <= k_moe.MAX_TOP_K
            and dtype in SUPPORTED_DTYPES and hidden % least == 0 and inter % least == 0 and inter >= 16)


def _check(x, topk_ids, topk_weights, w13, w2, out):
    t, h = x.shape if x.dim() == 2 else (None, None)
    inter = w13.n // 2
    if (x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape
            or w13.k != h or w13.n % 2 or w2.n != h or w2.k != inter or w13.num_experts != w2.num_experts):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, topk_weights "
                         f"{tuple(topk_weights.shape)}, w13 [{w13.num_experts}, {w13.n}, {w13.k}], "
                         f"w2 [{w2.num_experts}, {w2.n}, {w2.k}]")
    if out is not None and (tuple(out.shape) != (t, h) or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"out: expected [{t}, {h}] {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    return t, topk_ids.shape[1], h, inter


def moe_decode_q_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13, w2, out: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: `moe_experts_decode_ref` (its rounding points) on the exact fp32 weights of the
    experts the tokens chose (each dequantized once, on x's device, wherever the blocks lie)."""
    _check(x, topk_ids, topk_weights, w13, w2, out)
    used = torch.unique(topk_ids).tolist()
    index = torch.full((w13.num_experts,), -1, dtype=torch.long)
    index[used] = torch.arange(len(used))
    ids = index.to(topk_ids.device)[topk_ids.long()]
    f13 = torch.stack([w13.dequantize_expert(e, x.device) for e in used])
    f2 = torch.stack([w2.dequantize_expert(e, x.device) for e in used])
    return k_moe.moe_experts_decode_ref(x, ids, topk_weights, f13, f2, out)


def moe_decode_dp4a_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13, w2) -> torch.Tensor:
    """The definition with `dp4a` tiles (Q8_0, IQ3_S): as `moe_decode_q_ref`, each product's input
    quantized per 32 values (`dp4a.quantize_ref`), each group's sum of the exact weights times the int8
    codes scaled by the group's dx (the kernels sum integers and scale by d_w · dx: the same value up to
    fp32 rounding)."""
    from strata.kernels.quant.dp4a import quantize_ref

    def product(row: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xq, dx = quantize_ref(row.unsqueeze(0))
        groups = (w.view(w.shape[0], -1, 32) * xq.float().view(1, -1, 32)).sum(-1)
        return (groups * dx).sum(-1)

    t, k, h, inter = _check(x, topk_ids, topk_weights, w13, w2, None)
    dtype, out = x.dtype, torch.zeros(t, h, dtype=torch.float32, device=x.device)
    for tok in range(t):
        for j in range(k):
            e = int(topk_ids[tok, j])
            h13 = product(x[tok], w13.dequantize_expert(e).to(x.device)).to(dtype)
            act = torch.nn.functional.silu(h13[:inter]) * h13[inter:]
            y = product(act, w2.dequantize_expert(e).to(x.device)).to(dtype)
            out[tok] += (y * topk_weights[tok, j].float()).to(dtype).float()
    return out.to(dtype)


def reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13, w2,
              config: QMoeDecodeConfig | None = None) -> torch.Tensor:
    """The definition the kernels follow with `config` (default `decode_config`): with dp4a tiles x is
    quantized per 32 values (`moe_decode_dp4a_ref`), else the exact-weight `moe_decode_q_ref`."""
    cfg = config or decode_config(w13.ggml_type, w13.k, w2.k)
    return (moe_decode_dp4a_ref if cfg.dp4a else moe_decode_q_ref)(x, topk_ids, topk_weights, w13, w2)


@jit
def _fma_tile(acc, p0, p1, p2, p3, p4, table, w_rows, k0, k, x_row, FORMAT: tl.constexpr,
              ROWS: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr, DP4A: tl.constexpr):
    """acc + the weight tile (rows `w_rows` of the flat planes, values k0 .. k0 + BLOCK_K) times the
    activation row at x_row, elementwise in fp32. acc is [ROWS, BLOCK_K / 2] for Q4_K, Q6_K, Q5_K, Q4_0
    and IQ4_XS (their tiles come as two halves), [ROWS, BLOCK_K] otherwise; with DP4A (Q8_0, IQ3_S) [ROWS,
    BLOCK_K / 32], a group's exact int32 sum of products with x quantized per 32 values, scaled by
    d_w · dx (`dp4a`)."""
    if DP4A:
        GROUPS_4: tl.constexpr = BLOCK_K // 32
        g4 = tl.arange(0, GROUPS_4)
        if FORMAT == 0:  # Q8_0, p2: the qs plane as int32 words
            wq = tl.load(p2 + w_rows[:, None, None] * (k // 4) + (k0 // 4 + g4 * 8)[None, :, None]
                         + tl.arange(0, 8)[None, None, :])
            dw = tl.load(p1 + w_rows[:, None] * (k // 32) + k0 // 32 + g4[None, :]).to(tl.float32)
        else:  # IQ3_S: the signed weights and sub-block scales as its dp4a GEMV builds them
            wq, dw = iq3s_weight_words(p0, p2, p1, p3, p4, table, w_rows, k0 // 32 + g4, k)
        xw, dx = dp4a_quantize_row(tl.load(x_row + k0 + g4[:, None] * 32 + tl.arange(0, 32)[None, :]).to(tl.float32))
        isum = dp4a_words(wq, tl.broadcast_to(xw[None, :, :], wq.shape), INTERPRETED, False)
        acc += isum.to(tl.float32) * dw * dx[None, :]
    elif FORMAT == 1:  # Q4_K: low and high nibbles' halves, the high values 32 past the low ones
        w_lo, w_hi = q4k_dequant_tile(p0, p1, p2, w_rows, k0, k, ROWS, BLOCK_K, tl.float32)
        low = k0 + q4k_low_columns(BLOCK_K)
        acc += w_lo * tl.load(x_row + low).to(tl.float32)[None, :]
        acc += w_hi * tl.load(x_row + low + 32).to(tl.float32)[None, :]
    elif FORMAT == 3:  # Q6_K: as Q4_K, 64 apart
        w_lo, w_hi = q6k_dequant_tile(p0, p1, p2, p3, w_rows, k0, k, ROWS, BLOCK_K, tl.float32, INTERPRETED)
        low = k0 + q6k_low_columns(BLOCK_K)
        acc += w_lo * tl.load(x_row + low).to(tl.float32)[None, :]
        acc += w_hi * tl.load(x_row + low + 64).to(tl.float32)[None, :]
    elif FORMAT == 7:  # Q5_K: Q4_K's halves and columns, the high bits in p3
        w_lo, w_hi = q5k_dequant_tile(p0, p1, p2, p3, w_rows, k0, k, ROWS, BLOCK_K, tl.float32)
        low = k0 + q4k_low_columns(BLOCK_K)
        acc += w_lo * tl.load(x_row + low).to(tl.float32)[None, :]
        acc += w_hi * tl.load(x_row + low + 32).to(tl.float32)[None, :]
    elif FORMAT == 8:  # Q4_0: as Q4_K, 16 apart
        w_lo, w_hi = q40_dequant_tile(p0, p1, w_rows, k0, k, ROWS, BLOCK_K, tl.float32, False)
        low = k0 + q40_low_columns(BLOCK_K)
        acc += w_lo * tl.load(x_row + low).to(tl.float32)[None, :]
        acc += w_hi * tl.load(x_row + low + 16).to(tl.float32)[None, :]
    elif FORMAT == 5:  # IQ4_XS: as Q4_K, 16 apart; `table` holds its kvalues
        w_lo, w_hi = iq4xs_dequant_tile(p0, p1, p2, table, w_rows, k0, k, ROWS, BLOCK_K, tl.float32)
        low = k0 + iq4xs_low_columns(BLOCK_K)
        acc += w_lo * tl.load(x_row + low).to(tl.float32)[None, :]
        acc += w_hi * tl.load(x_row + low + 16).to(tl.float32)[None, :]
    else:
        if FORMAT == 0:  # Q8_0: p0 qs int8 [rows, K], p1 d fp16 [rows, K/32]
            GROUPS: tl.constexpr = BLOCK_K // 32
            g = tl.arange(0, GROUPS)
            q_ptrs = p0 + w_rows[:, None, None] * k + k0 + g[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
            d_ptrs = p1 + w_rows[:, None] * (k // 32) + k0 // 32 + g[None, :]
            w = q8_dequant_tile(q_ptrs, d_ptrs, ROWS, BLOCK_K, tl.float32)
        elif FORMAT == 2:  # IQ3_S: qs, signs, qh, scales, d and the grid
            w = iq3s_dequant_tile(p0, p1, p2, p3, p4, table, w_rows, k0, k, ROWS, BLOCK_K, INTERPRETED)
        elif FORMAT == 6:  # Q3_K: qs, hmask and scales as int32 words, d; one K-ordered tile
            w = q3k_dequant_tile(p0, p1, p2, p3, w_rows, k0, k, ROWS, BLOCK_K, tl.float32, INTERPRETED)
        else:  # FP8: p0 e4m3 [rows, K] (its row scale, p1, multiplies the row's sum: `_row_sum`)
            w = tl.load(p0 + w_rows[:, None] * k + k0 + tl.arange(0, BLOCK_K)[None, :]).to(tl.float32)
        acc += w * tl.load(x_row + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)[None, :]
    return acc


@jit
def _format_table(grid_ptr, FORMAT: tl.constexpr, SHARED_GRID: tl.constexpr):
    """The table a format gathers from, loaded once a program: IQ4_XS's kvalues (in the grid's slot),
    IQ3_S's grid (SHARED_GRID), else 0."""
    if FORMAT == 5:
        return iq4xs_load_kvalues(grid_ptr, True)
    else:
        return grid_table_words(grid_ptr, SHARED_GRID)


@jit
def _row_sum(acc, scale_ptr, w_rows, dtype: tl.constexpr, FORMAT: tl.constexpr):
    """A row's sum of products rounded to `dtype` (FP8: times the row's scale first), back in fp32."""
    total = tl.sum(acc, axis=1)
    if FORMAT == 4:
        total = total * tl.load(scale_ptr + w_rows)
    return total.to(dtype).to(tl.float32)


@jit
def _gate_up_kernel(x_ptr, x_stride, ids_ptr, ids_stride_t, ids_stride_j, p0, p1, p2, p3, p4, grid_ptr, act_ptr,
                    hidden, inter, top_k, FORMAT: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                    ACC_K: tl.constexpr, NUM_STAGES: tl.constexpr, INTERPRETED: tl.constexpr,
                    SHARED_GRID: tl.constexpr, DP4A: tl.constexpr, USE_LIBDEVICE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    table = _format_table(grid_ptr, FORMAT, SHARED_GRID)  # IQ3_S's grid or IQ4_XS's kvalues, gathered through smem
    pair = tl.program_id(0)
    token = pair // top_k
    slot = pair % top_k
    expert = tl.load(ids_ptr + token * ids_stride_t + slot * ids_stride_j).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    row_ok = rows < inter
    gate_rows = expert * (2 * inter) + tl.minimum(rows, inter - 1)  # rows past I re-read the last, never stored
    up_rows = gate_rows + inter
    x_row = x_ptr + token * x_stride
    acc_gate = tl.zeros((BLOCK_I, ACC_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_I, ACC_K), dtype=tl.float32)
    for k0 in tl.range(0, hidden, BLOCK_K, num_stages=NUM_STAGES):
        acc_gate = _fma_tile(acc_gate, p0, p1, p2, p3, p4, table, gate_rows, k0, hidden, x_row, FORMAT,
                             BLOCK_I, BLOCK_K, INTERPRETED, DP4A)
        acc_up = _fma_tile(acc_up, p0, p1, p2, p3, p4, table, up_rows, k0, hidden, x_row, FORMAT,
                           BLOCK_I, BLOCK_K, INTERPRETED, DP4A)
    dtype = act_ptr.dtype.element_ty
    gate = _row_sum(acc_gate, p1, gate_rows, dtype, FORMAT)
    up = _row_sum(acc_up, p1, up_rows, dtype, FORMAT)
    tl.store(act_ptr + pair.to(tl.int64) * inter + rows, k_moe.swiglu_rounded(gate, up, dtype, USE_LIBDEVICE),
             mask=row_ok)


@jit
def _down_kernel(act_ptr, ids_ptr, ids_stride_t, ids_stride_j, wts_ptr, wts_stride_t, wts_stride_j, p0, p1, p2, p3,
                 p4, grid_ptr, out_ptr, out_stride, hidden, inter, top_k, FORMAT: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, ACC_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                 INTERPRETED: tl.constexpr, SHARED_GRID: tl.constexpr, DP4A: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    table = _format_table(grid_ptr, FORMAT, SHARED_GRID)
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < hidden
    safe_rows = tl.minimum(rows, hidden - 1)
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    # Slots in order 0..k-1: the fixed summation order of the reference's `.sum(1)`.
    for slot in range(0, top_k):
        expert = tl.load(ids_ptr + token * ids_stride_t + slot * ids_stride_j).to(tl.int64)
        weight = tl.load(wts_ptr + token * wts_stride_t + slot * wts_stride_j).to(tl.float32)
        w_rows = expert * hidden + safe_rows
        a_row = act_ptr + (token * top_k + slot).to(tl.int64) * inter
        acc = tl.zeros((BLOCK_H, ACC_K), dtype=tl.float32)
        for k0 in tl.range(0, inter, BLOCK_K, num_stages=NUM_STAGES):
            acc = _fma_tile(acc, p0, p1, p2, p3, p4, table, w_rows, k0, inter, a_row, FORMAT, BLOCK_H,
                            BLOCK_K, INTERPRETED, DP4A)
        y = _row_sum(acc, p1, w_rows, dtype, FORMAT)
        total += (y * weight).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * out_stride + rows, total.to(dtype), mask=row_ok)


def _acc_k(ggml_type: str, block_k: int, dp4a: bool = False) -> int:
    halves = ("Q4_K", "Q6_K", "Q5_K", "Q4_0", "IQ4_XS")
    return block_k // 32 if dp4a else block_k // 2 if ggml_type in halves else block_k


def _measured_sound(cfg: QMoeDecodeConfig, ggml_type: str) -> bool:
    """Tiles that gave wrong sums on the H200 (Triton 3.6; right in the interpreter, cause not found): Q8_0's
    dequantized (not dp4a) tiles of 256 values, and Q4_K / Q6_K with 8-row gate_up and 4-row down blocks
    (bench/results/qmoe_decode_bench_cuda.txt, relative error ~1). Refused here; the pack-time probe
    (`moe_decode_q_works`) would have kept the grouped path for them anyway. Q5_K, Q4_0, IQ4_XS and Q3_K,
    whose tiles are built like Q4_K's or Q6_K's and were not run there, are held to their limits."""
    if ggml_type == "Q8_0" and not cfg.dp4a and max(cfg.gate_up_block_k, cfg.down_block_k) > 128:
        return False
    halves = ("Q4_K", "Q6_K", "Q5_K", "Q4_0", "IQ4_XS", "Q3_K")
    return ggml_type not in halves or (cfg.gate_up_block_i >= 16 and cfg.down_block_h >= 8)


def _check_config(cfg: QMoeDecodeConfig, ggml_type: str, hidden: int, inter: int) -> None:
    pow2 = lambda v, lo: v >= lo and v & (v - 1) == 0  # noqa: E731
    least = MIN_BLOCK_K[ggml_type]
    ok = (pow2(cfg.gate_up_block_i, 1) and pow2(cfg.down_block_h, 1) and pow2(cfg.gate_up_block_k, least)
          and pow2(cfg.down_block_k, least) and hidden % cfg.gate_up_block_k == 0 and inter % cfg.down_block_k == 0
          and (ggml_type != "IQ3_S" or max(cfg.gate_up_block_k, cfg.down_block_k) <= PCIE_BLOCK_K["IQ3_S"])
          and (not cfg.dp4a or (ggml_type in ("Q8_0", "IQ3_S") and min(cfg.gate_up_block_k, cfg.down_block_k) >= 64))
          and _measured_sound(cfg, ggml_type))
    if not ok:
        raise ValueError(f"invalid {ggml_type} {cfg} for H={hidden}, I={inter}")


def moe_decode_q_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13, w2, out: torch.Tensor | None = None, *,
                        config: QMoeDecodeConfig | None = None) -> torch.Tensor:
    """x [T ≤ 16, H] (contiguous rows), topk_ids [T, k] int32/int64, topk_weights [T, k] fp32, w13 the
    gate|up stack [E, 2I, H] and w2 the down stack [E, H, I] of one format (`QExpertStack`s or
    `Fp8Experts`) → out [T, H] in x.dtype.
    Expert ids must be in [0, E) (not checked: that would read them on the host). The intermediate
    [T·k, I] comes from torch.empty (the graph pool under capture). `config` overrides `decode_config`."""
    t, k, h, inter = _check(x, topk_ids, topk_weights, w13, w2, out)
    if w13.ggml_type != w2.ggml_type:
        raise ValueError(f"one format for both stacks, got {w13.ggml_type} and {w2.ggml_type}")
    fmt = w13.ggml_type
    if x.stride(1) != 1 or x.dtype not in SUPPORTED_DTYPES or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"x: contiguous rows of bf16/fp16 ({x.dtype}, strides {x.stride()}); topk_ids "
                         f"int32/int64 ({topk_ids.dtype})")
    out = k_moe.output_rows(x, out, t, h)
    if t == 0 or k == 0:
        return out.zero_()
    cfg = config or decode_config(fmt, h, inter)
    _check_config(cfg, fmt, h, inter)
    act = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)
    _launch(x, topk_ids, topk_weights, w13, w2, act, out, cfg, "both")
    return out


def _launch(x, topk_ids, topk_weights, w13, w2, act, out, cfg: QMoeDecodeConfig, which: str) -> None:
    """Kernel 1 into act, kernel 2 from it into out ("both"), or one of them ("gate_up", "down": the benchmark's parts)."""
    (t, k), h, inter, fmt = topk_ids.shape, x.shape[1], act.shape[1], w13.ggml_type
    common = dict(FORMAT=FORMAT_IDS[fmt], INTERPRETED=not x.is_cuda,
                  SHARED_GRID=fmt == "IQ3_S", DP4A=cfg.dp4a)
    on = use_pdl(x)
    if which != "down":
        _gate_up_kernel[(t * k, triton.cdiv(inter, cfg.gate_up_block_i))](
            x, x.stride(0), topk_ids, topk_ids.stride(0), topk_ids.stride(1), *_planes(w13, x.device), act, h, inter, k,
            BLOCK_I=cfg.gate_up_block_i, BLOCK_K=cfg.gate_up_block_k,
            ACC_K=_acc_k(fmt, cfg.gate_up_block_k, cfg.dp4a), NUM_STAGES=cfg.gate_up_stages,
            USE_LIBDEVICE=x.is_cuda, USE_PDL=on, launch_pdl=on, num_warps=cfg.gate_up_warps, **common)
    if which != "gate_up":
        _down_kernel[(t, triton.cdiv(h, cfg.down_block_h))](
            act, topk_ids, topk_ids.stride(0), topk_ids.stride(1), topk_weights, topk_weights.stride(0),
            topk_weights.stride(1), *_planes(w2, x.device), out, out.stride(0), h, inter, k,
            BLOCK_H=cfg.down_block_h, BLOCK_K=cfg.down_block_k, ACC_K=_acc_k(fmt, cfg.down_block_k, cfg.dp4a),
            NUM_STAGES=cfg.down_stages, USE_PDL=on, launch_pdl=on, num_warps=cfg.down_warps, **common)


def serves(x: torch.Tensor, top_k: int, w13, w2) -> bool:
    """Whether the kernels run this step (host metadata only: no sync)."""
    return (w13.ggml_type == w2.ggml_type and x.dim() == 2 and x.stride(1) == 1 and kernels_run(x, _gate_up_kernel)
            and supported(x.shape[0], top_k, w13.ggml_type, x.shape[1], w2.k, x.dtype))


def fused_chosen() -> bool:
    """The kernel choice `moe_decode`: whether decode-sized steps may take these kernels ('fused') or keep
    the grouped path ('grouped')."""
    return choices.current().moe_decode == "fused"


def decode_stacks(w13, w2, top_k: int, dtype: torch.dtype) -> tuple | None:
    """(w13, w2) when decode-sized steps of a MoE layer over these stacks should take the kernels: CUDA,
    the kernel choice `moe_decode` 'fused' and the pack-time probe passing; else None (the grouped path serves)."""
    if w13.device.type != "cuda" or not fused_chosen() or not moe_decode_q_works(w13, w2, top_k, dtype):
        return None
    return w13, w2


def moe_decode_q_works(w13, w2, top_k: int, dtype: torch.dtype) -> bool:
    """One call on the real stacks against the reference, at pack time (as `models.moe.moe_decode_works`):
    a kernel this device cannot build or run leaves the grouped path serving every step."""
    x = torch.randn(2, w13.k, device=w13.device, dtype=dtype)
    if not serves(x, top_k, w13, w2):
        return False
    ids = torch.stack([torch.randperm(w13.num_experts, device=w13.device)[:top_k] for _ in range(2)])
    w = torch.rand(2, top_k, device=w13.device)
    try:
        got = moe_decode_q_triton(x, ids, w, w13, w2)
    except Exception as err:  # a compiler or launch failure: fall back rather than fail every step
        log.warning("quantized MoE decode kernels unavailable (%s); using grouped GEMMs", err)
        return False
    ref = reference(x, ids, w, w13, w2)
    return bool(((got.float() - ref.float()).norm() <= 2e-2 * ref.float().norm()).item())
