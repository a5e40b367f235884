"""Sampling parameters and the per-request sampler.

The order of logit transforms follows llama.cpp / vLLM: logit bias (with presence / frequency penalties)
→ repetition penalty → temperature →
top-k → top-p → min-p → draw. Temperature 0 means greedy (argmax), which never consumes randomness.
"""

from __future__ import annotations

import torch

from strata.params import SamplingParams

__all__ = ["SamplingParams", "Sampler", "filtered_probs", "apply_logit_bias", "apply_output_penalties",
           "apply_repetition_penalty"]


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """`logits` [V] with each `bias` value added to its token's logit (OpenAI's `logit_bias`)."""
    if not bias:
        return logits
    ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
    values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits.index_add(-1, ids, values)


def apply_output_penalties(logits: torch.Tensor, output: list[int], presence: float, frequency: float
                           ) -> torch.Tensor:
    """OpenAI's presence / frequency penalties: each token in `output` (the tokens generated so far)
    loses `presence` once and `frequency` per occurrence."""
    if not output or presence == 0.0 and frequency == 0.0:
        return logits
    ids = torch.tensor(output, dtype=torch.long, device=logits.device)
    counts = torch.zeros_like(logits, dtype=torch.float32).index_add_(
        -1, ids, torch.ones(len(output), device=logits.device))
    return logits - (frequency * counts + presence * (counts > 0)).to(logits.dtype)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style: positive logits of seen tokens divided by `penalty`, negative ones multiplied."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    picked = logits.gather(-1, seen)
    logits = logits.clone()
    logits.scatter_(-1, seen, torch.where(picked > 0, picked / penalty, picked * penalty))
    return logits


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (fp32, [V])."""
    logits = logits.float() / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


class Sampler:
    """Draws the next token for one request; owns that request's random generator."""

    def __init__(self, params: SamplingParams, default_seed: int | None = None):
        """The request's own seed wins; else `default_seed` (the engine's --seed); else the OS's."""
        self.params = params
        self.gen = torch.Generator(device="cpu")
        seed = params.seed if params.seed is not None else default_seed
        if seed is not None:
            self.gen.manual_seed(seed)
        else:
            self.gen.seed()
        self.seed = self.gen.initial_seed()

    def __call__(self, logits: torch.Tensor, seen: torch.Tensor | None = None, output: list[int] | None = None
                 ) -> int:
        """`seen`: the tokens the repetition penalty reads (prompt and output); `output`: the tokens
        generated so far (presence / frequency penalties)."""
        p = self.params
        logits = apply_logit_bias(logits, p.logit_bias)
        if output:
            logits = apply_output_penalties(logits, output, p.presence_penalty, p.frequency_penalty)
        if seen is not None and p.repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, seen.to(logits.device), p.repetition_penalty)
        if p.greedy:
            return int(logits.argmax())
        # Draw on the CPU so a seed gives the same tokens on every device.
        probs = filtered_probs(logits, p).cpu()
        return int(torch.multinomial(probs, 1, generator=self.gen))
