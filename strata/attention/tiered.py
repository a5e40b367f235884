"""Attention over two KV tiers: a sequence's leading blocks in the host pool, the rest in the device pool.

The runner lays a tiered sequence out for the inner backend as if it began at its first device block
(block table, first position and context shifted by its host part; block-aligned, so the causal order
is unchanged), and names its host part with `set_host`. Each layer:
1. the inner backend attends over the device part and also returns each row's log-sum-exp
   (`attend_lse`: the reference in torch, on CUDA the Triton kernel's split-and-merge with an LSE
   output);
2. the host part, which every row of the step sees whole, gives (o, lse) per row: decode-sized rows
   on the CPU (`cpu`: the rows go down, the host pool is read in place, (o, lse) come back), prompt
   chunks by streaming (`stream`: the layer's host blocks are gathered into a pinned buffer and copied
   up, double-buffered: the next (layer, sequence) item is queued on a side stream while this one
   computes);
3. the two are merged by log-sum-exp, host part first (`merge`), a fixed order.
On the CPU both ways run the same code with the "device" being the CPU. Nothing here allocates device
memory per step beyond the torch reference's temporaries: the streaming buffers are made at start-up.
"""

from __future__ import annotations

import torch

from strata.attention.base import AttentionBackend
from strata.kvcache.pool import Int8Pool, KVPool, pool_tensors


def attend_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows q [Q, Hq, D] over keys k/v [L, Hkv, D], every key visible; fp32 math. Returns (o [Q, Hq, D]
    fp32, lse [Q, Hq] fp32, natural log)."""
    nq, hq, d = q.shape
    hkv = k.shape[1]
    qq = q.float().view(nq, hkv, hq // hkv, d)
    s = torch.einsum("qhgd,khd->hgqk", qq, k.float()) * scale
    lse = torch.logsumexp(s, dim=-1)  # [Hkv, G, Q]
    p = torch.exp(s - lse[..., None])
    o = torch.einsum("hgqk,khd->qhgd", p, v.float()).reshape(nq, hq, d)
    return o, lse.permute(2, 0, 1).reshape(nq, hq)


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets from each's normalised output and log-sum-exp ([Q, H, D],
    [Q, H]); fp32. Either part may be empty (lse -inf)."""
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    return (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]


class _Stage:
    """One streaming buffer: the pinned gather of one layer's host blocks and its device copy."""

    def __init__(self, host_pool: KVPool, max_blocks: int, device: torch.device, cuda: bool):
        bs = host_pool.block_size
        self.pinned, self.dev = [], []
        for t in pool_tensors(host_pool):
            width = bs * (t[0, 0].numel())
            self.pinned.append(torch.zeros((max_blocks, width), dtype=t.dtype, pin_memory=cuda))
            self.dev.append(torch.zeros((max_blocks, width), dtype=t.dtype, device=device) if cuda else self.pinned[-1])
        self.idx = torch.zeros(max_blocks, dtype=torch.long)
        self.event = torch.cuda.Event() if cuda else None
        self.item: tuple[int, int] | None = None  # (layer, span) staged here


