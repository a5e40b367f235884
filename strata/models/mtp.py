"""The multi-token-prediction draft head in the DeepSeek-V3 / GLM-4.5 layout.

    h'_i   = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])
    h''_i  = DecoderBlock(h'_i)            (its own attention K/V cache layer)
    logits = head(shared_head.norm(h''_i))  → distribution of t_{i+2}

`embed_tokens` and `shared_head.head` are shared with the main model unless the checkpoint stores
its own copies (GLM-4.5 does); the loader ties them when absent.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.config import ModelConfig
from strata.attention import AttentionBackend
from strata.models.decoder import DecoderLayer
from strata.models.layers import RMSNorm, RopeInputs, linear


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head: nn.Linear | None = None  # set by the loader when the checkpoint has its own head


class MTPLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(cfg)
        self.embed_tokens: nn.Embedding | None = None  # own copy only when the checkpoint has one

    def forward(  # type: ignore[override]
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        rope: RopeInputs,
        attn: AttentionBackend,
        main_embed: nn.Embedding,
    ) -> torch.Tensor:
        emb = (self.embed_tokens or main_embed)(next_ids)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        return super().forward(x, rope, attn)

    def logits(self, h: torch.Tensor, main_head_weight, gemv_ws: torch.Tensor | None = None) -> torch.Tensor:
        """`main_head_weight`: the main model's LM head (a tensor or a `QWeight`), used unless the
        checkpoint gave this layer its own."""
        own = self.shared_head.head
        weight = own.weight if own is not None else main_head_weight
        return linear(self.shared_head.norm(h), weight, None, gemv_ws).float()
