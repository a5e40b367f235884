"""Runs one scheduled step: builds the batch inputs, runs the model over the paged KV pool, samples.

Batch inputs go into buffers allocated once for the largest step (`max_num_batched_tokens` tokens,
`max_seqs` sequences): a step fills a prefix of each on the host and copies it to the device in one
transfer per buffer, so nothing on the hot path allocates device memory for inputs.

On CUDA, decode and verification steps (every chunk samples all its rows: one token, or its drafts
plus one) replay CUDA graphs captured at start-up per batch-size bucket, largest first, on one memory
pool. A graph covers the forward, the logits of every row, the greedy picks and their logprobs; its
inputs are the same static buffers an eager step uses, padded to the bucket. Steps with prompt reads
run eagerly, and so do steps where a sequence has blocks in the host KV tier (set in `_fill`).

Run-ahead chunks (async scheduling, `ScheduledChunk.pending`) take their first input token from the
previous launch's picks, still on the device: the runner keeps that launch's pick tensor and each
request's row in it, and copies the token into the input buffer after the upload, before the step.

Grammars (structured output): each logit row that samples has a row in a token bitmask, filled on the
host by the request's matcher before launch (all ones for requests without a grammar), uploaded with
the other inputs, and applied to the logits (`apply_token_mask`) before any pick: inside the graph
body, so graphs replay unchanged, and in eager steps that have a constrained row. A verification
row j of a constrained request gets the mask after its drafts[:j].

Two stages for run-ahead under a grammar: a constrained request's run-ahead chunk samples after a
token the host has not seen yet, so its mask cannot be filled at launch. Such a step launches its
forward only (`LaunchedStep.head_pending`; with graphs, the bucket's forward graph); once the engine
has collected the previous step and advanced the matchers, `launch_head` fills and uploads the masks
and runs the rest (logits, mask, picks; the bucket's head graph, which reads the forward graph's
hidden states). The host's mask work and its wait for the previous step overlap the forward.
"""

from __future__ import annotations

import logging
import time

import torch

from strata.config import graph_buckets
from strata.params import MAX_TOP_LOGPROBS
from strata.grammar import GrammarCompiler, GrammarMatcher
from strata.kernels.row_lse import row_logsumexp
from strata.kernels.token_mask import apply_token_mask
from strata.kvcache.pool import KVPool
from strata.kvcache.state_pool import RecurrentStates
from strata.models.decoder import cpu_kernels
from strata.models.transformer import CausalLM
from strata.attention.registry import make_attention
from strata.attention.reference import PagedAttention
from strata.attention.tiered import TieredAttention
from strata.models.moe import MoE
from strata.runner.graph_pieces import GraphCutter, GraphPieces, replay
from strata.runner.picks import Picker, SamplingRequests
from strata.runner.prompt_graphs import PROMPT_GRAPH_ROWS, PromptGraphs
from strata.runner.steps import BucketGraphs, LaunchedStep, Sampled, capture_bucket
from strata.kernels.transfer import to_device

log = logging.getLogger("strata")

