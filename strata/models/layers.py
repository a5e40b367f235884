"""Building blocks shared by every architecture: norms, rotary, attention, MLP, MoE, decoder block.

Modules take flat token batches: `x` is [N, hidden] for the N tokens of a step, whatever sequences
they belong to. Where those tokens' keys and values live, and which of them each query may see, is
the business of the `AttentionBackend` passed in (`strata.models.attention`), so one model serves
training, the simple generator and the paged serving engine alike.

Parameter names equal the HF checkpoint names, so HF weights load without a map.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from strata.config import ModelConfig, RopeConfig
from strata.kernels import activation as k_act
from strata.kernels import gemv as k_gemv
from strata.kernels import moe_decode as k_moe
from strata.kernels import moe_routing as k_route
from strata.kernels import moe_sort as k_sort
from strata.kernels import norm as k_norm
from strata.kernels import rope as k_rope
from strata.kernels import triton_available, use_triton
from strata.kernels.quant import QWeight
from strata.kernels.scratch import scratch
from strata.models.attention import AttentionBackend

log = logging.getLogger("strata")


def linear(x: torch.Tensor, weight: "torch.Tensor | QWeight", bias: torch.Tensor | None = None,
           workspace: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the decode GEMV kernel for the few-row products where it beats cuBLAS on the
    GPU (a workspace, set by `CausalLM.pack`, says the model runs there). Its K order depends only on
    the weight's shape, so a row's result is the same for any batch of up to 16 rows. A `QWeight` (a
    weight kept quantized) goes through its format's kernels."""
    if isinstance(weight, QWeight):
        y = weight.matmul(x)
        return y if bias is None else y + bias
    workspace = scratch(workspace)
    if (workspace is not None and x.dim() == 2 and use_triton(x) and x.stride(-1) == 1 and weight.is_contiguous()
            and weight.dtype == x.dtype and k_gemv.gemv_supported(x.shape[0], weight.shape[0], weight.shape[1], x.dtype)):
        return k_gemv.gemv_triton(x, weight, bias, workspace=workspace)
    return F.linear(x, weight, bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            return k_norm.rms_norm_triton(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        # Normalise in fp32 as the reference implementations do; bf16 variance loses too much.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm. With no residual
        yet, x itself is the residual. The kernel updates `residual` in place."""
        if residual is None:
            return self(x), x
        if use_triton(x):
            return k_norm.fused_add_rms_norm_triton(x, residual, self.weight, self.eps)
        residual = x + residual
        return self(residual), residual


def rope_inv_freq(rope: RopeConfig, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention (cos/sin) scale for the configured RoPE variant."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    pos_freqs = rope.theta**exponents
    inv_freq = 1.0 / pos_freqs
    if rope.kind == "linear":
        return (inv_freq / rope.factor).float(), 1.0
    if rope.kind != "yarn":
        return inv_freq.float(), 1.0

    factor = rope.factor
    orig = rope.original_max_position or 4096

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.attention_factor is not None:
        attn_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attn_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
    else:
        attn_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate
    return inv.float(), attn_factor


@dataclass
class RopeInputs:
    """What a step's layers need to rotate q and k: the kernels take positions and frequencies, the
    torch path cos/sin tables computed once per step on first use."""

    positions: torch.Tensor
    rotary: "Rotary"
    dtype: torch.dtype
    _tables: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None:
            self._tables = self.rotary.cos_sin(self.positions, self.dtype)
        return self._tables


class Rotary(nn.Module):
    """Neox-style (rotate-half) RoPE over the first `rotary_dim` dims of each head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.rotary_dim = cfg.rotary_dim
        inv_freq, self.scale = rope_inv_freq(cfg.rope, self.rotary_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim]; cos/sin: [N, rotary_dim]."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rotary_dim, self.eps = cfg.rotary_dim, cfg.rms_norm_eps
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # q|k|v stacked by pack(): one projection GEMM instead of three. Non-persistent, like MoE.w13.
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.qkv_q: QWeight | None = None  # q|k|v kept quantized (loader + pack), instead of qkv_weight
        self.o_q: QWeight | None = None
        self.gemv_ws: torch.Tensor | None = None  # shared GEMV workspace (CausalLM.pack, on CUDA)

    @torch.no_grad()
    def pack(self, dtype: torch.dtype | None = None) -> None:
        """Stack the q, k, v projections and make each a view of the stack (no second copy); weights
        the loader kept quantized become `QWeight`s (`dtype`: the model's, for a mixed stack)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.o_q = take_quantized([self.o_proj], dtype)
        self.qkv_q = take_quantized(list(projs), dtype)
        if self.qkv_q is not None:
            if self.q_proj.bias is not None:
                self.qkv_bias = torch.cat([p.bias.detach() for p in projs])
            return
        if any(p.weight.requires_grad or p.weight.is_meta for p in projs):
            return
        self.qkv_weight = _stack_views([p for p in projs], "weight")
        if self.q_proj.bias is not None:
            self.qkv_bias = _stack_views([p for p in projs], "bias")

    def forward(self, x: torch.Tensor, rope: RopeInputs, attn: AttentionBackend) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        w_qkv = self.qkv_q if self.qkv_q is not None else self.qkv_weight
        if w_qkv is not None and use_triton(x):
            qkv = linear(x, w_qkv, self.qkv_bias, self.gemv_ws)
            q, k, v = k_rope.qk_norm_rope_triton(
                qkv, rope.positions, rope.rotary.inv_freq, rope.rotary.scale,
                self.q_norm.weight if self.q_norm is not None else None,
                self.k_norm.weight if self.k_norm is not None else None,
                self.eps, self.n_heads, self.n_kv, d, self.rotary_dim)
        else:
            if w_qkv is not None:
                qkv = linear(x, w_qkv, self.qkv_bias)
                q, k, v = qkv.split([self.n_heads * d, self.n_kv * d, self.n_kv * d], dim=-1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = q.reshape(n, self.n_heads, d), k.reshape(n, self.n_kv, d), v.reshape(n, self.n_kv, d)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            cos, sin = rope.cos_sin()
            # fp32 norm weights promote q/k under autocast; attention kernels want one 16-bit dtype.
            q, k = apply_rotary(q, cos, sin).to(v.dtype), apply_rotary(k, cos, sin).to(v.dtype)
        o = attn.attend(self.layer_idx, q, k, v)
        w_o = self.o_q if self.o_q is not None else self.o_proj.weight
        return linear(o.reshape(n, self.n_heads * d), w_o, None, self.gemv_ws)


def take_quantized(modules: list[nn.Module], dtype: torch.dtype | None) -> QWeight | None:
    """The loader parks a weight it kept quantized on its `nn.Linear` as `quant_raw` (GGUF type, raw
    blocks on the device). For projections applied as one stack: their `QWeight`, rows of blocks
    concatenated in order, or None when none was kept quantized. A stack whose members differ (a file
    mixing formats, or one the kernels do not cover) gets float weights instead (`dtype`), so it
    packs as usual."""
    raws = [m.__dict__.pop("quant_raw", None) for m in modules]
    if all(r is None for r in raws):
        return None
    k = modules[0].in_features
    if any(r is None for r in raws) or len({r[0] for r in raws}) > 1:
        for m, r in zip(modules, raws):
            if r is not None:
                w = QWeight.from_raw(r[0], r[1], r[1].shape[0], k).dequantize()
                m.weight = nn.Parameter(w.to(dtype or torch.float32), requires_grad=False)
        return None
    rows = torch.cat([r[1] for r in raws]) if len(raws) > 1 else raws[0][1]
    return QWeight.from_raw(raws[0][0], rows, rows.shape[0], k)


def _stack_views(modules: list[nn.Module], attr: str) -> torch.Tensor:
    """Concatenate `attr` of each module along dim 0 and re-point each module's parameter at its
    slice of the result, so checkpoint names keep working and the weights exist once."""
    parts = [getattr(m, attr) for m in modules]
    stacked = torch.cat([p.detach() for p in parts], dim=0)
    start = 0
    for m, p in zip(modules, parts):
        setattr(m, attr, nn.Parameter(stacked[start : start + p.shape[0]], requires_grad=False))
        start += p.shape[0]
    return stacked


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)  # gate rows, then up rows
        self.gate_up_q: QWeight | None = None  # gate|up kept quantized, instead of gate_up_weight
        self.down_q: QWeight | None = None
        self.gemv_ws: torch.Tensor | None = None  # shared GEMV workspace (CausalLM.pack, on CUDA)

    @torch.no_grad()
    def pack(self, dtype: torch.dtype | None = None) -> None:
        self.down_q = take_quantized([self.down_proj], dtype)
        self.gate_up_q = take_quantized([self.gate_proj, self.up_proj], dtype)
        if self.gate_up_q is not None:
            return
        if any(p.weight.requires_grad or p.weight.is_meta for p in (self.gate_proj, self.up_proj)):
            return
        self.gate_up_weight = _stack_views([self.gate_proj, self.up_proj], "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_gate_up = self.gate_up_q if self.gate_up_q is not None else self.gate_up_weight
        if w_gate_up is not None:
            h = silu_mul(linear(x, w_gate_up, None, self.gemv_ws))
            return linear(h, self.down_q if self.down_q is not None else self.down_proj.weight, None, self.gemv_ws)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a [N, 2I] tensor holding gate then up."""
    if use_triton(gate_up):
        return k_act.silu_mul_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Router(nn.Module):
    """Top-k expert choice. Softmax (Qwen3-MoE) or sigmoid with a correction bias and optional
    group limit (DeepSeek-V3 / GLM-4.5). Scores are computed in fp32 in both cases."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.scoring, self.top_k, self.norm = cfg.scoring, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.n_group, self.topk_group, self.scale = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        if self.scoring == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        # The fp32 copy of a 16-bit router weight, made once by MoE.pack_experts() instead of every call.
        self.register_buffer("weight_f32", None, persistent=False)
        # Counters of the fused routing kernel (which leaves them at zero), set by MoE.pack_experts() on CUDA.
        self.route_ws: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (weights [N, k] fp32, expert ids [N, k], router logits [N, E] fp32). On CUDA without a
        gradient, strata.kernels.moe_routing: one launch for up to 16 tokens, else cuBLAS logits + one."""
        weight = self.weight_f32 if self.weight_f32 is not None else self.weight.float()
        if (self.route_ws is not None and x.dim() == 2 and use_triton(x)
                and not (weight.requires_grad and torch.is_grad_enabled())):
            return k_route.router_decode(x, weight, scoring=self.scoring, top_k=self.top_k, norm_topk_prob=self.norm,
                                         n_group=self.n_group, topk_group=self.topk_group,
                                         bias=self.e_score_correction_bias, scale=self.scale, workspace=scratch(self.route_ws))
        logits = F.linear(x.float(), weight)
        if self.scoring == "softmax":
            probs = logits.softmax(dim=-1)
            w, ids = probs.topk(self.top_k, dim=-1)
            if self.norm:
                w = w / w.sum(-1, keepdim=True)
            return w, ids, logits
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            n, e = choice.shape
            grouped = choice.view(n, self.n_group, e // self.n_group)
            group_score = grouped.topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(self.topk_group, dim=-1)[1], 1.0)
            keep = keep.unsqueeze(-1).expand_as(grouped).reshape(n, e)
            choice = choice.masked_fill(keep == 0, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1)[1]
        w = scores.gather(1, ids)
        if self.norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scale, ids, logits


def _grouped_mm_works(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """One tiny call of `torch._grouped_mm` on the real weights, checked against F.linear.

    The op is private and its kernels accept only some dtypes, shapes and alignments (CUDA may reject
    fp32 or dims that are not multiples of 8/16, or run a fallback that reads the group offsets on the
    host), so it is tried once here, at pack time, rather than failing or syncing in the middle of a step."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    e, two_i, h = w13.shape
    dev = w13.device
    # Uneven groups with some empty, as real routing gives.
    counts = torch.arange(e, device=dev) % 3
    offs = counts.cumsum(0).to(torch.int32)
    rows = int(counts.sum())
    x = torch.randn(rows, h, device=dev, dtype=w13.dtype)
    a = torch.randn(rows, two_i // 2, device=dev, dtype=w2.dtype)
    on_cuda = dev.type == "cuda"
    try:
        if on_cuda:
            # A fallback that copies `offs` to the host would defeat the point of this path.
            old_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        try:
            y13 = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)
            y2 = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
        finally:
            if on_cuda:
                torch.cuda.set_sync_debug_mode(old_mode)
    except (RuntimeError, NotImplementedError):
        # Unsupported dtype/shape/alignment/device on this build: the loop path serves instead.
        return False
    bounds = [0] + offs.tolist()
    ref13 = torch.cat([F.linear(x[bounds[i] : bounds[i + 1]], w13[i]) for i in range(e)])
    ref2 = torch.cat([F.linear(a[bounds[i] : bounds[i + 1]], w2[i]) for i in range(e)])
    # Loose enough for 16-bit rounding and TF32; a wrong layout is off by O(1).
    tol = 1e-2 if w13.dtype == torch.float32 else 3e-2
    return all(
        got.shape == ref.shape and bool((got.float() - ref.float()).abs().max() <= tol * ref.float().abs().max())
        for got, ref in ((y13, ref13), (y2, ref2))
    )


def _moe_decode_works(w13: torch.Tensor, w2: torch.Tensor, top_k: int) -> bool:
    """One call of the fused decode kernels on the real weights, checked against their reference, at
    pack time: a kernel this device cannot build or run leaves the grouped path serving every step."""
    e, two_i, h = w13.shape
    if not (w13.is_cuda and triton_available() and k_moe.moe_decode_supported(2, top_k, h, two_i // 2, w13.dtype)):
        return False
    x = torch.randn(2, h, device=w13.device, dtype=w13.dtype)
    ids = torch.stack([torch.randperm(e, device=w13.device)[:top_k] for _ in range(2)])
    w = torch.rand(2, top_k, device=w13.device)
    try:
        got = k_moe.moe_experts_decode_triton(x, ids, w, w13, w2)
    except Exception as err:  # a compiler or launch failure: fall back rather than fail every step
        log.warning("fused MoE decode kernels unavailable (%s); using grouped GEMMs", err)
        return False
    ref = k_moe.moe_experts_decode_ref(x, ids, w, w13, w2)
    return bool(((got.float() - ref.float()).norm() <= 1e-2 * ref.float().norm()).item())


class MoE(nn.Module):
    """Routed experts plus optional shared experts. Experts keep the HF per-expert layout as loaded.

    Three forward paths, named by `self.path`:
    - "loop" (reference; any unpacked module): groups tokens by expert so each expert runs one matmul;
      it reads the group sizes on the host, one device sync per call.
    - "grouped" (after `pack_experts()`): all experts in two `torch._grouped_mm` calls over stacked
      weights, with no host sync, so a step can be queued on the GPU without the host waiting.
    - "masked" (after `pack_experts()` on CUDA where grouped_mm cannot serve, e.g. fp32): `_masked`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )
        # Set by a trainer that balances load (aux-loss-free bias update); the serving path ignores it.
        self.last_expert_ids: torch.Tensor | None = None
        self.keep_routing = False
        self.path = "loop"
        self.num_experts_per_tok = cfg.num_experts_per_tok
        # The fused decode kernels (strata.kernels.moe_decode) serve steps of few tokens; set by
        # pack_experts() once a probe has checked them on this device.
        self.decode_kernel = False
        # Stacked expert weights, set by pack_experts(). Non-persistent: the checkpoint names stay HF's.
        self.register_buffer("w13", None, persistent=False)  # [E, 2*I, H]: gate rows, then up rows
        self.register_buffer("w2", None, persistent=False)  # [E, H, I]
        self.sort_ws: torch.Tensor | None = None  # the token sort's counters (CUDA), set by pack_experts()
        # --quantize fp8: (w13, its scales, w2, its scales) in e4m3 instead of w13 / w2 (`quantize_fp8`).
        self.fp8: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def pack_experts(self) -> str:
        """Stack the experts' weights into `w13`/`w2` and make each expert's weights views of them
        (no second copy), then pick the path. Call after the weights are on their final device and
        dtype: moving the module afterwards copies the views apart. Returns `self.path`."""
        params = [p for m in self.experts for p in (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)]
        if any(p.requires_grad for p in params) or any(p.is_meta for p in params):
            # The grouped path reads the stacked buffers, which autograd would not train.
            self.path = "loop"
            return self.path
        first = self.experts[0]
        inter, hidden = first.gate_proj.weight.shape
        ref = first.gate_proj.weight
        w13 = torch.empty(self.num_experts, 2 * inter, hidden, device=ref.device, dtype=ref.dtype)
        w2 = torch.empty(self.num_experts, hidden, inter, device=ref.device, dtype=ref.dtype)
        for e, m in enumerate(self.experts):
            w13[e, :inter].copy_(m.gate_proj.weight)
            w13[e, inter:].copy_(m.up_proj.weight)
            w2[e].copy_(m.down_proj.weight)
            m.gate_proj.weight = nn.Parameter(w13[e, :inter], requires_grad=False)
            m.up_proj.weight = nn.Parameter(w13[e, inter:], requires_grad=False)
            m.down_proj.weight = nn.Parameter(w2[e], requires_grad=False)
        self.w13, self.w2 = w13, w2
        if self.gate.weight.dtype != torch.float32:
            self.gate.weight_f32 = self.gate.weight.detach().float()
        if w13.is_cuda and triton_available():
            self.sort_ws = k_sort.sort_tokens_workspace(w13.device)
            self.gate.route_ws = k_route.router_decode_workspace(w13.device)
        if _grouped_mm_works(w13, w2):
            self.path = "grouped"
            self.decode_kernel = _moe_decode_works(w13, w2, self.num_experts_per_tok)
        else:
            # On CUDA a step must not read expert counts on the host (CUDA graphs, overlapped steps).
            self.path = "masked" if w13.is_cuda else "loop"
        return self.path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, ids, _ = self.gate(x)
        if self.keep_routing:
            self.last_expert_ids = ids.detach()
        if self.fp8 is not None:
            out = self._grouped(x, w, ids)
        # The dtype test is on host metadata (no sync): under autocast x may differ from the weights.
        elif (self.decode_kernel and x.dtype == self.w13.dtype and use_triton(x)
                and k_moe.moe_decode_supported(x.shape[0], ids.shape[1], x.shape[1], self.w2.shape[2], x.dtype)):
            out = k_moe.moe_experts_decode_triton(x, ids, w, self.w13, self.w2)
        elif self.path == "grouped" and x.dtype == self.w13.dtype:
            out = self._grouped(x, w, ids)
        elif self.path == "masked":
            out = self._masked(x, w, ids)
        else:
            out = self._loop(x, w, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _loop(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        flat_ids = ids.reshape(-1)
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // ids.shape[1]
        weight_of = w.reshape(-1)[order]
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            tok = token_of[start : start + c]
            y = self.experts[e](x[tok]) * weight_of[start : start + c, None]
            out.index_add_(0, tok, y.to(x.dtype))
            start += c
        return out

    def _masked(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert over every token, weighted by a routing weight that is 0 where the token did
        not choose it: E/k times the loop's work, but no host sync. Per token it adds the same terms
        as the loop in the same (expert) order, and adding an exact 0 changes nothing."""
        dense_w = torch.zeros(x.shape[0], self.num_experts, dtype=w.dtype, device=w.device).scatter_(1, ids, w)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out += (expert(x) * dense_w[:, e : e + 1]).to(x.dtype)
        return out

    def _grouped(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n, k = ids.shape
        # Pairs stably sorted by expert and the group ends, with no host sync (not bincount: on CUDA it
        # reads the ids' max on the host). Two launches on CUDA, argsort + searchsorted elsewhere.
        order, offs = k_sort.sort_tokens(ids, self.num_experts, workspace=scratch(self.sort_ws))
        xs = x[order // k]
        if self.fp8 is not None:  # --quantize fp8: the experts in e4m3 (strata.kernels.quant.fp8)
            from strata.kernels.quant import fp8

            w13, s13, w2, s2 = self.fp8
            h13 = fp8.grouped_matmul(xs, w13, s13, offs)
            y = fp8.grouped_matmul(silu_mul(h13), w2, s2, offs)
        else:
            h13 = torch._grouped_mm(xs, self.w13.transpose(1, 2), offs=offs)
            y = torch._grouped_mm(silu_mul(h13), self.w2.transpose(1, 2), offs=offs)
        # As the loop: fp32 routing weights, each expert's contribution rounded to x.dtype.
        y = (y * w.reshape(-1)[order, None]).to(x.dtype)
        # Back to (token, k) order and a plain sum over k: no atomics, so the result is deterministic.
        unsorted = torch.empty_like(y)
        unsorted[order] = y
        return unsorted.view(n, k, y.shape[-1]).sum(1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MoE(cfg) if cfg.layer_is_moe(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: RopeInputs, attn: AttentionBackend) -> torch.Tensor:
        out, residual = self.forward_fused(x, None, rope, attn)
        return residual + out

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs,
                      attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """The block with its residual adds deferred into the next norm: takes the previous block's
        output and the residual stream before it (None for the first block), returns this block's
        output and the residual stream before it. The sum of the two is the block's plain output."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, rope, attn)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual
