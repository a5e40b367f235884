"""Batch-invariant MoE experts for `--batch-invariant` on CUDA: a token's output row is bitwise
the same whatever other tokens share the step (how many, in what order, a decode step or a long read).

Ops (each `op` dispatches to `op_triton` on CUDA and under TRITON_INTERPRET=1, to `op_ref` elsewhere):
- `grouped_matmul_invariant(xs [T, K], w [E, N, K], offs [E] int32) → [T, N]`: xs's rows sorted by
  expert, offs the groups' cumulative ends (`moe_sort.sort_tokens`); row r times its expert's weightᵀ,
  in fp32, rounded once to xs's dtype (the reference: per expert F.linear in fp32, rounded once). Rows
  at or past offs[E-1] are left unwritten (zeros in the reference); MoE layers have none.
- `moe_combine_invariant(y [T·k, N], order [T·k], weights [T, k] fp32) → [T, N]`: y's rows in sorted
  order (row p is pair order[p] = token·k + slot); per token, each slot's row times its routing weight
  rounded to y's dtype (`MoE._grouped`'s rounding point), then the k terms added in fp32 in slot order
  0, 1, ..., k-1 and rounded once. Not torch's `.sum(1)`, whose reduction may be blocked by tensor size.
- `router_logits(x [T, H], weight [E, H] fp32) → [T, E] fp32`: `matmul.matmul_invariant` on x.float()
  (never cuBLAS, whose algorithm follows T); the scoring and top-k after it (`moe_routing.route`) run
  one program per row.

Why a row of the grouped GEMM cannot depend on the batch (the construction of `matmul.py`):
- A program owns one (row tile, column tile) of one expert: row tiles are cut per expert group, so a
  tile never mixes experts; rows past the group's end load as zeros and are never stored. Rows of an
  MMA tile are independent, so a row's neighbours, its place in the tile and how full the tile is
  cannot change it.
- Each row is summed over K in one fixed order: BLOCK_K = 64 (matmul's) and `matmul._k_range_sum`, the
  fp32 accumulator chained through `acc = tl.dot(a, b, acc)` from block 0 to the last (a K tail masked
  to zeros the same way for every T). Split ranges (`split_k`) would be walked in the program and added
  in range order as in `_matmul_kernel`; the configurations use none: a grouped launch gets its
  parallelism from the experts (8 active experts x column tiles at decode), so ranges would only add
  pipeline restarts.
- One configuration for every T (`grouped_invariant_config` depends on the dtype only), so T never
  changes the binary: T reaches the kernel only through `tiles_m`, which Triton does not specialise on.
  The tiles could follow T (as `matmul.invariant_config` does) under the same assumption matmul.py
  states for wgmma instruction sizes; until the device confirms it there, one tile serves all.
- fp32 inputs use the "ieee" dot (an FMA chain in K order per element).

The grid is an upper bound from shapes, as in `quant.moe_q`: at most min(E, T) groups are non-empty, so
their row tiles number at most cdiv(T + min(E, T)·(BLOCK_M - 1), BLOCK_M); each program finds its
expert and rows from offs on the device (`moe_q._expert_of_tile`) and programs past the work exit. No
host read of offs and no allocation but `out` (the combine allocates `out` and the inverse permutation),
so the launches can be captured in CUDA graphs. PDL: `pdl_prologue` first, launched with `launch_pdl`.

Cost (reasoned, not timed: `python benchmarks/kernels/moe_invariant.py` times it against torch._grouped_mm).
One 64 x 128 tile for every T: at decode each active expert's rows fill one 64-row tile (weight-bound,
as the fused decode kernel); in long reads 64-row tiles without TMA or warp specialisation reach perhaps
50-70% of torch._grouped_mm's CUTLASS grouped GEMM (128 x 256 tiles). The router's fp32 logits run
FMA tiles of 64 x 64 (`matmul.FP32_CONFIG`): slower than the fused router kernel at decode.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from strata.kernels import kernels_run, use_pdl
from strata.kernels.matmul import (
    BLOCK_K,
    FP32_CONFIG,
    MatmulConfig,
    _k_range_sum,
    check_config,
    invariant_split_k,
    matmul_invariant,
)
from strata.kernels.moe_routing import WORKSPACE_NUMEL as ROUTE_WORKSPACE_NUMEL
from strata.kernels.pdl import pdl_prologue
from strata.kernels.quant.moe_q import _expert_of_tile
from strata.kernels.splitk import shared_split_k_numel, split_k_parts
from strata.kernels.tiles import grouped_tile
from strata.kernels.triton_import import jit, tl, triton


SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# 16-bit: one wgmma warp group over a 64 x 128 tile (the wgmma minimum of 64 rows keeps the decode
# waste to one tile per active expert), 4 stages of (64 + 128) x 64 x 2 bytes = 96 KB: two programs an SM.
GROUPED_CONFIG = MatmulConfig(64, 128, block_k=BLOCK_K, num_warps=4, num_stages=4)
GROUPED_FP32_CONFIG = FP32_CONFIG  # FMA tiles that fit the registers; any tile gives the same bits
COMBINE_BLOCK = 1024  # columns per combine program


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def grouped_invariant_config(dtype: torch.dtype) -> MatmulConfig:
    """The configuration of every grouped launch of this dtype, whatever T (module docstring)."""
    return GROUPED_FP32_CONFIG if dtype == torch.float32 else GROUPED_CONFIG


# ---------------------------------------------------------------------------------------------- grouped GEMM


@jit(do_not_specialize=["tiles_m"])
def _grouped_invariant_kernel(x_ptr, x_stride, w_ptr, offs_ptr, out_ptr, out_stride, tiles_m, n, k, num_experts,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
                              EVEN_K: tl.constexpr, IEEE_DOT: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    tile_m, tile_n = grouped_tile(tl.program_id(0), tiles_m * BLOCK_M, n, BLOCK_M, BLOCK_N, GROUP_M)
    expert, row0, row_end = _expert_of_tile(offs_ptr, num_experts, tile_m, BLOCK_M, BLOCK_E)
    if expert < num_experts:
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < row_end
        col_ok = cols < n
        w_expert = w_ptr + expert.to(tl.int64) * n * k
        k_blocks = tl.cdiv(k, BLOCK_K)
        acc = _k_range_sum(x_ptr, x_stride, w_expert, rows, cols, row_ok, col_ok, k, 0, k_blocks // SPLIT_K,
                           BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE_DOT)
        for s in tl.static_range(1, SPLIT_K):
            acc += _k_range_sum(x_ptr, x_stride, w_expert, rows, cols, row_ok, col_ok, k, s * k_blocks // SPLIT_K,
                                (s + 1) * k_blocks // SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE_DOT)
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _check_grouped(xs: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Validates the call; returns `out` or a new empty one."""
    if w.dim() != 3 or not w.is_contiguous() or w.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"w: expected a contiguous [E, N, K] bf16/fp16/fp32 stack, got {tuple(w.shape)} {w.dtype} "
                         f"strides {w.stride()}")
    e, n, k = w.shape
    if xs.dim() != 2 or xs.shape[1] != k or xs.stride(1) != 1 or xs.dtype != w.dtype or xs.device != w.device:
        raise ValueError(f"xs: expected [T, {k}] {w.dtype} with contiguous rows on {w.device}, got {tuple(xs.shape)} "
                         f"{xs.dtype} strides {xs.stride()} on {xs.device}")
    if offs.dtype != torch.int32 or tuple(offs.shape) != (e,) or not offs.is_contiguous() or offs.device != xs.device:
        raise ValueError(f"offs: expected contiguous int32 [{e}] on {xs.device}, got {offs.dtype} "
                         f"{tuple(offs.shape)} on {offs.device}")
    t = xs.shape[0]
    if out is None:
        return torch.empty((t, n), dtype=xs.dtype, device=xs.device)
    if tuple(out.shape) != (t, n) or out.dtype != xs.dtype or out.stride(1) != 1 or out.device != xs.device:
        raise ValueError(f"out: expected [{t}, {n}] {xs.dtype} with contiguous rows, got {tuple(out.shape)} "
                         f"{out.dtype} strides {out.stride()}")
    return out


