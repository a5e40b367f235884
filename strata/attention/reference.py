"""The torch reference backends.

- `CausalBatch`: B sequences of equal length, no cache (training, scoring whole texts).
- `ContiguousKV`: one sequence in a contiguous per-layer buffer (the single-sequence generator).
- `PagedAttention`: a mixed step (prompt-read chunks and decodes together) over the paged KV pool.
  Each step gathers every scheduled sequence's K/V from the pool into a padded [R, L] batch and runs
  one masked SDPA, so there is no Python loop over tokens or sequences per layer. The gather index
  and mask depend only on the step's layout, so they are built once per step in `prepare` and shared
  by all layers. K/V are gathered whole blocks at a time. A step whose sequences all end at the same
  position (a lone decode, one sequence's prompt chunk) needs no row maps and at most a causal mask.
  The Triton backend replaces `attend`, not the layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.attention.base import AttentionBackend
from strata.kernels import invariant as k_invariant
from strata.kvcache.pool import DensePool, KVPool
from strata.kernels.transfer import to_device


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

    def attend(self, layer, q, k, v):
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

    def attend(self, layer, q, k, v):
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


class PagedAttention(AttentionBackend):
    meta = None  # no layout tensors for a runner to fill: `prepare` builds the layout (see attention_backends)
    # Set by the CPU runner: `strata.kernels.cpu_decode`'s kernels, whose `decode_attention` serves steps of
    # one query row per sequence over an fp32 DensePool (decodes), in one call instead of a gather and SDPA.
    cpu_kernels = None

    def __init__(self, pool: KVPool, batch_invariant: bool = False):
        self.pool = pool
        self.slots: torch.Tensor | None = None
        self.batch_invariant = batch_invariant  # `strata.kernels.invariant.attention` instead of SDPA
        # The layout of a step (`prepare`): its block tables and key count, and where needed the rows'
        # maps and the mask.
        self.blocks: torch.Tensor | None = None
        self.keys = 0
        self.q_rows: torch.Tensor | None = None  # None: q is [R, Q] rows already (every sequence has Q rows)
        self.out_rows: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None  # None: every query sees every gathered key
        self._kpos: torch.Tensor | None = None  # positions 0..L-1, made once (grown by doubling), sliced per step

    def _key_positions(self, lmax: int, device: torch.device) -> torch.Tensor:
        kpos = self._kpos
        if kpos is None or kpos.shape[0] < lmax or kpos.device != device:
            self._kpos = kpos = torch.arange(max(lmax, 2 * kpos.shape[0] if kpos is not None else 256), device=device)
        return kpos[:lmax]

    def prepare(self, slots: torch.Tensor, starts: list[int], lens: list[int], block_tables: torch.Tensor) -> None:
        """slots [N]: pool slot of each new token; starts/lens: per sequence, the first new position and
        the number of new tokens (rows are laid out sequence after sequence); block_tables [R, B]."""
        device = slots.device
        r = len(starts)
        self.slots = slots
        # Sizes come from the host lists and the per-sequence vectors travel in one pinned copy:
        # nothing here waits for the device, so a step can be launched while the previous one runs.
        lmax, qmax = max(s + n for s, n in zip(starts, lens)), max(lens)
        # K/V are gathered whole blocks at a time; positions past a sequence's context are masked.
        self.blocks, self.keys = block_tables[:, : -(-lmax // self.pool.block_size)], lmax
        kpos = self._key_positions(lmax, device)
        if not self.batch_invariant and all(n == qmax and s + n == lmax for s, n in zip(starts, lens)):
            # Every sequence reads Q rows ending at the same position (a decode step of one sequence, or
            # of sequences as long as each other; one sequence's prompt chunk): q and the output are
            # plain views, and only a chunk's causal order hides keys.
            self.q_rows = self.out_rows = None
            self.mask = None if qmax == 1 else (kpos[None] <= kpos[lmax - qmax : lmax, None])[None]  # [1, Q, L]
            return
        start_t, n_t = to_device([list(starts), list(lens)], device)
        ctx = start_t + n_t
        qi = kpos[:qmax]
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

    def attend_lse(self, layer, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend` that also returns each row's log-sum-exp of its scaled scores ([N, Hq] fp32), so a
        caller can merge it with attention over other keys (`strata.attention.tiered`); fp32 math."""
        self.pool.write(layer, self.slots, k, v)
        kk, vv = self.pool.gather_blocks(layer, self.blocks, self.keys, torch.float32)  # [R, L, Hkv, D]
        qq = q.view(kk.shape[0], -1, *q.shape[1:]) if self.q_rows is None else q[self.q_rows]  # [R, Q, Hq, D]
        r, nq, hq, d = qq.shape
        hkv = kk.shape[2]
        s = torch.einsum("rqhgd,rkhd->rhgqk", qq.float().reshape(r, nq, hkv, hq // hkv, d), kk) / d ** 0.5
        if self.mask is not None:
            s = s.masked_fill(~self.mask[:, None, None], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[..., None])
        o = torch.einsum("rhgqk,rkhd->rqhgd", p, vv).reshape(r * nq, hq, d).to(q.dtype)
        lse = lse.permute(0, 3, 1, 2).reshape(r * nq, hq)
        if self.out_rows is None:
            return o, lse
        return o.index_select(0, self.out_rows), lse.index_select(0, self.out_rows)

    def attend(self, layer, q, k, v):
        kernels = self.cpu_kernels
        if (kernels is not None and self.q_rows is None and self.mask is None and not self.batch_invariant
                and type(self.pool) is DensePool and q.shape[0] == self.blocks.shape[0]
                and kernels.serves_decode_attention(self.pool.k[layer], self.pool.v[layer], self.blocks, q, k, v)):
            return kernels.decode_attention(self.pool.k[layer], self.pool.v[layer], self.slots, self.blocks,
                                            self.pool.block_size, self.keys, q, k, v)
        self.pool.write(layer, self.slots, k, v)
        kk, vv = self.pool.gather_blocks(layer, self.blocks, self.keys, q.dtype)  # [R, L, Hkv, D]
        qq = q.view(kk.shape[0], -1, *q.shape[1:]) if self.q_rows is None else q[self.q_rows]  # [R, Q, Hq, D]
        if self.batch_invariant:
            o = k_invariant.attention(qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), self.mask)
        else:
            mask = None if self.mask is None else self.mask[:, None]
            o = sdpa(qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), causal=False, mask=mask)
        o = o.transpose(1, 2)  # [R, Q, Hq, D]
        o = o.reshape(-1, *o.shape[2:])
        return o if self.out_rows is None else o.index_select(0, self.out_rows)
