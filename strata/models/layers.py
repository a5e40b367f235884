"""Building blocks shared by every architecture: linear, norms, rotary, attention, MLP (the MoE layer
is in `strata.models.moe`, the decoder block in `strata.models.decoder`).

Modules take flat token batches: `x` is [N, hidden] for the N tokens of a step, whatever sequences
they belong to. Where those tokens' keys and values live, and which of them each query may see, is
the business of the `AttentionBackend` passed in (`strata.attention`), so one model serves
training, the simple generator and the paged serving engine alike.

Parameter names equal the HF checkpoint names, so HF weights load without a map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from strata.config import ModelConfig, RopeConfig
from strata.kernels import activation as k_act
from strata.kernels import gemv as k_gemv
from strata.kernels import invariant as k_invariant
from strata.kernels import matmul as k_matmul
from strata.kernels import norm as k_norm
from strata.kernels import rope as k_rope
from strata.kernels import use_triton
from strata.kernels.quant import QWeight, QWeightStack
from strata.kernels.quant import invariant as k_quant_invariant
from strata.kernels.scratch import scratch
from strata.attention import AttentionBackend


def linear(x: torch.Tensor, weight: "torch.Tensor | QWeight", bias: torch.Tensor | None = None,
           workspace: torch.Tensor | None = None, invariant: bool = False) -> torch.Tensor:
    """F.linear, through the decode GEMV kernel for the few-row products where it beats cuBLAS on the
    GPU (a workspace, set by `CausalLM.pack`, says the model runs there). Its K order depends only on
    the weight's shape, so a row's result is the same for any batch of up to 16 rows. A `QWeight` (a
    weight kept quantized) goes through its format's kernels. `invariant` (`--batch-invariant`, float
    weights and Q8_0 / FP8 ones kept quantized): a row's result is the same for any number of rows
    (`strata.kernels.invariant`, `strata.kernels.quant.invariant`)."""
    if workspace is None and not invariant and isinstance(weight, torch.Tensor):  # no kernel to choose (the CPU)
        return F.linear(x, weight, bias)
    if invariant and k_quant_invariant.supports(weight):
        if use_triton(x) and x.dim() == 2 and x.stride(-1) == 1:
            return k_quant_invariant.matmul_invariant_q(x, weight, bias, workspace=scratch(workspace))
        return k_quant_invariant.matmul_invariant_q_ref(x, weight, bias)
    if invariant and not isinstance(weight, (QWeight, QWeightStack)):
        if use_triton(x) and x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous() and weight.dtype == x.dtype:
            return k_matmul.matmul_invariant(x, weight, bias, workspace=scratch(workspace))
        return k_invariant.linear(x, weight, bias)
    if isinstance(weight, (QWeight, QWeightStack)):
        y = weight.matmul(x)
        return y if bias is None else y + bias
    workspace = scratch(workspace)
    if (workspace is not None and x.dim() == 2 and use_triton(x) and x.stride(-1) == 1 and weight.is_contiguous()
            and weight.dtype == x.dtype and k_gemv.gemv_supported(x.shape[0], weight.shape[0], weight.shape[1], x.dtype)):
        return k_gemv.gemv_triton(x, weight, bias, workspace=workspace)
    return F.linear(x, weight, bias)


class RMSNorm(nn.Module):
    zero_centred = False  # Qwen3-Next's norms set it: x / rms(x) * (1 + weight), all in fp32

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            return k_norm.rms_norm_triton(x.reshape(-1, x.shape[-1]), self.weight, self.eps,
                                          zero_centred=self.zero_centred).view(x.shape)
        if self.zero_centred:
            return k_norm.rms_norm_ref(x, self.weight, self.eps, zero_centred=True)
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm. With no residual
        yet, x itself is the residual. The kernel updates `residual` in place."""
        if residual is None:
            return self(x), x
        if use_triton(x):
            return k_norm.fused_add_rms_norm_triton(x, residual, self.weight, self.eps, zero_centred=self.zero_centred)
        residual = x + residual
        return self(residual), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, normalised in fp32 as the reference implementations do (bf16 variance
    loses too much); `weight` broadcasts against x (one row per head for a stack of heads). In fp32 it
    is torch's one op, which gives the same floats as the steps below: a small model's CPU step pays
    per op, not per element."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if weight.shape == x.shape[-1:]:
            return F.rms_norm(x, weight.shape, weight, eps)
        return F.rms_norm(x, x.shape[-1:], None, eps) * weight
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


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
    _signed: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None:
            self._tables = self.rotary.cos_sin(self.positions, self.dtype)
        return self._tables

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """`apply_rotary(x, *cos_sin())` for x [N, heads, head_dim] (any number of heads: q and k
        stacked rotate in one go), in four ops on the rotary dims: the rotate-half's sign is folded
        into a signed sin table, made once per step, so x·cos + roll(x)·sin_signed gives the same
        floats (negation is exact) without the slices, negation and concatenation."""
        if self._signed is None:
            cos, sin = self.cos_sin()
            self._signed = cos[:, None], (sin * self.rotary.sin_sign(sin.device, sin.dtype))[:, None]
        cos, sin = self._signed
        rd = cos.shape[-1]
        if rd == x.shape[-1]:
            return x * cos + x.roll(rd // 2, -1) * sin
        rot = x[..., :rd]
        return torch.cat([rot * cos + rot.roll(rd // 2, -1) * sin, x[..., rd:]], dim=-1)


class Rotary(nn.Module):
    """Neox-style (rotate-half) RoPE over the first `rotary_dim` dims of each head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.rotary_dim = cfg.rotary_dim
        inv_freq, self.scale = rope_inv_freq(cfg.rope, self.rotary_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._sin_signs: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def sin_sign(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """-1 on the first half of the rotary dims, +1 on the second: rotate-half's sign
        (`RopeInputs.rotate`), made once per device and dtype."""
        sign = self._sin_signs.get((device, dtype))
        if sign is None:
            half = self.rotary_dim // 2
            with torch.inference_mode(False):  # a plain tensor, usable outside inference mode
                sign = torch.cat([-torch.ones(half), torch.ones(self.rotary_dim - half)])
                sign = sign.to(device=device, dtype=dtype)
            self._sin_signs[(device, dtype)] = sign
        return sign

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:  # x * 1.0 is x: skipped, as the conversion to fp32
            cos, sin = cos * self.scale, sin * self.scale
        return (cos, sin) if dtype == torch.float32 else (cos.to(dtype), sin.to(dtype))


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
        self.batch_invariant = False  # CausalLM.set_batch_invariant
        self._qk_norm_stack: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # _qk_norm_weight

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
        self.qkv_weight = stack_views([p for p in projs], "weight")
        if self.q_proj.bias is not None:
            self.qkv_bias = stack_views([p for p in projs], "bias")

    def gemv_weights(self) -> tuple[torch.Tensor | None, ...]:
        """The float weights `linear` runs through the decode GEMV (`CausalLM.pack` sizes its workspace)."""
        return self.qkv_weight, self.o_proj.weight

    def _qk_norm_weight(self) -> torch.Tensor:
        """The q and k norms' weights as one [Hq + Hkv, D] stack (a row per head), made once for weights
        that no longer train (the loader's), else per call so a gradient reaches both."""
        w = self._qk_norm_stack
        if w is not None and w[0] is self.q_norm.weight and w[1] is self.k_norm.weight:
            return w[2]
        parts = (self.q_norm.weight.expand(self.n_heads, -1), self.k_norm.weight.expand(self.n_kv, -1))
        if self.q_norm.weight.requires_grad or self.k_norm.weight.requires_grad:
            return torch.cat(parts)
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable outside inference mode
            stack = torch.cat(parts)
        self._qk_norm_stack = (self.q_norm.weight, self.k_norm.weight, stack)
        return stack

    def forward(self, x: torch.Tensor, rope: RopeInputs, attn: AttentionBackend) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        w_qkv = self.qkv_q if self.qkv_q is not None else self.qkv_weight
        if w_qkv is not None and use_triton(x):
            qkv = linear(x, w_qkv, self.qkv_bias, self.gemv_ws, self.batch_invariant)
            q, k, v = k_rope.qk_norm_rope_triton(
                qkv, rope.positions, rope.rotary.inv_freq, rope.rotary.scale,
                self.q_norm.weight if self.q_norm is not None else None,
                self.k_norm.weight if self.k_norm is not None else None,
                self.eps, self.n_heads, self.n_kv, d, self.rotary_dim)
        elif w_qkv is not None:
            # The q and k heads as one [N, Hq + Hkv, D] stack: one norm (a weight row per head) and one
            # rotation for both, the same floats as normalising and rotating each (all per row).
            qkv = linear(x, w_qkv, self.qkv_bias, invariant=self.batch_invariant)
            nqk = (self.n_heads + self.n_kv) * d
            qk, v = qkv[:, :nqk].view(n, -1, d), qkv[:, nqk:].view(n, self.n_kv, d)
            if self.q_norm is not None:
                qk = rms_norm(qk, self._qk_norm_weight(), self.eps)
            qk = rope.rotate(qk)
            if qk.dtype != v.dtype:  # fp32 norm weights promote q/k under autocast; attention wants one dtype
                qk = qk.to(v.dtype)
            q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = q.reshape(n, self.n_heads, d), k.reshape(n, self.n_kv, d), v.reshape(n, self.n_kv, d)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            cos, sin = rope.cos_sin()
            q, k = apply_rotary(q, cos, sin).to(v.dtype), apply_rotary(k, cos, sin).to(v.dtype)
        o = attn.attend(self.layer_idx, q, k, v)
        w_o = self.o_q if self.o_q is not None else self.o_proj.weight
        return linear(o.reshape(n, self.n_heads * d), w_o, None, self.gemv_ws, self.batch_invariant)


def take_quantized(modules: list[nn.Module], dtype: torch.dtype | None) -> QWeight | None:
    """The loader parks a weight it kept quantized on its `nn.Linear` as `quant_raw` (GGUF type, raw
    blocks on the device). For projections applied as one stack: their `QWeight`, rows of blocks
    concatenated in order, or None when none was kept quantized. Members kept in different formats (a
    Q4_K_M file's Q6_K attn_v beside Q4_K q and k) make a `QWeightStack`; a stack with some members
    not kept quantized gets float weights instead (`dtype`), so it packs as usual."""
    raws = [m.__dict__.pop("quant_raw", None) for m in modules]
    if all(r is None for r in raws):
        return None
    k = modules[0].in_features
    if all(r is not None for r in raws) and len({r[0] for r in raws}) > 1:
        return QWeightStack(tuple(QWeight.from_raw(r[0], r[1], r[1].shape[0], k) for r in raws))
    if any(r is None for r in raws):
        for m, r in zip(modules, raws):
            if r is not None:
                w = QWeight.from_raw(r[0], r[1], r[1].shape[0], k).dequantize()
                m.weight = nn.Parameter(w.to(dtype or torch.float32), requires_grad=False)
        return None
    rows = torch.cat([r[1] for r in raws]) if len(raws) > 1 else raws[0][1]
    return QWeight.from_raw(raws[0][0], rows, rows.shape[0], k)


class QuantizedEmbedding(nn.Module):
    """An embedding table kept quantized (a GGUF file's token_embd, as llama.cpp keeps it): a step's rows
    are gathered from the blocks and dequantized in the model's dtype, the values the table expanded at
    load would give. `weight` is an empty parameter on the device in the model's dtype (what packing and
    the runner read; the LM head ties to it where the model ties them)."""

    def __init__(self, q: QWeight, dtype: torch.dtype):
        super().__init__()
        self.q = q
        self.weight = nn.Parameter(torch.zeros(0, q.k, dtype=dtype, device=q.device), requires_grad=False)

    @classmethod
    def take(cls, module: nn.Embedding, dtype: torch.dtype) -> "QuantizedEmbedding":
        """The table the loader parked on `module` as `quant_raw`."""
        fmt, raw = module.__dict__.pop("quant_raw")
        return cls(QWeight.from_raw(fmt, raw, raw.shape[0], module.embedding_dim), dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = {name: p.index_select(0, flat) for name, p in self.q.planes.items()}
        out = self.q.module.dequantize(rows, flat.numel(), self.q.k).to(self.weight.dtype)
        return out.view(*ids.shape, self.q.k)


def stack_views(modules: list[nn.Module], attr: str) -> torch.Tensor:
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
        self.batch_invariant = False  # CausalLM.set_batch_invariant

    @torch.no_grad()
    def pack(self, dtype: torch.dtype | None = None) -> None:
        self.down_q = take_quantized([self.down_proj], dtype)
        self.gate_up_q = take_quantized([self.gate_proj, self.up_proj], dtype)
        if self.gate_up_q is not None:
            return
        if self.gate_up_weight is not None:  # stacked already (a shared expert inside its MoE's stack)
            return
        if any(p.weight.requires_grad or p.weight.is_meta for p in (self.gate_proj, self.up_proj)):
            return
        self.gate_up_weight = stack_views([self.gate_proj, self.up_proj], "weight")

    def gemv_weights(self) -> tuple[torch.Tensor | None, ...]:
        """The float weights `linear` runs through the decode GEMV (`CausalLM.pack` sizes its workspace)."""
        return self.gate_up_weight, self.down_proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_gate_up = self.gate_up_q if self.gate_up_q is not None else self.gate_up_weight
        if w_gate_up is not None:
            h13 = linear(x, w_gate_up, None, self.gemv_ws, self.batch_invariant)
            if isinstance(self.down_q, QWeight) and not self.batch_invariant and h13.dim() == 2:
                return self.down_q.silu_mul_matmul(h13)
            down = self.down_q if self.down_q is not None else self.down_proj.weight
            return linear(silu_mul(h13), down, None, self.gemv_ws, self.batch_invariant)
        if self.batch_invariant:  # unpacked (MoE experts): each projection through the row-invariant linear
            gate, up = (linear(x, p.weight, invariant=True) for p in (self.gate_proj, self.up_proj))
            return linear(F.silu(gate) * up, self.down_proj.weight, invariant=True)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a [N, 2I] tensor holding gate then up."""
    if use_triton(gate_up):
        return k_act.silu_mul_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
