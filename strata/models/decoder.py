"""The decoder block shared by the dense and MoE architectures: attention and an MLP or MoE layer, each
behind an RMSNorm, with the residual adds deferred into the next norm (`forward_fused`)."""

from __future__ import annotations

import torch
from torch import nn

from strata.config import ModelConfig
from strata.attention import AttentionBackend
from strata.models.layers import MLP, Attention, RMSNorm, RopeInputs
from strata.models.moe import MoE


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
