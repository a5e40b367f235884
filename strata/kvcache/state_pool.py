"""The per-sequence state of a hybrid model's linear-attention layers, beside the paged KV pool.

A Gated DeltaNet layer keeps, per sequence, its conv window (the last K-1 projected inputs, [C, K-1])
and its recurrent state ([H, Dk, Dv], fp32): a fixed size however long the sequence, so the pool holds
one of each per slot (`--parallel`), allocated once at start-up. The engine uses the request's slot as
its state index; a sequence read from position 0 starts from zeros (`fresh`), so a slot needs no
clearing when it changes hands, and a preempted request that is read again recomputes its state.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod

import torch

from strata.config import ModelConfig


class RecurrentStates(ABC):
    """Where the linear-attention layers (hybrid models) keep each sequence's fixed-size state.

    Rules every implementation follows:
    - `spans` lists the step's sequences in row order: (first row, rows, state index, fresh, keep). Host
      values, set before the forward like the attention layout. `fresh`: the sequence starts at
      position 0, so its state is read as zeros (whatever the slot held before). `keep`: a verification
      chunk; the state after each of its rows is also written to `conv_rows` / `recurrent_rows`, so
      the runner can go back to the state after the last accepted draft (`restore`).
    - `index` holds the spans' state indices on the device ([sequences], long) for batched updates.
    - `conv(layer)` [states, C, K-1] and `recurrent(layer)` [states, H, Dk, Dv] (fp32) are read and
      written in place by linear layer `layer` (counted among linear layers only); `conv_rows(layer)`
      [states, rows, C, K-1] and `recurrent_rows(layer)` [states, rows, H, Dk, Dv] only by keep spans."""

    spans: list[tuple[int, int, int, bool, bool]]
    index: torch.Tensor

    @abstractmethod
    def conv(self, layer: int) -> torch.Tensor: ...

    @abstractmethod
    def recurrent(self, layer: int) -> torch.Tensor: ...

    @abstractmethod
    def conv_rows(self, layer: int) -> torch.Tensor: ...

    @abstractmethod
    def recurrent_rows(self, layer: int) -> torch.Tensor: ...


class StatePool(RecurrentStates):
    """`verify_rows` > 0 (speculation: 1 + the most drafts) also reserves each state's copy after every
    row of a verification chunk, so a rejected draft's update can be undone by `restore`."""

    def __init__(self, num_layers: int, num_states: int, conv_channels: int, conv_kernel: int, heads: int,
                 key_dim: int, value_dim: int, device, conv_dtype: torch.dtype, verify_rows: int = 0,
                 max_rows: int = 0):
        self.device = torch.device(device)
        conv_shape = (conv_channels, conv_kernel - 1)
        rec_shape = (heads, key_dim, value_dim)
        self.conv_states = torch.zeros(num_layers, num_states, *conv_shape, dtype=conv_dtype, device=self.device)
        self.recurrent_states = torch.zeros(num_layers, num_states, *rec_shape, dtype=torch.float32, device=self.device)
        rows = max(verify_rows, 0)
        self.conv_after = torch.zeros(num_layers, num_states if rows else 0, rows, *conv_shape, dtype=conv_dtype,
                                      device=self.device)
        self.recurrent_after = torch.zeros(num_layers, num_states if rows else 0, rows, *rec_shape,
                                           dtype=torch.float32, device=self.device)
        self.max_rows = max_rows or num_states
        self.num_states, self.verify_rows = num_states, rows
        self._new_layout()

    def _new_layout(self) -> None:
        """The step layout's buffers: `_index` on the device (what a decode graph reads), staged through
        a pinned host copy so setting it never waits for the device."""
        self._index = torch.zeros(self.max_rows, dtype=torch.long, device=self.device)
        self.h_index = torch.zeros(self.max_rows, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.spans: list[tuple[int, int, int, bool, bool]] = []
        self.index = self._index[:0]

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_states: int, device, dtype: torch.dtype,
                  verify_rows: int = 0, max_rows: int = 0, layers: int | None = None) -> "StatePool":
        """`layers`: how many linear layers it holds (a pipeline stage's); default the model's."""
        if layers is None:
            layers = sum(cfg.layer_is_linear(i) for i in range(cfg.num_hidden_layers))
        channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        return cls(layers, num_states, channels, cfg.linear_conv_kernel_dim, cfg.linear_num_value_heads,
                   cfg.linear_key_head_dim, cfg.linear_value_head_dim, device, dtype, verify_rows, max_rows)

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
        return sum(t.numel() * t.element_size()
                   for t in (self.conv_states, self.recurrent_states, self.conv_after, self.recurrent_after))

    def restore(self, state: int, row: int) -> None:
        """Back to the state after row `row` of the sequence's last verification chunk (its last
        accepted draft), in every linear layer."""
        self.conv_states[:, state] = self.conv_after[:, state, row]
        self.recurrent_states[:, state] = self.recurrent_after[:, state, row]

    def view(self) -> "StatePool":
        """The same states with a step layout of its own: for a second runner (the concurrent read's
        stage), whose sequences are never the first runner's."""
        other = copy.copy(self)
        other._new_layout()
        return other

    def set_spans(self, spans: list[tuple[int, int, int, bool, bool]]) -> None:
        """The next step's sequences: (first row, rows, state index, fresh, keep), in row order."""
        self.spans = spans
        n = len(spans)
        self.h_index.numpy()[:n] = [s[2] for s in spans]
        self._index[:n].copy_(self.h_index[:n], non_blocking=True)
        self.index = self._index[:n]

    def conv(self, layer: int) -> torch.Tensor:
        return self.conv_states[layer]

    def recurrent(self, layer: int) -> torch.Tensor:
        return self.recurrent_states[layer]

    def conv_rows(self, layer: int) -> torch.Tensor:
        return self.conv_after[layer]

    def recurrent_rows(self, layer: int) -> torch.Tensor:
        return self.recurrent_after[layer]
