"""The serving engine: scheduler + model runner + per-request text state, stepped synchronously.

Start-up reads like a table of contents (its steps in `strata.engine.startup`): place and load the model
(built on meta, weights assigned; the memory plan on CUDA) → size the KV pool → build allocator,
scheduler and runner (static buffers) → capture graphs; the phases' seconds are logged. `step()` runs
one scheduled step and returns the events it produced; `AsyncEngine` runs steps in a thread.

With batch groups (`--batch-groups G`, G > 1, and `overlap` on) steps are pipelined: `step()` schedules
and launches the next group's step, then finishes the previous one (waits for its tokens, updates the
scheduler, drafts, detokenizes) while the device computes the new one. The scheduler keeps the two
steps apart (a request in flight is not scheduled again), so the result is the same as stepping in turn.

With async scheduling (`async_scheduling`, on by default on CUDA without speculation) steps are
pipelined the same way with one group: the next step is scheduled and launched before the previous
one's tokens are read, its decode inputs taken from the previous step's picks on the device
(the scheduler's run-ahead), so the GPU always has a step queued while the host finishes the last.
A request that stops on a token has had one more step computed for it; that step is dropped.

With pipeline stages (`--split-mode layer`, `overlap` on) steps are pipelined whatever the groups, up
to one step in flight per stage, at least two (`Link.depth`): `step()` launches the next step and
finishes the oldest once that many are out (or when nothing new was launched). Besides the groups' decodes, the next
chunks of one prompt fill the pipeline (the scheduler's read-ahead).
"""

from __future__ import annotations

import dataclasses
from collections import deque
import logging
import time
from dataclasses import dataclass

import torch

from strata.config import EngineConfig
from strata.engine.concurrent import ConcurrentReadSetup
from strata.engine.types import (MAX_TOP_LOGPROBS, RATE_WINDOW_S, TTFT_BUCKETS, EngineEvent, EngineRequest,
                                 EngineStats, RateWindow, SlotSnapshot)
from strata.grammar import GrammarError
from strata.kernels import choices as kernel_choices
from strata.kvcache.allocator import BlockAllocator
from strata.kvcache.pool import kv_bytes_per_token, make_pool
from strata.kvcache.tier import tier_tokens
from strata.engine import placement
from strata.engine.startup import (StartupClock, grammar_compiler, host_limits, hybrid_limits, kv_capacity_tokens,
                                   load_placed, tier_limits)
from strata.dist.draft import StageDrafter
from strata.dist.launch import join as join_stages
from strata.loaders import LoadedModel
from strata.memory_plan import Plan
from strata.runner.host_offload import set_up_host_experts
from strata.engine.kv_tiering import HostKVTier
from strata.models.host_experts import HostStagingPool
from strata.models.invariance import check_batch_invariant
from strata.runner.generator import Detokenizer, StopChecker
from strata.runner.model_runner import ModelRunner
from strata.runner.picks import SamplingRequests
from strata.runner.prompt_graphs import PROMPT_GRAPH_ROWS, prompt_graph_sizes
from strata.runner.steps import LaunchedStep
from strata.runner.read_stage import AllocationGrowth, AllocationGuard, ReadStage
from strata.sched.request import Request
from strata.sched.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from strata.speculative.drafter import MTPDrafter

log = logging.getLogger("strata")


def _is_eos(r: Request, token: int) -> bool:
    return token in r.params.stop_token_ids or (not r.params.ignore_eos and token in r.eos_ids)


class RequestError(ValueError):
    """A request the engine refuses (prompt too long, empty, ...). The server maps it to a 400."""


def check_prompt(num_tokens: int, max_model_len: int, sizes: str = "") -> None:
    """`sizes`: what the context is made of, named in the refusal (the KV tiers)."""
    if num_tokens == 0:
        raise RequestError("the prompt is empty")
    if num_tokens >= max_model_len:
        raise RequestError(f"the prompt has {num_tokens} tokens; the context is {max_model_len}{sizes}")


@dataclass
class _Launched:
    out: SchedulerOutput
    step: LaunchedStep | None  # None: nothing to compute (only requests that finished while scheduling)


@dataclass
class _TextState:
    detok: Detokenizer | None
    stops: StopChecker
    sent_tokens: int = 0
    logprobs: bool = False


