"""What goes into the engine and what comes out: typed, torch-free data.

The HTTP layer (or `strata.LLM`) turns JSON and chat templates into an `EngineRequest`; the engine
answers with a stream of `EngineEvent`s, one per step that produced text for the request, the last
one carrying `finish_reason`. `EngineStats` is a snapshot for /metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.params import SamplingParams


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
    ttft_seconds: tuple[float, ...] = field(default=())  # every finished first token, for histograms
    uptime_seconds: float = 0.0
