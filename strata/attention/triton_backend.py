"""Attention over the paged KV pool through the Triton kernels (`strata.kernels.attention`).

The step's layout lives in device tensors the kernels read: per sequence its first query row, its
number of query rows and its context length (int32), the block tables, and each new token's slot.
`prepare` fills them from host lists for an eager step; a CUDA-graph step fills the same tensors
before replay (`layout_buffers`) and the captured launches read them in place, so nothing about the
layout is baked into a graph except its sizes (sequences, rows, query rows per sequence, splits).

Attention output goes into one preallocated buffer reused by every layer: rows that belong to no
sequence (a graph's padding) are never written, so they hold zeros or an earlier step's finite
values, never uninitialised memory that could turn into NaN downstream.
"""

from __future__ import annotations

import math

import torch

from strata.kernels import attention as k_attn
from strata.kernels import kv_dequant as k_dequant
from strata.kernels import kv_store as k_store
from strata.kernels.device import current as device_spec
from strata.kvcache.pool import Int8Pool, KVPool
from strata.attention.base import AttentionBackend
from strata.kernels.transfer import to_device

MAX_SPLITS = 32
# Over an int8 pool, steps with at least this many query rows in one sequence attend over a dequantized
# bf16 copy of their contexts (see strata.kernels.kv_dequant); decode-sized steps read int8 directly.
DEQUANT_MIN_Q = 128


