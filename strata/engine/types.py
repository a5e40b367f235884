"""What goes into the engine and what comes out: typed, torch-free data.

The HTTP layer (or `strata.LLM`) turns JSON and chat templates into an `EngineRequest`; the engine
answers with a stream of `EngineEvent`s, one per step that produced text for the request, the last
one carrying `finish_reason`. `EngineStats` is a snapshot for /metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.params import SamplingParams


# Time to first token spans a short prompt on a GPU (milliseconds) to a long prompt queued behind
# others on a CPU (a minute).
TTFT_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float


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