# A CPU step of at most this many rows (a decode step, a short prompt) runs on one thread: its ops take
# microseconds (a product of one row is read-bound and torch does not split it), so another thread only
# adds a hand-off per op, and a wait of a scheduler tick whenever another process holds that core (a
# 32-token read of the embedded model on 2 busy cores: 10 ms on one thread, 30-370 ms on two). Longer
# steps (long prompt reads) get torch's thread count.
CPU_ONE_THREAD_ROWS = 64
# Host tokens of the layer timed both ways for `--kv-tier-decode auto`: both ways' time grows with them.
TIER_PROBE_TOKENS = 32768


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, *, max_num_batched_tokens: int, max_seqs: int,
                 max_model_len: int, device: torch.device, sampling: SamplingRequests | None = None,
                 max_drafts: int = 0, cuda_graph: bool = True, grammar: GrammarCompiler | None = None,
                 states: RecurrentStates | None = None,
                 batch_invariant: bool = False, host_pool: KVPool | None = None, tier_graphs: bool = False,
                 tier_decode: str = "cpu"):
        """`sampling`: the requests' samplers and asks (a read stage's runner shares the main one's).
        `states`: the linear-attention state pool of a hybrid model, indexed by request slot.
        `batch_invariant`: the attention backend computes each row alone. `host_pool`: the host KV tier's
        pool (`strata.attention.tiered`): requests' leading blocks may live there. `tier_graphs`: decode
        steps with a host part replay graphs cut at each attention layer (else they run eagerly).
        `tier_decode`: where decode rows attend their host part (cpu, stream, pcie, or auto: measured here)."""
        self.model, self.pool, self.device = model, pool, torch.device(device)
        self.max_model_len, self.max_seqs = max_model_len, max_seqs
        self.rows_per_seq = 1 + max_drafts  # a decode or verification chunk's most rows
        bs = pool.block_size
        self.max_blocks = (max_model_len + bs - 1) // bs
        t, s = max(max_num_batched_tokens, max_seqs * self.rows_per_seq), max_seqs + 1  # +1: graph padding
        self.attn = make_attention(pool, model.config, max_seqs=s, max_rows=t,
                                   max_split_rows=max(max_seqs * self.rows_per_seq, PROMPT_GRAPH_ROWS[0]),
                                   device=self.device,
                                   dtype=model.model.embed_tokens.weight.dtype, max_context=max_model_len,
                                   batch_invariant=batch_invariant)
        self.batch_invariant = batch_invariant
        self.attn.states = states
        cuda = self.device.type == "cuda"
        if not cuda and hasattr(self.attn, "cpu_kernels"):
            self.attn.cpu_kernels = cpu_kernels()  # decode attention in one call (strata.kernels.cpu_decode)
        self.cpu_threads = None if cuda else torch.get_num_threads()  # a long CPU step's threads
        self.tiered = host_pool is not None
        # (A batch-invariant tier assembles each tiered sequence whole, eagerly.)
        self.tier_cuts = self.tiered and tier_graphs and not batch_invariant
        self.tier_decode = "cpu"  # where decode rows read a host part: resolved below when tiered
        self.tier_decode_seconds: dict[str, float] = {}  # auto's start-up probe: one layer's host part each way
        self.attn_device = self.attn  # the backend of the device's own kernels
        if self.tiered:
            # The inner backend also gives each row's log-sum-exp (`attend_lse`): the Triton kernels' (the
            # backend with layout tensors) on CUDA, the torch reference's elsewhere.
            inner = self.attn
            if inner.meta is None:
                inner = PagedAttention(pool, batch_invariant=batch_invariant)
                inner.cpu_kernels = getattr(self.attn_device, "cpu_kernels", None)
            self.attn = TieredAttention(inner, host_pool, device=self.device, decode_rows=self.rows_per_seq,
                                        max_host_tokens=max_model_len, num_layers=model.num_attention_layers,
                                        cpu_kernels=cpu_kernels())
            self.attn.states = states
            self.tier_decode = self._tier_decode_way(tier_decode)
            self.attn.stream_decode = self.tier_decode == "stream"
            self.attn.pcie_decode = self.tier_decode == "pcie"
            self.tier_cuts = self.tier_cuts and self.tier_decode == "cpu"  # the pieces' host parts are the CPU's
        # Host staging (pinned on CUDA) and device buffers, one of each, reused every step.
        self.h_ids = torch.zeros(t, dtype=torch.long, pin_memory=cuda)
        self.h_pos = torch.zeros(t, dtype=torch.long, pin_memory=cuda)
        self.h_slots = torch.zeros(t, dtype=torch.long, pin_memory=cuda)
        self.h_tables = torch.zeros(s, self.max_blocks, dtype=torch.int32, pin_memory=cuda)
        self.h_meta = torch.zeros(3, s, dtype=torch.int32, pin_memory=cuda)
        self.np_ids, self.np_pos, self.np_slots = self.h_ids.numpy(), self.h_pos.numpy(), self.h_slots.numpy()
        self.np_tables, self.np_meta = self.h_tables.numpy(), self.h_meta.numpy()
        # On the CPU the host buffers are the device's: nothing to copy (`_upload`).
        dev = (lambda h: torch.zeros_like(h, device=self.device)) if cuda else (lambda h: h)
        self.d_ids, self.d_pos, self.d_slots, self.d_tables = (dev(h) for h in (self.h_ids, self.h_pos, self.h_slots,
                                                                                 self.h_tables))
        # Run-ahead inputs: (input row, row in the previous launch's picks) per pending chunk.
        self.h_pending = torch.zeros(2, max_seqs, dtype=torch.long, pin_memory=cuda)
        self.np_pending = self.h_pending.numpy()
        self.d_pending = dev(self.h_pending)
        self.d_pending_ids = torch.zeros(max_seqs, dtype=torch.long, device=self.device)
        self.last_picks: torch.Tensor | None = None  # the latest launch's picks (device), one per row
        self.last_pick_rows: dict[str, int] = {}  # request id -> its sampled token's row in last_picks
        self.num_pending = 0  # pending inputs of the step being launched
        # The host buffers are reused every step: before refilling them, wait until the previous step's
        # copies out of them have finished (a step that samples nothing never syncs otherwise).
        self.copied = torch.cuda.Event() if cuda else None
        # Pinned outputs, two sets: with overlapped steps one is being filled while the other is read.
        self.h_greedy = [torch.zeros(t, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.h_logprob = [torch.zeros(t, dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
        # Top alternatives of the picked rows (at most one per sequence and row), flat so a step's
        # [rows, k] prefix is contiguous; filled only in steps where some request asks.
        top_size = max_seqs * self.rows_per_seq * MAX_TOP_LOGPROBS
        self.h_top_ids = [torch.zeros(top_size, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.h_top_lp = [torch.zeros(top_size, dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
        # Token bitmasks, one row per sampling logit row (at most every sequence's drafts + 1). The
        # device copy is all ones except in the first `mask_dirty` rows (those of the last step that
        # had a grammar), so steps without grammars upload nothing.
        self.grammar = grammar
        self.matchers: dict[str, GrammarMatcher] = {}  # request id -> its grammar's state (engine-owned)
        self.h_mask = self.np_mask = self.d_mask = None
        self.mask_rows = self.mask_dirty = 0  # rows to upload this step; rows the device may hold masks in
        if grammar is not None:
            shape = (max_seqs * self.rows_per_seq, grammar.mask_words)
            self.h_mask = torch.full(shape, -1, dtype=torch.int32, pin_memory=cuda)
            self.np_mask = self.h_mask.numpy()
            self.d_mask = torch.full(shape, -1, dtype=torch.int32, device=self.device) if cuda else self.h_mask
        self.next_out = 0
        self.two_stage_steps = 0  # steps sampled by launch_head (tests and benchmarks read it)
        self.sampling = sampling if sampling is not None else SamplingRequests()
        self.picker = Picker(self.sampling, max_seqs * self.rows_per_seq, model.config.vocab_size, self.device,
                             max_seen=max_model_len + max_drafts, batch_invariant=batch_invariant)
        self.hidden: torch.Tensor | None = None
        self.row_starts: list[int] = []
        # CUDA graphs, by sequences per step; their hidden states are copied out per step (two sets, as
        # the pinned outputs) because the next replay overwrites the graph's own.
        self.graphs: dict[int, BucketGraphs] = {}
        # With the host KV tier, the same buckets cut at each attention layer, for steps with a host part.
        self.tier_graphs: dict[int, BucketGraphs] = {}
        self.use_graphs = cuda and cuda_graph
        self.hidden_out: list[torch.Tensor] = []
        self.prompt_graphs = PromptGraphs(self, max_num_batched_tokens)  # one sequence's short prompt chunk
        # Pipeline stages (`strata.dist.link.Link`): the forward hands the step to the later stages and the
        # step samples when collected, once their hidden states are back (`LaunchedStep.remote`).
        self.pipeline = None

    def release(self, request_id: str) -> None:
        self.sampling.release(request_id)
        self.matchers.pop(request_id, None)

    def constrain(self, request_id: str, matcher: GrammarMatcher) -> None:
        """Mask the request's rows by `matcher`'s state; the engine advances it after each step."""
        if self.grammar is None:
            raise ValueError("this runner was built without a grammar compiler")
        self.matchers[request_id] = matcher

    # ---- inputs ---------------------------------------------------------------------------------
    def _fill(self, chunks) -> tuple[int, list[int], list[int]]:
        """Token ids, positions, slots, block tables and per-sequence (first row, rows, context) into
        the host buffers, through numpy views (element-wise torch indexing costs microseconds each).
        Returns (rows, starts, lens)."""
        if self.copied is not None:
            self.copied.synchronize()
        bs = self.pool.block_size
        ids, pos, slots, starts, lens = [], [], [], [], []
        q_start, ctx, host = [], [], []
        tables = self.np_tables
        for r, ch in enumerate(chunks):
            req, s, k = ch.request, ch.start, ch.num_tokens
            table = req.block_ids
            q_start.append(len(ids))
            ids.extend(ch.token_ids)
            pos.extend(range(s, s + k))
            slots.extend(table[p // bs] * bs + p % bs for p in range(s, s + k))
            # A host-tier part (leading blocks): the device part is laid out as if the sequence began
            # after it, and the tiered backend attends over the host part.
            off = len(req.host_blocks)
            tables[r, : len(table) - off] = table[off:]
            off *= bs
            if off:
                host.append((len(ids) - k, k, req.host_blocks, r, s - off))
            starts.append(s - off)
            lens.append(k)
            ctx.append(s + k - off)
        if self.tiered:
            self.attn.set_host(host)
        n, r = len(ids), len(chunks)
        self.num_pending = 0
        for i, ch in enumerate(chunks):
            if ch.pending:
                self.np_pending[0, self.num_pending] = q_start[i]
                self.np_pending[1, self.num_pending] = self.last_pick_rows[ch.request.request_id]
                self.num_pending += 1
        self.np_ids[:n] = ids
        self.np_pos[:n] = pos
        self.np_slots[:n] = slots
        meta = self.np_meta
        meta[0, :r], meta[1, :r], meta[2, :r] = q_start, lens, ctx
        return n, starts, lens

    def _fill_masks(self, chunks, picks: list[int], spans: list[tuple[int, int]]) -> bool:
        """The step's bitmask rows into the host buffer (after `_fill`: the previous upload has left
        it); sets `mask_rows`, what `_upload` copies. `spans`: per pick, (first logit row, rows).
        Returns whether any row is constrained."""
        entries = []
        if self.matchers:
            for i, (r0, _) in zip(picks, spans):
                m = self.matchers.get(chunks[i].request.request_id)
                if m is not None:
                    entries.append((m, r0, chunks[i].drafts))
        if not entries and not self.mask_dirty:
            self.mask_rows = 0
            return False
        used = max((r0 + k for r0, k in spans), default=0) if entries else 0
        self.mask_rows = max(used, self.mask_dirty)
        self.np_mask[: self.mask_rows] = -1
        if entries:
            # Drafts the grammar rejects were cut by the engine; any left get all-ones rows and are
            # rejected by verification (their own row's mask excludes them).
            self.grammar.fill_masks(entries, self.np_mask)
        self.mask_dirty = used
        return bool(entries)

    def _upload(self, rows: int, seqs: int) -> None:
        if self.d_ids is not self.h_ids:
            for h, d in ((self.h_ids, self.d_ids), (self.h_pos, self.d_pos), (self.h_slots, self.d_slots)):
                d[:rows].copy_(h[:rows], non_blocking=True)
            self.d_tables[:seqs].copy_(self.h_tables[:seqs], non_blocking=True)
        if self.attn.meta is not None:
            self.attn.meta[:, :seqs].copy_(self.h_meta[:, :seqs], non_blocking=True)
        p = self.num_pending
        if self.mask_rows and self.d_mask is not self.h_mask:
            self.d_mask[: self.mask_rows].copy_(self.h_mask[: self.mask_rows], non_blocking=True)
        if p:
            if self.d_pending is not self.h_pending:
                self.d_pending[:, :p].copy_(self.h_pending[:, :p], non_blocking=True)
            picked = torch.index_select(self.last_picks, 0, self.d_pending[1, :p], out=self.d_pending_ids[:p])
            self.d_ids.index_copy_(0, self.d_pending[0, :p], picked)
        if self.copied is not None:
            self.copied.record()

    # ---- CUDA graphs ------------------------------------------------------------------------------
    def _graph_for(self, chunks) -> BucketGraphs | None:
        graphs = self.graphs
        if not graphs or len(chunks) > self.max_seqs:
            return None
        if self.tiered and self.attn.has_host:
            graphs = self.tier_graphs  # cut for the CPU's host parts, or reading them over PCIe
            if not graphs:
                return None
        for ch in chunks:
            if not ch.sample or ch.num_tokens != len(ch.drafts) + 1 or ch.num_tokens > self.rows_per_seq:
                return None
            if self.attn.states is not None and ch.start == 0:
                return None  # a fresh linear-attention state: the graphs read each slot's state
        for b in sorted(graphs):
            if b >= len(chunks):
                return graphs[b]
        return None

    def _pad(self, rows: int, seqs: int, g: BucketGraphs, chunks=()) -> None:
        """Padding rows read token 0 at position 0 and write their K/V into slot 0 (the padding block);
        padding sequences have no rows and no context, so attention skips them. With linear-attention
        states (one row per sequence: graphs are captured so only without drafts) padding rows update
        the spare state after the slots'."""
        self.np_ids[rows : g.rows] = 0
        self.np_pos[rows : g.rows] = 0
        self.np_slots[rows : g.rows] = 0
        self.np_meta[:, seqs : g.seqs] = 0
        self.np_meta[0, seqs : g.seqs] = rows
        if self.attn.states is not None:
            slots = [ch.request.slot for ch in chunks] + [self.max_seqs] * (g.rows - rows)
            self.attn.states.set_spans([(i, 1, slot, False, False) for i, slot in enumerate(slots)])

    def _tier_decode_way(self, choice: str) -> str:
        """Where decode rows attend their host part: as asked (pcie only where the inner backend is the
        Triton one), or (auto, on CUDA with the kernel path) whichever way one layer's host
        part over TIER_PROBE_TOKENS tokens took least time just now."""
        if choice != "auto":
            return "cpu" if choice == "pcie" and not self.attn.stream_kernel else choice
        if self.device.type != "cuda" or not self.attn.stream_kernel:
            return "cpu"
        times = self.tier_decode_seconds = self.attn.decode_seconds(TIER_PROBE_TOKENS,
                                                                    self.model.config.num_attention_heads)
        way = min(times, key=times.get)
        log.info("host KV decode rows: %s (one layer over %d host tokens: %s)", way, TIER_PROBE_TOKENS,
                 ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items()))
        return way

    @torch.inference_mode()
    def capture_graphs(self) -> float:
        """Capture the decode/verify graphs, largest bucket first, on one memory pool. Returns seconds."""
        if not self.use_graphs:
            return 0.0
        t0 = time.perf_counter()
        buckets = graph_buckets(self.max_seqs)
        q = self.rows_per_seq
        pool = torch.cuda.graph_pool_handle()
        rows_max = max(buckets[0] * q, self.prompt_graphs.max_rows)
        self.hidden_out = [torch.zeros(rows_max, self.model.config.hidden_size, device=self.device,
                                       dtype=self.model.model.embed_tokens.weight.dtype) for _ in range(2)]
        stream = torch.cuda.Stream(self.device)
        if self.pipeline is not None:  # the graphs hold rank 0's layers; each replay's sends follow it
            self.pipeline.capturing = True
        hosts = [m for m in self.model.modules() if isinstance(m, MoE) and m.host is not None]
        cutter = None
        if hosts:
            # Layers with experts in RAM cut the graphs into pieces; only steps their CPU computes (not
            # those streamed to the GPU, nor larger than the staging) are captured.
            cutter = GraphCutter(pool, stream)
            limit = min([m.host_staging.tokens + 1 for m in hosts]
                        + [m.stream_min_tokens for m in hosts if m.streamer is not None and m.stream_min_tokens])
            buckets = [b for b in buckets if b * q < limit]
            for m in hosts:
                m.graph_cut = cutter
        try:
            self.graphs = self._capture_buckets(buckets, pool, stream, cutter)
            if self.tier_cuts:
                self.attn.reserve_graph_rows(buckets[0] * q if buckets else 0, self.model.config.num_attention_heads)
                self.attn.graph_cut = cutter = cutter or GraphCutter(pool, stream)
                self.tier_graphs = self._capture_buckets(buckets, pool, stream, cutter)
            elif self.tier_decode == "pcie" and not self.attn.invariant:
                # The host part read over PCIe reads only device-side state (`set_host` fills it before a
                # replay): steps with one replay graphs of their own, with no cut for it.
                self.attn.capture_pcie = True
                self.tier_graphs = self._capture_buckets(buckets, pool, stream, cutter)
        finally:
            for m in hosts:
                m.graph_cut = None
            if self.tiered:
                self.attn.graph_cut = None
                self.attn.capture_pcie = False
        # A prompt chunk's graphs are left out with experts in RAM: such chunks may stream them.
        prompt = self.prompt_graphs.capture(pool, stream) if self.pipeline is None and not hosts else 0
        torch.cuda.synchronize(self.device)
        if self.pipeline is not None:
            self.pipeline.capturing = False
        took = time.perf_counter() - t0
        pieces = sum(len(g.graph.pieces) for g in self.graphs.values() if isinstance(g.graph, GraphPieces))
        tier = "" if not self.tier_graphs else (
            f"; {len(self.tier_graphs)} more cut at each attention layer for steps with a host KV part" if self.tier_cuts
            else f"; {len(self.tier_graphs)} more for steps with a host KV part read over PCIe")
        log.info("captured %d CUDA graphs (up to %d sequences x %d rows; %d for one prompt chunk of up to %d "
                 "tokens%s%s) in %.1fs", len(buckets) + prompt, max(buckets, default=0), q, prompt,
                 self.prompt_graphs.max_rows, f"; {pieces} pieces around the CPU's experts" if pieces else "", tier,
                 took)
        return took

    def _capture_buckets(self, buckets: list[int], pool, stream, cutter: GraphCutter | None = None
                         ) -> dict[int, BucketGraphs]:
        graphs = {}
        q = self.rows_per_seq
        for b in buckets:
            rows = b * q
            # A layout that exercises every row: each sequence reads q tokens at the start of the
            # padding block (slot 0), so capture writes nothing that matters.
            self.h_ids[:rows] = 0
            self.h_pos[:rows] = torch.arange(q).repeat(b)
            self.h_slots[:rows] = 0
            self.h_tables[:b] = 0
            self.h_meta[0, :b] = torch.arange(0, rows, q, dtype=torch.int32)
            self.h_meta[1, :b] = q
            self.h_meta[2, :b] = q
            if self.attn.states is not None:  # every row a decode of the spare state
                self.attn.states.set_spans([(i, 1, self.max_seqs, False, False) for i in range(rows)])
            self._upload(rows, b)
            self.attn.set_layout(self.d_slots[:rows], self.d_tables[:b], b, q, self.max_model_len)
            g = graphs[b] = capture_bucket(self._graph_body, rows, b, pool, stream, self.device, cutter)
            if self.grammar is not None or self.pipeline is not None:
                g.forward, g.head = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                if cutter is not None:
                    g.forward, g.forward_hidden = cutter.capture(self.model, self.d_ids[:rows], self.d_pos[:rows],
                                                                 self.attn)
                else:
                    with torch.cuda.graph(g.forward, pool=pool, stream=stream):
                        g.forward_hidden = self.model(self.d_ids[:rows], self.d_pos[:rows], self.attn)
                with torch.cuda.graph(g.head, pool=pool, stream=stream):
                    g.head_outputs = self._head_body(g.forward_hidden)
        return graphs

    def _graph_body(self, rows: int):
        hidden = self.model(self.d_ids[:rows], self.d_pos[:rows], self.attn)
        return hidden, *self._head_body(hidden)

    def _head_body(self, hidden: torch.Tensor):
        logits = self.model.compute_logits(hidden)
        if self.d_mask is not None:  # all ones for unconstrained rows: one read of the mask, no writes
            apply_token_mask(logits, self.d_mask[: hidden.shape[0]])
        best = logits.argmax(-1)
        lse = row_logsumexp(logits, self.batch_invariant)
        best_lp = logits.gather(1, best[:, None])[:, 0] - lse
        return logits, best, best_lp, lse

    # ---- steps -------------------------------------------------------------------------------------
    def execute(self, chunks, draft_probs: dict[str, torch.Tensor] | None = None) -> dict[str, Sampled]:
        """Launch and collect in one go (see `launch` and `collect`)."""
        step = self.launch(chunks)
        return self.collect(step, draft_probs) if step is not None else {}

    @torch.inference_mode()
    def launch(self, chunks) -> LaunchedStep | None:
        """Queue one step on the device without waiting for it: inputs, forward, the logit rows of
        chunks that sample (`chunk.sample`: the last row, or the last k+1 with k drafts), greedy
        picks and their logprobs copied towards pinned host memory."""
        if not chunks:
            return None
        n, starts, lens = self._fill(chunks)
        if self.cpu_threads is not None:
            threads = 1 if n <= CPU_ONE_THREAD_ROWS else self.cpu_threads
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        r = len(chunks)
        row_starts = [0] * r
        for i in range(1, r):
            row_starts[i] = row_starts[i - 1] + lens[i - 1]
        g = self._graph_for(chunks)
        # A constrained run-ahead row's mask needs the token still being computed: sample it later.
        defer = bool(self.matchers) and any(ch.pending and ch.request.request_id in self.matchers for ch in chunks)
        defer = defer or self.pipeline is not None
        if g is not None:
            spans = [(row_starts[i], ch.num_tokens) for i, ch in enumerate(chunks)]
            if defer:
                return self._launch_forward_graph(g, chunks, n, r, row_starts, spans)
            if self.grammar is not None:
                self._fill_masks(chunks, list(range(r)), spans)
            return self._launch_graph(g, chunks, n, r, row_starts)
        pg = self.prompt_graphs.graph_for(chunks)
        if pg is not None:
            return self.prompt_graphs.launch(pg, chunks, n, row_starts)
        picks = [i for i, ch in enumerate(chunks) if ch.sample]
        spans, m = [], 0
        for i in picks:
            spans.append((m, len(chunks[i].drafts) + 1))
            m += len(chunks[i].drafts) + 1
        masked = self.grammar is not None and not defer and self._fill_masks(chunks, picks, spans)
        if defer:
            self.mask_rows = 0  # filled and uploaded by launch_head
        if self.attn.states is not None:  # before the upload, whose event covers the layout's copy too
            self.attn.states.set_spans([(row_starts[i], ch.num_tokens, ch.request.slot, ch.start == 0, bool(ch.drafts))
                                        for i, ch in enumerate(chunks)])
        self._upload(n, r)
        if self.attn.meta is not None:
            ctx = [s + k for s, k in zip(starts, lens)]
            self.attn.set_layout(self.d_slots[:n], self.d_tables[:r], r, max(lens), max(ctx))
            self.attn.plan_dequant(ctx)
        else:
            self.attn.prepare(self.d_slots[:n], starts, lens, self.d_tables[:r])
        if self.pipeline is not None:
            self.pipeline.begin(self, r)
        hidden = self.model(self.d_ids[:n], self.d_pos[:n], self.attn)
        step = LaunchedStep(chunks, hidden, row_starts, picks, spans, head_pending=defer and bool(picks))
        if self.pipeline is not None:
            step.remote = self.pipeline.launched()
        if not step.picks or step.head_pending:
            return step
        return self._head_eager(step, masked)

    @torch.inference_mode()
    def launch_head(self, step: LaunchedStep) -> None:
        """The second stage of a two-stage step: fill and upload its masks (the matchers have seen the
        previous step's tokens now), then logits, masks and picks, as a one-stage launch would. A
        pipeline step's head runs when it is collected, its hidden states back."""
        if not step.head_pending or step.remote is not None:
            return
        step.head_pending = False
        self.two_stage_steps += 1
        masked = self._fill_masks(step.chunks, step.picks, step.spans)
        if self.mask_rows and self.d_mask is not self.h_mask:
            self.d_mask[: self.mask_rows].copy_(self.h_mask[: self.mask_rows], non_blocking=True)
            if self.copied is not None:
                self.copied.record()  # the next fill of the host mask waits for this copy too
        g = step.graph
        if g is None:
            self._head_eager(step, masked)
            return
        g.head.replay()
        self._picks_from(step, g, *g.head_outputs)

    def _head_eager(self, step: LaunchedStep, masked: bool) -> LaunchedStep:
        chunks, row_starts, hidden = step.chunks, step.row_starts, step.hidden
        rows = []
        for i in step.picks:
            ch = chunks[i]
            first = row_starts[i] + ch.num_tokens - len(ch.drafts) - 1
            rows.extend(range(first, first + len(ch.drafts) + 1))
        if len(rows) < hidden.shape[0]:  # else every row samples (a decode step): no gather
            hidden = hidden.index_select(0, to_device(rows, self.device))
        step.logits = self.model.compute_logits(hidden)
        if masked:
            apply_token_mask(step.logits, self.d_mask[: len(rows)])
        step.lse = row_logsumexp(step.logits, self.batch_invariant)
        picked, top = self.picker.pick(step.logits, step.lse, [chunks[i] for i in step.picks])
        self._send_picks(step, *picked, len(rows), top)
        return step

    def _launch_graph(self, g: BucketGraphs, chunks, n: int, r: int, row_starts: list[int]) -> LaunchedStep:
        self._pad(n, r, g, chunks)
        self._upload(g.rows, g.seqs)
        replay(g.graph, n)
        out = self.next_out
        hidden = self.hidden_out[out][:n]
        hidden.copy_(g.hidden[:n])
        step = LaunchedStep(chunks, hidden, row_starts, list(range(r)),
                            [(row_starts[i], ch.num_tokens) for i, ch in enumerate(chunks)])
        self._picks_from(step, g, g.logits, g.best, g.best_lp, g.lse)
        return step

    def _launch_forward_graph(self, g: BucketGraphs, chunks, n: int, r: int, row_starts: list[int],
                              spans: list[tuple[int, int]]) -> LaunchedStep:
        self.mask_rows = 0  # filled and uploaded by launch_head
        self._pad(n, r, g, chunks)
        self._upload(g.rows, g.seqs)
        replay(g.forward, n)
        hidden = self.hidden_out[self.next_out][:n]
        hidden.copy_(g.forward_hidden[:n])
        step = LaunchedStep(chunks, hidden, row_starts, list(range(r)), spans, head_pending=True, graph=g)
        if self.pipeline is not None:
            self.pipeline.begin(self, r)
            self.pipeline.send_replayed(n)
            step.remote = self.pipeline.launched()
        return step

    def _picks_from(self, step: LaunchedStep, g: BucketGraphs, logits, best, best_lp, lse) -> None:
        """A replayed graph's picks towards the host (after the replay and outside the graph: its
        outputs stay valid until the next replay)."""
        n, chunks = sum(k for _, k in step.spans), step.chunks  # logit rows: the hidden rows, or fewer
        if any(ch.drafts and not ch.request.params.greedy for ch in chunks):
            # Sampled drafts are verified on the host from the logits, which the next replay overwrites.
            step.logits, step.lse = logits[:n].clone(), lse[:n].clone()
        picked, top = self.picker.pick(logits[:n], lse[:n], chunks, (best[:n], best_lp[:n]))
        self._send_picks(step, *picked, n, top)

    def _send_picks(self, step: LaunchedStep, best: torch.Tensor, best_lp: torch.Tensor, m: int,
                    top: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> None:
        step.faults = self.picker.take_faults()
        self.last_picks = best
        self.last_pick_rows = {step.chunks[i].request.request_id: r0 + k1 - 1
                               for i, (r0, k1) in zip(step.picks, step.spans) if not step.chunks[i].drafts}
        step.out, self.next_out = self.next_out, 1 - self.next_out
        self.h_greedy[step.out][:m].copy_(best, non_blocking=True)
        self.h_logprob[step.out][:m].copy_(best_lp, non_blocking=True)
        if top is not None:
            ids, lps, step.top_k = top
            self.h_top_ids[step.out][: m * step.top_k].view(m, step.top_k).copy_(ids, non_blocking=True)
            self.h_top_lp[step.out][: m * step.top_k].view(m, step.top_k).copy_(lps, non_blocking=True)
        if self.device.type == "cuda":
            step.ready = torch.cuda.Event()
            step.ready.record()

    @torch.inference_mode()
    def collect(self, step: LaunchedStep, draft_probs: dict[str, torch.Tensor] | None = None) -> dict[str, Sampled]:
        """Wait for a launched step and return the tokens of its sampling chunks: one token, or with
        drafts the verified ones. `draft_probs`: the draft distributions of sampled requests.
        Afterwards `hidden` / `row_starts` describe this step (the drafter reads them)."""
        if step.remote is not None:
            step.hidden, step.remote = self.pipeline.receive(step.remote), None
            if step.graph is not None:  # its head graph reads the forward graph's hidden states
                step.graph.forward_hidden[: step.hidden.shape[0]].copy_(step.hidden)
            self.launch_head(step)
        self.hidden, self.row_starts = step.hidden, step.row_starts
        if not step.picks:
            return {}
        if step.head_pending:
            raise RuntimeError("a two-stage step is collected before launch_head")
        if step.ready is not None:
            step.ready.synchronize()
        m = sum(k for _, k in step.spans)
        greedy = self.h_greedy[step.out][:m].tolist()
        greedy_lp = self.h_logprob[step.out][:m].tolist()
        top = None
        if step.top_k:
            size = m * step.top_k
            top = (self.h_top_ids[step.out][:size].view(m, step.top_k).numpy(),
                   self.h_top_lp[step.out][:size].view(m, step.top_k).numpy())
        out = self.picker.results(step, greedy, greedy_lp, top, draft_probs)
        if self.attn.states is not None:
            # A linear layer's state has taken every row in; go back to the last accepted one.
            for i in step.picks:
                ch = step.chunks[i]
                taken = len(out[ch.request.request_id].tokens) - 1
                if ch.drafts and taken < len(ch.drafts):
                    self.attn.states.restore(ch.request.slot, taken)
        return out
