"""The concurrent read (STRATA_PIPED_CONCURRENT=1): prompt reads run as their own stage beside the
decode loop, so a decoding slot's steps never wait for a read chunk.

The stage has a worker thread, on CUDA its own stream of lower priority, and its own `ModelRunner`
(eager: reads never replay graphs) over the same model and KV pool (and host KV tier, through a tiered
attention backend of its own): its static input buffers are the stage's scratch `region`, allocated once. The engine's scheduler hands it one read step at a time
(`Scheduler.schedule("read")`); the worker runs the forward, samples where a read ends (the request's
first token) and waits for its own stream only, then reports; the engine applies the result and hands
the request to the decode lane, with nothing read again.

Nothing allocates on the read's path:
- the per-step inputs live in the runner's static buffers (the region);
- the small uploads (attention bounds, logit rows) go through `up_ring`, a pinned host ring with a
  device mirror, whose capacity `reserve_uploads` sets before each read (`UPLOAD_BYTES_PER_TOKEN`
  per token of the largest step);
- the kernels' shared scratch (split-K counters, token-sort counters, the stream-K pool) has twins
  made at start-up and installed for the worker (`strata.kernels.scratch`), so the two stages never
  share one;
- activations come from torch's caching allocator on the read's stream, which warm-up steps of the
  largest size fill (after the graph captures, which empty the cache); `AllocationGuard` fails when
  anything grows after that.

With STRATA_SPLIT_MTP_BATCH=1 and STRATA_PIPED_CONCURRENT_SMB=1 the stage also writes the MTP layer's
prompt K/V for each chunk on its stream (`Prefill.draft_kv`, its own MTP call buffers), reserving the
stream-K pool of its twin context first (`Prefill.reserve_draft_kv`).
"""

from __future__ import annotations

import queue
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from strata.kernels import scratch as k_scratch
from strata.models.quantize import model_scratch
from strata.runner.model_runner import ModelRunner
from strata.runner.steps import Sampled
from strata.kernels.transfer import UpRing

UPLOAD_BYTES_PER_TOKEN = 32  # reserve_uploads: T x K x 4 bytes with K = 8 int32 words per token


WARM_UP_MAX_STEPS = 4
# Small read steps warmed after the largest (see `ReadStage.warm_up`): a short prompt, a read's last chunk.
WARM_UP_SMALL_STEPS = (256, 128, 96, 64, 48, 32, 16, 8, 1)


@dataclass
class ReadResult:
    out: object  # the SchedulerOutput the step ran
    sampled: dict[str, Sampled] = field(default_factory=dict)
    hidden: torch.Tensor | None = None
    row_starts: list[int] = field(default_factory=list)
    draft_kv: dict[str, int] = field(default_factory=dict)  # request id -> positions with MTP K/V written
    error: BaseException | None = None


class Prefill:
    """The read stage's MTP prompt K/V (STRATA_SPLIT_MTP_BATCH beside the concurrent read): one call of
    the MTP layer over each read chunk's rows, from the stage's own MTP call buffers."""

    def __init__(self, drafter, *, max_rows: int, max_seqs: int, max_model_len: int, device, dtype):
        from strata.attention.registry import make_attention
        from strata.speculative.mtp_step import MTPStep

        model, pool = drafter.model, drafter.pool
        self.attn = make_attention(pool, model.config, max_seqs=max_seqs + 1, max_rows=max_rows, max_split_rows=max_seqs,
                                   device=device, dtype=dtype, max_context=max_model_len)
        host_pool = getattr(drafter.attn, "host_pool", None)  # the host KV tier's, as the drafter's own calls
        if host_pool is not None:
            from strata.attention.reference import PagedAttention
            from strata.attention.tiered import TieredAttention

            inner = self.attn if self.attn.meta is not None else PagedAttention(pool)
            self.attn = TieredAttention(inner, host_pool, device=device, decode_rows=1, max_host_tokens=max_model_len,
                                        num_layers=0, cpu_kernels=drafter.attn.cpu_kernels)
        self.step = MTPStep(model, pool, self.attn, max_seqs=max_seqs, max_rows=max_rows, rows_per_seq=1,
                            max_model_len=max_model_len, device=device, dtype=dtype, cuda_graph=False)
        self.contexts: list = []  # the stage's stream-K contexts, grown by reserve_draft_kv

    def reserve_draft_kv(self) -> None:
        """Grow the stage's stream-K pools to the largest fix-up (one 128 x 128 fp32 tile per SM)."""
        from strata.kernels.device import current as device_spec
        from strata.kernels.quant.streamk import QMatmulContext

        for ctx in self.contexts:
            sms = device_spec(ctx.device).sm_count if ctx.device.type == "cuda" else 1
            ctx.reserve_fixup(QMatmulContext.largest_fixup(sms))

    def draft_kv(self, chunks, hidden: torch.Tensor, row_starts: list[int]) -> dict[str, int]:
        """MTP K/V for the rows of read chunks that do not end their prompt (the last chunk's are
        written by the drafter with the first drafts). Returns request id -> positions written."""
        seqs = [(i, ch) for i, ch in enumerate(chunks) if not ch.sample]
        if not seqs:
            return {}
        rows = [r for i, ch in seqs for r in range(row_starts[i], row_starts[i] + ch.num_tokens)]
        self.step.stage_rows(hidden, rows)
        reqs = [ch.request for _, ch in seqs]
        starts = [ch.start for _, ch in seqs]
        lens = [ch.num_tokens for _, ch in seqs]
        nxt = [t for _, ch in seqs for t in ch.request.token_ids(ch.start + 1, ch.start + ch.num_tokens + 1)]
        self.step.run(reqs, starts, lens, nxt)
        return {ch.request.request_id: ch.end for _, ch in seqs}


