"""Sampling parameters: plain data, importable without torch (the scheduler reads them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from strata.grammar.spec import GrammarSpec

MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's limit)
# What the device sampler can hold: top-k is an int64 column and a torch.topk argument; a penalty
# outside this range turns fp32 logits into inf or NaN (and no sensible request needs one).
MAX_TOP_K = 2**31 - 1
REPETITION_PENALTY_RANGE = (0.01, 100.0)
PRESENCE_PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range, for both presence and frequency penalties
# logit_bias as OpenAI bounds it: -100 bans a token, +100 all but forces it.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's: subtracted from the logit of each token already generated, once (presence) and per
    # occurrence (frequency); added with the logit bias, before the repetition penalty.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # What the output must match (structured output, enforced tool calls): plain data, compiled by the
    # engine's strata.grammar.GrammarCompiler.
    grammar: GrammarSpec | None = None
    # Added to the logits of these token ids before every other transform (OpenAI's `logit_bias`).
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}]")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise ValueError(f"repetition_penalty must be in [{lo}, {hi}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not PRESENCE_PENALTY_RANGE[0] <= getattr(self, name) <= PRESENCE_PENALTY_RANGE[1]:
                raise ValueError(f"{name} must be in [{PRESENCE_PENALTY_RANGE[0]:g}, {PRESENCE_PENALTY_RANGE[1]:g}]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS_TOKENS} tokens")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias: token ids must be non-negative integers, got {token!r}")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias: the bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}]")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError("grammar must be a GrammarSpec")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def output_penalised(self) -> bool:
        """Whether presence or frequency penalties read the tokens generated so far."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
