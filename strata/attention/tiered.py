"""Attention over two KV tiers: a sequence's leading blocks in the host pool, the rest in the device pool.

The runner lays a tiered sequence out for the inner backend as if it began at its first device block
(block table, first position and context shifted by its host part; block-aligned, so the causal order
is unchanged), and names its host part with `set_host`. Each layer:
1. the inner backend attends over the device part and also returns each row's log-sum-exp
   (`attend_lse`: the reference in torch, on CUDA the Triton kernel's split-and-merge with an LSE
   output);
2. the host part, which every row of the step sees whole, gives (o, lse) per row: decode-sized rows
   on the CPU (the rows go down, the host pool is read in place, (o, lse) come back: with the C kernels
   of `strata.kernels.cpu_decode`, the span is cut into parts of at least SPAN_PART_KEYS keys, one per
   thread, each read where it lies, and the parts merged by log-sum-exp; without them, torch gathers
   and widens the span first), prompt
   chunks by streaming (the layer's host blocks are copied up on a side stream, double-buffered: the
   next (layer, sequence) item is queued while this one computes; run by run straight from the pinned
   host pool where the blocks are mostly consecutive, else gathered into a pinned buffer first) and
   attending the copy with the paged attention kernel, every row seeing all of it (`whole_context`),
   when the inner backend is the Triton one; otherwise in torch over key tiles whose scores stay within
   STREAM_SCORE_BYTES;
   With `pcie_decode` (`--kv-tier-decode pcie`) decode-sized rows instead have the paged attention
   kernel read the host part in place over PCIe (the pinned host pool is mapped into the GPU's address
   space; the span's host block ids go up as its block table), its keys split over enough programs to
   keep many reads in flight: no copy, no CPU work, no wait for the host;
3. the two are merged by log-sum-exp, host part first (`merge`), a fixed order.
On the CPU both ways run the same code with the "device" being the CPU. Nothing here allocates device
memory per step beyond the torch reference's temporaries: the streaming buffers are made at start-up.

Decode steps with a host part can still replay CUDA graphs, in pieces (`strata.runner.graph_pieces`):
captured with a `graph_cut`, each layer queues its device part and the copy of its rows down to pinned
memory, and cuts the graph there; at replay the host part attends the step's spans on the CPU into
pinned outputs (rows without a host part get lse -inf, which the merge gives no weight), and the next
piece starts with their copy up and the merge of every row.

With a batch-invariant inner backend (`--batch-invariant`) a merge would make a row's bits depend on
where its sequence's host part ends, which follows the schedule. So each tiered sequence is instead
assembled whole, per layer, into a one-layer pool of the device pool's storage (host blocks first,
then its device blocks) and attended there by a twin of the inner backend in the same mode, at its
real positions: the same keys, values and arithmetic as without the tier, so the same bits.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from strata.attention.base import AttentionBackend
from strata.kernels import attention as k_attn
from strata.kernels.transfer import to_device
from strata.kvcache.pool import Int8Pool, KVPool, make_pool, pool_tensors

log = logging.getLogger("strata")

# A streamed chunk's scores ([Hq, rows, keys] fp32) are computed over key tiles of at most this size.
STREAM_SCORE_BYTES = 64 << 20
# A host span read by the C kernel is split over threads in parts of at least this many keys: below it a
# part's hand-off costs more than its reading.
SPAN_PART_KEYS = 2048
# A streamed host part whose blocks form at most this many runs of consecutive ids is copied run by run
# straight from the (pinned) host pool; more scattered ones are gathered on the CPU first.
MAX_STREAM_RUNS = 256
# A host part read in place over PCIe is split so that one decode row's launch puts about this many
# programs on each SM (each of at least PCIE_MIN_SPLIT_KEYS keys): a read over PCIe takes microseconds,
# so many must be in flight at once, and a model with few K/V heads (Qwen3-Next's 2) has few programs
# per split. A workspace of the tier's own holds the splits' partials.
PCIE_PROGRAMS_PER_SM = 4
PCIE_MIN_SPLIT_KEYS = 256


def pcie_splits(max_host_tokens: int, num_kv_heads: int, num_sms: int) -> int:
    """Key splits for reads of a host part over PCIe: PCIE_PROGRAMS_PER_SM programs an SM for one row,
    no split shorter than PCIE_MIN_SPLIT_KEYS keys of the longest host part."""
    want = -(-PCIE_PROGRAMS_PER_SM * num_sms // max(num_kv_heads, 1))
    return max(1, min(want, -(-max_host_tokens // PCIE_MIN_SPLIT_KEYS)))


def block_runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """(first position in `blocks`, first block id, count) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for j, b in enumerate(blocks):
        if runs and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((j, b, 1))
    return runs


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
    [Q, H]); fp32. Either part may be empty (lse -inf), or both (zeros)."""
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    # Both empty (a graph's padding row): 0, not 0 / 0.
    return (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2).clamp_min(1e-30)[..., None]


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


def _like(pool: KVPool, num_blocks: int, device: torch.device) -> KVPool:
    """A one-layer pool of `pool`'s storage and block size."""
    if isinstance(pool, Int8Pool):
        return make_pool("int8", 1, num_blocks, pool.block_size, pool.n_kv, pool.head_dim, device, torch.float32)
    return make_pool("auto", 1, num_blocks, pool.block_size, pool.n_kv, pool.head_dim, device, pool.k.dtype)


