"""`config.json` `model_type` → the class that builds it."""

from __future__ import annotations

from typing import Callable

from strata.config import ConfigError, ModelConfig
from strata.models.glm4_moe import Glm4MoeForCausalLM
from strata.models.qwen3 import Qwen3ForCausalLM
from strata.models.qwen3_moe import Qwen3MoeForCausalLM
from strata.models.qwen3_next import Qwen3NextForCausalLM
from strata.models.transformer import CausalLM

ARCHITECTURES: dict[str, Callable[..., CausalLM]] = {
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
}


def model_class(cfg: ModelConfig) -> Callable[..., CausalLM]:
    try:
        return ARCHITECTURES[cfg.model_type]
    except KeyError:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ConfigError(f"unknown architecture {cfg.model_type!r} (supported: {known})") from None


def build_model(cfg: ModelConfig, with_mtp: bool = False) -> CausalLM:
    """Builds on the current default device; the loader calls it under `torch.device('meta')`."""
    return model_class(cfg)(cfg, with_mtp=with_mtp)
