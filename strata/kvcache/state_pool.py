"""The per-sequence state of a hybrid model's linear-attention layers, beside the paged KV pool.

A Gated DeltaNet layer keeps, per sequence, its conv window (the last K-1 projected inputs, [C, K-1])
and its recurrent state ([H, Dk, Dv], fp32): a fixed size however long the sequence, so the pool holds
one of each per slot (`--parallel`), allocated once at start-up. The engine uses the request's slot as
its state index; a sequence read from position 0 starts from zeros (`fresh`), so a slot needs no
clearing when it changes hands, and a preempted request that is read again recomputes its state.
"""

from __future__ import annotations

import torch

from strata.config import ModelConfig
from strata.models.attention import RecurrentStates


class StatePool(RecurrentStates):
    def __init__(self, num_layers: int, num_states: int, conv_channels: int, conv_kernel: int, heads: int,
                 key_dim: int, value_dim: int, device, conv_dtype: torch.dtype):
        self.device = torch.device(device)
        self.conv_states = torch.zeros(num_layers, num_states, conv_channels, conv_kernel - 1, dtype=conv_dtype,
                                       device=self.device)
        self.recurrent_states = torch.zeros(num_layers, num_states, heads, key_dim, value_dim, dtype=torch.float32,
                                            device=self.device)
        self._index = torch.zeros(num_states, dtype=torch.long, device=self.device)
        self.spans: list[tuple[int, int, int, bool]] = []
        self.index = self._index[:0]

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_states: int, device, dtype: torch.dtype) -> "StatePool":
        layers = sum(cfg.layer_is_linear(i) for i in range(cfg.num_hidden_layers))
        channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        return cls(layers, num_states, channels, cfg.linear_conv_kernel_dim, cfg.linear_num_value_heads,
                   cfg.linear_key_head_dim, cfg.linear_value_head_dim, device, dtype)

    @staticmethod
    def bytes_per_state(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """One sequence's state over all linear layers."""
        layers = sum(cfg.layer_is_linear(i) for i in range(cfg.num_hidden_layers))
        channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        conv = channels * (cfg.linear_conv_kernel_dim - 1) * dtype.itemsize
        rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        return layers * (conv + rec)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_states, self.recurrent_states))

    def set_spans(self, spans: list[tuple[int, int, int, bool]]) -> None:
        """The next step's sequences: (first row, rows, state index, fresh), in row order."""
        self.spans = spans
        n = len(spans)
        self._index[:n].copy_(torch.tensor([s[2] for s in spans], dtype=torch.long), non_blocking=True)
        self.index = self._index[:n]

    def conv(self, layer: int) -> torch.Tensor:
        return self.conv_states[layer]

    def recurrent(self, layer: int) -> torch.Tensor:
        return self.recurrent_states[layer]
