"""Qwen3-MoE: Qwen3 attention; softmax top-k routing (optionally renormalised), no shared experts,
dense MLP on `mlp_only_layers` and off the `decoder_sparse_step` grid."""

from __future__ import annotations

from strata.config import ModelConfig
from strata.models.transformer import CausalLM


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, with_mtp: bool = False):
        super().__init__(cfg.replace(use_qk_norm=True, scoring="softmax", n_shared_experts=0), with_mtp=False)
