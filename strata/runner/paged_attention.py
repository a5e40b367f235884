"""Attention over the paged KV pool for a mixed step (prompt-read chunks and decodes together).

This is the torch reference: each step gathers every scheduled sequence's K/V from the pool into a
padded [R, L] batch and runs one masked SDPA, so there is no Python loop over tokens or sequences
per layer. The gather index and mask depend only on the step's layout, so they are built once per
step in `prepare` and shared by all layers. Fast kernels replace `attend`, not the layout.
"""

from __future__ import annotations

import torch

from strata.kvcache.pool import KVPool
from strata.kernels import invariant as k_invariant
from strata.models.attention import AttentionBackend, sdpa
from strata.transfer import to_device


class PagedAttention(AttentionBackend):
    meta = None  # no layout tensors for a runner to fill: `prepare` builds the layout (see attention_backends)

    def __init__(self, pool: KVPool, batch_invariant: bool = False):
        self.pool = pool
        self.slots: torch.Tensor | None = None
        self.batch_invariant = batch_invariant  # `strata.kernels.invariant.attention` instead of SDPA

    def prepare(self, slots: torch.Tensor, starts: list[int], lens: list[int], block_tables: torch.Tensor) -> None:
        """slots [N]: pool slot of each new token; starts/lens: per sequence, the first new position and
        the number of new tokens (rows are laid out sequence after sequence); block_tables [R, B]."""
        device, bs = slots.device, self.pool.block_size
        r = len(starts)
        # Sizes come from the host lists and the per-sequence vectors travel in one pinned copy:
        # nothing here waits for the device, so a step can be launched while the previous one runs.
        lmax, qmax = max(s + n for s, n in zip(starts, lens)), max(lens)
        start_t, n_t = to_device([list(starts), list(lens)], device)
        ctx = start_t + n_t
        kpos = torch.arange(lmax, device=device)
        blocks = block_tables[:, : (lmax + bs - 1) // bs].long()
        idx = blocks.gather(1, (kpos // bs).expand(r, -1)) * bs + kpos % bs
        self.kv_index = torch.where(kpos[None] < ctx[:, None], idx, torch.zeros_like(idx))  # [R, L]
        qi = torch.arange(qmax, device=device)
        row_start = torch.cumsum(n_t, 0) - n_t
        q_valid = qi[None] < n_t[:, None]  # [R, Q]
        self.q_rows = torch.where(q_valid, row_start[:, None] + qi[None], torch.zeros_like(qi)[None])
        # Where each new token's row sits in the padded [R * Q] output. Boolean indexing would need the
        # count of valid rows from the device (a sync per layer); the host knows it.
        n_tokens = sum(lens)
        seq = torch.repeat_interleave(torch.arange(r, device=device), n_t, output_size=n_tokens)
        self.out_rows = seq * qmax + torch.arange(n_tokens, device=device) - row_start[seq]
        qpos = start_t[:, None] + qi[None]
        self.mask = (kpos[None, None] <= qpos[:, :, None]) & (kpos[None, None] < ctx[:, None, None])  # [R, Q, L]
        self.slots = slots

    def attend(self, layer, q, k, v, stored=False):
        self.pool.write(layer, self.slots, k, v)
        kk, vv = self.pool.gather(layer, self.kv_index, q.dtype)  # [R, L, Hkv, D]
        qq = q[self.q_rows]  # [R, Q, Hq, D]
        if self.batch_invariant:
            o = k_invariant.attention(qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), self.mask)
        else:
            o = sdpa(qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), causal=False, mask=self.mask[:, None])
        o = o.transpose(1, 2)  # [R, Q, Hq, D]
        return o.reshape(-1, *o.shape[2:]).index_select(0, self.out_rows)
