"""Attention backends: the interface models call (`base.py`), the torch references (`reference.py`), the
Triton backend over the paged KV pool (`triton_backend.py`, its kernel in `strata.kernels.attention`)
and the registry that picks one for a device (`registry.py`)."""

from strata.attention.base import AttentionBackend
from strata.attention.reference import CausalBatch, ContiguousKV, PagedAttention, sdpa
from strata.attention.registry import make_attention

__all__ = ["AttentionBackend", "CausalBatch", "ContiguousKV", "PagedAttention", "make_attention", "sdpa"]