class TritonPagedAttention(AttentionBackend):
    def __init__(self, pool: KVPool, *, num_q_heads: int, max_seqs: int, max_rows: int, max_split_rows: int,
                 device: torch.device, dtype: torch.dtype, max_context: int = 0, batch_invariant: bool = False):
        """max_seqs / max_rows: the most sequences and query rows of one step; max_split_rows: the most
        rows a step may have and still split its keys (decode-sized steps); max_context: the longest
        context (sizes the dequantized copy an int8 pool's prompt chunks attend over). batch_invariant:
        the kernels' invariant mode (`paged_attention_triton(invariant=True)`): decode-sized steps split
        every context in INVARIANT_SPLIT_KEYS pieces, enough for max_context; larger steps walk their
        splits in each program; int8 prompt chunks read int8 as decodes do (no dequantized copy)."""
        self.batch_invariant = batch_invariant
        self.invariant_splits = -(-max(max_context, 1) // k_attn.INVARIANT_SPLIT_KEYS)
        self.pool, self.device = pool, torch.device(device)
        self.head_dim, self.block_size = pool.head_dim, pool.block_size
        self.scale = 1.0 / math.sqrt(pool.head_dim)
        self.quantized = isinstance(pool, Int8Pool)
        # q_start, q_len, ctx_len per sequence (one spare entry for a graph's padding).
        self.meta = torch.zeros(3, max_seqs + 1, dtype=torch.int32, device=self.device)
        self.out = torch.zeros(max_rows, num_q_heads, pool.head_dim, dtype=dtype, device=self.device)
        self.lse = torch.zeros(max_rows, num_q_heads, dtype=torch.float32, device=self.device)  # attend_lse's
        max_splits = max(MAX_SPLITS, self.invariant_splits) if batch_invariant else MAX_SPLITS
        self.workspace = k_attn.SplitWorkspace(max_split_rows, num_q_heads, pool.head_dim, max_splits, self.device)
        self.max_split_rows = max_split_rows
        self.num_sms = device_spec(self.device).sm_count  # key splits fill this device's SMs
        self.slots: torch.Tensor | None = None
        self.tables: torch.Tensor | None = None
        self.num_seqs = self.max_q_len = self.num_splits = 0
        # The dequantized copy: 2 x max_context positions so a chunk and a few decodes fit beside it.
        self.dq_tokens = 2 * max_context if self.quantized and not batch_invariant else 0
        if self.dq_tokens:
            shape = (self.dq_tokens, pool.n_kv, pool.head_dim)
            self.dq_k = torch.zeros(shape, dtype=dtype, device=self.device)
            self.dq_v = torch.zeros(shape, dtype=dtype, device=self.device)
            self.dq_tables = torch.zeros(max_seqs, self.dq_tokens // self.block_size + 1, dtype=torch.int32,
                                         device=self.device)
        self.dq_slots: torch.Tensor | None = None  # pool slot of each copied position, or None: read int8

    def set_layout(self, slots: torch.Tensor, tables: torch.Tensor, num_seqs: int, max_q_len: int,
                   max_ctx: int) -> None:
        """Point the backend at a layout already in `self.meta[:, :num_seqs]`, `tables[:num_seqs]` and
        `slots`; the host sizes bound the kernels' grids and choose the key split."""
        self.slots, self.tables = slots, tables
        self.num_seqs, self.max_q_len = num_seqs, max_q_len
        self.dq_slots = None
        rows = slots.shape[0]
        splits = 1
        if rows <= self.max_split_rows:
            splits = (self.invariant_splits if self.batch_invariant else
                      k_attn.choose_num_splits(num_seqs, max_q_len, self.pool.n_kv, max_ctx, self.num_sms, MAX_SPLITS))
        self.num_splits = splits

    def prepare(self, slots: torch.Tensor, starts: list[int], lens: list[int], block_tables: torch.Tensor) -> None:
        """The reference backend's signature: per sequence the first new position and the number of
        new tokens, rows laid out sequence after sequence."""
        r = len(starts)
        q_start = [0] * r
        for i in range(1, r):
            q_start[i] = q_start[i - 1] + lens[i - 1]
        ctx = [s + n for s, n in zip(starts, lens)]
        self.meta[:, :r].copy_(to_device([q_start, list(lens), ctx], self.device, torch.int32))
        self.set_layout(slots, block_tables, r, max(lens), max(ctx))
        self.plan_dequant(ctx)

    def plan_dequant(self, ctx: list[int]) -> None:
        """For an int8 pool and a prompt-sized step: where each sequence's context goes in the dense
        copy (block-aligned regions, one after another) and which pool slot each position comes from.
        Built once per step on the device; every layer reuses it."""
        bs = self.block_size
        if not self.dq_tokens or self.max_q_len < DEQUANT_MIN_Q:
            return
        regions = [-(-c // bs) for c in ctx]
        if sum(regions) * bs > self.dq_tokens:
            return  # too much context for the copy: attend over int8 directly
        first, parts, dq_rows = 0, [], []
        for r, nb in enumerate(regions):
            blocks = self.tables[r, :nb].long()
            parts.append((blocks[:, None] * bs + torch.arange(bs, device=self.device)).reshape(-1))
            dq_rows.append(list(range(first, first + nb)))
            first += nb
        self.dq_slots = torch.cat(parts)
        width = max(regions)
        self.dq_tables[: len(ctx), :width].copy_(
            to_device([row + [0] * (width - len(row)) for row in dq_rows], self.device, torch.int32))

    def attend(self, layer, q, k, v):
        return self._attend(layer, q, k, v, None)

    def attend_lse(self, layer, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend` that also returns each row's log-sum-exp of its scaled scores ([N, Hq] fp32, natural
        log; the reference's `attend_lse`), so a caller can merge it with attention over other keys
        (`strata.attention.tiered`). Both come from buffers the next layer reuses."""
        n = q.shape[0]
        lse = self.lse[:n] if n <= self.lse.shape[0] else torch.empty(n, q.shape[1], dtype=torch.float32,
                                                                       device=q.device)
        return self._attend(layer, q, k, v, lse), lse

    def _attend(self, layer, q, k, v, lse: torch.Tensor | None) -> torch.Tensor:
        pool = self.pool
        ks, vs = (pool.k_scale[layer], pool.v_scale[layer]) if self.quantized else (None, None)
        k_store.store_kv_triton(k, v, pool.k[layer], pool.v[layer], self.slots, ks, vs)
        n, r = q.shape[0], self.num_seqs
        fits = n <= self.out.shape[0] and self.out.dtype == q.dtype
        out = self.out[:n] if fits else torch.empty_like(q)
        k_cache, v_cache, tables = pool.k[layer], pool.v[layer], self.tables
        if self.dq_slots is not None and q.dtype == self.dq_k.dtype:
            t = self.dq_slots.shape[0]
            k_cache = k_dequant.gather_dequant_triton(k_cache, ks, self.dq_slots, self.dq_k)[:t]
            v_cache = k_dequant.gather_dequant_triton(v_cache, vs, self.dq_slots, self.dq_v)[:t]
            tables, ks, vs = self.dq_tables[:r], None, None
        k_attn.paged_attention_triton(
            q, k_cache, v_cache, tables, self.meta[0, :r], self.meta[1, :r], self.meta[2, :r], out,
            block_size=self.block_size, max_q_len=self.max_q_len, scale=self.scale, k_scale=ks, v_scale=vs,
            num_splits=self.num_splits, workspace=self.workspace if self.num_splits > 1 else None,
            invariant=self.batch_invariant, lse=lse)
        return out