class TieredAttention(AttentionBackend):
    def __init__(self, inner: AttentionBackend, host_pool: KVPool, *, device, decode_rows: int,
                 max_host_tokens: int, num_layers: int):
        """`decode_rows`: a sequence with at most this many rows in the step attends its host part on the
        CPU; longer ones stream it. `max_host_tokens`: the longest host part (sizes the stream buffers)."""
        self.inner, self.host_pool, self.device = inner, host_pool, torch.device(device)
        self.decode_rows, self.num_layers = decode_rows, num_layers
        self.scale = 1.0 / host_pool.head_dim ** 0.5
        cuda = self.device.type == "cuda"
        max_blocks = max(-(-max_host_tokens // host_pool.block_size), 1)
        self.stages = [_Stage(host_pool, max_blocks, self.device, cuda) for _ in range(2)]
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.spans: list[tuple[int, int, torch.Tensor, int]] = []  # (first row, rows, host blocks, host tokens)
        self.streamed: list[int] = []  # indices into spans of those streamed
        self.host_rows_total = 0

    # The inner backend's layout, as the runner and the models see it.
    @property
    def meta(self):
        return self.inner.meta

    @property
    def states(self):
        return self.inner.states

    @states.setter
    def states(self, value):
        self.inner.states = value

    def set_layout(self, *args, **kwargs):
        return self.inner.set_layout(*args, **kwargs)

    def plan_dequant(self, ctx):
        return self.inner.plan_dequant(ctx)

    def prepare(self, *args, **kwargs):
        return self.inner.prepare(*args, **kwargs)

    @property
    def nbytes_stream(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.stages for t in s.dev)

    def set_host(self, spans: list[tuple[int, int, list[int]]]) -> None:
        """The step's host parts: per tiered sequence (first row, rows, host block ids)."""
        bs = self.host_pool.block_size
        self.spans = [(r0, n, torch.tensor(blocks, dtype=torch.long), len(blocks) * bs) for r0, n, blocks in spans]
        self.streamed = [i for i, (_, n, _, _) in enumerate(self.spans) if n > self.decode_rows]
        for s in self.stages:
            s.item = None

    def attend(self, layer, q, k, v):
        if not self.spans:
            return self.inner.attend(layer, q, k, v)
        o, lse = self.inner.attend_lse(layer, q, k, v)
        for i, (r0, n, blocks, tokens) in enumerate(self.spans):
            if n > self.decode_rows:
                o_h, lse_h = self._streamed(layer, i, q[r0:r0 + n])
            else:
                o_h, lse_h = self._on_host(layer, q[r0:r0 + n], blocks, tokens)
            o[r0:r0 + n] = merge(o_h, lse_h, o[r0:r0 + n], lse[r0:r0 + n]).to(o.dtype)
            self.host_rows_total += n
        return o

    def _on_host(self, layer: int, q: torch.Tensor, blocks: torch.Tensor, tokens: int):
        k, v = self.host_pool.gather_blocks(layer, blocks[None], tokens, torch.float32)
        o, lse = attend_all(q.to(self.host_pool.device), k[0], v[0], self.scale)
        return o.to(q.device, non_blocking=True), lse.to(q.device, non_blocking=True)

    # ---- streaming ---------------------------------------------------------------------------------
    def _items(self) -> list[tuple[int, int]]:
        return [(layer, i) for layer in range(self.num_layers) for i in self.streamed]

    def _stage(self, item: tuple[int, int], stage: _Stage) -> None:
        layer, i = item
        if stage.event is not None:
            stage.event.synchronize()  # its previous copy up has left the pinned buffer
        blocks = self.spans[i][2]
        nb = blocks.shape[0]
        stage.idx[:nb] = blocks
        for t, pinned in zip(pool_tensors(self.host_pool), stage.pinned):
            src = t[layer].view(t.shape[1] // self.host_pool.block_size, -1)
            torch.index_select(src, 0, stage.idx[:nb], out=pinned[:nb])
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                for pinned, dev in zip(stage.pinned, stage.dev):
                    dev[:nb].copy_(pinned[:nb], non_blocking=True)
                stage.event.record(self.stream)
        stage.item = item

    def _streamed(self, layer: int, i: int, q: torch.Tensor):
        item = (layer, i)
        stage = next((s for s in self.stages if s.item == item), None)
        if stage is None:
            stage = next(s for s in self.stages if s.item != item)
            self._stage(item, stage)
        if stage.event is not None:
            torch.cuda.current_stream(self.device).wait_event(stage.event)
        items = self._items()
        at = items.index(item) if item in items else -1
        if 0 <= at < len(items) - 1:  # the next item goes up while this one computes
            other = next(s for s in self.stages if s is not stage)
            if other.event is not None:
                # Its previous contents may still be read by a kernel queued on the compute stream.
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            if other.item != items[at + 1]:
                self._stage(items[at + 1], other)
        tokens = self.spans[i][3]
        k, v = self._dequantized(stage, tokens, q.dtype)
        return attend_all(q, k, v, self.scale)

    def _dequantized(self, stage: _Stage, tokens: int, dtype: torch.dtype):
        pool = self.host_pool
        nb = -(-tokens // pool.block_size)
        shape = (nb * pool.block_size, pool.n_kv, pool.head_dim)
        k = stage.dev[0][:nb].view(shape)[:tokens]
        v = stage.dev[1][:nb].view(shape)[:tokens]
        if isinstance(pool, Int8Pool):
            ks = stage.dev[2][:nb].view(shape[:2])[:tokens]
            vs = stage.dev[3][:nb].view(shape[:2])[:tokens]
            return k.float() * ks[..., None], v.float() * vs[..., None]
        return k, v
