"""Acceptance statistics, per request and global: drafts proposed, accepted per draft position,
acceptance rate and mean accepted length (tokens emitted per verification step = accepted + 1)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    max_drafts: int
    steps: int = 0  # verification steps that carried at least one draft
    proposed: int = 0
    accepted: int = 0
    proposed_at: list[int] = field(default_factory=list)  # per draft position 1..N
    accepted_at: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.proposed_at = self.proposed_at or [0] * self.max_drafts
        self.accepted_at = self.accepted_at or [0] * self.max_drafts

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        if not 0 <= num_accepted <= num_drafts <= self.max_drafts:
            raise ValueError(f"bad verification result: {num_accepted} of {num_drafts} (max {self.max_drafts})")
        self.steps += 1
        self.proposed += num_drafts
        self.accepted += num_accepted
        for i in range(num_drafts):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < num_accepted

    def merge(self, other: "SpecStats") -> None:
        self.steps += other.steps
        self.proposed += other.proposed
        self.accepted += other.accepted
        for i in range(min(self.max_drafts, other.max_drafts)):
            self.proposed_at[i] += other.proposed_at[i]
            self.accepted_at[i] += other.accepted_at[i]

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step (the accepted drafts plus the target's own token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {
            "drafts_proposed": self.proposed, "drafts_accepted": self.accepted, "verification_steps": self.steps,
            "acceptance": self.acceptance, "mean_accepted_length": self.mean_accepted_length,
            "accepted_per_position": [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)],
        }
