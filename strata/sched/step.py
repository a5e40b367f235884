"""What one schedule() hands the runner: the step's chunks (positions of one request each), and who
was preempted or finished meanwhile. Pure Python, like the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.sched.request import Request

PENDING_TOKEN = -1


@dataclass(frozen=True, eq=False)
class ScheduledChunk:
    """Positions [start, start + num_tokens) of `request`; `sample`: the runner samples from the last."""

    request: Request
    start: int
    num_tokens: int
    sample: bool
    drafts: tuple[int, ...] = ()  # speculative tokens after the request's last one, to verify
    pending: int = 0  # 1: the first input is the token the request's in-flight step samples (run-ahead)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """Input tokens; a pending one is PENDING_TOKEN (the runner fills it in on the device)."""
        known = self.request.token_ids(self.start + self.pending, self.end - len(self.drafts))
        return [PENDING_TOKEN] * self.pending + known + list(self.drafts)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then reads
    preempted: list[Request] = field(default_factory=list)  # lost their slot and blocks this step
    finished: list[Request] = field(default_factory=list)  # finished while scheduling (update() returns them too)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class StepBuilder:
    """A step being built: chunks keyed by request id so a preempted victim's chunk can be withdrawn."""

    def __init__(self) -> None:
        self.chunks: dict[str, ScheduledChunk] = {}
        self.tokens = 0
        self.preempted: list[Request] = []
        self.finished: list[Request] = []

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks[chunk.request.request_id] = chunk
        self.tokens += chunk.num_tokens

    def withdraw(self, req: Request) -> None:
        chunk = self.chunks.pop(req.request_id, None)
        if chunk is not None:
            self.tokens -= chunk.num_tokens