def _twin(inner: AttentionBackend, pool: KVPool, max_context: int) -> AttentionBackend:
    """A backend of `inner`'s kind and batch-invariant mode over `pool`, for one sequence at a time."""
    from strata.attention.reference import PagedAttention

    if isinstance(inner, PagedAttention):
        return PagedAttention(pool, batch_invariant=True)
    from strata.attention.triton_backend import TritonPagedAttention

    return TritonPagedAttention(pool, num_q_heads=inner.out.shape[1], max_seqs=1, max_rows=inner.out.shape[0],
                                max_split_rows=inner.max_split_rows, device=inner.device, dtype=inner.out.dtype,
                                max_context=max_context, batch_invariant=True)


class TieredAttention(AttentionBackend):
    def __init__(self, inner: AttentionBackend, host_pool: KVPool, *, device, decode_rows: int,
                 max_host_tokens: int, num_layers: int, cpu_kernels=None):
        """`decode_rows`: a sequence with at most this many rows in the step attends its host part on the
        CPU; longer ones stream it. `max_host_tokens`: the longest host part (sizes the stream buffers),
        and with a batch-invariant inner backend the longest context (sizes the assembly pool).
        `cpu_kernels`: `strata.kernels.cpu_decode`'s kernels, which read the host part in place (None:
        torch's ops)."""
        self.inner, self.host_pool, self.device = inner, host_pool, torch.device(device)
        k_host = getattr(host_pool, "k", None)
        serves = cpu_kernels is not None and k_host is not None and cpu_kernels.serves_span_attention(k_host[0])
        self.cpu_kernels = cpu_kernels if serves else None
        self.threads = max(torch.get_num_threads(), 1)
        self.executor = (ThreadPoolExecutor(self.threads - 1, "strata-kv-host")
                         if self.cpu_kernels and not self.cpu_kernels.threaded_split and self.threads > 1 else None)
        self.span_bufs: tuple[torch.Tensor, ...] | None = None  # per part: o, lse, work; the merged o, lse
        self.decode_rows, self.num_layers = decode_rows, num_layers
        # Decode-sized rows stream their host part too (`--kv-tier-decode stream`), or have the kernel read
        # it in place over PCIe (`pcie`); set by the runner, as asked or measured faster.
        self.stream_decode = False
        self.pcie_decode = False
        self.pcie_spans: list[int] = []  # indices into spans of those read over PCIe
        self.scale = 1.0 / host_pool.head_dim ** 0.5
        cuda = self.device.type == "cuda"
        bs = host_pool.block_size
        max_blocks = max(-(-max_host_tokens // bs), 1)
        self.stages = [_Stage(host_pool, max_blocks, self.device, cuda) for _ in range(2)]
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        # Streamed parts go through the paged attention kernel when the device part does (the stage's
        # copy read as a pool of its own: identity block table, one sequence per streamed span).
        from strata.attention.triton_backend import TritonPagedAttention

        self.stream_kernel = isinstance(inner, TritonPagedAttention)
        if self.stream_kernel:
            self.stream_table = torch.arange(max_blocks, dtype=torch.int32, device=self.device)[None]
            self.stream_meta = torch.zeros_like(inner.meta)  # per streamed span: q_start 0, rows, host tokens
            self.stream_out = torch.zeros_like(inner.out)
            self.stream_lse = torch.zeros_like(inner.lse)
            # Per span read over PCIe (`set_host`): its host block ids (the kernel's block table) and its first
            # row in the step, rows, host tokens.
            self.pcie_table = torch.zeros(inner.meta.shape[1], max_blocks, dtype=torch.int32, device=self.device)
            self.pcie_meta = torch.zeros_like(inner.meta)
            # One split count for every step (the kernel gives a shorter host part fewer): graphs keep it.
            self.pcie_splits = pcie_splits(max_host_tokens, host_pool.n_kv, inner.num_sms)
            # Rows for every sequence's decode rows (the PCIe way's steps; larger ones run unsplit).
            rows = min(inner.workspace.max_rows, (inner.meta.shape[1] - 1) * decode_rows)
            self.pcie_workspace = k_attn.SplitWorkspace(max(rows, 1), inner.out.shape[1], host_pool.head_dim,
                                                        self.pcie_splits, self.device)
        # Set by the runner while it captures the graphs of steps with a host part read over PCIe.
        self.capture_pcie = False
        self.runs: dict[int, list[tuple[int, int, int]]] = {}  # streamed span -> its blocks' runs (direct copies)
        # (first row, rows, host blocks, host tokens, sequence index, first position of the device part)
        self.spans: list[tuple[int, int, torch.Tensor, int, int, int]] = []
        self.streamed: list[int] = []  # indices into spans of those streamed
        self.tables: torch.Tensor | None = None  # the step's device block tables (shifted), as the inner's
        self.host_rows_total = 0
        # Wall time of the host parts attended on the CPU (in eager steps the wait for their rows too).
        self.host_seconds_total = 0.0
        # Set by the runner while it captures graphs in pieces (`GraphCutter`); the pinned rows of those
        # pieces' host parts (`reserve_graph_rows`).
        self.graph_cut = None
        self.cut_bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.invariant = bool(getattr(inner, "batch_invariant", False))
        self.whole_pool = self.whole = None
        self.whole_sequences_total = 0
        if self.invariant:
            self.whole_pool = _like(inner.pool, max_blocks + 1, self.device)  # +1: block 0 is padding
            self.whole = _twin(inner, self.whole_pool, max_host_tokens)
            # Assembly position p sits at slot p + bs (block 0 is the padding block).
            self.whole_slots = torch.arange(bs, (max_blocks + 1) * bs, device=self.device)
            self.whole_table = torch.arange(1, max_blocks + 1, dtype=torch.int32, device=self.device)[None]
            self._whole_for: tuple[int, int] | None = None  # (step, span) the twin's layout is prepared for
            self._step = 0

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

    @property
    def has_host(self) -> bool:
        """Whether the step set up last has a host part (its attention cannot be replayed by a graph)."""
        return bool(self.spans)

    def set_layout(self, slots, tables, *args, **kwargs):
        self.tables = tables
        return self.inner.set_layout(slots, tables, *args, **kwargs)

    def plan_dequant(self, ctx):
        return self.inner.plan_dequant(ctx)

    def prepare(self, slots, starts, lens, block_tables):
        self.tables = block_tables
        return self.inner.prepare(slots, starts, lens, block_tables)

    @property
    def nbytes_stream(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.stages for t in s.dev)

    def set_host(self, spans) -> None:
        """The step's host parts: per tiered sequence (first row, rows, host block ids, sequence index,
        first position of its device part); a batch-invariant inner backend needs the last two."""
        bs = self.host_pool.block_size
        self.spans = []
        for r0, n, blocks, *where in spans:
            if self.invariant and not where:
                raise ValueError("a batch-invariant tiered step needs each host part's sequence and start")
            seq, start = where or (0, 0)
            self.spans.append((r0, n, torch.tensor(blocks, dtype=torch.long), len(blocks) * bs, seq, start))
        self.streamed = [] if self.invariant else [i for i, s in enumerate(self.spans)
                                                    if s[1] > self.decode_rows or self.stream_decode]
        self.pcie_spans = [] if self.invariant or not (self.pcie_decode and self.stream_kernel) else [
            i for i in range(len(self.spans)) if i not in self.streamed]
        if self.pcie_spans:
            # Entry j: the j-th span's rows (from its first row in the step), its host tokens and blocks; the
            # entries after the last are empty, so one launch over every entry serves any step (and graphs).
            table = torch.zeros(len(self.pcie_spans), self.pcie_table.shape[1], dtype=torch.int32)
            meta = torch.zeros(self.pcie_meta.shape, dtype=torch.int32)
            for j, i in enumerate(self.pcie_spans):
                r0, n, blocks, tokens = self.spans[i][:4]
                table[j, : len(blocks)] = blocks
                meta[:, j] = torch.tensor([r0, n, tokens])
                self.host_rows_total += n * self.num_layers
            self.pcie_table[: len(table)].copy_(table)  # from pageable memory: done before the host moves on
            self.pcie_meta.copy_(meta)
        self.runs = {}
        for i in self.streamed:
            runs = block_runs(spans[i][2])
            if len(runs) <= MAX_STREAM_RUNS:
                self.runs[i] = runs
        if self.stream_kernel and self.streamed:
            rows = [self.spans[i][1] for i in self.streamed]
            tokens = [self.spans[i][3] for i in self.streamed]
            self.stream_meta[:, : len(rows)].copy_(to_device([[0] * len(rows), rows, tokens], self.device,
                                                             torch.int32))
        for stage in self.stages:
            stage.item = None
        if self.invariant:
            self._step += 1

    def attend(self, layer, q, k, v):
        if self.graph_cut is not None and self.graph_cut.capturing:
            return self._attend_cut(layer, q, k, v)
        if not self.spans and not self.capture_pcie:
            return self.inner.attend(layer, q, k, v)
        if self.invariant:
            return self._attend_whole(layer, q, k, v)
        o, lse = self.inner.attend_lse(layer, q, k, v)
        for i, (r0, n, blocks, tokens, _, _) in enumerate(self.spans):
            if i in self.pcie_spans:
                continue  # all of them below, in one launch
            if n > self.decode_rows or self.stream_decode:
                o_h, lse_h = self._streamed(layer, i, q[r0:r0 + n])
            else:
                o_h, lse_h = self._on_host(layer, q[r0:r0 + n], blocks, tokens)
            o[r0:r0 + n] = merge(o_h, lse_h, o[r0:r0 + n], lse[r0:r0 + n]).to(o.dtype)
            self.host_rows_total += n
        if self.pcie_spans or self.capture_pcie:
            o_h, lse_h = self._over_pcie(layer, q)
            o = merge(o_h, lse_h, o, lse).to(o.dtype)  # rows of no PCIe span have lse -inf: unchanged
        return o

    def _on_host(self, layer: int, q: torch.Tensor, blocks: torch.Tensor, tokens: int):
        t0 = time.perf_counter()
        try:
            o, lse = self._rows_on_host(layer, q.to(self.host_pool.device, torch.float32).contiguous(), blocks, tokens)
            return o.to(q.device, non_blocking=True), lse.to(q.device, non_blocking=True)
        finally:
            self.host_seconds_total += time.perf_counter() - t0

    def _rows_on_host(self, layer: int, q: torch.Tensor, blocks: torch.Tensor, tokens: int):
        """Rows q (fp32, contiguous, in host memory) over a host part: (o, lse) in host memory."""
        if self.cpu_kernels is not None:
            return self._span_parts(layer, q, blocks, tokens)
        k, v = self.host_pool.gather_blocks(layer, blocks[None], tokens, torch.float32)
        return attend_all(q, k[0], v[0], self.scale)

    def decode_seconds(self, tokens: int, num_q_heads: int, repeats: int = 3) -> dict[str, float]:
        """Seconds of one layer's host part for a decode step's rows (`decode_rows` of `num_q_heads`) over
        `tokens` host tokens (the host pool's first blocks, zeroed: made at start-up, they hold nothing
        yet), each way: "cpu", "stream" (copied up, the kernel) and "pcie" (the kernel reading the pool in
        place). Best of `repeats`. For the CUDA kernel path; leaves the backend without a step."""
        bs, stage = self.host_pool.block_size, self.stages[0]
        nb = max(1, min(tokens // bs, stage.dev[0].shape[0], self.host_pool.num_blocks))
        for t in pool_tensors(self.host_pool):
            t[0, : nb * bs].zero_()
        rows, d = self.decode_rows, self.host_pool.head_dim
        q_host = torch.zeros(rows, num_q_heads, d)
        q_dev = q_host.to(self.device)
        blocks = torch.arange(nb)

        def best(fn) -> float:
            times = []
            for _ in range(repeats + 1):  # the first builds and warms
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize(self.device)
                times.append(time.perf_counter() - t0)
            return min(times[1:])

        rows_total = self.host_rows_total  # the probe's spans are no step's: its count is undone below
        out = {"cpu": best(lambda: self._rows_on_host(0, q_host, blocks, nb * bs))}
        was = self.stream_decode, self.pcie_decode
        self.stream_decode, self.pcie_decode = True, False
        self.set_host([(0, rows, list(range(nb)))])

        def streamed() -> None:
            stage.item = None
            self._stage((0, 0), stage)
            if stage.event is not None:
                torch.cuda.current_stream(self.device).wait_event(stage.event)
            self._streamed_kernel(stage, 0, q_dev)

        out["stream"] = best(streamed)
        self.stream_decode, self.pcie_decode = False, True
        self.set_host([(0, rows, list(range(nb)))])
        try:
            out["pcie"] = best(lambda: self._over_pcie(0, q_dev))
        except Exception as err:  # noqa: BLE001 - the kernel cannot take host pointers here: the other ways serve
            log.info("the attention kernel cannot read the host KV pool in place here (%s)", str(err).splitlines()[0][:200])
        self.stream_decode, self.pcie_decode = was
        self.set_host([])
        self.host_rows_total = rows_total
        return out

    # ---- graphs in pieces ----------------------------------------------------------------------------
    def reserve_graph_rows(self, rows: int, num_q_heads: int) -> None:
        """The pinned rows (q down; o and lse up) of graph pieces' host parts, for steps of up to `rows`
        rows. Made before any capture: no host memory is pinned while a graph is captured."""
        pin, d = self.device.type == "cuda", self.host_pool.head_dim
        self.cut_bufs = (torch.zeros(rows, num_q_heads, d, pin_memory=pin), torch.zeros(rows, num_q_heads, d, pin_memory=pin),
                         torch.full((rows, num_q_heads), float("-inf"), pin_memory=pin))

    def _attend_cut(self, layer, q, k, v):
        """Under a graph capture: the device part and the rows' copy down end the piece; the host part
        attends the replayed step's spans; the next piece merges every row with what came back up."""
        if self.cut_bufs is None or q.shape[0] > self.cut_bufs[0].shape[0]:
            raise RuntimeError("a tiered graph captured with more rows than reserve_graph_rows made room for")
        o, lse = self.inner.attend_lse(layer, q, k, v)
        t = q.shape[0]
        q_h, o_h, lse_h = (b[:t] for b in self.cut_bufs)
        q_h.copy_(q.float(), non_blocking=True)

        def host_part(rows: int | None) -> None:
            t0 = time.perf_counter()
            o_h.zero_()
            lse_h.fill_(float("-inf"))
            for r0, n, blocks, tokens, _, _ in self.spans:
                o_h[r0:r0 + n], lse_h[r0:r0 + n] = self._rows_on_host(layer, q_h[r0:r0 + n], blocks, tokens)
                self.host_rows_total += n
            self.host_seconds_total += time.perf_counter() - t0

        self.graph_cut.cut(host_part)
        o_up, lse_up = o_h.to(q.device, non_blocking=True), lse_h.to(q.device, non_blocking=True)
        return merge(o_up, lse_up, o, lse).to(o.dtype)

    def _span_parts(self, layer: int, q: torch.Tensor, blocks: torch.Tensor, tokens: int):
        """The host part through the C kernel, its keys split over the threads, merged by log-sum-exp."""
        n, hq, d = q.shape
        parts = max(1, min(self.threads, tokens // SPAN_PART_KEYS))
        work = self.cpu_kernels.span_work_numel(n, hq, d)
        bufs = self.span_bufs
        if bufs is None or bufs[0].shape[1] < n or bufs[0].shape[2:] != (hq, d):
            # Made once for the largest decode step (grown if a step has more rows), reused after.
            rows = max(n, self.decode_rows)
            bufs = self.span_bufs = (torch.empty(self.threads, rows, hq, d), torch.empty(self.threads, rows, hq),
                                     torch.empty(self.threads, self.cpu_kernels.span_work_numel(rows, hq, d)),
                                     torch.empty(rows, hq, d), torch.empty(rows, hq))
        pool = self.host_pool
        scales = (pool.k_scale[layer], pool.v_scale[layer]) if isinstance(pool, Int8Pool) else (None, None)
        if self.cpu_kernels.threaded_split:
            # One call: the library's OpenMP team takes the parts and merges them, the GIL released throughout
            # (threads of Python's would each take the GIL back between their part and the merge).
            o, lse = bufs[3][:n], bufs[4][:n]
            o_parts = bufs[0].view(-1)[: parts * n * hq * d].view(parts, n, hq, d)
            lse_parts = bufs[1].view(-1)[: parts * n * hq].view(parts, n, hq)
            self.cpu_kernels.span_attention_split(pool.k[layer], pool.v[layer], *scales, blocks, pool.block_size, 0,
                                                  tokens, q, self.scale, o_parts, lse_parts, bufs[2][:parts], o, lse)
            return o, lse
        o_parts, lse_parts = bufs[0][:, :n], bufs[1][:, :n]

        def part(i: int) -> None:
            o_i, lse_i = o_parts[i], lse_parts[i]  # views of contiguous rows: [n, hq, d] and [n, hq]
            self.cpu_kernels.span_attention(pool.k[layer], pool.v[layer], *scales, blocks, pool.block_size,
                                            tokens * i // parts, tokens * (i + 1) // parts, q, self.scale,
                                            o_i, lse_i, bufs[2][i, :work])

        futures = [self.executor.submit(part, i) for i in range(1, parts)] if parts > 1 else []
        part(0)
        for f in futures:
            f.result()
        if parts == 1:
            return o_parts[0].clone(), lse_parts[0].clone()
        lse = torch.logsumexp(lse_parts[:parts], dim=0)
        w = torch.exp(lse_parts[:parts] - lse)
        return (o_parts[:parts] * w[..., None]).sum(0), lse

    # ---- batch-invariant: each tiered sequence attended whole ------------------------------------------
    def _attend_whole(self, layer, q, k, v):
        o = self.inner.attend(layer, q, k, v)  # writes the step's K/V; the untiered sequences' rows
        for i, (r0, n, _, tokens, seq, start) in enumerate(self.spans):
            self._assemble(layer, i)
            if self._whole_for != (self._step, i):
                nb = -(-(tokens + start + n) // self.host_pool.block_size)
                self.whole.prepare(self.whole_slots[tokens + start : tokens + start + n], [tokens + start], [n],
                                   self.whole_table[:, :nb])
                self._whole_for = (self._step, i)
            o[r0:r0 + n] = self.whole.attend(0, q[r0:r0 + n], k[r0:r0 + n], v[r0:r0 + n])
            self.host_rows_total += n
            self.whole_sequences_total += 1
        return o

    def _assemble(self, layer: int, i: int) -> None:
        """Span i's sequence into the assembly pool's blocks 1..: its host blocks, then its device blocks."""
        _, n, blocks, tokens, seq, start = self.spans[i]
        bs = self.host_pool.block_size
        nh, nd = blocks.shape[0], -(-(start + n) // bs)
        device_blocks = self.tables[seq, :nd]
        pinned = self.stages[0].pinned
        for j, (src, host, dst) in enumerate(zip(pool_tensors(self.inner.pool), pool_tensors(self.host_pool),
                                                 pool_tensors(self.whole_pool))):
            whole = dst[0].view(dst.shape[1] // bs, -1)
            on_device = src[layer].view(src.shape[1] // bs, -1)
            torch.index_select(on_device, 0, device_blocks, out=whole[1 + nh : 1 + nh + nd])
            host_blocks = host[layer].view(host.shape[1] // bs, -1)
            if whole.device == host_blocks.device:
                torch.index_select(host_blocks, 0, blocks, out=whole[1 : 1 + nh])
            else:
                # Through pinned memory; a blocking copy, so the buffer is free again for the next tensor.
                torch.index_select(host_blocks, 0, blocks, out=pinned[j][:nh])
                whole[1 : 1 + nh].copy_(pinned[j][:nh])

    # ---- streaming ---------------------------------------------------------------------------------
    def _items(self) -> list[tuple[int, int]]:
        return [(layer, i) for layer in range(self.num_layers) for i in self.streamed]

    def _stage(self, item: tuple[int, int], stage: _Stage) -> None:
        layer, i = item
        blocks = self.spans[i][2]
        nb = blocks.shape[0]
        bs = self.host_pool.block_size
        runs = self.runs.get(i)
        if runs is None:
            if stage.event is not None:
                stage.event.synchronize()  # its previous copy up has left the pinned buffer
            stage.idx[:nb] = blocks
            for t, pinned in zip(pool_tensors(self.host_pool), stage.pinned):
                torch.index_select(t[layer].view(t.shape[1] // bs, -1), 0, stage.idx[:nb], out=pinned[:nb])
        if self.stream is not None:
            # The device buffer's previous contents may still be read by a kernel queued on the compute stream.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            if runs is not None:  # the host pool is pinned: its runs of blocks go up as they lie
                for t, dev in zip(pool_tensors(self.host_pool), stage.dev):
                    src = t[layer].view(t.shape[1] // bs, -1)
                    for at, first, count in runs:
                        dev[at : at + count].copy_(src[first : first + count], non_blocking=True)
            elif self.stream is not None:
                for pinned, dev in zip(stage.pinned, stage.dev):
                    dev[:nb].copy_(pinned[:nb], non_blocking=True)
            if stage.event is not None:
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
            if other.item != items[at + 1]:
                self._stage(items[at + 1], other)
        tokens = self.spans[i][3]
        if self.stream_kernel:
            return self._streamed_kernel(stage, self.streamed.index(i), q)
        tile = max(STREAM_SCORE_BYTES // (4 * q.shape[0] * q.shape[1]), self.host_pool.block_size)
        o, lse = attend_all(q, *self._keys(stage, 0, min(tile, tokens)), self.scale)
        for lo in range(tile, tokens, tile):
            o2, lse2 = attend_all(q, *self._keys(stage, lo, min(lo + tile, tokens)), self.scale)
            o, lse = merge(o, lse, o2, lse2), torch.logaddexp(lse, lse2)
        return o, lse

    def _streamed_kernel(self, stage: _Stage, j: int, q: torch.Tensor):
        """Rows q over the staged host part of the j-th streamed span, through the paged attention kernel:
        (o, lse) in buffers the next span reuses."""
        pool, n = self.host_pool, q.shape[0]
        slots = stage.dev[0].shape[0] * pool.block_size
        k = stage.dev[0].view(slots, pool.n_kv, pool.head_dim)
        v = stage.dev[1].view(slots, pool.n_kv, pool.head_dim)
        ks, vs = ((stage.dev[2].view(slots, pool.n_kv), stage.dev[3].view(slots, pool.n_kv))
                  if isinstance(pool, Int8Pool) else (None, None))
        fits = n <= self.stream_out.shape[0] and self.stream_out.dtype == q.dtype
        out = self.stream_out[:n] if fits else torch.empty_like(q)
        lse = self.stream_lse[:n] if fits else torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        meta = self.stream_meta[:, j : j + 1]
        k_attn.paged_attention_triton(q, k, v, self.stream_table, meta[0], meta[1], meta[2], out,
                                      block_size=pool.block_size, max_q_len=n, scale=self.scale, k_scale=ks,
                                      v_scale=vs, lse=lse, whole_context=True)
        return out, lse

    def _over_pcie(self, layer: int, q: torch.Tensor):
        """Every row of the step q over its span's host part read in place over PCIe, one launch over the
        entries `set_host` wrote (`pcie_table`, `pcie_meta`; rows of no such span get o 0, lse -inf): the
        paged attention kernel reading the pinned host pool, its keys split `pcie_splits` ways (`pcie_workspace`
        holds the partials). (o, lse) in
        buffers the next layer reuses; no host state is read, so graphs capture it."""
        pool, t = self.host_pool, q.shape[0]
        ks, vs = (pool.k_scale[layer], pool.v_scale[layer]) if isinstance(pool, Int8Pool) else (None, None)
        if t <= self.stream_out.shape[0] and self.stream_out.dtype == q.dtype:
            o_h, lse_h = self.stream_out[:t], self.stream_lse[:t]
        else:  # rows of another dtype (the start-up probe's fp32)
            o_h, lse_h = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        o_h.zero_()
        lse_h.fill_(float("-inf"))
        ws = self.pcie_workspace
        splits = self.pcie_splits if t <= ws.max_rows else 1
        k_attn.paged_attention_triton(q, pool.k[layer], pool.v[layer], self.pcie_table, *self.pcie_meta, o_h,
                                      block_size=pool.block_size, max_q_len=self.decode_rows, scale=self.scale,
                                      k_scale=ks, v_scale=vs, lse=lse_h, whole_context=True, num_splits=splits,
                                      workspace=ws if splits > 1 else None)
        return o_h, lse_h

    def _keys(self, stage: _Stage, lo: int, hi: int):
        """Keys and values lo..hi of the staged host part (dequantized for int8)."""
        pool = self.host_pool
        shape = (stage.dev[0].shape[0] * pool.block_size, pool.n_kv, pool.head_dim)
        k = stage.dev[0].view(shape)[lo:hi]
        v = stage.dev[1].view(shape)[lo:hi]
        if isinstance(pool, Int8Pool):
            ks = stage.dev[2].view(shape[:2])[lo:hi]
            vs = stage.dev[3].view(shape[:2])[lo:hi]
            return k.float() * ks[..., None], v.float() * vs[..., None]
        return k, v
