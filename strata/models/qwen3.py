"""Qwen3 (dense): GQA with per-head q/k RMSNorm, full rotary, SwiGLU MLP."""

from __future__ import annotations

from strata.config import ModelConfig
from strata.models.transformer import CausalLM


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, with_mtp: bool = False):
        if cfg.is_moe:
            cfg = cfg.replace(num_experts=0)
        super().__init__(cfg.replace(use_qk_norm=True), with_mtp=False)
