"""One call of the MTP layer over the paged pool, from static buffers, replayed as a CUDA graph where it can.

A call is a batch of sequences, each with one or more consecutive rows: the row at position p takes
the hidden state of p and the token at p + 1, writes the MTP layer's K/V at p and predicts the token
at p + 2. The caller puts the hidden rows in place (`stage_rows`, `stage_block`), then `run` fills
ids, positions, slots, block tables and the attention layout into host buffers (pinned on CUDA),
uploads them in one copy each and returns, per sequence, the MTP hidden state of its last row, that
row's logits (fp32) and the head's most likely token with its probability: device tensors that stay
valid until the next call. Only the last rows reach the head: a prompt's catch-up call of thousands
of rows computes one row of logits, not thousands.

CUDA graphs (`cuda_graph`, the Triton attention backend): two families, captured at start-up per
bucket of sequences, largest first, on one pool of their own, as the target's decode graphs are:
one row per sequence (the drafting recursion: draft j from draft j - 1) and up to `rows_per_seq`
rows per sequence (after a verification step: the verified tokens' rows). Padding rows write their
K/V into the padding block's slot 0 and padding sequences have no rows and no context. Calls that
fit no graph (a prompt's catch-up, a read's rows with STRATA_SPLIT_MTP_BATCH, a sequence with blocks
in the host KV tier) run eagerly on the same buffers; nothing is allocated for inputs either way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from strata.kvcache.pool import KVPool
from strata.attention import AttentionBackend
from strata.models.transformer import CausalLM
from strata.config import graph_buckets

log = logging.getLogger("strata")


@dataclass
class _DraftGraph:
    graph: torch.cuda.CUDAGraph
    seqs: int
    rows: int
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # h_last, logits, top, top_p


class MTPStep:
    def __init__(self, model: CausalLM, pool: KVPool, attn: AttentionBackend, *, max_seqs: int, max_rows: int,
                 rows_per_seq: int, max_model_len: int, device: torch.device, dtype: torch.dtype, cuda_graph: bool):
        self.model, self.pool, self.attn, self.device = model, pool, attn, torch.device(device)
        self.max_seqs, self.max_rows, self.rows_per_seq = max_seqs, max_rows, rows_per_seq
        self.max_model_len = max_model_len
        bs = pool.block_size
        self.max_blocks = (max_model_len + bs - 1) // bs
        cuda = self.device.type == "cuda"
        t, s = max_rows, max_seqs + 1  # +1: a graph's padding sequence

        def host(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, pin_memory=cuda)

        def dev(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        self.d_hidden = dev(t, model.config.hidden_size, dtype=dtype)
        self.h_ids, self.h_pos, self.h_slots, self.h_rows = host(t), host(t), host(t), host(t)
        self.d_ids, self.d_pos, self.d_slots, self.d_rows = dev(t), dev(t), dev(t), dev(t)
        self.h_last, self.d_last = host(s), dev(s)
        self.h_tables = host(s, self.max_blocks, dtype=torch.int32)
        self.d_tables = dev(s, self.max_blocks, dtype=torch.int32)
        self.h_meta = host(3, s, dtype=torch.int32)  # q_start, q_len, ctx_len per sequence
        self.np_ids, self.np_pos, self.np_slots = self.h_ids.numpy(), self.h_pos.numpy(), self.h_slots.numpy()
        self.np_rows, self.np_last = self.h_rows.numpy(), self.h_last.numpy()
        self.np_tables, self.np_meta = self.h_tables.numpy(), self.h_meta.numpy()
        # Before refilling a pinned buffer, wait until the copy out of it has finished.
        self.inputs_copied = torch.cuda.Event() if cuda else None
        self.rows_copied = torch.cuda.Event() if cuda else None
        self.graphs: dict[tuple[int, int], _DraftGraph] = {}  # (rows per sequence, sequences) -> graph
        self.use_graphs = cuda and cuda_graph and getattr(attn, "meta", None) is not None
        self.graph_replays = 0  # calls served by a graph (tests and benchmarks read it)

    # ---- hidden rows ------------------------------------------------------------------------------
    def stage_rows(self, src: torch.Tensor, rows: list[int]) -> None:
        """The next call's hidden inputs: rows `rows` of `src`, in that order (one gather)."""
        n = len(rows)
        self._check_rows(n)
        if self.rows_copied is not None:
            self.rows_copied.synchronize()
        self.np_rows[:n] = rows
        self.d_rows[:n].copy_(self.h_rows[:n], non_blocking=True)
        if self.rows_copied is not None:
            self.rows_copied.record()
        torch.index_select(src, 0, self.d_rows[:n], out=self.d_hidden[:n])

    def stage_block(self, src: torch.Tensor) -> None:
        """The next call's hidden inputs: all of `src` [n, H]."""
        self._check_rows(src.shape[0])
        self.d_hidden[: src.shape[0]].copy_(src)

    def _check_rows(self, n: int) -> None:
        if n > self.max_rows:
            raise ValueError(f"an MTP call of {n} rows exceeds the drafter's {self.max_rows}")

    # ---- one call ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, reqs, starts: list[int], lens: list[int], next_ids: list[int]):
        """Sequence j: rows starts[j] .. starts[j] + lens[j] - 1 of request reqs[j], fed next_ids (flat,
        sequence after sequence). Returns (h_last [R, H], logits [R, V] fp32, top [R], top_p [R])."""
        n, r = len(next_ids), len(reqs)
        self._check_rows(n)
        if r > self.max_seqs:
            raise ValueError(f"an MTP call of {r} sequences exceeds the drafter's {self.max_seqs}")
        if self.inputs_copied is not None:
            self.inputs_copied.synchronize()
        offs = self._fill(reqs, starts, lens, next_ids)
        q = max(lens)
        g = None if any(offs) else self._graph_for(q, r)  # a host-tier part is attended eagerly
        if g is not None:
            self._pad(n, r, g)
            self._upload(g.rows, g.seqs)
            g.graph.replay()
            self.graph_replays += 1
            return tuple(t[:r] for t in g.outputs)
        self._upload(n, r)
        starts = [s - o for s, o in zip(starts, offs)]
        ctx = [s + k for s, k in zip(starts, lens)]
        if getattr(self.attn, "meta", None) is not None:
            self.attn.set_layout(self.d_slots[:n], self.d_tables[:r], r, q, max(ctx))
            self.attn.plan_dequant(ctx)
        else:
            self.attn.prepare(self.d_slots[:n], starts, lens, self.d_tables[:r])
        return self._body(n, r)

    def _fill(self, reqs, starts: list[int], lens: list[int], next_ids: list[int]) -> None:
        bs = self.pool.block_size
        pos, slots, q_start, last, offs, host = [], [], [], [], [], []
        for j, (req, s, k) in enumerate(zip(reqs, starts, lens)):
            table = req.block_ids
            q_start.append(len(pos))
            last.append(len(pos) + k - 1)
            pos.extend(range(s, s + k))
            slots.extend(table[p // bs] * bs + p % bs for p in range(s, s + k))
            off = len(req.host_blocks)  # a host-tier part: see ModelRunner._fill
            self.np_tables[j, : len(table) - off] = table[off:]
            if off:
                host.append((q_start[-1], k, req.host_blocks))
            offs.append(off * bs)
        n, r = len(pos), len(reqs)
        self.np_ids[:n] = next_ids
        self.np_pos[:n] = pos
        self.np_slots[:n] = slots
        self.np_last[:r] = last
        meta = self.np_meta
        meta[0, :r], meta[1, :r], meta[2, :r] = q_start, lens, [s + k - o for s, k, o in zip(starts, lens, offs)]
        if hasattr(self.attn, "set_host"):
            self.attn.set_host(host)
        return offs

    def _pad(self, rows: int, seqs: int, g: _DraftGraph) -> None:
        self.np_ids[rows : g.rows] = 0
        self.np_pos[rows : g.rows] = 0
        self.np_slots[rows : g.rows] = 0
        self.np_last[seqs : g.seqs] = 0
        self.np_meta[:, seqs : g.seqs] = 0
        self.np_meta[0, seqs : g.seqs] = rows

    def _upload(self, rows: int, seqs: int) -> None:
        for h, d in ((self.h_ids, self.d_ids), (self.h_pos, self.d_pos), (self.h_slots, self.d_slots)):
            d[:rows].copy_(h[:rows], non_blocking=True)
        self.d_last[:seqs].copy_(self.h_last[:seqs], non_blocking=True)
        self.d_tables[:seqs].copy_(self.h_tables[:seqs], non_blocking=True)
        meta = getattr(self.attn, "meta", None)
        if meta is not None:
            meta[:, :seqs].copy_(self.h_meta[:, :seqs], non_blocking=True)
        if self.inputs_copied is not None:
            self.inputs_copied.record()

    def _body(self, rows: int, seqs: int):
        h = self.model.mtp_hidden(self.d_hidden[:rows], self.d_ids[:rows], self.d_pos[:rows], self.attn)
        h_last = h.index_select(0, self.d_last[:seqs])
        logits = self.model.mtp_logits(h_last)
        top_p, top = logits.softmax(-1).max(-1)
        return h_last, logits, top, top_p

    # ---- CUDA graphs ------------------------------------------------------------------------------
    def _graph_for(self, q: int, seqs: int) -> _DraftGraph | None:
        for (gq, b), g in sorted(self.graphs.items()):
            if gq >= q and b >= seqs:
                return g
        return None

    @torch.inference_mode()
    def capture_graphs(self) -> float:
        """Capture both families, largest bucket first, on one memory pool. Returns seconds."""
        if not self.use_graphs:
            return 0.0
        t0 = time.perf_counter()
        buckets = graph_buckets(self.max_seqs)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for q in sorted({self.rows_per_seq, 1}, reverse=True):
            for b in buckets:
                rows = b * q
                if rows > self.max_rows:
                    continue
                # Every sequence reads q tokens at the start of the padding block: capture writes
                # nothing that matters.
                self.h_ids[:rows] = 0
                self.h_pos[:rows] = torch.arange(q).repeat(b)
                self.h_slots[:rows] = 0
                self.h_tables[:b] = 0
                self.h_meta[0, :b] = torch.arange(0, rows, q, dtype=torch.int32)
                self.h_meta[1, :b] = q
                self.h_meta[2, :b] = q
                self.h_last[:b] = torch.arange(q - 1, rows, q)
                self._upload(rows, b)
                self.attn.set_layout(self.d_slots[:rows], self.d_tables[:b], b, q, self.max_model_len)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compile kernels and create library handles outside the capture
                        self._body(rows, b)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    outputs = self._body(rows, b)
                self.graphs[(q, b)] = _DraftGraph(graph, b, rows, outputs)
        torch.cuda.synchronize(self.device)
        took = time.perf_counter() - t0
        log.info("captured %d MTP draft graphs (up to %d sequences, 1 and %d rows each) in %.1fs",
                 len(self.graphs), buckets[0], self.rows_per_seq, took)
        return took
