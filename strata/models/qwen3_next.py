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
from torch import nn

from strata.config import ModelConfig
from strata.kernels import activation as k_act
from strata.kernels import moe_decode as k_moe
from strata.kernels import norm as k_norm
from strata.kernels import rope as k_rope
from strata.kernels import use_triton
from strata.kernels.causal_conv import causal_conv1d_varlen
from strata.kernels.gated_delta import gated_delta_varlen
from strata.kernels.gated_delta_decode import causal_conv1d_decode, delta_gates, gated_delta_decode_with_gating
from strata.attention import AttentionBackend, CausalBatch
from strata.kvcache.state_pool import RecurrentStates
from strata.kernels.quant import QWeight
from strata.models.layers import MLP, RMSNorm, RopeInputs, apply_rotary, linear, stack_views, take_quantized
from strata.models.moe import MoE, moe_decode_works
from strata.models.transformer import CausalLM


class ZeroCentredRMSNorm(RMSNorm):
    """RMSNorm whose weight is stored as an offset from one: x / rms(x) * (1 + w), all in fp32 (one
    kernel on CUDA, `norm.rms_norm(zero_centred=True)`)."""

    zero_centred = True

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the delta rule's output per value head, times SiLU of the z projection (one kernel
    on CUDA, `norm.gated_rms_norm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x [N, Hv, Dv]; z [N, Hv, Dv] or [N, Hk, Hv // Hk, Dv] (the projection's view)."""
        return k_norm.gated_rms_norm(x, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    QUANTIZABLE = ("in_proj_qkvz", "in_proj_ba", "out_proj")  # may stay quantized (`pack`)

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
        # `pack`: q | k | v | z | b | a rows in one tensor (in_proj_qkvz's rows regrouped), each
        # projection's weight a view of it. Non-persistent, as Attention.qkv_weight.
        self.register_buffer("in_proj_weight", None, persistent=False)
        self.in_proj_q: QWeight | None = None  # the same rows kept quantized, instead of in_proj_weight
        self.out_q: QWeight | None = None
        self.gemv_ws: torch.Tensor | None = None  # shared GEMV workspace (CausalLM.pack, on CUDA)

    def _qkvz_order(self, rows: torch.Tensor) -> torch.Tensor:
        """in_proj_qkvz's rows (floats, or a quantized file's rows of blocks) from the checkpoint's order
        (per key head: q, k, then the v and z of its `ratio` value heads) to q | k | v | z, each head-major."""
        rv = self.ratio * self.dv
        parts = rows.view(self.hk, 2 * self.dk + 2 * rv, -1).split([self.dk, self.dk, rv, rv], dim=1)
        return torch.cat([p.reshape(-1, rows.shape[1]) for p in parts])

    @torch.no_grad()
    def pack(self, dtype: torch.dtype | None = None) -> None:
        """One projection GEMM instead of two, laid out so that the conv input, z, b and a are views of
        its output, with no copies or concatenation per step: in_proj_qkvz's rows regrouped in place
        (`_qkvz_order`), then in_proj_ba's rows below them. Weights the loader kept quantized become
        `QWeight`s of the same rows (`dtype`: the model's, for a mixed stack)."""
        projs = (self.in_proj_qkvz, self.in_proj_ba)
        if "quant_raw" in self.in_proj_qkvz.__dict__:
            fmt, raw = self.in_proj_qkvz.quant_raw
            self.in_proj_qkvz.quant_raw = (fmt, self._qkvz_order(raw))
        self.out_q = take_quantized([self.out_proj], dtype)
        self.in_proj_q = take_quantized(list(projs), dtype)
        if self.in_proj_q is not None or self.in_proj_weight is not None \
                or any(p.weight.is_meta or p.weight.requires_grad for p in projs):
            return
        w = self.in_proj_qkvz.weight
        w.copy_(self._qkvz_order(w))
        self.in_proj_weight = stack_views([self.in_proj_qkvz, self.in_proj_ba], "weight")

    def gemv_weights(self) -> tuple[torch.Tensor | None, ...]:
        """The weights `linear` runs through the decode GEMV (`CausalLM.pack` sizes its workspace)."""
        return self.in_proj_weight, self.out_proj.weight

    def _project(self, x: torch.Tensor):
        """q|k|v (conv input, [N, C]), z [N, Hv, Dv] or [N, Hk, ratio, Dv], b and a [N, Hk, ratio]:
        views of the one projection after `pack`; before it, q|k|v is gathered from the checkpoint's
        order."""
        n, r = x.shape[0], self.ratio
        packed = self.in_proj_q if self.in_proj_q is not None else self.in_proj_weight
        if packed is not None:
            out = linear(x, packed, None, self.gemv_ws)
            z_end = self.conv_dim + self.hv * self.dv
            b, a = out[:, z_end:].view(n, self.hk, 2 * r).split([r, r], dim=-1)
            return out[:, : self.conv_dim], out[:, self.conv_dim : z_end].view(n, self.hv, self.dv), b, a
        qkvz = linear(x, self.in_proj_qkvz.weight)
        b, a = linear(x, self.in_proj_ba.weight).view(n, self.hk, 2 * r).split([r, r], dim=-1)
        qkvz = qkvz.view(n, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return mixed, z.unflatten(-1, (r, self.dv)), b, a

    def _heads(self, mixed: torch.Tensor, repeat: bool = True):
        """q, k, v per head; q and k repeated to the value heads unless `repeat` is off (per key head)."""
        n, kd = mixed.shape[0], self.hk * self.dk
        q, k, v = mixed.split([kd, kd, self.hv * self.dv], dim=-1)
        q, k = q.reshape(n, self.hk, self.dk), k.reshape(n, self.hk, self.dk)
        if repeat:
            q, k = q.repeat_interleave(self.ratio, dim=1), k.repeat_interleave(self.ratio, dim=1)
        return q, k, v.reshape(n, self.hv, self.dv)

    def forward(self, x: torch.Tensor, states: RecurrentStates) -> torch.Tensor:
        mixed, z, b, a = self._project(x)
        weight = self.conv1d.weight[:, 0]  # [C, K]
        conv_st, rec_st = states.conv(self.linear_idx), states.recurrent(self.linear_idx)
        spans = states.spans
        if len(spans) == x.shape[0] and not any(fresh for _, _, _, fresh, _ in spans):
            # Decode: one token per sequence, every state updated in place in one batched step (on
            # CUDA one kernel each, key heads mapped to value heads and g, beta made from a, b inside;
            # elsewhere the references).
            conv_out = causal_conv1d_decode(mixed, weight, conv_st, states.index)
            q, k, v = self._heads(conv_out, repeat=False)
            o = gated_delta_decode_with_gating(q, k, v, a, b, self.A_log, self.dt_bias, rec_st, states.index)
        else:
            o = self._reads(states, mixed.contiguous(), a, b, weight)
        o = self.norm(o.reshape(x.shape[0], self.hv, self.dv).contiguous(), z).reshape(x.shape[0], -1)
        return linear(o, self.out_q if self.out_q is not None else self.out_proj.weight, None, self.gemv_ws)

    def _reads(self, states: RecurrentStates, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               weight: torch.Tensor) -> torch.Tensor:
        """Steps with prompt chunks: the conv over every sequence in one varlen call, then the delta
        rule likewise over the plain ones; verification chunks (`keep`) token by token, their states
        after each row kept."""
        g, beta = delta_gates(a, b, self.A_log, self.dt_bias)
        conv_st, rec_st = states.conv(self.linear_idx), states.recurrent(self.linear_idx)
        for r0, n, slot, fresh, keep in states.spans:
            if keep:  # before the conv replaces the window
                self._keep_windows(states, slot, mixed[r0 : r0 + n], None if fresh else conv_st[slot])
        conv_out = causal_conv1d_varlen(mixed, weight, conv_st, [sp[:4] for sp in states.spans])
        q, k, v = self._heads(conv_out)
        o = torch.empty(mixed.shape[0], self.hv, self.dv, dtype=mixed.dtype, device=mixed.device)
        plain = [sp for sp in states.spans if not sp[4]]
        if plain:
            rows = (slice(None) if len(plain) == len(states.spans) else
                    torch.cat([torch.arange(r0, r0 + n, device=mixed.device) for r0, n, *_ in plain]))
            zeros = rec_st.new_zeros(rec_st.shape[1:])
            init = torch.stack([zeros if fresh else rec_st[slot] for _, _, slot, fresh, _ in plain])
            o[rows], final = gated_delta_varlen(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                                [n for _, n, *_ in plain], init)
            for i, (_, _, slot, _, _) in enumerate(plain):
                rec_st[slot] = final[i]
        for r0, n, slot, fresh, keep in states.spans:
            if keep:
                rows = slice(r0, r0 + n)
                o[rows] = self._verify(states, slot, conv_out[rows], a[rows], b[rows], fresh)
        return o

    def _keep_windows(self, states: RecurrentStates, slot: int, x: torch.Tensor, past: torch.Tensor | None) -> None:
        """The conv window after each row of a verification chunk: the K-1 inputs ending at it."""
        width = self.conv1d.weight.shape[-1] - 1
        before = x.new_zeros(x.shape[1], width) if past is None else past.to(x.dtype)
        full = torch.cat([before, x.t()], dim=1)
        rows = states.conv_rows(self.linear_idx)
        for t in range(x.shape[0]):
            rows[slot, t] = full[:, t + 1 : t + 1 + width]

    def _verify(self, states: RecurrentStates, slot: int, conv_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                fresh: bool) -> torch.Tensor:
        """A verification chunk token by token through the decode step (its kernel on CUDA, so that a
        verified row is computed as the plain decode of the same token is), the state updated in place
        and kept after each row."""
        rec_st, rows = states.recurrent(self.linear_idx), states.recurrent_rows(self.linear_idx)
        if fresh:
            rec_st[slot].zero_()
        q, k, v = self._heads(conv_out, repeat=False)
        index = torch.full((1,), slot, dtype=torch.long, device=v.device)
        outs = []
        for t in range(v.shape[0]):
            outs.append(gated_delta_decode_with_gating(q[t : t + 1], k[t : t + 1], v[t : t + 1], a[t : t + 1],
                                                       b[t : t + 1], self.A_log, self.dt_bias, rec_st, index))
            rows[slot, t] = rec_st[slot]
        return torch.cat(outs)


class GatedAttention(nn.Module):
    QUANTIZABLE = ("q_proj", "k_proj", "v_proj", "o_proj")  # may stay quantized (`pack`)

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
        # `pack`: gate | q | k | v rows in one tensor (q_proj's rows regrouped, gates first), each
        # projection's weight a view of it. Non-persistent, as Attention.qkv_weight.
        self.register_buffer("gqkv_weight", None, persistent=False)
        self.gqkv_q: QWeight | None = None  # the same rows kept quantized, instead of gqkv_weight
        self.o_q: QWeight | None = None
        self.gemv_ws: torch.Tensor | None = None  # shared GEMV workspace (CausalLM.pack, on CUDA)

    def _gates_first(self, rows: torch.Tensor) -> torch.Tensor:
        """q_proj's rows (floats, or a quantized file's rows of blocks), per head its q then its gate,
        as all gates, then all q."""
        per_head = rows.view(self.n_heads, 2, self.head_dim, rows.shape[1])
        return torch.cat([per_head[:, 1].reshape(-1, rows.shape[1]), per_head[:, 0].reshape(-1, rows.shape[1])])

    @torch.no_grad()
    def pack(self, dtype: torch.dtype | None = None) -> None:
        """One projection GEMM instead of three, its output laid out for the fused q/k norm + RoPE
        kernel (q | k | v contiguous after the gates): q_proj's rows regrouped in place (`_gates_first`).
        Weights the loader kept quantized become `QWeight`s of the same rows (`dtype`: the model's, for a
        mixed stack)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if "quant_raw" in self.q_proj.__dict__:
            fmt, raw = self.q_proj.quant_raw
            self.q_proj.quant_raw = (fmt, self._gates_first(raw))
        self.o_q = take_quantized([self.o_proj], dtype)
        self.gqkv_q = take_quantized(list(projs), dtype)
        if self.gqkv_q is not None or self.gqkv_weight is not None or any(
                p.bias is not None or p.weight.is_meta or p.weight.requires_grad for p in projs):
            return
        w = self.q_proj.weight
        w.copy_(self._gates_first(w))
        self.gqkv_weight = stack_views(list(projs), "weight")

    def gemv_weights(self) -> tuple[torch.Tensor | None, ...]:
        """The weights `linear` runs through the decode GEMV (`CausalLM.pack` sizes its workspace)."""
        return self.gqkv_weight, self.o_proj.weight

    def forward(self, x: torch.Tensor, rope: RopeInputs, attn: AttentionBackend) -> torch.Tensor:
        n, d, hd = x.shape[0], self.head_dim, self.n_heads * self.head_dim
        if self.gqkv_q is not None and not use_triton(x):  # gate | q | k | v from the quantized stack
            out = linear(x, self.gqkv_q)
            gate, q, k, v = out.split([hd, hd, self.n_kv * d, self.n_kv * d], dim=-1)
            q, k, v = q.reshape(n, self.n_heads, d), k.reshape(n, self.n_kv, d), v.reshape(n, self.n_kv, d)
            cos, sin = rope.cos_sin()
            q = apply_rotary(self.q_norm(q), cos, sin).to(v.dtype)
            k = apply_rotary(self.k_norm(k), cos, sin).to(v.dtype)
        elif (self.gqkv_q is not None or self.gqkv_weight is not None) and use_triton(x):
            packed = self.gqkv_q if self.gqkv_q is not None else self.gqkv_weight
            out = linear(x, packed, None, self.gemv_ws)
            gate = out[:, :hd]
            q, k, v = k_rope.qk_norm_rope_triton(
                out[:, hd:], rope.positions, rope.rotary.inv_freq, rope.rotary.scale, self.q_norm.weight,
                self.k_norm.weight, self.q_norm.eps, self.n_heads, self.n_kv, d, rope.rotary.rotary_dim,
                zero_centred=True)
        else:
            if self.gqkv_weight is not None:  # packed: q_proj's rows are the gates, then q
                gate, q = self.q_proj(x).split([hd, hd], dim=-1)
                q = q.view(n, self.n_heads, d)
            else:
                q, gate = self.q_proj(x).view(n, self.n_heads, 2 * d).split([d, d], dim=-1)
                gate = gate.reshape(n, -1)
            k = self.k_proj(x).view(n, self.n_kv, d)
            v = self.v_proj(x).view(n, self.n_kv, d)
            cos, sin = rope.cos_sin()
            q = apply_rotary(self.q_norm(q), cos, sin).to(v.dtype)
            k = apply_rotary(self.k_norm(k), cos, sin).to(v.dtype)
        o = attn.attend(self.kv_idx, q, k, v).reshape(n, hd)
        w_o = self.o_q if self.o_q is not None else self.o_proj.weight
        return linear(o * torch.sigmoid(gate), w_o, self.o_proj.bias, self.gemv_ws)


class SharedGatedMoE(MoE):
    """Routed experts plus one shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.replace(n_shared_experts=0))
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.fused_shared = False  # `pack_experts`: the shared expert runs inside the fused decode kernels

    @torch.no_grad()
    def pack_experts(self, extra: MLP | None = None) -> str:
        """The routed experts' stacks, with the shared expert stacked after them when it has their shape,
        so that a decode step runs it as one more (token, expert) pair of the fused kernels, weighted by
        its gate (`fused_shared`), where it took two GEMVs, a SiLU·mul and the gated add."""
        shared, first = self.shared_expert, self.experts[0]
        linears = (shared.gate_proj, shared.up_proj, shared.down_proj)
        same = all(a.weight.shape == b.weight.shape for a, b in zip(linears, (first.gate_proj, first.up_proj,
                                                                             first.down_proj)))
        kept_quantized = any("quant_raw" in lin.__dict__ for lin in linears)
        path = super().pack_experts(extra=shared if same and not kept_quantized else None)
        self.fused_shared = self.w13_ext is not None and moe_decode_works(self.w13_ext, self.w2_ext,
                                                                          self.num_experts_per_tok + 1)
        return path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.fused_shared and not self.batch_invariant and x.dim() == 2
                and self.decode_kernels_serve(x, self.num_experts_per_tok + 1, self.w13_ext)):
            w, ids, _ = self.gate(x)
            if self.keep_routing:
                self.last_expert_ids = ids.detach()
            w, ids = k_act.append_gated_expert_triton(x, self.shared_expert_gate.weight, w.contiguous(),
                                                      ids.contiguous(), self.num_experts)
            return k_moe.moe_experts_decode_triton(x, ids, w, self.w13_ext, self.w2_ext)
        shared: list[torch.Tensor] = []
        routed = self.routed(x, lambda: shared.append(self.shared_expert(x)))
        return k_act.sigmoid_gated_add(routed, shared[0], x, self.shared_expert_gate.weight)


class HybridDecoderLayer(nn.Module):
    """Layer `layer_idx` of the stack; an MTP layer (`mtp_depth` given) is full attention with its K/V
    after the stack's, and MoE when the model is."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, mtp_depth: int | None = None):
        super().__init__()
        before = [cfg.layer_is_linear(i) for i in range(layer_idx)]
        if mtp_depth is not None:
            self.self_attn = GatedAttention(cfg, cfg.num_full_attention_layers + mtp_depth)
        elif cfg.layer_is_linear(layer_idx):
            self.linear_attn = GatedDeltaNet(cfg, sum(before))
        else:
            self.self_attn = GatedAttention(cfg, len(before) - sum(before))
        moe = cfg.is_moe if mtp_depth is not None else cfg.layer_is_moe(layer_idx)
        self.mlp = SharedGatedMoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)
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


class Qwen3NextMTP(nn.Module):
    """The draft head as Qwen3-Next checkpoints store it (`mtp.*`), for the main model's hidden state
    h_i at position i and the token t_{i+1}:

        x  = fc([pre_fc_norm_embedding(embed(t_{i+1})); pre_fc_norm_hidden(h_i)])
        h' = norm(layers[d](x))          (full attention with its own K/V, MoE)
        logits = lm_head(h')             → distribution of t_{i+2}

    The next depth chains h' (already normed) with the drafted token, as the published servers do."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, cfg.num_hidden_layers + d, mtp_depth=d)
                                    for d in range(cfg.num_nextn_predict_layers))
        self.norm = ZeroCentredRMSNorm(h, cfg.rms_norm_eps)


class Qwen3NextForCausalLM(CausalLM):
    decoder_layer = HybridDecoderLayer
    final_norm = ZeroCentredRMSNorm
    mtp_checkpoint_prefix = "mtp."

    def __init__(self, cfg: ModelConfig, with_mtp: bool = False):
        super().__init__(cfg.replace(use_qk_norm=True, scoring="softmax", n_shared_experts=0), with_mtp=False)
        self.mtp = Qwen3NextMTP(self.config) if with_mtp and cfg.num_nextn_predict_layers > 0 else None

    @property
    def mtp_layers(self) -> list[nn.Module]:
        return list(self.mtp.layers) if self.mtp is not None else []

    @torch.no_grad()
    def pack(self) -> None:
        dtype = self.model.embed_tokens.weight.dtype
        for m in self.modules():  # first: the shared GEMV workspace is sized from the packed shapes
            if isinstance(m, (GatedDeltaNet, GatedAttention)):
                m.pack(dtype)
        super().pack()

    @property
    def num_attention_layers(self) -> int:
        """Full-attention and MTP layers (a pipeline stage's: those it holds)."""
        return sum(hasattr(m, "self_attn") for m in self.model.layers) + len(self.mtp_layers)

    def new_states(self, num_states: int, device=None, dtype: torch.dtype | None = None,
                   verify_rows: int = 0, max_rows: int = 0) -> RecurrentStates:
        """A state pool for `num_states` sequences (the engine sizes it by slots); `verify_rows`: see
        `StatePool`; `max_rows`: the most sequences (and graph rows) one step lays out."""
        from strata.kvcache.state_pool import StatePool

        w = self.model.embed_tokens.weight
        # A pipeline stage's linear layers only: the others are placeholders here.
        layers = sum(hasattr(m, "linear_attn") for m in self.model.layers)
        return StatePool.for_model(self.config, num_states, device or w.device, dtype or w.dtype, verify_rows,
                                   max_rows, layers=layers)

    def mtp_hidden(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                   depth: int = 0) -> torch.Tensor:
        m = self.mtp
        emb = m.pre_fc_norm_embedding(self.model.embed_tokens(next_ids))
        x = linear(torch.cat([emb, m.pre_fc_norm_hidden(hidden)], dim=-1), m.fc.weight)
        out, residual = m.layers[depth].forward_fused(x, None, self.rope(positions, x.dtype), attn)
        return m.norm.add_forward(out, residual)[0]

    def mtp_logits(self, h: torch.Tensor, depth: int = 0) -> torch.Tensor:
        return linear(h, self.head_weight, None, self.gemv_ws).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        if attn.states is None and isinstance(attn, CausalBatch):
            # Whole texts from their start: a scratch state per sequence.
            attn.states = self.new_states(attn.batch, input_ids.device)
            t = attn.seqlen
            attn.states.set_spans([(i * t, t, i, True, False) for i in range(attn.batch)])
        if attn.states is None:
            raise ValueError("qwen3_next needs an attention backend that carries linear-attention states")
        return super().forward(input_ids, positions, attn)
