"""Sampling parameters: plain data, importable without torch (the scheduler reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.grammar.spec import GrammarSpec

MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's limit)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # What the output must match (structured output, enforced tool calls): plain data, compiled by the
    # engine's strata.grammar.GrammarCompiler.
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError("grammar must be a GrammarSpec")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
