"""Routed MoE experts for decode-sized batches (T ≤ 16 tokens, top-k experts each) in two launches.

out [T, H] = Σ_j round(w[t, j] · round(down_e(round(silu(round(gate_e(x_t))) · round(up_e(x_t)))))), e = ids[t, j],
with the rounding points of `MoE._grouped` (see `moe_experts_decode_ref`). It replaces the grouped
path's sort, searchsorted, gathers, two `torch._grouped_mm`, SwiGLU, scatter and sum.

Kernels. At T ≤ 16 the active expert weights are the whole cost, so both kernels stream weights and
multiply them elementwise with a broadcast activation row (no tensor cores: one row per pair).
- `_gate_up_kernel`, grid (T·k pairs, I / BLOCK_I): one pair's BLOCK_I gate rows and the matching up
  rows of its expert, over H in BLOCK_H steps; writes silu(gate)·up for the pair to act [T·k, I].
- `_down_combine_kernel`, grid (T, H / BLOCK_H): per token and row block, the k experts' w2 rows in
  slot order j = 0..k-1, each term rounded and weighted as the reference does, summed in fp32.
A pair's expert is read from `topk_ids` on the device: the grid comes from shapes only and nothing
goes to the host, so the launches can be captured in a CUDA graph.

Determinism and batch invariance: the configuration is a function of (H, I) alone and each program
serves one pair (kernel 1) or one token (kernel 2), so a token's result is bit-identical whatever the
other tokens are and from run to run; the k-sum has a fixed order and no atomics.

Not done: tokens sharing an expert each stream its weights (from L2 after the first), fine at T = 1-4;
at T = 16 grouping the pairs by expert would save traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strata.kernels import use_pdl, use_triton
from strata.kernels.pdl import pdl_prologue
from strata.kernels.triton_import import jit, libdevice, tl, triton


MAX_TOKENS = 16
MAX_TOP_K = 32
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
_REF_CHUNK_BYTES = 256 << 20  # the reference gathers expert weights in fp32 chunks of at most this


@dataclass(frozen=True)
class MoeDecodeConfig:
    gate_up_block_i: int  # gate (and up) rows per kernel-1 program
    gate_up_block_h: int  # H per kernel-1 loop step
    gate_up_warps: int
    gate_up_stages: int
    down_block_h: int  # output rows per kernel-2 program
    down_block_k: int  # I per unrolled kernel-2 chunk (I is covered by ceil(I / down_block_k) chunks)
    down_warps: int
    down_stages: int


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def moe_decode_config(hidden: int, inter: int) -> MoeDecodeConfig:
    """A function of (H, I) only, which is what makes the results independent of T.

    Qwen3-30B-A3B (H 2048, I 768), batch 1: kernel 1 runs 8 · 768 / 16 = 384 programs (~3 per SM),
    each step loading 2 × 16 × 256 bf16 (16 KB); kernel 2 runs 2048 / 8 = 256 programs, each step one
    expert's 8 × 768 block (12 KB). Chosen by reasoning, not yet timed on the device."""
    block_h = min(256, _pow2_at_least(hidden))
    block_k = min(1024, _pow2_at_least(inter))
    return MoeDecodeConfig(gate_up_block_i=16, gate_up_block_h=block_h, gate_up_warps=4, gate_up_stages=3,
                           down_block_h=8, down_block_k=block_k, down_warps=8 if block_k >= 1024 else 4,
                           down_stages=3)


def moe_decode_supported(num_tokens: int, top_k: int, hidden: int, inter: int, dtype) -> bool:
    return (1 <= num_tokens <= MAX_TOKENS and 1 <= top_k <= MAX_TOP_K and hidden >= 16 and inter >= 16
            and hidden % 16 == 0 and inter % 16 == 0 and dtype in SUPPORTED_DTYPES)