class ReadStage:
    def __init__(self, main: ModelRunner, *, max_num_batched_tokens: int, max_seqs: int, max_model_len: int,
                 drafter=None, split_mtp_batch: bool = False):
        self.main, self.device = main, main.device
        model = main.model
        dtype = model.model.embed_tokens.weight.dtype
        self.runner = ModelRunner(model, main.pool, max_num_batched_tokens=max_num_batched_tokens, max_seqs=max_seqs,
                                  max_model_len=max_model_len, device=self.device, sampling=main.sampling, max_drafts=0,
                                  cuda_graph=False, grammar=main.grammar, batch_invariant=main.batch_invariant,
                                  states=main.attn.states.view() if main.attn.states is not None else None,
                                  host_pool=main.attn.host_pool if main.tiered else None)
        # One grammar state per request, whichever stage samples it (as its sampler: `sampling` above).
        self.runner.matchers = main.matchers
        self.max_tokens = max_num_batched_tokens
        self.up_ring = UpRing(self.device)
        self.twins = k_scratch.make_twins(model_scratch(model))
        self.prefill = None
        if drafter is not None and split_mtp_batch:
            self.prefill = Prefill(drafter, max_rows=max_num_batched_tokens, max_seqs=max_seqs,
                                   max_model_len=max_model_len, device=self.device, dtype=dtype)
            from strata.kernels.quant.streamk import QMatmulContext

            self.prefill.contexts = [t for t in self.twins.values() if isinstance(t, QMatmulContext)]
        cuda = self.device.type == "cuda"
        # The lowest priority the device offers (a larger number): decode kernels get free SMs first.
        self.stream = torch.cuda.Stream(self.device, priority=torch.cuda.Stream.priority_range()[0]) if cuda else None
        self.jobs: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue()
        self.current = None  # the SchedulerOutput being read, until its result is taken
        self.reads_total = 0
        self.worker = threading.Thread(target=self._work, name="strata-read", daemon=True)
        self.worker.start()

    @property
    def region_bytes(self) -> int:
        """The stage's preallocated input buffers (its runner's static tensors) and scratch twins."""
        r = self.runner
        tensors = [r.h_ids, r.h_pos, r.h_slots, r.h_tables, r.h_meta, r.d_ids, r.d_pos, r.d_slots, r.d_tables,
                   *r.h_greedy, *r.h_logprob, *r.h_top_ids, *r.h_top_lp]
        return sum(t.numel() * t.element_size() for t in tensors) + k_scratch.twin_bytes(self.twins)

    @property
    def busy(self) -> bool:
        return self.current is not None

    def reserve(self) -> None:
        """Before a read, with nothing in flight: room for the largest step's uploads (and, beside the
        batched draft K/V, the stage's stream-K pool)."""
        self.up_ring.reserve_uploads(self.max_tokens * UPLOAD_BYTES_PER_TOKEN)
        if self.prefill is not None:
            self.prefill.reserve_draft_kv()

    def warm_up(self) -> None:
        """Read steps through the stage, on its stream, so torch's caching allocator holds the read's
        activations before the first real read: the largest step, then small ones (`WARM_UP_SMALL_STEPS`),
        whose activations under 1 MiB come from the allocator's small-block pool, kept per stream (a
        short prompt or a read's last chunk grew it by a 2 MiB segment on the H200 when only the largest
        step had run). Its request reads token 0 into the padding block (block 0, whose K/V nobody reads)
        and samples greedily (no seed used); its uploads go through a ring of their own, so this ring's
        reservation is what later reads get."""
        # One prompt token past the step, and within the context: a step that does not sample needs the
        # next token (the MTP layer's input when the stage writes draft K/V).
        n = min(self.max_tokens, self.runner.max_model_len - 1)
        ring, self.up_ring = self.up_ring, UpRing(self.device, n * UPLOAD_BYTES_PER_TOKEN)
        try:
            for size in (n, *(k for k in WARM_UP_SMALL_STEPS if k < n)):
                self._warm_steps(size)
        finally:
            self.up_ring = ring
            self.reads_total = 0

    def _warm_steps(self, n: int) -> None:
        """Steps of `n` tokens until the cache stops growing: the runner keeps the last step's hidden
        states while the next one runs, so the steady state holds more than one step's activations, and
        the allocator's first placements can leave no block large enough for a later one."""
        from strata.params import SamplingParams
        from strata.sched.request import Request
        from strata.sched.scheduler import ScheduledChunk, SchedulerOutput

        req = Request("__read_warm_up__", [0] * (n + 1), SamplingParams(max_tokens=1), slot=0)
        req.block_ids = [0] * -(-(n + 1) // self.runner.pool.block_size)
        cuda = self.device.type == "cuda"
        for i in range(WARM_UP_MAX_STEPS):
            before = torch.cuda.memory_reserved(self.device) if cuda else 0
            self.submit(SchedulerOutput([ScheduledChunk(req, 0, n, i % 2 == 1)]))
            self.poll(block=True)
            if i >= 1 and (not cuda or torch.cuda.memory_reserved(self.device) == before):
                break

    def follow(self, stream) -> None:
        """The stage's next work waits for what `stream` has queued (the drafter's copies out of this
        step's hidden states), so blocks the stage frees are reused only after those reads."""
        if self.stream is not None:
            self.stream.wait_stream(stream)

    def submit(self, out) -> None:
        """Start reading `out`'s chunks on the stage's stream."""
        if self.current is not None:
            raise RuntimeError("the read stage runs one step at a time")
        self.current = out
        self.jobs.put((out, self.stream))

    def poll(self, block: bool = False) -> ReadResult | None:
        """The finished step's result, or None while it runs (block: wait for it)."""
        if self.current is None:
            return None
        try:
            res = self.results.get(block=block)
        except queue.Empty:
            return None
        self.current = None
        if res.error is not None:
            raise res.error
        self.reads_total += 1
        return res

    def close(self) -> None:
        self.jobs.put(None)
        self.worker.join(timeout=10)

    def _work(self) -> None:
        with k_scratch.use(self.twins), torch.inference_mode():
            while True:
                job = self.jobs.get()
                if job is None:
                    return
                out, stream = job
                res = ReadResult(out)
                try:
                    on_stream = torch.cuda.stream(stream) if stream is not None else nullcontext()
                    with on_stream, self.up_ring.installed():
                        self._read(out, res, stream)
                except BaseException as e:  # handed to the engine's thread, which raises it
                    res.error = e
                self.results.put(res)

    def _read(self, out, res: ReadResult, stream) -> None:
        self.up_ring.reset()
        step = self.runner.launch(out.chunks)
        if step is not None:
            res.sampled = self.runner.collect(step)
            res.hidden, res.row_starts = self.runner.hidden, self.runner.row_starts
            if self.prefill is not None:
                res.draft_kv = self.prefill.draft_kv(out.chunks, res.hidden, res.row_starts)
        if stream is not None:
            stream.synchronize()  # its K/V are written before a decode step may read them


class AllocationGrowth(RuntimeError):
    pass


class AllocationGuard:
    """`EngineConfig.alloc_guard`: around every read step (`start` before it is submitted, `check` when it is
    back), fail if the upload ring, a stream-K pool of the stage, the KV pool or (CUDA) torch's
    caching allocator grew. The main loop keeps running meanwhile: its steps must not grow them either."""

    def __init__(self, stage: ReadStage, pool):
        self.stage, self.pool = stage, pool
        self.before: dict[str, int] | None = None

    def snapshot(self) -> dict[str, int]:
        from strata.kernels.quant.streamk import QMatmulContext

        st = self.stage
        snap = {"up_ring_bytes": st.up_ring.nbytes, "up_ring_grows": st.up_ring.grows,
                "kv_pool_bytes": sum(t.numel() * t.element_size() for t in vars(self.pool).values()
                                     if isinstance(t, torch.Tensor)),
                "region_bytes": st.region_bytes}
        for i, ctx in enumerate(t for t in st.twins.values() if isinstance(t, QMatmulContext)):
            snap[f"streamk_pool_{i}_bytes"], snap[f"streamk_pool_{i}_grows"] = ctx.pool_bytes, ctx.grows
        if st.device.type == "cuda":
            snap["cuda_reserved_bytes"] = torch.cuda.memory_reserved(st.device)
        return snap

    def start(self) -> None:
        self.before = self.snapshot()

    def check(self) -> None:
        if self.before is None:
            return
        after = self.snapshot()
        grew = {k: (self.before[k], v) for k, v in after.items() if v > self.before.get(k, v)}
        self.before = None
        if grew:
            raise AllocationGrowth("allocation during a concurrent read: " +
                                   ", ".join(f"{k} {a} -> {b}" for k, (a, b) in grew.items()))
