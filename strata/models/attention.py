"""Attention backends: where a step's keys and values go and which of them each query sees.

Rules every backend follows:
- `attend(layer, q, k, v)` gets the step's N tokens flat: q [N, Hq, D], k and v [N, Hkv, D], already
  rotated. It stores k/v wherever it keeps them (or nowhere) and returns [N, Hq, D].
- `kv_store_target(layer)`: None, or (k_cache [S, Hkv, D], v_cache, slots [N]) where `attend` would
  store the step's k/v, for a caller that writes them there itself in a kernel it runs anyway (the
  fused q/k-norm + RoPE); that caller then passes `stored=True`, and `attend` stores nothing.
- The per-step layout (which token belongs to which sequence, at which position) is set on the
  backend before the forward, never passed through the model, so models stay layout-agnostic.
- Softmax scale is 1/sqrt(D) (all supported architectures use it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F


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


class AttentionBackend(ABC):
    states: RecurrentStates | None = None  # set where the model has linear-attention layers

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stored: bool = False
               ) -> torch.Tensor: ...

    def kv_store_target(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        return None


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, mask: torch.Tensor | None = None):
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] → [B, Hq, Tq, D], grouped-query aware."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and q.is_cuda:
        # Expanding K/V keeps CUDA on the flash/efficient kernels, which not all torch versions pair
        # with enable_gqa; the paged engine's kernels handle groups natively.
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=q.shape[1] != k.shape[1]
    )


class CausalBatch(AttentionBackend):
    """B sequences of equal length T, laid out row-major in the flat token dim; no cache.
    Used for training and for scoring whole texts."""

    def __init__(self, batch: int, seqlen: int):
        self.batch, self.seqlen = batch, seqlen

    def attend(self, layer, q, k, v, stored=False):
        b, t = self.batch, self.seqlen

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(b, t, x.shape[1], x.shape[2]).transpose(1, 2)

        o = sdpa(split(q), split(k), split(v), causal=True)
        return o.transpose(1, 2).reshape(b * t, q.shape[1], q.shape[2])


class ContiguousKV(AttentionBackend):
    """One contiguous K/V buffer per layer for a single sequence, preallocated to `max_len`.

    The plain generator uses it; the serving engine's paged cache replaces it. Call `step(start, n)`
    before each forward: the step's n tokens sit at positions start..start+n-1 and see every earlier
    position plus themselves causally.
    """

    def __init__(self, num_layers: int, max_len: int, n_kv: int, head_dim: int, device, dtype):
        self.k = torch.zeros(num_layers, n_kv, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.max_len = max_len
        self.start = 0
        self.n = 0

    def step(self, start: int, n: int) -> None:
        if start + n > self.max_len:
            raise ValueError(f"sequence of {start + n} tokens exceeds the context of {self.max_len}")
        self.start, self.n = start, n

    def attend(self, layer, q, k, v, stored=False):
        s, n = self.start, self.n
        end = s + n
        self.k[layer, :, s:end] = k.transpose(0, 1)
        self.v[layer, :, s:end] = v.transpose(0, 1)
        kk, vv = self.k[layer, :, :end][None], self.v[layer, :, :end][None]
        qq = q.transpose(0, 1)[None]
        if n == 1:
            o = sdpa(qq, kk, vv, causal=False)
        elif s == 0:
            o = sdpa(qq, kk, vv, causal=True)
        else:
            # Query i (at position s+i) sees keys 0..s+i.
            qpos = torch.arange(s, end, device=q.device)[:, None]
            kpos = torch.arange(end, device=q.device)[None, :]
            o = sdpa(qq, kk, vv, causal=False, mask=kpos <= qpos)
        return o[0].transpose(0, 1)
