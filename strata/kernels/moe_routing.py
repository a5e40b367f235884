"""MoE routing: expert choice from router logits, and the whole router in one launch for decode steps.
The sort of (token, slot) pairs by expert that the grouped expert GEMMs need is `moe_sort.py`.

Semantics (the references, equal to `Router.forward` and `MoE._grouped`):
- `route_ref(logits [T, E] fp32, ...)` → (weights [T, k] fp32, ids [T, k] int64). Softmax: top-k of
  the probabilities, optionally renormalised to sum 1 (Qwen3-MoE). Sigmoid: top-k of score + correction
  bias, limited to the `topk_group` groups (of `n_group` equal groups) with the largest sum of their two
  best biased scores; the weights are the unbiased scores, optionally renormalised (+1e-20), times the
  routed scaling factor (DeepSeek-V3, GLM-4.5). Ids come in torch.topk's order, descending key.
- `router_decode_ref(x, weight [E, H] fp32, ...)` = `route_ref(F.linear(x.float(), weight))`, plus
  the logits.

Kernels.
- `_route_kernel`: one program per token; iterative arg-max (k steps over the E ≤ 512 scores in
  registers, ties to the lowest expert id), group scores the same way.
- `_router_decode_kernel`, grid (expert blocks, token blocks of 4), T ≤ 16: each program computes the
  logits of its BLOCK_E experts for its 4 tokens (fp32, x upcast in registers), writes them, and bumps
  its token block's counter; the program that arrives last routes those 4 tokens from the logits and
  resets the counter, so the router is one launch (the split-K pattern of `gemv.py`).

Numerics: exp is libdevice's accurate `expf` on CUDA (as torch's kernels), divisions are IEEE; the scores and
keys match torch's up to the order of the softmax denominator's sum and of the k-sum for renormalising
(a few ulp). Ids match torch.topk except between keys equal to the last bit, where the kernel takes
the lower expert id. Logits of the fused router sum H in a fixed order of their own (not cuBLAS's).

Determinism and batch invariance: every result belongs to one program with a fixed order; the
configurations are functions of (E, H) only and T is not specialised, so a token's logits, weights and
ids are bit-identical alone or among 15 others.

CUDA graphs: grids come from shapes; the counters live in small preallocated workspaces that the
kernels leave at zero; the other buffers come from torch.empty (the graph pool under capture). A
workspace must not be used by launches that may run concurrently (two streams).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strata.kernels import use_pdl, use_triton
from strata.kernels.pdl import pdl_prologue
from strata.kernels.triton_import import jit, libdevice, tl


MAX_EXPERTS = 512
MAX_TOP_K = 64
MAX_GROUPS = 64
DECODE_MAX_TOKENS = 16
DECODE_BLOCK_T = 4  # tokens per program of the fused router: the weight is read once per 4 tokens
DECODE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WORKSPACE_NUMEL = 32  # int32 counters: one per decode token block (4)
SCORINGS = ("softmax", "sigmoid")


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------- routing


def _grouped(scoring: str, n_group: int) -> bool:
    return scoring == "sigmoid" and n_group > 1  # the reference limits groups only when scoring by sigmoid


def route_supported(num_experts: int, top_k: int, *, scoring: str = "softmax", n_group: int = 1,
                    topk_group: int = 1) -> bool:
    """Whether `route_triton` serves these settings (the reference serves all that torch does)."""
    if scoring not in SCORINGS or not (1 <= num_experts <= MAX_EXPERTS and 1 <= top_k <= min(num_experts, MAX_TOP_K)):
        return False
    if not _grouped(scoring, n_group):
        return True
    # Groups of >= 2 (the reference's top-2 needs two), and enough kept experts for k finite picks.
    return (n_group <= MAX_GROUPS and num_experts % n_group == 0 and num_experts // n_group >= 2
            and 1 <= topk_group <= n_group and top_k <= topk_group * (num_experts // n_group))


def route_ref(logits: torch.Tensor, *, scoring: str, top_k: int, norm_topk_prob: bool, n_group: int = 1,
              topk_group: int = 1, bias: torch.Tensor | None = None,
              scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, ids [T, k] int64) from fp32 logits [T, E], exactly as `Router.forward`."""
    if scoring == "softmax":
        probs = logits.softmax(dim=-1)
        w, ids = probs.topk(top_k, dim=-1)
        if norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return w, ids
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if n_group > 1:
        n, e = choice.shape
        grouped = choice.view(n, n_group, e // n_group)
        group_score = grouped.topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(topk_group, dim=-1)[1], 1.0)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(n, e)
        choice = choice.masked_fill(keep == 0, float("-inf"))
    ids = choice.topk(top_k, dim=-1)[1]
    w = scores.gather(1, ids)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, ids


