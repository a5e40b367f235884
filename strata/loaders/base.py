"""What every loader hands to the model builder: an HF-style config dict and HF-named tensors.

A loader's only job is to turn a file format into this. The model builder (`strata.loaders.build`)
then checks names and shapes against the model built on the meta device and assigns the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch


class LoadError(ValueError):
    """A model file that cannot be loaded. The message is one line and names the file."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass
class Checkpoint:
    """A model file read into memory lazily.

    `config` is a dict in HF `config.json` spelling (`model_type`, `hidden_size`, ...).
    `names` lists every tensor in HF naming (`model.layers.0.self_attn.q_proj.weight`);
    `get(name)` returns it as a CPU torch tensor (any float dtype; the builder casts).
    `tokenizer` is a `strata.tokenizer.Tokenizer` or None when the file has none.
    `raw(name)`, where the format has quantized tensors (GGUF): (GGUF type name, the file's blocks as a
    CPU uint8 tensor [N, bytes per row]) for a 2-D weight in a type `strata.kernels.quant` keeps
    quantized, else None; the builder uses it instead of `get` when it keeps weights quantized.
    """

    path: str
    config: dict[str, Any]
    names: list[str]
    get: Callable[[str], torch.Tensor]
    tokenizer: Any = None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    raw: Callable[[str], tuple[str, torch.Tensor] | None] | None = None
    # Each tensor's stored type (a safetensors dtype such as "BF16", or a GGUF type such as "Q8_0") and
    # its bytes in the file, where the format says (what the memory plan weighs before anything loads).
    types: dict[str, str] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for n in self.names:
            yield n, self.get(n)
