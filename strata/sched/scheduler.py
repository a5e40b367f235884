"""The step scheduler: which requests hold a slot, and which of their tokens the next step computes.

Each step mixes decodes (1 token for every running request whose only uncomputed token is its last)
with prompt reads (chunks of at most `chunk_size` positions), under a per-step token budget. Nothing
here knows about phases: a request's `num_computed_tokens` catches up with its `num_tokens`, and a
chunk that reaches `num_tokens` samples the next token.

Order of a step (`schedule()`):
1. Admission: waiting requests take free slots (ids 0..parallel-1, lowest first), FIFO.
2. Decodes, oldest admission first, 1 token each.
3. Reads, in arrival order, each `min(chunk_size, remaining, budget left)` tokens. With give-way on,
   a long read (remaining > chunk_size) yields the step to any newer read that gets tokens.
Blocks are allocated just before a chunk is scheduled; when the pool is empty the most recently
admitted running request is preempted (see `_make_room`).

Prefix cache (`prefix_cache`): full blocks are keyed by a hash chain of their tokens
(`strata.kvcache.prefix`) and registered with the allocator once their K/V are written (by update(),
or with the MTP layer in use by the engine through `cache_blocks`, once the MTP K/V are written too).
At admission a request takes the longest cached run of its leading blocks into its block table and
its counter starts after them: everything else (chunks, give-way, run-ahead, preemption) is
unchanged. Hits are whole blocks and stop before the block holding the last token, which must be
computed to sample: so a shared block is never written.

Steps may overlap: with batch groups the engine schedules and launches one group's step before it
applies the previous step's results. A request stays *in flight* from the schedule() that gave it a
chunk until the update() of that step; in-flight requests are not preempted (the device may still be
writing their blocks), so a preemption they block happens at their next step boundary instead, and
are not scheduled again, except by run-ahead and read-ahead (below).

Run-ahead (`run_ahead`, the engine's async scheduling): a request in flight may get the chunk after
its in-flight one in the very next schedule(), before update() has seen the in-flight step's result,
so the device always has the next step queued. The new chunk starts where the in-flight one ends;
if that one samples, the new chunk's first input is the token it samples (`pending`: the runner
takes it from the device), which is only allowed where nothing on the host needs that token first
(no drafts, no repetition penalty) and the request cannot finish by length on it. A run-ahead chunk
of a request that finishes on its in-flight token (EOS, a stop string, an abort) is computed and
dropped: update() skips requests that are no longer running.

Read-ahead (`read_ahead`, pipeline stages): chunks of one prompt are scheduled while the previous ones
are in flight, up to `read_ahead` of them (one per stage), so a lone long read keeps every stage busy.
Positions scheduled and not yet applied are counted on the request (`num_in_flight_tokens`,
`num_in_flight_chunks`); the next chunk starts after them. It is safe because a chunk only needs the
K/V and recurrent states its predecessors write on the same stage, which runs its steps in order. A
chunk read ahead samples nothing and follows chunks that sample nothing: it is read ahead only where
the remainder from its start exceeds `chunk_size`, so it ends before the last token; the chunk that
samples waits until every earlier one is applied, and ends the overlap. A chunk read ahead takes free
blocks only (it preempts nobody: the request may as well wait for its update), and a request with
chunks in flight is preempted only once they are all applied, as any in-flight request. Only on the
"all" lane, exclusive with run-ahead.

Lanes (`read_lane`, the engine's concurrent read): reads and decodes are scheduled apart, so a read
step can be in flight on its own stage for as long as it takes while decode steps come and go.
`schedule("decode")` admits, preempts and schedules decodes only; `schedule("read")` admits and
schedules reads only, with the same token budget and give-way rules. A request's chunk in flight on
one lane keeps it off the other until its update() (and no run-ahead crosses lanes): a read that
samples hands its request to the decode lane with everything it read kept.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from strata.kvcache.allocator import NULL_BLOCK, BlockAllocator
from strata.kvcache.prefix import PrefixKeys
from strata.sched.request import FINISH_STATUS, Request, RequestStatus
from strata.sched.step import PENDING_TOKEN, ScheduledChunk, SchedulerOutput, StepBuilder  # noqa: F401 (PENDING_TOKEN re-exported)

log = logging.getLogger("strata")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    num_blocks: int  # including the reserved padding block 0
    max_model_len: int
    parallel: int = 1  # requests that hold a slot at once
    max_num_batched_tokens: int = 2048  # per-step token budget, decodes and reads together
    chunk_size: int = 512  # most prompt positions one request reads in one step
    block_size: int = 16
    give_way: bool = True
    lookahead: int = 0  # extra positions to reserve blocks for (the drafter's K/V)
    batch_groups: int = 1  # slots split into groups (slot % G) whose decodes are stepped in turn
    max_hold_steps: int = 16  # a long read held back this many steps in a row reads the next one anyway
    run_ahead: bool = False  # schedule a request's next chunk while its previous step is in flight
    read_ahead: int = 1  # most prompt chunks of one request in flight at once (pipeline stages; 1: off)
    prefix_cache: bool = False  # reuse cached full blocks of earlier requests (see the module docstring)
    prefix_salt: str = ""  # what else the K/V depend on (model, dtype, KV storage): part of every key
    prefix_with_mtp: bool = False  # keys take the next token; blocks are registered by cache_blocks() only
    read_lane: bool = False  # reads scheduled apart from decodes: schedule("read") / schedule("decode")
    run_ahead_grammar: bool = False  # constrained requests run ahead too (the runner samples them in two stages)
    # A lone read whose whole remainder fits this many tokens (a prefix hit's tail, a short prompt) gets a
    # step of its own while others decode, the decodes waiting that one step: the runner replays a
    # prompt-chunk graph for it instead of running decodes and read eagerly together (0: never).
    solo_read_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "max_model_len", "parallel", "max_num_batched_tokens", "chunk_size", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_hold_steps < 1:
            raise ValueError("SchedulerConfig.max_hold_steps must be >= 1")
        if self.read_ahead < 1:
            raise ValueError("SchedulerConfig.read_ahead must be >= 1")
        if self.read_ahead > 1 and self.run_ahead:
            raise ValueError("SchedulerConfig.read_ahead and run_ahead do not go together")
        if self.batch_groups < 1 or self.batch_groups > self.parallel:
            raise ValueError("SchedulerConfig.batch_groups must be within 1..parallel")
        if self.num_blocks < 2:
            raise ValueError("SchedulerConfig.num_blocks must be >= 2 (block 0 is reserved)")


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: BlockAllocator | None = None,
        *,
        now: Callable[[], float] = time.monotonic,
    ):
        if allocator is None:
            allocator = BlockAllocator(config.num_blocks, config.block_size)
        if allocator.block_size != config.block_size or allocator.num_blocks != config.num_blocks:
            raise ValueError(
                f"allocator ({allocator.num_blocks} blocks of {allocator.block_size}) does not match the config "
                f"({config.num_blocks} blocks of {config.block_size})"
            )
        self.config = config
        self.allocator = allocator
        self._now = now
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._arrival: dict[str, int] = {}  # add() order; "arrived later" means a larger number
        self._next_arrival = 0
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admission order: the last one is the preemption victim
        self._free_slots = list(range(config.parallel))
        self._finished_on_add: list[Request] = []
        self._last_step: dict[str, set[str]] = {}  # per lane: requests that got tokens in its previous step
        self._lane_of: dict[str, str] = {}  # request id -> the lane its in-flight chunk is on
        self._next_group = 0  # batch groups: whose turn to decode is next
        self._held: dict[str, int] = {}  # long reads: steps held back in a row (starvation guard)
        self._solo_last = False  # the previous step was a solo read: this one decodes whatever comes
        self._in_flight: dict[str, ScheduledChunk] = {}  # scheduled, not yet updated: the latest chunk
        self._preempt_next: set[str] = set()  # victims that were in flight when their blocks were needed
        self.give_ways_total = 0
        self.solo_reads_total = 0  # steps given to one short read alone while others waited to decode
        self.preemptions_total = 0
        self.prefix_queries_total = self.prefix_hits_total = self.prefix_cached_tokens_total = 0
        self._salt = config.prefix_salt.encode()
        self.tier = None  # the host KV tier (`strata.kvcache.tier.KVTier`), set by the engine

    # ---------------------------------------------------------------- requests in and out

    def add(self, request: Request) -> None:
        """Queue a fresh request. The engine checks prompt length first; a prompt longer than
        max_model_len is refused here as a ValueError. max_tokens == 0 finishes it at once ("length"),
        reported by the next schedule()/update()."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if (request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.block_ids
                or request.num_in_flight_chunks):
            raise ValueError(f"request {request.request_id!r} is not fresh: {request!r}")
        if request.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: {request.num_tokens} tokens exceed max_model_len "
                f"{self.config.max_model_len}"
            )
        if request.params.max_tokens == 0:
            request.status = RequestStatus.FINISHED_LENGTH
            request.finish_time = self._now()
            self._finished_on_add.append(request)
            return
        self._requests[request.request_id] = request
        self._arrival[request.request_id] = self._next_arrival
        self._next_arrival += 1
        self._waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Finish as aborted and free its blocks and slot now. False if unknown or already finished."""
        return self.finish(request_id, "abort")

    def finish(self, request_id: str, reason: str | RequestStatus) -> bool:
        """Finish a request for the engine (e.g. its detokenizer matched a stop string).

        `reason` is "stop", "length" or "abort" (or the matching RequestStatus). Blocks and slot are freed
        at once; a chunk of it still in flight is ignored by update(). False if unknown or finished.
        """
        status = FINISH_STATUS.get(reason) if isinstance(reason, str) else reason
        if status is None or not status.is_finished:
            raise ValueError(f"not a finish reason: {reason!r}")
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._finish(req, status)
        return True

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._finished_on_add)

    # ---------------------------------------------------------------- stats

    @property
    def waiting(self) -> tuple[Request, ...]:
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._running)

    @property
    def queue_len(self) -> int:
        return len(self._waiting)

    @property
    def slots_busy(self) -> int:
        return len(self._running)

    @property
    def kv_blocks_used(self) -> int:
        return self.allocator.num_used

    @property
    def kv_blocks_total(self) -> int:
        return self.allocator.capacity

    @property
    def in_flight_ids(self) -> set[str]:
        """Requests with a chunk scheduled and not yet updated (the device may be using their blocks)."""
        return set(self._in_flight)

    def got_tokens_last_step(self, request_id: str) -> bool:
        """Whether the latest schedule() of a lane gave the request tokens (or its previous step is still in
        flight)."""
        return any(request_id in ids for ids in self._last_step.values())

    # ---------------------------------------------------------------- one step

    def schedule(self, lane: str = "all") -> SchedulerOutput:
        """The next step: decodes and reads ("all"), or with `read_lane` one lane's ("decode", "read")."""
        cfg = self.config
        if lane not in (("decode", "read") if cfg.read_lane else ("all",)):
            raise ValueError(f"lane {lane!r} with read_lane={cfg.read_lane}")
        step = StepBuilder()
        step.finished.extend(self._finished_on_add)
        self._finished_on_add.clear()
        self._admit()
        # After admission, so a victim waits at least one step before it is admitted again.
        for rid in sorted(self._preempt_next, key=lambda r: -self._arrival.get(r, -1)):
            victim = self._requests.get(rid)
            if victim is not None and victim.status is RequestStatus.RUNNING and rid not in self._in_flight:
                self._preempt(victim, step)
        self._preempt_next &= self._in_flight.keys()
        # Where each schedulable request's next chunk starts (after its in-flight chunk, if any).
        nexts = {r.request_id: n for r in self._running if (n := self._next_start(r)) is not None}

        solo = self._solo_read(lane, nexts)
        if not solo:
            self._schedule_decodes(lane, step, nexts)

        readers = sorted((r for r in self._running if r.request_id in nexts and self._uncomputed(r, nexts) > 1),
                         key=self._arrival_of) if lane != "decode" else []
        last_step = self._last_step.get(lane, set())
        newest = self._arrival_of(readers[-1]) if readers else -1
        deferred: list[Request] = []
        for req in readers:
            # Newer reads arriving every step would starve a long read: after max_hold_steps held
            # steps in a row it reads a chunk beside them.
            starving = self._held.get(req.request_id, 0) >= cfg.max_hold_steps
            if (cfg.give_way and self._uncomputed(req, nexts) > cfg.chunk_size and self._arrival_of(req) < newest
                    and not starving):
                deferred.append(req)
            else:
                self._held.pop(req.request_id, None)
                self._schedule_read(req, step, nexts[req.request_id][0])
        for req in deferred:
            if req.status is not RequestStatus.RUNNING:
                continue
            # It yields only to a newer read that really got tokens; if every newer one was squeezed out
            # (budget, blocks), yielding would stall both for nothing.
            if any(
                self._arrival_of(o) > self._arrival_of(req) and o.request_id in step.chunks for o in readers
            ):
                if req.request_id in last_step:
                    req.give_ways += 1
                    self.give_ways_total += 1
                self._held[req.request_id] = self._held.get(req.request_id, 0) + 1
                continue
            self._held.pop(req.request_id, None)
            self._schedule_read(req, step, nexts[req.request_id][0])

        if solo and not step.chunks:  # the read got no room after all: the decodes go on
            solo = False
            self._schedule_decodes(lane, step, nexts)
        if lane == "all":
            self._solo_last = solo
            self.solo_reads_total += solo
        # A read in flight from the previous step still counts as having read last.
        self._last_step[lane] = set(step.chunks) | {r for r, ln in self._lane_of.items() if ln == lane}
        self._in_flight.update(step.chunks)
        self._lane_of.update(dict.fromkeys(step.chunks, lane))
        for chunk in step.chunks.values():
            chunk.request.num_in_flight_tokens += chunk.num_tokens
            chunk.request.num_in_flight_chunks += 1
        return SchedulerOutput(list(step.chunks.values()), step.preempted, step.finished)

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Apply a step's results; returns the requests that finished (including `output.finished`).

        The sampled token is appended but not computed: afterwards num_computed_tokens == num_tokens - 1,
        so the next step decodes it. A stop token stays in output_ids; the engine decides what to show.
        """
        finished = list(output.finished)
        for chunk in output.chunks:
            req = chunk.request
            req.num_in_flight_tokens -= chunk.num_tokens
            req.num_in_flight_chunks -= 1
            if self._in_flight.get(req.request_id) is chunk:  # else a run-ahead or read-ahead chunk followed it
                del self._in_flight[req.request_id]
                self._lane_of.pop(req.request_id, None)
            if req.status is not RequestStatus.RUNNING:
                continue  # finished or aborted by the engine since schedule()
            if chunk.start != req.num_computed_tokens:
                raise RuntimeError(
                    f"request {req.request_id!r}: chunk starts at {chunk.start} but {req.num_computed_tokens} "
                    "tokens are computed (was update() called twice for one step?)"
                )
            if not chunk.sample:
                req.num_computed_tokens += chunk.num_tokens
                self._cache_written(req)
                continue
            try:
                got = sampled[req.request_id]
            except KeyError:
                raise KeyError(f"no sampled token for request {req.request_id!r}, whose chunk asked for one") from None
            # With drafts, `got` lists the accepted drafts and then the target's own token; the K/V of
            # rejected drafts stay in the blocks and are overwritten later (rollback by counter).
            emitted = [int(got)] if isinstance(got, int) else [int(t) for t in got]
            if not 1 <= len(emitted) <= len(chunk.drafts) + 1:
                raise ValueError(f"request {req.request_id!r}: {len(emitted)} tokens for {len(chunk.drafts)} drafts")
            req.num_computed_tokens += chunk.num_tokens - len(chunk.drafts) + len(emitted) - 1
            self._cache_written(req)
            if req.first_token_time is None:
                req.first_token_time = self._now()
            for token in emitted:
                req.output_ids.append(token)
                status = self._stop_status(req, token)
                if status is not None:
                    self._finish(req, status)
                    finished.append(req)
                    break
        return finished

    # ---------------------------------------------------------------- internals

    def _arrival_of(self, req: Request) -> int:
        return self._arrival[req.request_id]

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        if token in req.stop_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_ids) >= req.params.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _admit(self) -> None:
        held: list[Request] = []
        while self._waiting and self._free_slots:
            req = self._waiting.popleft()
            if self.config.prefix_cache and self._sibling_reads_it(req):
                held.append(req)
                continue
            req.slot = heapq.heappop(self._free_slots)
            req.status = RequestStatus.RUNNING
            self._running.append(req)
            if self.config.prefix_cache:
                self._take_cached_prefix(req)
        self._waiting.extendleft(reversed(held))

    def _sibling_reads_it(self, req: Request) -> bool:
        """Whether a running request holds, not yet cached, every prompt block `req` could reuse (n > 1
        choices, a resent prompt): `req` then waits until they are cached (after that request's read,
        and with speculation its MTP K/V) instead of reading them a second time. Only fresh requests
        wait, and only behind a running request, which registers its blocks as it goes or leaves
        (finish, abort, preemption), so nothing waits for ever."""
        if req.num_cached_tokens is not None:
            return False
        usable = (req.num_tokens - 1) // self.config.block_size
        if usable == 0:
            return False
        last = self._keys(req)[usable - 1]  # a chain key: equal last keys mean equal chains
        for r in self._running:
            if r.prefix_blocks >= usable:  # already cached (or registered by another copy)
                continue
            keys = self._keys(r)
            if len(keys) >= usable and keys[usable - 1] == last:
                return True
        return False

    # ---------------------------------------------------------------- prefix cache

    def _keys(self, req: Request) -> list[bytes]:
        if req.prefix_keys is None:
            req.prefix_keys = PrefixKeys(self.config.block_size, self._salt, self.config.prefix_with_mtp)
        return req.prefix_keys.extend(req.token_ids, req.num_tokens)

    def _take_cached_prefix(self, req: Request) -> None:
        """Start a newly admitted request's block table with the longest cached run of its blocks."""
        if req.block_ids or req.num_computed_tokens:
            raise RuntimeError(f"request {req.request_id!r} admitted with blocks or computed tokens: {req!r}")
        bs = self.config.block_size
        usable = (req.num_tokens - 1) // bs  # the block holding the last token is always computed
        keys = self._keys(req)[:usable]
        host: list[int] = []
        if self.tier is not None:
            host, blocks = self.tier.lookup(keys)
            req.host_blocks = host
            blocks = [NULL_BLOCK] * len(host) + blocks
        else:
            blocks = self.allocator.lookup(keys)
        req.block_ids = blocks
        req.prefix_blocks = len(blocks)
        req.prefix_hit = req.num_computed_tokens = len(blocks) * bs
        if req.num_cached_tokens is None:  # first admission: what the request's usage reports
            req.num_cached_tokens = req.prefix_hit
            req.num_host_cached_tokens = len(host) * bs
            if self.tier is not None:
                self.tier.host_hits_total += bool(host)
                self.tier.host_hit_tokens_total += len(host) * bs
            self.prefix_queries_total += 1
            self.prefix_hits_total += bool(blocks)
            self.prefix_cached_tokens_total += req.prefix_hit

    def _cache_written(self, req: Request) -> None:
        if self.config.prefix_cache and not self.config.prefix_with_mtp:
            self.cache_blocks(req, req.num_computed_tokens)

    def cache_blocks(self, req: Request, upto: int) -> None:
        """Register `req`'s full blocks below position `upto` (at most its computed tokens) in the prefix
        cache. update() does it for computed K/V; with `prefix_with_mtp` the engine calls it with the
        positions whose MTP K/V are written as well. A no-op when the cache is off or `req` is not running."""
        if not self.config.prefix_cache or req.status is not RequestStatus.RUNNING:
            return
        n = min(upto, req.num_computed_tokens) // self.config.block_size
        if n <= req.prefix_blocks:
            return
        keys = self._keys(req)
        n = min(n, len(keys), len(req.block_ids))
        for k in range(req.prefix_blocks, n):
            self.allocator.register(req.block_ids[k], keys[k])
        req.prefix_blocks = max(n, req.prefix_blocks)

    def _next_start(self, req: Request) -> tuple[int, int] | None:
        """(position the request's next chunk starts at, pending inputs) or None while it cannot get
        one: its chunk is in flight and may not be run ahead of (see the module docstring)."""
        ahead = self._in_flight.get(req.request_id)
        if ahead is None:
            return req.num_computed_tokens, 0
        if req.request_id in self._preempt_next:
            return None
        if self.config.read_ahead > 1:
            start = req.num_computed_tokens + req.num_in_flight_tokens
            # After chunks that sample nothing (the first that samples ends the read), one per stage at
            # most, and only a chunk that cannot sample either.
            if (ahead.sample or req.num_in_flight_chunks >= self.config.read_ahead
                    or self._lane_of.get(req.request_id) != "all"
                    or req.num_tokens - start <= self.config.chunk_size):
                return None
            return start, 0
        if not self.config.run_ahead or ahead.drafts or self._lane_of.get(req.request_id) == "read":
            return None
        if not ahead.sample:
            return ahead.end, 0
        # The in-flight step appends one token: the run-ahead decode reads it and samples the next,
        # which needs room under both length limits (else the request finishes on the first one).
        if (req.params.repetition_penalty != 1.0 or req.params.output_penalised or (req.params.grammar is not None and not self.config.run_ahead_grammar)
                or len(req.output_ids) + 2 > req.params.max_tokens
                or req.num_tokens + 2 > self.config.max_model_len):
            return None
        return ahead.end, 1

    @staticmethod
    def _uncomputed(req: Request, nexts: dict[str, tuple[int, int]]) -> int:
        start, pending = nexts[req.request_id]
        return req.num_tokens + pending - start

    def _schedule_read(self, req: Request, step: StepBuilder, start: int) -> None:
        left = self.config.max_num_batched_tokens - step.tokens
        if req.status is RequestStatus.RUNNING and left > 0:
            self._schedule_chunk(req, min(self.config.chunk_size, req.num_tokens - start, left), step, start=start,
                                 preempt=not req.num_in_flight_chunks)

    def _decode_group(self, nexts: dict[str, tuple[int, int]]) -> list[Request]:
        """The requests to decode this step: all of them, or with batch groups the next group in turn
        that has one ready (reads are not grouped: they run beside whichever group decodes)."""
        ready = [r for r in self._running if r.request_id in nexts and self._uncomputed(r, nexts) == 1]
        g_count = self.config.batch_groups
        if g_count == 1 or not ready:
            return ready
        groups = {r.slot % g_count for r in ready}
        g = next(x % g_count for x in range(self._next_group, self._next_group + g_count) if x % g_count in groups)
        self._next_group = (g + 1) % g_count
        return [r for r in ready if r.slot % g_count == g]

    def _schedule_decodes(self, lane: str, step: StepBuilder, nexts: dict[str, tuple[int, int]]) -> None:
        for req in self._decode_group(nexts) if lane != "read" else ():
            if step.tokens >= self.config.max_num_batched_tokens:
                break
            if req.status is RequestStatus.RUNNING:
                self._schedule_decode(req, step, *nexts[req.request_id])

    def _solo_read(self, lane: str, nexts: dict[str, tuple[int, int]]) -> bool:
        """Whether this step is one request's whole remaining read, alone (`solo_read_tokens`): the only
        read, short enough, with requests decoding beside it, and the previous step not solo already
        (decodes never wait two steps in a row)."""
        cfg = self.config
        if lane != "all" or not cfg.solo_read_tokens or self._solo_last:
            return False
        left = {r.request_id: self._uncomputed(r, nexts) for r in self._running if r.request_id in nexts}
        readers = [rid for rid, n in left.items() if n > 1]
        if len(readers) != 1 or len(left) == 1:
            return False
        return left[readers[0]] <= min(cfg.solo_read_tokens, cfg.chunk_size, cfg.max_num_batched_tokens)

    def _schedule_decode(self, req: Request, step: StepBuilder, start: int, pending: int) -> None:
        """One token, plus the request's drafts when budget, context and max_tokens leave room."""
        if pending:  # run-ahead: no drafts (they would have to follow the pending token)
            self._schedule_chunk(req, 1, step, start=start, pending=pending)
            return
        room = min(
            self.config.max_num_batched_tokens - step.tokens - 1,
            self.config.max_model_len - req.num_tokens - 1,
            req.params.max_tokens - len(req.output_ids) - 1,
        )
        drafts = tuple(req.draft_ids[: max(room, 0)])
        req.draft_ids = []
        self._schedule_chunk(req, 1 + len(drafts), step, drafts, start=start)

    def _schedule_chunk(self, req: Request, n: int, step: StepBuilder, drafts: tuple[int, ...] = (), *,
                        start: int, pending: int = 0, preempt: bool = True) -> bool:
        if req.request_id in self._preempt_next:
            return False  # marked as a victim in this step (run-ahead): it gets no more work
        # Lookahead blocks hold the K/V the drafter writes past the verified tokens.
        reserve = min(start + n + self.config.lookahead, self.config.max_model_len)
        if not self._make_room(req, max(reserve, start + n), step, preempt):
            return False
        sample = start + n - len(drafts) == req.num_tokens + pending
        step.add(ScheduledChunk(req, start, n, sample, drafts, pending))
        return True

    def _make_room(self, req: Request, num_tokens: int, step: StepBuilder, preempt: bool = True) -> bool:
        """Give `req` blocks for `num_tokens` positions, preempting the newest admissions as needed
        (`preempt` False: free blocks only, else False).

        If `req` is itself the newest it is the one preempted (False). If it is the only running request
        and still does not fit, it never will: it is finished as "length", as if it had hit
        max_model_len (False). With the host KV tier, a request whose blocks are being copied out of the
        device pool waits for them instead (False), preempting nobody.
        """
        alloc = self.allocator
        while True:
            need = alloc.blocks_for(num_tokens) - len(req.block_ids)
            if need <= 0:
                return True
            ids = alloc.allocate(need)
            if ids is not None:
                req.block_ids.extend(ids)
                return True
            if self.tier is not None and self.tier.moving.get(req.request_id):
                return False  # its blocks past the window are being copied to the host: room at a later step
            if not preempt:
                return False
            victim = self._running[-1]
            if victim is req and len(self._running) == 1:
                log.warning("request %s: it needs %d more KV blocks (to %d positions; %d of its blocks in the host tier), the "
                            "pool has %d free and no other request to preempt: finished (\"length\")", req.request_id,
                            need, num_tokens, len(req.host_blocks), alloc.num_free)
                # Finishing is safe even while a run-ahead step of it is in flight: nothing comes back.
                self._finish(req, RequestStatus.FINISHED_LENGTH)
                step.finished.append(req)
                return False
            if victim.request_id in self._in_flight:
                # Its step may still be writing those blocks, and its result would come back to a
                # recomputing request: preempt it at its next step boundary and let `req` wait until then.
                self._preempt_next.add(victim.request_id)
                return False
            self._preempt(victim, step)
            if victim is req:
                return False

    def _preempt(self, req: Request, step: StepBuilder) -> None:
        """Back to the front of the queue with nothing computed; output_ids are kept for recompute.

        A request that holds no blocks yet (admitted but never scheduled; or only its cache hit) lost
        nothing: it is returned to the queue without counting a preemption.
        """
        lost_work = len(req.block_ids) > req.prefix_hit // self.config.block_size  # more than its cache hit
        step.withdraw(req)
        self._release(req)
        req.num_computed_tokens = req.prefix_hit = req.prefix_blocks = 0
        req.draft_ids = []
        self._waiting.appendleft(req)
        if lost_work:
            req.status = RequestStatus.PREEMPTED
            req.preemptions += 1
            self.preemptions_total += 1
            step.preempted.append(req)
        else:
            req.status = RequestStatus.PREEMPTED if req.preemptions else RequestStatus.WAITING

    def _release(self, req: Request) -> None:
        if req.block_ids:
            self.allocator.free([b for b in req.block_ids if b != NULL_BLOCK])  # NULL: moved to the host tier
            req.block_ids = []
        if self.tier is not None:
            self.tier.release(req)
        if req.slot is not None:
            heapq.heappush(self._free_slots, req.slot)
            req.slot = None
        if req in self._running:
            self._running.remove(req)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status is RequestStatus.RUNNING:
            self._release(req)
        else:
            self._waiting.remove(req)
        req.status = status
        req.finish_time = self._now()
        del self._requests[req.request_id]
        del self._arrival[req.request_id]
        for ids in self._last_step.values():
            ids.discard(req.request_id)
        self._held.pop(req.request_id, None)
        self._in_flight.pop(req.request_id, None)
        self._lane_of.pop(req.request_id, None)
        self._preempt_next.discard(req.request_id)
