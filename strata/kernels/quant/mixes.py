"""Per-tensor format mixes, as llama.cpp's quantize names them (`Q4_K_M`): which GGUF type each linear
weight of a model gets. The benchmarks build random models in a mix (`random_model(quant="Q4_K_M")`), so
the numbers are those of the files users actually have, not of one format everywhere.

Q4_K_M, as llama.cpp's quantize applies it to a dense model: Q4_K everywhere, Q6_K for the LM head, and
for `attn_v` and `ffn_down` in the layers that get more bits: the first and last eighth of the layers,
and every third layer in between (`more_bits`).
"""

from __future__ import annotations

import re

MIXES = ("Q4_K_M",)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def more_bits(layer: int, num_layers: int) -> bool:
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def tensor_type(mix: str, name: str, num_layers: int) -> str:
    """The GGUF type of the weight `name` (HF spelling, e.g. `model.layers.3.self_attn.v_proj.weight`)
    in `mix`; a single format's name is that format for every weight."""
    if mix not in MIXES:
        return mix
    if name.startswith("lm_head."):
        return "Q6_K"
    m = _LAYER.search(name)
    if m and (".v_proj." in name or ".down_proj." in name) and more_bits(int(m.group(1)), num_layers):
        return "Q6_K"
    return "Q4_K"
