"""The attention backend interface: where a step's keys and values go and which of them each query sees.

Rules every backend follows:
- `attend(layer, q, k, v)` gets the step's N tokens flat: q [N, Hq, D], k and v [N, Hkv, D], already
  rotated. It stores k/v wherever it keeps them (or nowhere) and returns [N, Hq, D].
- The per-step layout (which token belongs to which sequence, at which position) is set on the
  backend before the forward, never passed through the model, so models stay layout-agnostic.
- Softmax scale is 1/sqrt(D) (all supported architectures use it).
- The paged backends also have `attend_lse(layer, q, k, v)`: `attend` that returns each row's
  log-sum-exp of its scaled scores too ([N, Hq] fp32, natural log), which `tiered.py` merges by.
- `states`: where a hybrid model's linear-attention layers keep each sequence's state
  (`strata.kvcache.state_pool.RecurrentStates`), or None.

Backends: `reference.py` (torch: a batch without cache, one contiguous sequence, the paged pool),
`triton_backend.py` (the paged pool through `strata.kernels.attention`); `registry.make_attention`
picks one for a device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from strata.kvcache.state_pool import RecurrentStates


class AttentionBackend(ABC):
    states: RecurrentStates | None = None  # set where the model has linear-attention layers

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...