class LLMEngine:
    def __init__(self, cfg: EngineConfig, progress: bool = True, loaded: LoadedModel | None = None):
        """`loaded`: a model already on the device (benchmarks build random weights in place); else
        `cfg.model` is loaded."""
        cfg = cfg.resolved()
        clock = StartupClock()
        # Pipeline stages (--split-mode layer): ranks other than 0 run their stage inside `join` and exit.
        self.stages = join_stages(cfg) if cfg.split_mode == "layer" else None
        try:
            self._start(cfg, clock, progress, loaded)
        except BaseException:
            if self.stages is not None:  # the other stages wait for sizes that will never come
                self.stages.stop()
            raise

    def _start(self, cfg: EngineConfig, clock: StartupClock, progress: bool, loaded: LoadedModel | None) -> None:
        """Everything after the stages joined: place and load, size the pools, reserve, capture."""
        if self.stages is not None:
            if loaded is not None:
                raise ValueError("--split-mode layer loads the model in every stage: not with a model already built")
            cfg = self.stages.engine_config(cfg)
        self.tiered = cfg.kv_resident is not None or cfg.kv_host_memory is not None
        if self.tiered:
            cfg = tier_limits(cfg)
        self.cfg = cfg
        kernel_choices.set_choices(cfg.kernel_choices())  # before the model is loaded and packed
        self.device = torch.device(cfg.resolved_device)
        dtype = cfg.torch_dtype
        self.memory_plan: Plan | None = None
        if loaded is None:
            loaded, self.memory_plan = load_placed(cfg, self.device, dtype, progress, self.stages)
            clock.mark("load")
        elif self.device.type == "cuda":
            # Its builder placed a model built before the engine; the cap bounds everything that follows.
            placement.cap_allocator(cfg, self.device)
            placement.pin_exact_sizes()
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        if self.stages is not None:
            self.stages.install(self.model)
        self.model_name = cfg.model or "strata-default"
        self.max_model_len = min(cfg.ctx, self.model_config.max_position_embeddings)
        self.eos_ids = self.tokenizer.stop_ids if self.tokenizer else frozenset(self.model_config.eos_token_ids)

        mc = self.model_config
        self.host_staging: HostStagingPool | None
        self.host_staging, self.expert_streamer = set_up_host_experts(self.model, mc, cfg, self.device)
        if self.host_staging is not None:
            clock.mark("host experts' staging and stream threshold")
        cfg = self.cfg = host_limits(cfg, self.model, self.device, self.stages is not None)
        check_batch_invariant(cfg, mc, self.device, self.model)
        self.model.set_batch_invariant(cfg.batch_invariant)
        if mc.is_hybrid:
            cfg = self.cfg = hybrid_limits(cfg, mc)
        layers = self.model.num_attention_layers
        per_token = kv_bytes_per_token(layers, mc.num_key_value_heads, mc.head_dim, cfg.kv, dtype)
        # With a resident window a read's blocks leave the device before the read ends, so the prompt's MTP
        # K/V are written chunk by chunk (as with STRATA_SPLIT_MTP_BATCH=1), not at hand-over.
        split_drafts = MTPDrafter.split_mode() or cfg.kv_resident is not None
        drafter_bytes = (cfg.parallel * self.max_model_len * mc.hidden_size * dtype.itemsize
                         if cfg.spec and not split_drafts and self.stages is None else 0)
        # Hybrid models: one linear-attention state per slot (+1: a graph's padding rows), allocated now.
        self.states = (self.model.new_states(cfg.parallel + 1, self.device, dtype, verify_rows=1 + cfg.spec if cfg.spec else 0)
                       if mc.is_hybrid else None)
        if self.states is not None:
            log.info("linear-attention state pool: %d slots x %.1f MiB (%d linear layers; K/V for %d layers)",
                     cfg.parallel + 1, self.states.nbytes / (cfg.parallel + 1) / 2**20,
                     mc.num_hidden_layers - mc.num_full_attention_layers, layers)
        self.concurrent = ConcurrentReadSetup.from_env()
        if cfg.spec and cfg.kv_resident is not None and self.concurrent.piped_concurrent:
            # Beside the concurrent read, the read stage writes those MTP K/V (STRATA_PIPED_CONCURRENT_SMB).
            self.concurrent = dataclasses.replace(self.concurrent, split_mtp_batch=True, smb=True)
        self.concurrent.log_decision()
        sharing = self.stages.plan.sharing if self.stages is not None else 1
        tokens = kv_capacity_tokens(cfg, mc, per_token, self.device, drafter_bytes, self.memory_plan, sharing)
        if self.stages is not None:  # every stage's pool has the blocks of rank 0's allocator
            tokens = self.stages.kv_tokens(tokens)
        if cfg.kv_resident is not None and not cfg.kv_size and self.memory_plan is None:  # the plan counts the window
            tokens = min(tokens, cfg.parallel * tier_tokens(cfg.kv_resident, cfg.chunk_size, cfg.spec, cfg.block_size))
        # --kv-size is what the pool holds at least (the context is capped to it); a size from memory is a ceiling.
        blocks = -(-tokens // cfg.block_size) if cfg.kv_size else tokens // cfg.block_size
        num_blocks = max(blocks, 2) + 1  # +1: block 0 is the padding block
        self.pool = make_pool(cfg.kv, layers, num_blocks, cfg.block_size, mc.num_key_value_heads, mc.head_dim,
                              self.device, dtype)
        log.info("KV pool: %d blocks of %d tokens (%s, %.1f MiB)", num_blocks, cfg.block_size, cfg.kv,
                 num_blocks * cfg.block_size * per_token / 2**20)
        self.allocator = BlockAllocator(num_blocks, cfg.block_size)
        # A request the pool cannot hold alone could never finish: the context is what the pool holds.
        self.kv_capacity = (num_blocks - 1) * cfg.block_size
        self.kv_tier = (HostKVTier(cfg, mc, self.pool, self.allocator, layers, per_token, dtype, self.device)
                        if self.tiered else None)
        self.host_pool = self.kv_tier.host_pool if self.kv_tier else None
        self.context_sizes = ""
        if self.kv_tier is not None and cfg.kv_resident is not None:
            # The context is what both tiers hold.
            self.context_sizes = (f" ({self.kv_capacity} tokens in the device KV pool "
                                  f"with --kv-resident {cfg.kv_resident} + {self.kv_tier.host_capacity} in the host "
                                  "KV pool)")
            self.kv_capacity += self.kv_tier.host_capacity
        if self.kv_capacity < self.max_model_len:
            log.info("context limited to %d tokens: the KV pool holds no more (--kv-size, --ctx %d)",
                     self.kv_capacity, cfg.ctx)
            self.max_model_len = self.kv_capacity
        self.scheduler = Scheduler(
            SchedulerConfig(parallel=cfg.parallel, max_num_batched_tokens=cfg.max_num_batched_tokens,
                            chunk_size=cfg.chunk_size, block_size=cfg.block_size, num_blocks=num_blocks,
                            max_model_len=self.max_model_len, give_way=cfg.give_way, lookahead=cfg.spec,
                            batch_groups=cfg.batch_groups, max_hold_steps=cfg.max_hold_steps,
                            run_ahead=bool(cfg.async_scheduling), prefix_cache=cfg.prefix_cache,
                            read_ahead=self.stages.depth if self.stages is not None and cfg.overlap else 1,
                            prefix_salt=f"{self.model_name}|{dtype}|{cfg.kv}", prefix_with_mtp=bool(cfg.spec),
                            read_lane=self.concurrent.enabled, run_ahead_grammar=True,
                            solo_read_tokens=self._solo_read_tokens(cfg)),
            self.allocator,
        )
        self.scheduler.tier = self.kv_tier.tier if self.kv_tier else None
        self.grammar_compiler = grammar_compiler(self.tokenizer, mc.vocab_size)
        self.runner = ModelRunner(self.model, self.pool, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                  max_seqs=cfg.parallel, max_model_len=self.max_model_len, device=self.device,
                                  sampling=SamplingRequests(cfg.seed), max_drafts=cfg.spec, cuda_graph=cfg.cuda_graph,
                                  grammar=self.grammar_compiler, states=self.states,
                                  batch_invariant=cfg.batch_invariant, host_pool=self.host_pool,
                                  tier_graphs=cfg.kv_tier_graphs, tier_decode=cfg.kv_tier_decode)
        self.drafter = None
        if cfg.spec:
            if not loaded.has_mtp:
                raise ValueError(f"{loaded.path}: --spec needs a model with an MTP head; this one has none")
        if cfg.spec and self.stages is not None:  # the MTP head is the last stage's
            self.drafter = StageDrafter(self.stages, max_drafts=cfg.spec, max_seqs=cfg.parallel,
                                        max_blocks=self.runner.max_blocks, max_model_len=self.max_model_len,
                                        vocab_size=mc.vocab_size, split=split_drafts)
        elif cfg.spec:
            self.drafter = MTPDrafter(self.model, self.pool, max_drafts=cfg.spec, min_p=cfg.spec_min_p,
                                      batch_mtp=cfg.batch_mtp, adaptive=cfg.spec_adaptive,
                                      max_model_len=self.max_model_len, max_seqs=cfg.parallel,
                                      chunk_size=cfg.chunk_size, device=self.device, dtype=dtype,
                                      seed_of=lambda req: self.runner.sampling.sampler(req).seed,
                                      max_num_batched_tokens=cfg.max_num_batched_tokens, cuda_graph=cfg.cuda_graph,
                                      host_pool=self.host_pool, split=split_drafts)
            if self.runner.tiered:  # the MTP layer's decode rows take the target's way to their host part
                self.drafter.attn.stream_decode = self.runner.attn.stream_decode
                self.drafter.attn.pcie_decode = self.runner.attn.pcie_decode
        self.read_stage = None
        if self.concurrent.enabled:
            self.read_stage = ReadStage(self.runner, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                        max_seqs=cfg.parallel, max_model_len=self.max_model_len, drafter=self.drafter,
                                        split_mtp_batch=self.concurrent.split_mtp_batch_reserved)
            self.read_stage.reserve()
            if self.read_stage.stream is not None and self.host_staging is not None:
                self.host_staging.reserve([self.read_stage.stream])  # the read's host-expert layers
            if self.stages is not None:  # the read's steps go through the stages too, in a slot of their own
                self.stages.lane_for(self.read_stage.runner)
        self.alloc_guard = AllocationGuard(self.read_stage, self.pool) if self.read_stage and cfg.alloc_guard else None
        if self.stages is not None:
            self.stages.attach(self.runner, num_blocks, self.max_model_len,
                               max(cfg.parallel * (1 + cfg.spec), PROMPT_GRAPH_ROWS[0]), cfg.spec, split_drafts)
        clock.mark("pools and buffers")
        # Every buffer a graph reads exists now.
        self.graph_seconds = self.runner.capture_graphs()
        if self.drafter:
            self.graph_seconds += self.drafter.capture_graphs()
        if self.read_stage is not None:
            # After the captures: torch.cuda.graph empties the caching allocator on entry, which would drop
            # the read activations the warm-up leaves cached for the stage's stream.
            if self.device.type == "cuda" or cfg.alloc_guard:
                self.read_stage.warm_up()
            log.info("read stage: %.1f MiB of region and scratch twins, %d B upload ring",
                     self.read_stage.region_bytes / 2**20, self.read_stage.up_ring.nbytes)
        clock.mark("graphs and warm-up")
        clock.log()
        self.text: dict[str, _TextState] = {}
        self.requests: dict[str, Request] = {}
        self.progress_ids: set[str] = set()  # requests that asked for an event per chunk of their prompt read
        self.pipelined = (((cfg.batch_groups > 1 or self.stages is not None) and cfg.overlap)
                          or bool(cfg.async_scheduling))
        # Steps launched and not finished, oldest first: at most `depth` (each stage's ring of slots).
        self.flights: deque[_Launched] = deque()
        self.depth = self.stages.depth if self.stages is not None else 2
        self.pending_events: list[EngineEvent] = []  # produced outside step() (an abort waiting for a read)
        self._struck: list[SchedulerOutput] = []  # the steps the current step() scheduled or completed
        self.started = time.monotonic()
        self.prompt_tokens_total = self.generation_tokens_total = self.finished_total = 0
        self.steps_total = self.step_rows_total = self.longest_sequence = 0
        self.decode_seconds_total = 0.0
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.ttft_last: float | None = None
        self.prompt_rate, self.generation_rate = RateWindow(RATE_WINDOW_S), RateWindow(RATE_WINDOW_S)
        self.idle_slots = tuple(SlotSnapshot(i) for i in range(cfg.parallel))

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, req: EngineRequest, logprobs: bool = False) -> None:
        check_prompt(len(req.prompt_ids), self.max_model_len, self.context_sizes)
        if req.request_id in self.requests:
            raise RequestError(f"duplicate request id {req.request_id!r}")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}")
        if req.filtered_logprobs and not req.top_logprobs:
            raise RequestError("filtered_logprobs needs top_logprobs")
        # Ids the model cannot embed or sample would fail the step of every request batched beside it.
        vocab = self.model_config.vocab_size
        for what, ids in (("prompt", req.prompt_ids), ("logit_bias", req.params.logit_bias)):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"{what}: token id {bad} is outside the model's vocabulary [0, {vocab})")
        matcher = self._matcher(req.params)
        r = Request(request_id=req.request_id, prompt_ids=list(req.prompt_ids), params=req.params,
                    arrival_time=req.arrival_time, eos_ids=frozenset(self.eos_ids))
        self.requests[req.request_id] = r
        if req.report_progress:
            self.progress_ids.add(req.request_id)
        try:
            # Without a tokenizer (token-id-only checkpoints, benchmarks) events carry ids and no text.
            detok = Detokenizer(self.tokenizer, list(req.prompt_ids[-4:])) if self.tokenizer else None
            self.text[req.request_id] = _TextState(detok, StopChecker(req.params.stop), logprobs=logprobs)
            self.runner.sampling.sampler(r)  # its seed, in arrival order, whichever stage samples it first
            if req.top_logprobs:
                self.runner.sampling.want_top_logprobs(req.request_id, req.top_logprobs, req.filtered_logprobs)
            if matcher is not None:
                self.runner.constrain(req.request_id, matcher)
            self.scheduler.add(r)
        except Exception:
            self.requests.pop(req.request_id, None)
            self.progress_ids.discard(req.request_id)
            self.text.pop(req.request_id, None)
            self.runner.release(req.request_id)
            raise

    def _matcher(self, params):
        """A new matcher for the request's grammar (the server compiled it already: a cache hit)."""
        if params.grammar is None:
            return None
        if self.grammar_compiler is None:
            raise RequestError("structured output needs the model's tokenizer, which this model lacks")
        try:
            return self.grammar_compiler.compile(params.grammar).matcher()
        except GrammarError as e:
            raise RequestError(str(e)) from None

    def abort(self, request_id: str) -> EngineEvent | None:
        stage = self.read_stage
        if stage is not None and stage.busy and any(c.request.request_id == request_id for c in stage.current.chunks):
            # Its blocks are being written on the read's stream: free them only once that is done.
            self.pending_events += self._read_lane(block=True, next_read=False)
        r = self.requests.get(request_id)
        if r is None or not self.scheduler.abort(request_id):
            return None
        return self._finish_event(r, "abort", (), "")

    @property
    def in_flight(self) -> _Launched | None:
        """The latest step launched and not finished yet."""
        return self.flights[-1] if self.flights else None

    def has_work(self) -> bool:
        return bool(self.requests) or bool(self.pending_events)

    def _written(self, req: Request) -> int:
        """Positions of `req` whose K/V are final in every layer and may move: computed, registered in the
        prefix cache (the host copy takes the block's key), written by the MTP layer."""
        n = req.num_computed_tokens
        if self.cfg.prefix_cache:
            n = min(n, req.prefix_blocks * self.cfg.block_size)
        if self.drafter is not None:
            n = min(n, self.drafter.mtp_upto.get(req.request_id, 0))
        return n

    def _solo_read_tokens(self, cfg: EngineConfig) -> int:
        """The scheduler's `solo_read_tokens`: the largest prompt-chunk graph the runner will capture (CUDA
        graphs on, not a hybrid model: those graphs leave hybrids out), else 0."""
        if self.device.type != "cuda" or not cfg.cuda_graph or not cfg.solo_reads or self.states is not None:
            return 0
        return max(prompt_graph_sizes(1 + cfg.spec, cfg.max_num_batched_tokens), default=0)

    def close(self) -> None:
        """Stop the read stage's worker (the concurrent read), if any."""
        if self.read_stage is not None:
            self.read_stage.close()
        if self.stages is not None:
            self.stages.stop()

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[EngineEvent]:
        """One step's events. A failure fails the requests of the steps it struck (each ends with an
        error event) and the engine goes on with the others (`_fail_step`)."""
        events, self.pending_events = self.pending_events, []
        self._struck = []
        try:
            events += self._step()
        except AllocationGrowth:
            raise  # --alloc-guard checks the engine itself (a test mode): no request's fault
        except Exception as e:
            events += self._fail_step(e)
        return events

    def _step(self) -> list[EngineEvent]:
        reads: list[EngineEvent] = []
        if self.read_stage is not None:
            reads += self._read_lane(block=False)
        launched = self._launch()
        if not self.pipelined:
            done = self._complete(launched) if launched else []
        else:
            if launched is not None:
                self.flights.append(launched)
            full = launched is None or len(self.flights) >= self.depth
            oldest = self.flights.popleft() if self.flights and full else None
            done = self._complete(oldest) if oldest else []
            if launched is not None and launched.step is not None:
                self.runner.launch_head(launched.step)  # a grammar run-ahead step samples now
            launched = launched or oldest
        if launched is None and self.read_stage is not None and self.read_stage.busy:
            reads += self._read_lane(block=True)  # nothing to decode: wait for the read
        return reads + done

    def _fail_step(self, e: Exception) -> list[EngineEvent]:
        """Fails the requests of the steps this call scheduled or completed, and of the step in flight
        (a failed step leaves it unusable), with an error naming `e`; the scheduler frees their blocks
        and slots. Without any such step (the scheduler itself failed) every request fails."""
        oom = isinstance(e, torch.OutOfMemoryError)
        log.error("engine step failed: %s: %s", type(e).__name__, e, exc_info=not oom)
        if oom:
            message = ("out of memory in a step; lower --parallel, --max-num-batched-tokens or --chunk-size, "
                       "or --gpu-memory-utilization to leave more room beside the KV pool")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        else:
            message = f"engine error: {type(e).__name__}: {e}"
        outs = self._struck + [f.out for f in self.flights]
        self.flights.clear()
        self.runner.picker.faults.clear()
        struck = {c.request.request_id for o in outs for c in o.chunks} | {r.request_id for o in outs for r in o.finished}
        if not struck:  # the scheduler's own fault, which no step's requests can be held to: it would recur
            struck = set(self.requests)
        return self._fail_requests({rid: message for rid in struck})

    def _fail_requests(self, faults: dict[str, str]) -> list[EngineEvent]:
        """Each request named ends with an error event (finish reason "abort"), its blocks freed."""
        events = []
        stage = self.read_stage
        for rid, message in faults.items():
            r = self.requests.get(rid)
            if r is None:
                continue
            if stage is not None and stage.busy and any(c.request.request_id == rid for c in stage.current.chunks):
                try:  # its blocks are being written on the read's stream, as in abort()
                    self.pending_events += self._read_lane(block=True, next_read=False)
                except Exception:
                    log.exception("the read stage failed while request %s was failed", rid)
                if rid not in self.requests:
                    continue
            self.scheduler.finish(rid, "abort")
            events.append(self._finish_event(r, "abort", (), "", error=message))
        return events

    def _launch(self) -> _Launched | None:
        if self.kv_tier is not None:
            self.kv_tier.before_schedule(self.scheduler, self._written)
        out = self.scheduler.schedule("decode" if self.read_stage else "all")
        self._struck.append(out)
        if self.kv_tier is not None:
            self.kv_tier.after_schedule()
        if not out.chunks and not out.finished:
            if self.kv_tier is not None and self.requests:
                self.kv_tier.wait_for_copy()  # a request may wait for its blocks to leave the device pool
            return None
        return _Launched(out, self.runner.launch(out.chunks))

    def _read_lane(self, block: bool, next_read: bool = True) -> list[EngineEvent]:
        """The concurrent read: take the read stage's finished step, then give it the next one."""
        stage, events = self.read_stage, []
        res = stage.poll(block)
        if res is not None:
            self._struck.append(res.out)
            if self.alloc_guard is not None:
                self.alloc_guard.check()
            events = self._apply(res.out, res.sampled, res.hidden, res.row_starts, res.draft_kv)
            if res.hidden is not None and res.hidden.is_cuda:
                # The drafter may still copy from it on this thread's stream after the stage moves on. Not
                # record_stream: its blocks would come back late and fragment the stage's cache.
                stage.follow(torch.cuda.current_stream(res.hidden.device))
        if next_read and not stage.busy:
            if self.kv_tier is not None:  # a long read is back in flight at once: its blocks move now
                self.kv_tier.before_schedule(self.scheduler, self._written)
            out = self.scheduler.schedule("read")
            self._struck.append(out)
            if self.kv_tier is not None:
                self.kv_tier.after_schedule(stage.stream)
            if out.chunks:
                stage.reserve()  # nothing in flight on the stage
                if self.alloc_guard is not None:
                    self.alloc_guard.start()
                stage.submit(out)
            elif out.finished or out.preempted:
                events += self._apply(out, {}, None, [])
        return events

    def _complete(self, launched: _Launched) -> list[EngineEvent]:
        self._struck.append(launched.out)
        sampled = (self.runner.collect(launched.step, self.drafter.draft_probs if self.drafter else None)
                   if launched.step else {})
        # Requests whose own sampling failed end here; the step's other requests go on.
        failed = self._fail_requests(launched.step.faults) if launched.step is not None else []
        return failed + self._apply(launched.out, sampled, self.runner.hidden, self.runner.row_starts)

    def _apply(self, out: SchedulerOutput, sampled, hidden, row_starts, kv_written: dict[str, int] | None = None
               ) -> list[EngineEvent]:
        """A step's results into the scheduler, the drafter and events (`kv_written`: MTP K/V the read
        stage wrote, per request)."""
        # An overlapped step may come back for requests aborted since it was launched: drop them.
        sampled = {rid: s for rid, s in sampled.items() if rid in self.requests}
        self.prompt_tokens_total += sum(max(0, min(c.start + c.num_tokens, len(c.request.prompt_ids)) - c.start)
                                        for c in out.chunks)
        if out.chunks:
            self.steps_total += 1
            self.step_rows_total += len(out.chunks)
        progress = self._progress_events(out) if self.progress_ids else []
        finished = self.scheduler.update(out, {rid: s.tokens for rid, s in sampled.items()})
        grammar_done = self._advance_grammars(sampled)
        if self.drafter:
            for r in out.preempted:
                self.drafter.reset(r.request_id)
            live = [i for i, c in enumerate(out.chunks) if c.request.request_id in self.requests]
            if live:
                self.drafter.after_step([out.chunks[i] for i in live], hidden, [row_starts[i] for i in live], sampled,
                                        kv_written)
            for i in live:  # blocks whose MTP K/V are now written too may join the prefix cache
                r = out.chunks[i].request
                self.scheduler.cache_blocks(r, self.drafter.mtp_upto.get(r.request_id, 0))
            self._cut_drafts(sampled)
        events: list[EngineEvent] = progress
        done = {r.request_id for r in finished}
        for rid, s in sampled.items():
            try:
                events += self._events_of(rid, s, done, grammar_done)
            except Exception as e:  # its own text state (detokenizer, stop strings): it alone fails
                log.exception("request %s: its output failed", rid)
                events += self._fail_requests({rid: f"output failed: {type(e).__name__}: {e}"})
        for r in finished:  # finished without a sampled token this step (e.g. could never fit)
            if r.request_id in self.requests:
                events.append(self._finish_event(r, r.finish_reason, (), self.text[r.request_id].stops.flush()))
        return events

    def _progress_events(self, out: SchedulerOutput) -> list[EngineEvent]:
        """An event with `prompt_read` for each chunk of a first prompt read whose request asked for them
        (`EngineRequest.report_progress`), before the step's token events."""
        events = []
        for c in out.chunks:
            r = c.request
            n = len(r.prompt_ids)
            if r.request_id in self.progress_ids and r.request_id in self.requests and not r.output_ids \
                    and c.start < n:
                events.append(EngineEvent(r.request_id, (), "", prompt_tokens=n, cached_tokens=r.num_cached_tokens or 0,
                                          prompt_read=min(c.start + c.num_tokens, n)))
        return events

    def _events_of(self, rid: str, s, done: set[str], grammar_done: set[str]) -> list[EngineEvent]:
        """The event of one request's new tokens in a step: text through its detokenizer and stop strings."""
        events: list[EngineEvent] = []
        r = self.requests[rid]
        st = self.text[rid]
        self.generation_tokens_total += len(r.output_ids) - st.sent_tokens
        if st.sent_tokens == 0 and r.first_token_time is not None:
            self._record_ttft(r.first_token_time - r.arrival_time)
        new_ids = tuple(r.output_ids[st.sent_tokens :])
        text = ""
        stopped = False
        for t in new_ids:
            if rid in done and _is_eos(r, t):
                continue  # the EOS token itself produces no text
            piece, stopped = st.stops.push(st.detok.push(t) if st.detok else "")
            text += piece
            if stopped:
                break
        st.sent_tokens = len(r.output_ids)
        lp = tuple(s.logprobs[: len(new_ids)]) if st.logprobs else None
        top = tuple(tuple(t) for t in s.top[: len(new_ids)]) if s.top is not None else None
        if (stopped or rid in grammar_done) and rid not in done:
            self.scheduler.finish(rid, "stop")
            if not stopped:
                text += st.stops.flush()
            events.append(self._finish_event(r, "stop", new_ids, text, lp, top))
        elif rid in done:
            events.append(self._finish_event(r, r.finish_reason, new_ids, text + st.stops.flush(), lp, top))
        else:
            events.append(EngineEvent(rid, new_ids, text, None, len(r.prompt_ids), len(r.output_ids), lp,
                                      top_logprobs=top))
        return events

    def _advance_grammars(self, sampled) -> set[str]:
        """Feeds each constrained request's new output tokens to its matcher; returns the requests
        whose grammar is done: a stop token was accepted, or nothing but one may follow (finished now
        rather than after a step that samples it). With ignore_eos too: the output cannot go on."""
        done = set()
        matchers = self.runner.matchers
        for rid in sampled:
            m = matchers.get(rid)
            if m is None:
                continue
            new = self.requests[rid].output_ids[m.num_tokens :]
            if m.accept_many(new) < len(new) or m.is_terminated() or m.must_stop():
                done.add(rid)
        return done

    def _cut_drafts(self, sampled) -> None:
        """Drops the drafts a constrained request's grammar rejects before they are verified: each
        would cost a row and could never be accepted (its row's mask excludes it)."""
        matchers = self.runner.matchers
        for rid in sampled:
            m = matchers.get(rid)
            r = self.requests.get(rid)
            if m is not None and r is not None and r.draft_ids:
                n = m.valid_prefix(r.draft_ids)
                if n < len(r.draft_ids):
                    r.draft_ids = r.draft_ids[:n]

    def _record_ttft(self, seconds: float) -> None:
        self.ttft_sum += seconds
        self.ttft_last = seconds
        for i, bound in enumerate(TTFT_BUCKETS):
            if seconds <= bound:
                self.ttft_counts[i] += 1
        self.ttft_counts[-1] += 1

    def _finish_event(self, r: Request, reason: str, ids, text: str, lp=None, top=None,
                      error: str | None = None) -> EngineEvent:
        self.requests.pop(r.request_id, None)
        self.progress_ids.discard(r.request_id)
        self.text.pop(r.request_id, None)
        self.runner.release(r.request_id)
        spec = self.drafter.forget(r.request_id) if self.drafter else None
        self.finished_total += 1
        self.longest_sequence = max(self.longest_sequence, len(r.prompt_ids) + len(r.output_ids))
        if r.first_token_time is not None:
            self.decode_seconds_total += time.monotonic() - r.first_token_time
        completion = len(r.output_ids)
        if r.output_ids and reason == "stop" and _is_eos(r, r.output_ids[-1]):
            completion -= 1  # the EOS token is not part of the completion
        return EngineEvent(r.request_id, tuple(ids), text, reason, len(r.prompt_ids), completion, lp,
                           spec=spec.as_dict() if spec else None, top_logprobs=top,
                           cached_tokens=r.num_cached_tokens or 0, error=error)

    def stats(self) -> EngineStats:
        """A snapshot of host counters only (no device reads). Call it from the thread that steps:
        it also advances the recent-rate windows."""
        s = self.scheduler
        now = time.monotonic()
        uptime = now - self.started
        return EngineStats(
            parallel=self.cfg.parallel, queue_len=s.queue_len, slots_busy=s.slots_busy,
            kv_blocks_used=s.kv_blocks_used, kv_blocks_total=s.kv_blocks_total,
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
            requests_finished_total=self.finished_total, give_ways_total=s.give_ways_total,
            preemptions_total=s.preemptions_total, ttft_counts=tuple(self.ttft_counts), ttft_sum=self.ttft_sum,
            uptime_seconds=uptime, steps_total=self.steps_total, step_rows_total=self.step_rows_total,
            longest_sequence=self.longest_sequence, decode_seconds_total=self.decode_seconds_total,
            spec=self.drafter.total.as_dict() if self.drafter else None,
            prompt_tokens_per_second=self.prompt_rate.update(self.prompt_tokens_total, uptime),
            generation_tokens_per_second=self.generation_rate.update(self.generation_tokens_total, uptime),
            ttft_last_seconds=self.ttft_last, slots=self.slot_snapshots(now),
            prefix_cache_queries_total=s.prefix_queries_total, prefix_cache_hits_total=s.prefix_hits_total,
            prefix_cache_cached_tokens_total=s.prefix_cached_tokens_total,
            read_stage_steps_total=self.read_stage.reads_total if self.read_stage else 0,
            solo_reads_total=s.solo_reads_total,
            **(self.kv_tier.stats() if self.kv_tier else {}),
        )

    def slot_snapshots(self, now: float) -> tuple[SlotSnapshot, ...]:
        """Every slot as of the last step, from the scheduler's counters; `now` is time.monotonic()."""
        s = self.scheduler
        slots = list(self.idle_slots)
        spec = self.drafter.stats if self.drafter else {}
        for r in s.running:
            if r.is_reading or not r.output_ids:
                state = "reading" if s.got_tokens_last_step(r.request_id) else "waiting"
            else:
                state = "decoding"
            generated = len(r.output_ids)
            since_first = now - r.first_token_time if r.first_token_time is not None else 0.0
            drafts = spec.get(r.request_id)
            slots[r.slot] = SlotSnapshot(
                r.slot, state, r.request_id, prompt_tokens=len(r.prompt_ids),
                prompt_read=min(r.num_computed_tokens, len(r.prompt_ids)), generated=generated,
                max_tokens=r.params.max_tokens,
                tokens_per_s=(generated - 1) / since_first if generated > 1 and since_first > 0 else 0.0,
                give_ways=r.give_ways, drafts_proposed=drafts.proposed if drafts else 0,
                drafts_accepted=drafts.accepted if drafts else 0,
            )
        return tuple(slots)

    # ---- offline convenience ---------------------------------------------------------------------
    def run_to_completion(self) -> dict[str, list[EngineEvent]]:
        events: dict[str, list[EngineEvent]] = {}
        while self.has_work():
            for ev in self.step():
                events.setdefault(ev.request_id, []).append(ev)
        return events
