"""Qwen3-Next: a hybrid of Gated DeltaNet (linear attention) and gated full attention, with MoE
layers that add one sigmoid-gated shared expert.

Three of every four layers (`layer_types`) mix tokens with Gated DeltaNet: a depthwise causal conv
over the projected q|k|v, then the gated delta rule (`strata.kernels.gated_delta`), then an RMSNorm
gated by SiLU(z). Their per-sequence state lives in a `RecurrentStates` the attention backend
carries (`attn.states`), so the model stays layout-agnostic. The other layers are full attention with
a per-head sigmoid output gate (q_proj yields q and the gate interleaved per head) and partial rotary;
only they have K/V, numbered among themselves. Norms are zero-centred: x * (1 + w), in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.config import ModelConfig
from strata.kernels.gated_delta import (causal_conv1d_ref, causal_conv1d_step_ref, gated_delta_chunked_ref,
                                        gated_delta_step_ref)
from strata.models.attention import AttentionBackend, CausalBatch, RecurrentStates
from strata.models.layers import MLP, MoE, RMSNorm, RopeInputs, apply_rotary, linear
from strata.models.transformer import CausalLM


class ZeroCentredRMSNorm(RMSNorm):
    """RMSNorm whose weight is stored as an offset from one: x / rms(x) * (1 + w), all in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else x + residual
        return self(residual), residual


class GatedRMSNorm(nn.Module):
    """RMSNorm of the delta rule's output per value head, times SiLU of the z projection."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, linear_idx: int):
        super().__init__()
        self.linear_idx = linear_idx  # index among the linear layers: its state in `attn.states`
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.ratio = self.hv // self.hk
        key_dim, value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        h, kernel = cfg.hidden_size, cfg.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False,
                                padding=kernel - 1)
        self.in_proj_qkvz = nn.Linear(h, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = nn.Linear(h, 2 * self.hv, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, h, bias=False)

    def _project(self, x: torch.Tensor):
        """q|k|v (conv input, [N, C]), z [N, Hv, Dv], b and a [N, Hv]. The checkpoint groups the
        projections by key head: per key head q, k, then the v and z of its `ratio` value heads."""
        n, r = x.shape[0], self.ratio
        qkvz = linear(x, self.in_proj_qkvz.weight).view(n, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = linear(x, self.in_proj_ba.weight).view(n, self.hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return mixed, z.reshape(n, self.hv, self.dv), b.reshape(n, self.hv), a.reshape(n, self.hv)

    def _heads(self, mixed: torch.Tensor):
        n, kd = mixed.shape[0], self.hk * self.dk
        q, k, v = mixed.split([kd, kd, self.hv * self.dv], dim=-1)
        q = q.reshape(n, self.hk, self.dk).repeat_interleave(self.ratio, dim=1)
        k = k.reshape(n, self.hk, self.dk).repeat_interleave(self.ratio, dim=1)
        return q, k, v.reshape(n, self.hv, self.dv)

    def forward(self, x: torch.Tensor, states: RecurrentStates) -> torch.Tensor:
        mixed, z, b, a = self._project(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        weight = self.conv1d.weight[:, 0]  # [C, K]
        conv_st, rec_st = states.conv(self.linear_idx), states.recurrent(self.linear_idx)
        spans = states.spans
        if len(spans) == x.shape[0] and not any(fresh for *_, fresh in spans):
            # Decode: one token per sequence, every state updated in one batched step.
            idx = states.index
            conv_out, conv_new = causal_conv1d_step_ref(mixed, weight, conv_st.index_select(0, idx))
            conv_st.index_copy_(0, idx, conv_new.to(conv_st.dtype))
            q, k, v = self._heads(conv_out)
            o, rec_new = gated_delta_step_ref(q, k, v, g, beta, rec_st.index_select(0, idx))
            rec_st.index_copy_(0, idx, rec_new)
        else:
            o = torch.empty(x.shape[0], self.hv, self.dv, dtype=x.dtype, device=x.device)
            for r0, n, slot, fresh in spans:
                rows = slice(r0, r0 + n)
                conv_out, conv_st[slot] = causal_conv1d_ref(mixed[rows], weight, None if fresh else conv_st[slot])
                q, k, v = self._heads(conv_out)
                o[rows], rec_st[slot] = gated_delta_chunked_ref(q, k, v, g[rows], beta[rows],
                                                                None if fresh else rec_st[slot])
        o = self.norm(o.reshape(-1, self.dv), z.reshape(-1, self.dv)).reshape(x.shape[0], -1)
        return linear(o, self.out_proj.weight)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_idx: int):
        super().__init__()
        self.kv_idx = kv_idx  # index among the K/V-cached layers
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(h, 2 * self.n_heads * d, bias=bias)  # per head: q, then its gate
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: RopeInputs, attn: AttentionBackend) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(n, self.n_heads, 2 * d).split([d, d], dim=-1)
        k = self.k_proj(x).view(n, self.n_kv, d)
        v = self.v_proj(x).view(n, self.n_kv, d)
        cos, sin = rope.cos_sin()
        q = apply_rotary(self.q_norm(q), cos, sin).to(v.dtype)
        k = apply_rotary(self.k_norm(k), cos, sin).to(v.dtype)
        o = attn.attend(self.kv_idx, q, k, v).reshape(n, self.n_heads * d)
        return self.o_proj(o * torch.sigmoid(gate.reshape(n, -1)))


class SharedGatedMoE(MoE):
    """Routed experts plus one shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.replace(n_shared_experts=0))
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        before = [cfg.layer_is_linear(i) for i in range(layer_idx)]
        if cfg.layer_is_linear(layer_idx):
            self.linear_attn = GatedDeltaNet(cfg, sum(before))
        else:
            self.self_attn = GatedAttention(cfg, len(before) - sum(before))
        self.mlp = SharedGatedMoE(cfg) if cfg.layer_is_moe(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs,
                      attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """As `DecoderLayer.forward_fused`: the residual add deferred into the next norm."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        if hasattr(self, "linear_attn"):
            h = self.linear_attn(h, attn.states)
        else:
            h = self.self_attn(h, rope, attn)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class Qwen3NextForCausalLM(CausalLM):
    decoder_layer = HybridDecoderLayer
    final_norm = ZeroCentredRMSNorm

    def __init__(self, cfg: ModelConfig, with_mtp: bool = False):
        if with_mtp:
            raise ValueError("qwen3_next: the MTP layer is not supported yet")
        super().__init__(cfg.replace(use_qk_norm=True, scoring="softmax", n_shared_experts=0), with_mtp=False)

    @property
    def num_attention_layers(self) -> int:
        return self.config.num_full_attention_layers

    def new_states(self, num_states: int, device=None, dtype: torch.dtype | None = None) -> RecurrentStates:
        """A state pool for `num_states` sequences (the engine sizes it by slots)."""
        from strata.kvcache.state_pool import StatePool

        w = self.model.embed_tokens.weight
        return StatePool.for_model(self.config, num_states, device or w.device, dtype or w.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        if attn.states is None and isinstance(attn, CausalBatch):
            # Whole texts from their start: a scratch state per sequence.
            attn.states = self.new_states(attn.batch, input_ids.device)
            t = attn.seqlen
            attn.states.set_spans([(i * t, t, i, True) for i in range(attn.batch)])
        if attn.states is None:
            raise ValueError("qwen3_next needs an attention backend that carries linear-attention states")
        return super().forward(input_ids, positions, attn)
