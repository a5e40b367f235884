"""The decoder block shared by the dense and MoE architectures: attention and an MLP or MoE layer, each
behind an RMSNorm, with the residual adds deferred into the next norm (`forward_fused`).

On the CPU a step of few rows (a decode) pays per call and per byte of weights, not per activation:
there `forward_fused` runs `CpuDecodePlan`, on weights prepared once and without the modules' dispatch
layers (module calls, kernel choices, no-op casts)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from strata.config import ModelConfig
from strata.attention import AttentionBackend
from strata.env import ENV
from strata.kernels import choices, cpu_decode
from strata.kernels.cpu_decode import CpuKernels, GatedMlp, MoeDecode, Prepared, Product, compact
from strata.models.layers import MLP, Attention, RMSNorm, RopeInputs, rms_norm
from strata.models.moe import MoE

# The most rows a CPU step runs through `CpuDecodePlan` (decodes, verifications, short prompt chunks);
# longer steps are matmul-bound and take the modules' paths.
CPU_PLAN_ROWS = 16


def cpu_kernels() -> CpuKernels | None:
    """The C kernels for few-row CPU steps, unless the kernel choices turn them off (`cpu_kernels`) or
    they cannot be built here."""
    if not choices.current().cpu_kernels:
        return None
    cache = ENV.CACHE_DIR.get()
    try:
        root = Path(cache) if cache else Path.home() / ".cache" / "strata"
    except RuntimeError:  # no home directory to resolve
        root = Path(tempfile.gettempdir()) / "strata-cache"
    return cpu_decode.load(root / "kernels")


def cpu_product(kernels: CpuKernels | None, w: torch.Tensor,
                bias: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """`x -> F.linear(x, w, bias)` for a CPU step of few rows: through the C kernels where they are
    built (`strata.kernels.cpu_decode`: w read as bf16 where that is exact), else the op F.linear runs, on
    a transposed view made once (the same floats as F.linear)."""
    if kernels is not None and w.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32):
        return Product(kernels, compact(w), None if bias is None else bias.detach().contiguous())
    return TorchProduct(w, bias)


class TorchProduct(Prepared):
    """F.linear's op on a transposed view made once."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None):
        self.w_t, self.bias = w.t(), bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.w_t) if self.bias is None else torch.addmm(self.bias, x, self.w_t)


