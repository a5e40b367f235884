"""What goes into the engine and what comes out: typed, torch-free data.

The HTTP layer (or `strata.LLM`) turns JSON and chat templates into an `EngineRequest`; the engine
answers with a stream of `EngineEvent`s, one per step that produced text for the request, the last
one carrying `finish_reason`. `EngineStats` is the snapshot /metrics and /slots read: built on the
engine thread after each step and never changed after, so other threads may read it without locks.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from strata.params import MAX_TOP_LOGPROBS, SamplingParams  # noqa: F401 (MAX_TOP_LOGPROBS: the engine's limit)

# Time to first token spans a short prompt on a GPU (milliseconds) to a long prompt queued behind
# others on a CPU (a minute).
TTFT_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW_S = 5.0  # the span of the engine's recent token rates


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float
    top_logprobs: int = 0  # 1..MAX_TOP_LOGPROBS: events also carry each token's most likely alternatives
    # With top_logprobs: logprobs and alternatives under the distribution after temperature, top-k, top-p
    # and min-p, the one the token was drawn from (a token they filter out has -inf).
    filtered_logprobs: bool = False
    report_progress: bool = False  # an event (`prompt_read`) after each chunk of the prompt read


@dataclass(frozen=True)
class EngineEvent:
    request_id: str
    token_ids: tuple[int, ...]  # tokens new since the previous event
    text: str  # text new since the previous event (stop strings already cut)
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last event
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    logprobs: tuple[float, ...] | None = None  # of token_ids, when the request asked for them
    error: str | None = None  # set with finish_reason "abort" when the engine failed the request
    spec: dict | None = None  # on the last event with speculation on: the request's draft statistics
    # Per token of token_ids, when the request set top_logprobs: the most likely (token id, logprob),
    # descending, under the distribution `logprobs` come from.
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    cached_tokens: int = 0  # on the last event: prompt tokens whose K/V came from the prefix cache
    # On a progress event (no tokens, no text; EngineRequest.report_progress): prompt tokens whose K/V are
    # computed or came from the prefix cache (`cached_tokens`, set on it too) after this step's chunk.
    prompt_read: int | None = None


class SlotSnapshot(NamedTuple):
    """One engine slot as of the last step. `state`: "idle" (no request), "waiting" (holds a request
    that got no tokens in the last step: its read gave way or was held back), "reading" (K/V still to
    compute: the prompt, or prompt + output again after a preemption), "decoding" (generating).

    A NamedTuple rather than a frozen dataclass: one is built per busy slot per step, at a fifth of
    the cost, and it is just as immutable."""

    id: int
    state: str = "idle"
    request_id: str | None = None
    prompt_tokens: int = 0
    prompt_read: int = 0  # prompt tokens whose K/V are computed
    generated: int = 0
    max_tokens: int = 0
    tokens_per_s: float = 0.0  # tokens after the first one / seconds since the first one
    give_ways: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0

    @property
    def acceptance(self) -> float | None:
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else None


class RateWindow:
    """Per-second rate of a counter over roughly the last `window_s` seconds of updates.

    Samples are kept at most every window_s / 50 seconds, so the deque stays small however often it
    is updated; the newest sample older than the window is kept so the rate always spans the window.
    """

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.clock = window_s, clock
        self.samples: deque[tuple[float, float]] = deque()

    def update(self, total: float, uptime_s: float) -> float:
        now = self.clock()
        if not self.samples or now - self.samples[-1][0] >= self.window_s / 50:
            self.samples.append((now, total))
        while len(self.samples) > 1 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        t0, v0 = self.samples[0]
        if now - t0 > 0:
            return max(total - v0, 0.0) / (now - t0)
        return total / uptime_s if uptime_s > 0 else 0.0  # nothing to span yet: the lifetime average


@dataclass(frozen=True)
class EngineStats:
    parallel: int
    queue_len: int  # waiting for a slot
    slots_busy: int
    kv_blocks_used: int
    kv_blocks_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished_total: int
    give_ways_total: int
    preemptions_total: int
    # Time-to-first-token histogram, kept as cumulative counts so it never grows: ttft_counts[i]
    # counts first tokens within TTFT_BUCKETS[i] seconds, the last entry counts them all (+Inf).
    ttft_counts: tuple[int, ...] = field(default=())
    ttft_sum: float = 0.0
    uptime_seconds: float = 0.0
    spec: dict | None = None  # global draft statistics when speculation is on
    # Token rates over the engine's last few seconds (RATE_WINDOW_S), not between scrapes.
    prompt_tokens_per_second: float = 0.0
    generation_tokens_per_second: float = 0.0
    ttft_last_seconds: float | None = None  # of the most recent first token
    slots: tuple[SlotSnapshot, ...] = ()  # one per slot, by slot id
    # Prefix cache, counted at each request's first admission: lookups, lookups that reused at least
    # one block, and the tokens reused.
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    prefix_cache_cached_tokens_total: int = 0
    read_stage_steps_total: int = 0  # read steps run on the concurrent read's stage (STRATA_PIPED_CONCURRENT)
    solo_reads_total: int = 0  # short reads given a step of their own beside decoding slots (prompt graphs)
    # The host KV tier (--kv-resident, --kv-host-memory): prefix-cache hits that took host blocks and their
    # tokens (also counted in prefix_cache_*); host blocks in use and in all; blocks moved to the host.
    prefix_cache_host_hits_total: int = 0
    prefix_cache_host_cached_tokens_total: int = 0
    kv_host_blocks_used: int = 0
    kv_host_blocks_total: int = 0
    kv_blocks_moved_total: int = 0
    steps_total: int = 0  # model steps run (each a forward pass over one or more requests' tokens)
    step_rows_total: int = 0  # requests in those steps, summed
    longest_sequence: int = 0  # the most tokens (prompt + output) a finished request held
    decode_seconds_total: float = 0.0  # from each finished request's first token to its end, summed
