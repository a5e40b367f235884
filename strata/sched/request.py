"""A request as the scheduler sees it: a token list and a counter of how much of it is computed.

There are no prefill/decode phases. `num_computed_tokens` catches up with `num_tokens` chunk by
chunk; a request is "reading" while more than its last token is uncomputed and "decoding" when only
the last one is (that last token is always the one the previous step sampled, or the final prompt
token). Preemption just resets the counter to 0 and keeps `output_ids`, so recomputation is a read
of prompt + output like any other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from strata.kvcache.prefix import PrefixKeys
from strata.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
FINISH_STATUS = {reason: status for status, reason in _FINISH_REASONS.items()}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    eos_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Scheduled in chunks whose step update() has not applied yet: positions and chunks. They count as
    # computed only once applied; a prompt chunk read ahead (pipeline stages) starts after them.
    num_in_flight_tokens: int = 0
    num_in_flight_chunks: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    give_ways: int = 0
    preemptions: int = 0
    # Speculation: tokens drafted for the next step, verified by it (set by the engine's drafter).
    draft_ids: list[int] = field(default_factory=list)
    # Prefix cache (kept by the scheduler): the keys of the request's full blocks; how many leading
    # blocks of its table are cached (hits or registered); tokens taken from the cache at its latest
    # admission; and at its first admission (None until admitted), which usage reports.
    prefix_keys: PrefixKeys | None = None
    prefix_blocks: int = 0
    prefix_hit: int = 0
    num_cached_tokens: int | None = None
    # Host KV tier (`strata.kvcache.tier`): the host pool's blocks holding the request's leading blocks,
    # whose entries in block_ids are NULL_BLOCK; and how many of the tokens taken from the prefix cache
    # at its first admission came from the host tier.
    host_blocks: list[int] = field(default_factory=list)
    num_host_cached_tokens: int = 0

    def __post_init__(self) -> None:
        self.prompt_ids = list(self.prompt_ids)
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r}: empty prompt")
        self.eos_ids = frozenset(self.eos_ids)
        # Fixed for the request's life; computed once because update() checks it every token.
        eos = frozenset() if self.params.ignore_eos else self.eos_ids
        self.stop_ids: frozenset[int] = eos | frozenset(self.params.stop_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens at positions [start, stop) of prompt + output, without copying the whole list."""
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        if start >= p:
            return self.output_ids[start - p : stop - p]
        return self.prompt_ids[start:] + self.output_ids[: stop - p]

    @property
    def remaining_read(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_reading(self) -> bool:
        return self.remaining_read > 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, in_flight={self.num_in_flight_tokens}, out={len(self.output_ids)}, slot={self.slot}, "
            f"blocks={len(self.block_ids)})"
        )