@jit
def _exp(v, USE_LIBDEVICE: tl.constexpr):
    if USE_LIBDEVICE:
        return libdevice.exp(v)
    else:
        return tl.exp(v)


@jit
def _first_max(key, avail, cols, BLOCK: tl.constexpr):
    """Per row: the largest key among the `avail` columns and the lowest column holding it. NaN ranks
    above everything, as in torch.topk, so a row of NaN logits (overflowed activations) still picks
    valid experts instead of an id past the end.

    One reduction instead of a max and then a min over the columns holding it: each key's bits, made
    order-preserving as an int32 (negative floats' magnitude bits flipped; -0.0 taken as +0.0, which
    float comparison calls equal), form the high word of an int64 whose low word ranks lower columns
    higher; columns not available take the lowest high word, below every float."""
    masked = tl.where(key == key, key, float("inf"))
    bits = tl.where(masked == 0.0, 0, masked.to(tl.int32, bitcast=True))
    ordered = tl.where(avail, bits ^ ((bits >> 31) & 0x7FFFFFFF), -2147483648)
    packed = (ordered.to(tl.int64) << 32) | (BLOCK - 1 - cols)[None, :].to(tl.int64)
    best = tl.max(packed, axis=1)
    col = (BLOCK - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
    best_ordered = (best >> 32).to(tl.int32)
    best_bits = best_ordered ^ ((best_ordered >> 31) & 0x7FFFFFFF)
    return best_bits.to(tl.float32, bitcast=True), col


@jit
def _route_rows(logits_ptr, logits_stride, rows, row_ok, bias_ptr, w_ptr, ids_ptr, n_experts, top_k, group_size,
                n_group, topk_group, scale, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_G: tl.constexpr, SIGMOID: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                GROUPED: tl.constexpr, USE_LIBDEVICE: tl.constexpr):
    """Routes BLOCK_T rows of logits (rows ≥ T masked) into weights and ids [T, k]."""
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < n_experts
    # ".cg": the fused router reads logits other SMs just wrote, from L2, never a stale L1 line.
    logits = tl.load(logits_ptr + rows[:, None] * logits_stride + cols[None, :],
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0, cache_modifier=".cg")
    avail = tl.broadcast_to(col_ok[None, :], (BLOCK_T, BLOCK_E))
    if SIGMOID:
        weights = tl.div_rn(tl.full((BLOCK_T, BLOCK_E), 1.0, tl.float32), 1.0 + _exp(-logits, USE_LIBDEVICE))
        key = weights
        if HAS_BIAS:
            key = weights + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    else:
        peak = tl.max(tl.where(avail, logits, float("-inf")), axis=1)
        ex = tl.where(avail, _exp(logits - peak[:, None], USE_LIBDEVICE), 0.0)
        weights = tl.div_rn(ex, tl.sum(ex, axis=1)[:, None])
        key = weights
    if GROUPED:
        group_of = cols // group_size
        gcols = tl.arange(0, BLOCK_G)
        group_score = tl.full((BLOCK_T, BLOCK_G), float("-inf"), tl.float32)
        for g in range(n_group):
            in_group = avail & (group_of == g)[None, :]
            first, first_col = _first_max(key, in_group, cols, BLOCK_E)
            second, _second_col = _first_max(key, in_group & (cols[None, :] != first_col[:, None]), cols, BLOCK_E)
            group_score = tl.where(gcols[None, :] == g, (first + second)[:, None], group_score)
        group_left = tl.broadcast_to((gcols < n_group)[None, :], (BLOCK_T, BLOCK_G))
        keep = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
        for _pick in range(topk_group):
            _best_score, best_group = _first_max(group_score, group_left, gcols, BLOCK_G)
            group_left = group_left & (gcols[None, :] != best_group[:, None])
            keep = keep | (group_of[None, :] == best_group[:, None])
        key = tl.where(keep, key, float("-inf"))  # still candidates, as in the reference's masked_fill

    kcols = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    picked_id = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for j in range(top_k):
        best_key, col = _first_max(key, avail, cols, BLOCK_E)
        if HAS_BIAS or GROUPED:
            w = tl.sum(tl.where(cols[None, :] == col[:, None], weights, 0.0), axis=1)  # exact: one value among zeros
        else:
            # The key is the weight. Weights are at most 1, so an infinite key stood for a NaN weight.
            w = tl.where(best_key == float("inf"), float("nan"), best_key)
        total += w
        picked_w = tl.where(kcols[None, :] == j, w[:, None], picked_w)
        picked_id = tl.where(kcols[None, :] == j, col[:, None], picked_id)
        avail = avail & (cols[None, :] != col[:, None])
    if NORM:
        if SIGMOID:
            total = total + 1e-20
        picked_w = tl.div_rn(picked_w, total[:, None])
    if SIGMOID:
        picked_w = picked_w * scale
    out_mask = row_ok[:, None] & (kcols < top_k)[None, :]
    out_offs = rows[:, None] * top_k + kcols[None, :]
    tl.store(w_ptr + out_offs, picked_w, mask=out_mask)
    tl.store(ids_ptr + out_offs, picked_id.to(tl.int64), mask=out_mask)


@jit
def _route_kernel(logits_ptr, logits_stride, bias_ptr, w_ptr, ids_ptr, n_experts, top_k, group_size, n_group,
                  topk_group, scale, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
                  SIGMOID: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr,
                  USE_LIBDEVICE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0) + tl.arange(0, 1)
    _route_rows(logits_ptr, logits_stride, rows, rows >= 0, bias_ptr, w_ptr, ids_ptr, n_experts, top_k, group_size,
                n_group, topk_group, scale, 1, BLOCK_E, BLOCK_K, BLOCK_G, SIGMOID, NORM, HAS_BIAS, GROUPED,
                USE_LIBDEVICE)


def _check_settings(num_experts: int, scoring: str, top_k: int, n_group: int, topk_group: int,
                    bias: torch.Tensor | None) -> None:
    if not route_supported(num_experts, top_k, scoring=scoring, n_group=n_group, topk_group=topk_group):
        raise ValueError(f"routing not supported by the kernel: E={num_experts}, scoring={scoring!r}, top_k={top_k}, "
                         f"n_group={n_group}, topk_group={topk_group}")
    if bias is not None and (bias.shape != (num_experts,) or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(f"bias: expected contiguous fp32 [{num_experts}], got {tuple(bias.shape)} {bias.dtype}")


def _route_meta(num_experts: int, scoring: str, top_k: int, norm_topk_prob: bool, n_group: int, topk_group: int,
                bias: torch.Tensor | None, scale: float, device: torch.device) -> tuple[tuple, dict]:
    """The runtime arguments (after the pointers) and constexprs shared by both routing kernels."""
    grouped = _grouped(scoring, n_group) and topk_group < n_group  # keeping every group changes nothing
    args = (num_experts, top_k, num_experts // n_group if grouped else num_experts, n_group if grouped else 1,
            topk_group if grouped else 1, float(scale))
    meta = dict(BLOCK_E=_pow2_at_least(num_experts), BLOCK_K=_pow2_at_least(top_k),
                BLOCK_G=_pow2_at_least(n_group if grouped else 1), SIGMOID=scoring == "sigmoid",
                NORM=bool(norm_topk_prob), HAS_BIAS=scoring == "sigmoid" and bias is not None, GROUPED=grouped,
                USE_LIBDEVICE=device.type == "cuda")
    return args, meta


def route_triton(logits: torch.Tensor, *, scoring: str, top_k: int, norm_topk_prob: bool, n_group: int = 1,
                 topk_group: int = 1, bias: torch.Tensor | None = None,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 with contiguous rows → (weights [T, k] fp32, ids [T, k] int64); one program per token."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits: expected fp32 [T, E] with contiguous rows, got {tuple(logits.shape)} "
                         f"{logits.dtype} strides {logits.stride()}")
    t, e = logits.shape
    _check_settings(e, scoring, top_k, n_group, topk_group, bias)
    w = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t == 0:
        return w, ids
    args, meta = _route_meta(e, scoring, top_k, norm_topk_prob, n_group, topk_group, bias, scale, logits.device)
    on = use_pdl(logits)
    _route_kernel[(t,)](logits, logits.stride(0), logits if bias is None else bias, w, ids, *args, **meta,
                        USE_PDL=on, launch_pdl=on, num_warps=max(1, min(4, meta["BLOCK_E"] // 256)))
    return w, ids


def _fp32_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias as the kernels take it; the reference's fp32 + bias promotes to the same values."""
    if bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()):
        return bias
    return bias.float().contiguous()


def route(logits: torch.Tensor, *, scoring: str, top_k: int, norm_topk_prob: bool, n_group: int = 1,
          topk_group: int = 1, bias: torch.Tensor | None = None,
          scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel for CUDA logits it serves, the reference elsewhere."""
    settings = dict(scoring=scoring, top_k=top_k, norm_topk_prob=norm_topk_prob, n_group=n_group,
                    topk_group=topk_group, bias=_fp32_bias(bias), scale=scale)
    if (use_triton(logits) and logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1
            and route_supported(logits.shape[1], top_k, scoring=scoring, n_group=n_group, topk_group=topk_group)):
        return route_triton(logits, **settings)
    return route_ref(logits, **settings)


# ---------------------------------------------------------------------------------------------- fused router


@dataclass(frozen=True)
class RouterDecodeConfig:
    block_e: int  # experts per program
    block_h: int  # H per loop step
    num_warps: int = 4
    num_stages: int = 3  # loop steps whose loads are in flight at once


def router_decode_config(num_experts: int, hidden: int) -> RouterDecodeConfig:
    """A function of (E, H) only. One expert per program up to 256 experts (8 KB of weight each at H
    2048), two beyond, so all of a layer's rows stream at once, a few programs per SM; the product tile
    [4 tokens, BLOCK_E, BLOCK_H] is 4096 fp32 (32 registers a thread). On the H200
    (`python benchmarks/kernels/moe_routing.py --sweep`): E 128 7.65 us at one expert per program; E 512
    14.2 us at two experts over 512-wide steps, against 17.3 at one over 1024 (15.8 and 20.5 at T = 8).
    Four per program (a cap of 128 programs) takes 16.3 us in the Qwen3-Next profile."""
    block_e = min(16, _pow2_at_least(_cdiv(num_experts, 256)))
    block_h = max(16, min(_pow2_at_least(hidden), 1024 // block_e))
    return RouterDecodeConfig(block_e, block_h)


def router_decode_supported(num_tokens: int, num_experts: int, hidden: int, dtype: torch.dtype, *, top_k: int,
                            scoring: str = "softmax", n_group: int = 1, topk_group: int = 1) -> bool:
    """Whether the fused one-launch router serves x [T, H] @ weight [E, H]ᵀ with these settings."""
    return (1 <= num_tokens <= DECODE_MAX_TOKENS and hidden >= 1 and dtype in DECODE_DTYPES
            and route_supported(num_experts, top_k, scoring=scoring, n_group=n_group, topk_group=topk_group))


def router_decode_workspace(device) -> torch.Tensor:
    """Zeroed counters for the fused router; the kernel leaves them at zero after each call."""
    return torch.zeros(WORKSPACE_NUMEL, dtype=torch.int32, device=device)


def router_decode_ref(x: torch.Tensor, weight: torch.Tensor, *, scoring: str, top_k: int, norm_topk_prob: bool,
                      n_group: int = 1, topk_group: int = 1, bias: torch.Tensor | None = None,
                      scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, ids [T, k] int64, logits [T, E] fp32), as `Router.forward`."""
    logits = F.linear(x.float(), weight.float())
    w, ids = route_ref(logits, scoring=scoring, top_k=top_k, norm_topk_prob=norm_topk_prob, n_group=n_group,
                       topk_group=topk_group, bias=bias, scale=scale)
    return w, ids, logits


@jit(do_not_specialize=["n_tokens"])
def _router_decode_kernel(x_ptr, x_stride, weight_ptr, logits_ptr, counter_ptr, bias_ptr, w_ptr, ids_ptr, n_tokens,
                          hidden, n_experts, top_k, group_size, n_group, topk_group, scale,
                          BLOCK_T: tl.constexpr, BLOCK_EP: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr, SIGMOID: tl.constexpr,
                          NORM: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr,
                          USE_LIBDEVICE: tl.constexpr, NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    token_block = tl.program_id(1)
    rows = token_block * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.program_id(0) * BLOCK_EP + tl.arange(0, BLOCK_EP)
    hs = tl.arange(0, BLOCK_H)
    row_ok = rows < n_tokens
    expert_ok = experts < n_experts
    x_ptrs = x_ptr + rows[:, None] * x_stride + hs[None, :]
    w_ptrs = weight_ptr + experts[:, None] * hidden + hs[None, :]
    # Products stay per lane until after the loop: each logit's order depends on H and BLOCK_H only.
    acc = tl.zeros((BLOCK_T, BLOCK_EP, BLOCK_H), dtype=tl.float32)
    for h0 in tl.range(0, hidden, BLOCK_H, num_stages=NUM_STAGES):
        h_ok = h0 + hs < hidden
        xv = tl.load(x_ptrs + h0, mask=row_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        wv = tl.load(w_ptrs + h0, mask=expert_ok[:, None] & h_ok[None, :], other=0.0)
        acc += xv[:, None, :] * wv[None, :, :]
    logits = tl.sum(acc, axis=2)
    tl.store(logits_ptr + rows[:, None] * n_experts + experts[None, :], logits,
             mask=row_ok[:, None] & expert_ok[None, :])
    # Every thread's logit stores are ordered before thread 0's release (the atomic runs on one thread).
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + token_block, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        _route_rows(logits_ptr, n_experts, rows, row_ok, bias_ptr, w_ptr, ids_ptr, n_experts, top_k, group_size,
                    n_group, topk_group, scale, BLOCK_T, BLOCK_E, BLOCK_K, BLOCK_G, SIGMOID, NORM, HAS_BIAS,
                    GROUPED, USE_LIBDEVICE)
        tl.store(counter_ptr + token_block, 0)


def router_decode_triton(x: torch.Tensor, weight: torch.Tensor, *, scoring: str, top_k: int, norm_topk_prob: bool,
                         n_group: int = 1, topk_group: int = 1, bias: torch.Tensor | None = None, scale: float = 1.0,
                         workspace: torch.Tensor | None = None, logits: torch.Tensor | None = None,
                         config: RouterDecodeConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T ≤ 16, H] (bf16/fp16/fp32, contiguous rows), weight [E, H] fp32 contiguous → (weights [T, k]
    fp32, ids [T, k] int64, logits [T, E] fp32) in one launch. `workspace`: `router_decode_workspace`
    (without one, a zeroed one is allocated per call); `logits`: an optional contiguous output."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"expected x [T, H] with contiguous rows and a contiguous weight [E, H]; got x "
                         f"{tuple(x.shape)} strides {x.stride()}, weight {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    t, h = x.shape
    e = weight.shape[0]
    if weight.shape[1] != h or weight.dtype != torch.float32 or x.dtype not in DECODE_DTYPES or t > DECODE_MAX_TOKENS:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit fp32 weight {tuple(weight.shape)} {weight.dtype} "
                         f"(T ≤ {DECODE_MAX_TOKENS}, x in {DECODE_DTYPES})")
    _check_settings(e, scoring, top_k, n_group, topk_group, bias)
    if logits is None:
        logits = torch.empty((t, e), dtype=torch.float32, device=x.device)
    elif logits.shape != (t, e) or logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(f"logits: expected contiguous fp32 [{t}, {e}], got {tuple(logits.shape)} {logits.dtype}")
    if workspace is None:
        workspace = router_decode_workspace(x.device)
    elif workspace.dtype != torch.int32 or workspace.numel() < WORKSPACE_NUMEL or not workspace.is_contiguous():
        raise ValueError(f"workspace: expected a contiguous int32 tensor of >= {WORKSPACE_NUMEL} elements")
    w = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=x.device)
    if t == 0:
        return w, ids, logits
    cfg = config or router_decode_config(e, h)
    args, meta = _route_meta(e, scoring, top_k, norm_topk_prob, n_group, topk_group, bias, scale, x.device)
    on = use_pdl(x)
    _router_decode_kernel[(_cdiv(e, cfg.block_e), _cdiv(t, DECODE_BLOCK_T))](
        x, x.stride(0), weight, logits, workspace, weight if bias is None else bias, w, ids, t, h, *args,
        BLOCK_T=DECODE_BLOCK_T, BLOCK_EP=cfg.block_e, BLOCK_H=cfg.block_h, **meta, NUM_STAGES=cfg.num_stages,
        USE_PDL=on, launch_pdl=on, num_warps=cfg.num_warps)
    return w, ids, logits


def router_decode(x: torch.Tensor, weight: torch.Tensor, *, scoring: str, top_k: int, norm_topk_prob: bool,
                  n_group: int = 1, topk_group: int = 1, bias: torch.Tensor | None = None, scale: float = 1.0,
                  workspace: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router for any T: on CUDA the fused kernel where it serves, else fp32 logits (cuBLAS) and
    `route`; the reference off CUDA."""
    settings = dict(scoring=scoring, top_k=top_k, norm_topk_prob=norm_topk_prob, n_group=n_group,
                    topk_group=topk_group, bias=bias, scale=scale)
    if not use_triton(x):
        return router_decode_ref(x, weight, **settings)
    settings["bias"] = _fp32_bias(bias)
    if (x.dim() == 2 and x.stride(1) == 1 and weight.dim() == 2 and weight.is_contiguous()
            and weight.dtype == torch.float32
            and router_decode_supported(x.shape[0], weight.shape[0], x.shape[1], x.dtype, top_k=top_k,
                                        scoring=scoring, n_group=n_group, topk_group=topk_group)):
        return router_decode_triton(x, weight, workspace=workspace, **settings)
    logits = F.linear(x.float(), weight.float())
    return (*route(logits, **settings), logits)