def grouped_matmul_invariant_triton(xs: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                                    out: torch.Tensor | None = None, *,
                                    config: MatmulConfig | None = None) -> torch.Tensor:
    """The kernel (one launch). `config` overrides `grouped_invariant_config` (tests, benchmarks): a row's
    bits are then only as invariant as the configurations compared, `split_k` included."""
    out = _check_grouped(xs, w, offs, out)
    cfg = config or grouped_invariant_config(xs.dtype)
    check_config(cfg, xs.dtype)
    (t, k), (e, n, _) = xs.shape, w.shape
    if t == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    tiles_m = _cdiv(t + min(e, t) * (cfg.block_m - 1), cfg.block_m)
    on = use_pdl(xs)
    _grouped_invariant_kernel[(tiles_m * _cdiv(n, cfg.block_n),)](
        xs, xs.stride(0), w, offs, out, out.stride(0), tiles_m, n, k, e,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=max(16, triton.next_power_of_2(e)),
        GROUP_M=cfg.group_m, SPLIT_K=cfg.split_k, EVEN_K=k % cfg.block_k == 0, IEEE_DOT=xs.dtype == torch.float32,
        USE_PDL=on, launch_pdl=on, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def grouped_matmul_invariant_ref(xs: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Per expert: its rows of xs times its weightᵀ in fp32, rounded once to xs's dtype (reads offs on the host)."""
    y = xs.new_zeros(xs.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            y[start:end] = F.linear(xs[start:end].float(), w[e].float()).to(xs.dtype)
        start = end
    return y if out is None else out.copy_(y)


def grouped_matmul_invariant(xs: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """xs [T, K] sorted by expert, w [E, N, K] contiguous in xs's dtype, offs int32 [E] the groups' ends →
    [T, N] in xs's dtype (into `out` when given). Row r's bits depend only on row r and its expert's weight."""
    if kernels_run(xs, _grouped_invariant_kernel):
        return grouped_matmul_invariant_triton(xs, w, offs, out)
    return grouped_matmul_invariant_ref(xs, w, offs, _check_grouped(xs, w, offs, out))


# ---------------------------------------------------------------------------------------------- combine


@jit
def _combine_kernel(y_ptr, y_stride, pos_ptr, weights_ptr, out_ptr, out_stride, n, TOP_K: tl.constexpr,
                    BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    dtype = out_ptr.dtype.element_ty
    # Each slot's row, weighted and rounded to the dtype, then added into fp32 in slot order.
    pos = tl.load(pos_ptr + token * TOP_K)
    y = tl.load(y_ptr + pos * y_stride + cols, mask=ok, other=0.0).to(tl.float32)
    acc = (y * tl.load(weights_ptr + token * TOP_K)).to(dtype).to(tl.float32)
    for j in tl.static_range(1, TOP_K):
        pos = tl.load(pos_ptr + token * TOP_K + j)
        y = tl.load(y_ptr + pos * y_stride + cols, mask=ok, other=0.0).to(tl.float32)
        acc = acc + (y * tl.load(weights_ptr + token * TOP_K + j)).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * out_stride + cols, acc.to(dtype), mask=ok)


def _check_combine(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> tuple[int, int, int]:
    if weights.dim() != 2 or y.dim() != 2 or y.shape[0] != weights.numel() or tuple(order.shape) != (y.shape[0],):
        raise ValueError(f"expected y [T·k, N], order [T·k] and weights [T, k], got {tuple(y.shape)}, "
                         f"{tuple(order.shape)}, {tuple(weights.shape)}")
    if y.stride(1) != 1 or y.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"y: expected bf16/fp16/fp32 with contiguous rows, got {y.dtype} strides {y.stride()}")
    return weights.shape[0], weights.shape[1], y.shape[1]


def moe_combine_invariant_ref(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    t, k, n = _check_combine(y, order, weights)
    scaled = (y * weights.reshape(-1)[order, None]).to(y.dtype)
    unsorted = torch.empty_like(scaled)
    unsorted[order] = scaled
    per_slot = unsorted.view(t, k, n)
    acc = per_slot[:, 0].float()
    for j in range(1, k):
        acc = acc + per_slot[:, j].float()
    return acc.to(y.dtype)


def moe_combine_invariant_triton(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One launch, a program per (token, column block), after the inverse permutation (two small torch ops)."""
    t, k, n = _check_combine(y, order, weights)
    out = torch.empty((t, n), dtype=y.dtype, device=y.device)
    if t == 0 or n == 0:
        return out
    # pos[pair] = the pair's row in y; order is a permutation, so the scatter writes each slot once.
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    weights = weights.float().contiguous()
    block = min(triton.next_power_of_2(n), COMBINE_BLOCK)
    on = use_pdl(y)
    _combine_kernel[(t, _cdiv(n, block))](y, y.stride(0), pos, weights, out, out.stride(0), n, TOP_K=k, BLOCK=block,
                                          USE_PDL=on, launch_pdl=on, num_warps=max(1, min(4, block // 256)))
    return out


def moe_combine_invariant(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T·k, N] in sorted order, order [T·k] (`sort_tokens`), weights [T, k] → [T, N] in y's dtype:
    per token Σ_j round(y[its pair j] · weights[t, j]) in fp32, slot order, rounded once."""
    if kernels_run(y, _combine_kernel):
        return moe_combine_invariant_triton(y, order, weights)
    return moe_combine_invariant_ref(y, order, weights)


# ---------------------------------------------------------------------------------------------- router


def router_logits_workspace_parts(num_experts: int, hidden: int) -> tuple[int, int]:
    """(counter slots, partial elements) of the split ranges `router_logits` runs as programs of their own
    at decode sizes on CUDA (matmul_invariant's fp32 tiles, FP32_CONFIG, and the weight's ranges)."""
    return split_k_parts(num_experts, FP32_CONFIG.block_n, invariant_split_k(num_experts, hidden),
                         FP32_CONFIG.block_m)


def router_workspace(num_experts: int, hidden: int, device) -> torch.Tensor:
    """One zeroed int32 workspace for both router paths: the fused decode router's counters
    (`moe_routing.router_decode`) and `router_logits`' split ranges. Both leave their counters at zero
    and never run at once, so one buffer serves them (`splitk.shared_split_k_numel`)."""
    numel = shared_split_k_numel([(ROUTE_WORKSPACE_NUMEL, 0), router_logits_workspace_parts(num_experts, hidden)])
    return torch.zeros(numel, dtype=torch.int32, device=device)


def router_logits(x: torch.Tensor, weight: torch.Tensor, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] (any float dtype), weight [E, H] fp32 contiguous → logits [T, E] fp32, each row's bits
    independent of T (`matmul_invariant`). `workspace`: `router_workspace` on CUDA (a smaller one, or
    none, and the decode-sized launches allocate their own)."""
    parts = router_logits_workspace_parts(*weight.shape)
    if workspace is not None and (not x.is_cuda or workspace.numel() < sum(parts)):
        workspace = None  # the interpreter's tiles differ from CUDA's fp32 ones; a routing-only workspace
    return matmul_invariant(x.float(), weight, workspace=workspace)
