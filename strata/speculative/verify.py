"""Verification of drafted tokens against the target model.

Greedy: accept the longest prefix of drafts equal to the target's argmax at each position, then emit
the target's own token at the first mismatch (or the bonus position after the last draft), so the
output equals plain greedy decoding token for token.

Sampling: speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Draft i, drawn
from the draft distribution q_i, is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the
first rejection a token is drawn from the residual max(0, p_i - q_i), normalised; when every draft is
accepted, a bonus token is drawn from p_k. The emitted tokens are distributed exactly as sampling
the target alone would be.
"""

from __future__ import annotations

import torch


def verify_greedy(drafts: list[int], target_argmax: list[int]) -> list[int]:
    """drafts d_1..d_k; target_argmax a_0..a_k (a_i: the target's choice after the prefix + d_1..d_i).
    Returns the emitted tokens: the accepted drafts followed by one target token."""
    out = []
    for i, d in enumerate(drafts):
        if d != target_argmax[i]:
            break
        out.append(d)
    out.append(target_argmax[len(out)])
    return out


def verify_sampled(drafts: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   gen: torch.Generator) -> list[int]:
    """drafts d_1..d_k; draft_probs q [k, V] (the distributions they were drawn from); target_probs
    p [k+1, V] (p_i: the target's distribution for the token after d_1..d_i). All on the CPU, fp32."""
    out = []
    for i, d in enumerate(drafts):
        p, q = target_probs[i, d].item(), draft_probs[i, d].item()
        if q <= 0:
            raise ValueError(f"draft {i} has zero probability under its own distribution")
        if torch.rand((), generator=gen).item() < min(1.0, p / q):
            out.append(d)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
        total = residual.sum()
        dist = residual / total if total > 0 else target_probs[i]
        out.append(int(torch.multinomial(dist, 1, generator=gen)))
        return out
    out.append(int(torch.multinomial(target_probs[len(drafts)], 1, generator=gen)))
    return out