def _check(x, topk_ids, topk_weights, w13, w2, out):
    if x.dim() != 2 or topk_ids.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [T, H], topk_ids [T, k], w13 [E, 2I, H], w2 [E, H, I]; got "
                         f"{tuple(x.shape)}, {tuple(topk_ids.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    t, h = x.shape
    e, two_i, h13 = w13.shape
    inter = two_i // 2
    if (h13 != h or two_i % 2 or w2.shape != (e, h, inter) or topk_ids.shape[0] != t
            or topk_weights.shape != topk_ids.shape or w13.dtype != w2.dtype or w13.dtype not in (x.dtype, torch.float32)):
        raise ValueError(f"shapes/dtypes do not fit: x {tuple(x.shape)} {x.dtype}, topk_ids {tuple(topk_ids.shape)}, "
                         f"topk_weights {tuple(topk_weights.shape)}, w13 {tuple(w13.shape)} {w13.dtype}, "
                         f"w2 {tuple(w2.shape)} {w2.dtype}")
    if out is not None and (out.shape != (t, h) or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"out: expected [{t}, {h}] {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    return t, topk_ids.shape[1], h, inter


def moe_experts_decode_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                           w2: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The definition, with the rounding points of `MoE._grouped`, which the kernels reproduce (weights in
    x's dtype, or fp32: the exact values of quantized experts, `quant.moe_decode_q`):
    1. h13 = x_t @ w13[e]ᵀ accumulated in fp32, rounded to x.dtype (gate and up each);
    2. a = F.silu(gate) * up in x.dtype (silu in fp32 rounded, product in fp32 rounded);
    3. y = a @ w2[e]ᵀ accumulated in fp32, rounded to x.dtype;
    4. term = (y * w[t, j]) with fp32 w, computed in fp32 and rounded once to x.dtype;
    5. out[t] = Σ_j term over j = 0..k-1, accumulated in fp32, rounded once (torch's 16-bit `.sum`).
    Only the fp32 summation order inside steps 1, 3 and 5 differs between this and the kernels."""
    t, k, h, inter = _check(x, topk_ids, topk_weights, w13, w2, out)
    dtype = x.dtype
    flat_ids = topk_ids.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)  # pair p = t * k + j
    chunk = max(1, _REF_CHUNK_BYTES // (3 * inter * h * 4))
    ys = []
    for start in range(0, t * k, chunk):
        ids = flat_ids[start:start + chunk]
        g13 = w13.index_select(0, ids).float()
        h13 = torch.bmm(g13, xs[start:start + chunk].float().unsqueeze(-1)).squeeze(-1).to(dtype)
        a = F.silu(h13[:, :inter]) * h13[:, inter:]
        g2 = w2.index_select(0, ids).float()
        ys.append(torch.bmm(g2, a.float().unsqueeze(-1)).squeeze(-1).to(dtype))
    y = torch.cat(ys) if ys else x.new_empty(0, h)
    terms = (y * topk_weights.reshape(-1, 1).float()).to(dtype)
    result = terms.view(t, k, h).sum(1)
    if out is None:
        return result
    return out.copy_(result)


@jit
def _gate_up_kernel(x_ptr, x_stride, ids_ptr, ids_stride_t, ids_stride_j, w13_ptr, act_ptr, hidden, inter, top_k,
                    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, EVEN: tl.constexpr, NUM_STAGES: tl.constexpr,
                    USE_LIBDEVICE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    pair = tl.program_id(0)
    token = pair // top_k
    slot = pair % top_k
    expert = tl.load(ids_ptr + token * ids_stride_t + slot * ids_stride_j).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < inter
    gate_ptrs = w13_ptr + expert * (2 * inter) * hidden + rows[:, None] * hidden + cols[None, :]
    up_ptrs = gate_ptrs + inter * hidden
    x_ptrs = x_ptr + token * x_stride + cols
    # Partial products stay per lane and are reduced once after the loop: no shuffles in the stream.
    acc_gate = tl.zeros((BLOCK_I, BLOCK_H), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_I, BLOCK_H), dtype=tl.float32)
    for h0 in tl.range(0, hidden, BLOCK_H, num_stages=NUM_STAGES):
        if EVEN:
            xv = tl.load(x_ptrs + h0).to(tl.float32)
            g = tl.load(gate_ptrs + h0)
            u = tl.load(up_ptrs + h0)
        else:
            col_ok = h0 + cols < hidden
            mask = row_ok[:, None] & col_ok[None, :]
            xv = tl.load(x_ptrs + h0, mask=col_ok, other=0.0).to(tl.float32)
            g = tl.load(gate_ptrs + h0, mask=mask, other=0.0)
            u = tl.load(up_ptrs + h0, mask=mask, other=0.0)
        acc_gate += g.to(tl.float32) * xv[None, :]
        acc_up += u.to(tl.float32) * xv[None, :]
    dtype = act_ptr.dtype.element_ty
    gate = tl.sum(acc_gate, axis=1).to(dtype).to(tl.float32)
    up = tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)
    tl.store(act_ptr + pair.to(tl.int64) * inter + rows, swiglu_rounded(gate, up, dtype, USE_LIBDEVICE), mask=row_ok)


@jit
def swiglu_rounded(gate, up, dtype: tl.constexpr, USE_LIBDEVICE: tl.constexpr):
    """silu(gate) · up in `dtype` from gate and up already rounded to it (held in fp32), with torch's
    SwiGLU rounding as strata.kernels.activation: silu rounded, then the product rounded."""
    if USE_LIBDEVICE:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    silu = tl.div_rn(gate, 1.0 + e).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@jit
def _down_combine_kernel(act_ptr, ids_ptr, ids_stride_t, ids_stride_j, wts_ptr, wts_stride_t, wts_stride_j, w2_ptr,
                         out_ptr, out_stride, hidden, inter, top_k,
                         BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr, EVEN: tl.constexpr,
                         NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < hidden
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    # Slots in order 0..k-1: the fixed summation order of the reference's `.sum(1)`.
    for slot in tl.range(0, top_k, num_stages=NUM_STAGES):
        expert = tl.load(ids_ptr + token * ids_stride_t + slot * ids_stride_j).to(tl.int64)
        weight = tl.load(wts_ptr + token * wts_stride_t + slot * wts_stride_j).to(tl.float32)
        w_ptrs = w2_ptr + expert * hidden * inter + rows[:, None] * inter + cols[None, :]
        a_ptrs = act_ptr + (token * top_k + slot).to(tl.int64) * inter + cols
        acc = tl.zeros((BLOCK_H, BLOCK_K), dtype=tl.float32)
        for c in tl.static_range(K_CHUNKS):
            if EVEN:
                w = tl.load(w_ptrs + c * BLOCK_K)
                a = tl.load(a_ptrs + c * BLOCK_K)
            else:
                col_ok = c * BLOCK_K + cols < inter
                w = tl.load(w_ptrs + c * BLOCK_K, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
                a = tl.load(a_ptrs + c * BLOCK_K, mask=col_ok, other=0.0)
            acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1).to(dtype).to(tl.float32)
        total += (y * weight).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * out_stride + rows, total.to(dtype), mask=row_ok)


def output_rows(x: torch.Tensor, out: torch.Tensor | None, t: int, h: int) -> torch.Tensor:
    """`out` (checked for contiguous rows), or a new [T, H] in x's dtype."""
    if out is None:
        return torch.empty((t, h), dtype=x.dtype, device=x.device)
    if out.stride(1) != 1:
        raise ValueError(f"out: expected contiguous rows, got strides {out.stride()}")
    return out


def moe_experts_decode_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                              w2: torch.Tensor, out: torch.Tensor | None = None, *,
                              config: MoeDecodeConfig | None = None) -> torch.Tensor:
    """x [T, H] with contiguous rows, topk_ids [T, k] int32/int64, topk_weights [T, k] (fp32), w13
    [E, 2I, H] and w2 [E, H, I] contiguous → out [T, H] in x.dtype. Expert ids must be in [0, E): they
    are not checked (that would read them on the host). The intermediate [T·k, I] comes from
    torch.empty (the graph pool under capture). `config` overrides `moe_decode_config(H, I)`."""
    t, k, h, inter = _check(x, topk_ids, topk_weights, w13, w2, out)
    if x.stride(1) != 1 or not w13.is_contiguous() or not w2.is_contiguous():
        raise ValueError("x needs contiguous rows and w13, w2 must be contiguous")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids: expected int32 or int64, got {topk_ids.dtype}")
    out = output_rows(x, out, t, h)
    if t == 0 or k == 0:
        return out.zero_()
    cfg = config or moe_decode_config(h, inter)
    act = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)
    _launch_gate_up(x, topk_ids, w13, act, cfg)
    _launch_down_combine(act, topk_ids, topk_weights, w2, out, cfg)
    return out


def _launch_gate_up(x, topk_ids, w13, act, cfg: MoeDecodeConfig) -> None:
    (t, k), h, inter = topk_ids.shape, x.shape[1], act.shape[1]
    even = h % cfg.gate_up_block_h == 0 and inter % cfg.gate_up_block_i == 0
    on = use_pdl(x)
    _gate_up_kernel[(t * k, triton.cdiv(inter, cfg.gate_up_block_i))](
        x, x.stride(0), topk_ids, topk_ids.stride(0), topk_ids.stride(1), w13, act, h, inter, k,
        BLOCK_I=cfg.gate_up_block_i, BLOCK_H=cfg.gate_up_block_h, EVEN=even, NUM_STAGES=cfg.gate_up_stages,
        USE_LIBDEVICE=x.is_cuda, USE_PDL=on, launch_pdl=on, num_warps=cfg.gate_up_warps)


def _launch_down_combine(act, topk_ids, topk_weights, w2, out, cfg: MoeDecodeConfig) -> None:
    (t, k), h, inter = topk_ids.shape, out.shape[1], act.shape[1]
    even = inter % cfg.down_block_k == 0 and h % cfg.down_block_h == 0
    on = use_pdl(act)
    _down_combine_kernel[(t, triton.cdiv(h, cfg.down_block_h))](
        act, topk_ids, topk_ids.stride(0), topk_ids.stride(1), topk_weights, topk_weights.stride(0),
        topk_weights.stride(1), w2, out, out.stride(0), h, inter, k,
        BLOCK_H=cfg.down_block_h, BLOCK_K=cfg.down_block_k, K_CHUNKS=triton.cdiv(inter, cfg.down_block_k),
        EVEN=even, NUM_STAGES=cfg.down_stages, USE_PDL=on, launch_pdl=on,
        num_warps=cfg.down_warps)


def moe_experts_decode(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels for CUDA inputs they serve, the reference elsewhere."""
    if (use_triton(x) and x.dim() == 2 and topk_ids.dim() == 2 and w13.dim() == 3 and x.stride(1) == 1
            and w13.is_contiguous() and w2.is_contiguous() and topk_ids.dtype in (torch.int32, torch.int64)
            and moe_decode_supported(x.shape[0], topk_ids.shape[1], x.shape[1], w13.shape[1] // 2, x.dtype)
            and (out is None or out.stride(1) == 1)):
        return moe_experts_decode_triton(x, topk_ids, topk_weights, w13, w2, out)
    return moe_experts_decode_ref(x, topk_ids, topk_weights, w13, w2, out)