class CpuDecodePlan(Prepared):
    """One decoder block's CPU path for steps of few rows, built by `DecoderLayer.plan_cpu` from packed
    float weights (copies: a copy of the model gets no plan until it is packed again).

    With the C kernels (`strata.kernels.cpu_decode`, fp32 models): each norm with its residual add, the
    q/k norm and rotation, each product, and the MLP or the whole MoE layer (router, routing, experts,
    shared expert) is one call; the attention is the backend's. Routing with expert groups takes the
    router's own `_route` and an expert MLP call per pair. The floats agree with the modules' to fp32
    rounding. Without them (`kernels` None): the modules' own ops on the same operands, called directly
    (`torch.mm(x, w.t())` is what F.linear runs; the MoE's pairs and combine are `MoE._picked`'s): the
    same floats."""

    def __init__(self, layer: "DecoderLayer", kernels: CpuKernels | None):
        a, m = layer.self_attn, layer.mlp
        self.norm_in, self.norm_post = layer.input_layernorm, layer.post_attention_layernorm
        self.layer_idx, self.hq, self.d, self.eps = a.layer_idx, a.n_heads, a.head_dim, a.eps
        self.nqk, self.nheads = a.n_heads + a.n_kv, a.n_heads + 2 * a.n_kv
        self.dtype = a.qkv_weight.dtype
        # Prepared weights are copies: a model that trains again (requires_grad) leaves the plan.
        self.probe = a.o_proj.weight
        self.qk_norm = a._qk_norm_weight() if a.q_norm is not None else None
        self.moe = m if isinstance(m, MoE) else None
        mlp = m.shared_experts if self.moe is not None else m
        if self.moe is not None:
            g = self.moe.gate
            self.router_w = g.weight_f32 if g.weight_f32 is not None else g.weight
            self.max_pairs = self.moe.picked_pairs
        self.kernels = kernels if self.dtype == torch.float32 and a.head_dim <= cpu_decode.MAX_HEAD_DIM else None
        self.qkv = cpu_product(self.kernels, a.qkv_weight, a.qkv_bias)
        self.o = cpu_product(self.kernels, a.o_proj.weight)
        if self.kernels is not None:
            k = self.kernels
            self.norm_w = [n.weight.detach().contiguous() for n in (self.norm_in, self.norm_post)]
            dense = () if mlp is None else (mlp.gate_up_weight, mlp.down_proj.weight)
            if self.moe is None:
                self.dense = GatedMlp(k, *compact(*dense))
                return
            w13, w2, *shared = compact(self.moe.w13, self.moe.w2, *dense)
            self.dense = GatedMlp(k, *shared) if shared else None
            self.experts = [GatedMlp(k, a13, a2) for a13, a2 in zip(w13, w2)]
            g = self.moe.gate
            self.moe_decode = None
            if g.scoring in ("sigmoid", "softmax") and (g.n_group <= 1 or g.topk_group >= g.n_group):
                self.moe_decode = MoeDecode(k, self.router_w.detach().float(), g.e_score_correction_bias, g.top_k,
                                            g.scoring == "sigmoid", g.norm, g.scale, w13, w2, tuple(shared) or None)
            return
        self.mlp = None if mlp is None else (cpu_product(None, mlp.gate_up_weight),
                                             cpu_product(None, mlp.down_proj.weight), mlp.gate_up_weight.shape[0] // 2)
        if self.moe is not None:
            self.w13 = [cpu_product(None, w) for w in self.moe.w13]
            self.w2 = [cpu_product(None, w) for w in self.moe.w2]
            self.inter = self.moe.w2.shape[2]

    @staticmethod
    def covers(layer: "DecoderLayer") -> bool:
        """Whether the block's weights are packed float tensors on the CPU that this plan runs as its
        modules would."""
        a, m = layer.self_attn, layer.mlp
        if a.qkv_weight is None or a.qkv_q is not None or a.o_q is not None or a.qkv_weight.device.type != "cpu":
            return False
        if layer.input_layernorm.zero_centred or layer.post_attention_layernorm.zero_centred:
            return False
        if (a.q_norm is None) != (a.k_norm is None):
            return False
        dense = m.shared_experts if isinstance(m, MoE) else m
        if isinstance(m, MoE) and (m.w13 is None or m.host is not None or m.fp8 is not None or m.quant is not None
                                   or m.keep_routing):
            return False
        if dense is not None and (not isinstance(dense, MLP) or dense.gate_up_weight is None
                                  or dense.gate_up_q is not None or dense.down_q is not None):
            return False
        return True

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernels is None:
            return self._forward_torch(x, residual, rope, attn)
        kern, n, d, hq = self.kernels, x.shape[0], self.d, self.hq
        if not x.is_contiguous():
            x = x.contiguous()
        h, residual = kern.add_rms_norm(x, residual, self.norm_w[0], self.norm_in.eps)
        qkv = self.qkv(h)
        cos, sin = rope.cos_sin()
        qk = kern.qk_norm_rope(qkv, self.nqk, d, self.qk_norm, cos, sin, self.eps)
        o = attn.attend(self.layer_idx, qk[:, :hq], qk[:, hq:], qkv.view(n, self.nheads, d)[:, self.nqk :])
        h, residual = kern.add_rms_norm(self.o(o.reshape(n, hq * d)), residual, self.norm_w[1], self.norm_post.eps)
        moe = self.moe
        if moe is None:
            return self.dense(h), residual
        if self.moe_decode is not None:
            return self.moe_decode(h)[0], residual
        w, ids = moe.gate._route(h, self.router_w)[:2]
        if n * ids.shape[1] > self.max_pairs:  # beyond `_picked`'s few pairs: the module's own choice of path
            out = moe._routed_on_device(h, w, ids)
            return (out if self.dense is None else self.dense(h, out, 1.0, True)), residual
        out = torch.empty_like(h)
        experts = self.experts
        for t, (row, weights) in enumerate(zip(ids.tolist(), w.tolist())):
            xt, ot = (h, out) if n == 1 else (h[t : t + 1], out[t : t + 1])
            for j, (e, scale) in enumerate(zip(row, weights)):  # the routed sum, then the shared expert
                experts[e](xt, ot, scale, j > 0)
        if self.dense is not None:
            self.dense(h, out, 1.0, True)
        return out, residual

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down, inter = self.mlp
        h = gate_up(x)
        return down(F.silu(h[:, :inter]) * h[:, inter:])

    def _forward_torch(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs,
                       attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        n, d = x.shape[0], self.d
        residual = x if residual is None else x + residual
        h = rms_norm(residual, self.norm_in.weight, self.norm_in.eps)
        qkv = self.qkv(h).view(n, self.nheads, d)
        qk, v = qkv[:, : self.nqk], qkv[:, self.nqk :]
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, self.eps)
        qk = rope.rotate(qk)
        if qk.dtype != v.dtype:
            qk = qk.to(v.dtype)
        o = attn.attend(self.layer_idx, qk[:, : self.hq], qk[:, self.hq :], v)
        residual = self.o(o.reshape(n, self.hq * d)) + residual
        h = rms_norm(residual, self.norm_post.weight, self.norm_post.eps)
        moe = self.moe
        if moe is None:
            return self._mlp(h), residual
        w, ids = moe.gate._route(h if h.dtype == torch.float32 else h.float(), self.router_w)[:2]
        k = ids.shape[1]
        if n * k > self.max_pairs:  # beyond `_picked`'s few pairs: the module's own choice of path
            out = moe._routed_on_device(h, w, ids)
        else:
            pairs, w13, w2, inter = [], self.w13, self.w2, self.inter
            for t, row in enumerate(ids.tolist()):
                xt = h if n == 1 else h[t : t + 1]
                for e in row:
                    y = w13[e](xt)
                    pairs.append(w2[e](F.silu(y[:, :inter]) * y[:, inter:]))
            y = torch.cat(pairs) * w.reshape(-1, 1)
            out = (y if y.dtype == h.dtype else y.to(h.dtype)).view(n, k, -1).sum(1)
        if self.mlp is not None:
            out = out + self._mlp(h)
        return out, residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MoE(cfg) if cfg.layer_is_moe(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.cpu_plan: CpuDecodePlan | None = None  # plan_cpu

    def plan_cpu(self, kernels: CpuKernels | None) -> None:
        """Build the CPU path for steps of few rows (`CpuDecodePlan`), where it covers the packed block;
        `kernels`: the C products, or None for torch's."""
        self.cpu_plan = CpuDecodePlan(self, kernels) if CpuDecodePlan.covers(self) else None

    def forward(self, x: torch.Tensor, rope: RopeInputs, attn: AttentionBackend) -> torch.Tensor:
        out, residual = self.forward_fused(x, None, rope, attn)
        return residual + out

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs,
                      attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """The block with its residual adds deferred into the next norm: takes the previous block's
        output and the residual stream before it (None for the first block), returns this block's
        output and the residual stream before it. The sum of the two is the block's plain output."""
        plan = self.cpu_plan
        if (plan is not None and x.shape[0] <= CPU_PLAN_ROWS and not x.is_cuda and not torch.is_grad_enabled()
                and not self.self_attn.batch_invariant and x.dtype == plan.dtype and not plan.probe.requires_grad):
            return plan.forward(x, residual, rope, attn)
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, rope, attn)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual
