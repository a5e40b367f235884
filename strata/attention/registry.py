"""Which attention backend a device gets: the Triton kernels on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import torch

from strata.config import ModelConfig
from strata.kernels import triton_available
from strata.kvcache.pool import KVPool
from strata.attention.base import AttentionBackend


def make_attention(pool: KVPool, cfg: ModelConfig, *, max_seqs: int, max_rows: int, max_split_rows: int,
                   device: torch.device, dtype: torch.dtype, max_context: int = 0,
                   batch_invariant: bool = False) -> AttentionBackend:
    """Both backends take `prepare(slots, starts, lens, tables)`; the Triton one also exposes its
    layout tensors (`meta`, `set_layout`) so the runner can fill them directly and replay graphs.
    The reference has `meta = None`. `batch_invariant`: a row's result does not depend on the batch"""
    if torch.device(device).type == "cuda" and triton_available():
        from strata.attention.triton_backend import TritonPagedAttention

        return TritonPagedAttention(pool, num_q_heads=cfg.num_attention_heads, max_seqs=max_seqs, max_rows=max_rows,
                                    max_split_rows=max_split_rows, device=device, dtype=dtype,
                                    max_context=max_context, batch_invariant=batch_invariant)
    from strata.attention.reference import PagedAttention

    return PagedAttention(pool, batch_invariant=batch_invariant)
