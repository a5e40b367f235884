"""GLM-4.5 MoE: partial rotary (neox layout on the first half of each head), q/k/v biases, optional
qk-norm; sigmoid routing with a score-correction bias, group-limited top-k, routed scaling factor
and shared experts; the first `first_k_dense_replace` layers dense. MTP layers follow the decoder
layers in the checkpoint (`num_nextn_predict_layers`)."""

from __future__ import annotations

from strata.config import ModelConfig
from strata.models.transformer import CausalLM


class Glm4MoeForCausalLM(CausalLM):
    supports_mtp = True

    def __init__(self, cfg: ModelConfig, with_mtp: bool = False):
        super().__init__(cfg.replace(scoring="sigmoid"), with_mtp=with_mtp and cfg.num_nextn_predict_layers > 0)
