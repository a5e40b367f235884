"""Verification rules of speculative decoding: greedy identity and the rejection-sampling
distribution (a statistical test with fixed seeds)."""

from __future__ import annotations

import pytest
import torch

from strata.speculative.stats import SpecStats
from strata.speculative.verify import verify_greedy, verify_sampled


def test_greedy_accepts_longest_matching_prefix():
    assert verify_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert verify_greedy([5, 9, 7], [5, 6, 7, 8]) == [5, 6]  # second rejected: target's token instead
    assert verify_greedy([1], [2, 3]) == [2]
    assert verify_greedy([], [4]) == [4]


def test_rejection_sampling_matches_target_distribution():
    """Two-token windows: the joint distribution of what speculation emits equals the target's."""
    torch.manual_seed(0)
    v = 4
    p0 = torch.tensor([0.1, 0.4, 0.3, 0.2])  # target after the prefix
    p1 = torch.softmax(torch.randn(v, v), -1)  # target after the prefix + token a: row a
    q0 = torch.tensor([0.4, 0.1, 0.25, 0.25])  # a deliberately different draft distribution
    gen = torch.Generator().manual_seed(1234)
    n = 40000
    counts = torch.zeros(v)
    pairs = torch.zeros(v, v)
    for _ in range(n):
        d = int(torch.multinomial(q0, 1, generator=gen))
        target = torch.stack([p0, p1[d]])
        out = verify_sampled([d], q0[None], target, gen)
        counts[out[0]] += 1
        if len(out) == 2:
            pairs[out[0], out[1]] += 1
    assert torch.allclose(counts / n, p0, atol=0.01)
    # Given an accepted first token a, the bonus token follows p1[a].
    for a in range(v):
        if pairs[a].sum() > 2000:
            assert torch.allclose(pairs[a] / pairs[a].sum(), p1[a], atol=0.03)


def test_rejection_with_identical_distributions_always_accepts():
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([[0.5, 0.5, 0.0]])
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    for d in (0, 1):
        assert verify_sampled([d], q, p, gen) == [d, 2]


def test_stats():
    s = SpecStats(max_drafts=3)
    s.record(3, 2)
    s.record(2, 0)
    s.record(0, 0)  # no drafts: not a speculative step
    d = s.as_dict()
    assert d["drafts_proposed"] == 5 and d["drafts_accepted"] == 2
    assert d["accepted_per_position"] == [0.5, 0.5, 0.0]
    assert s.mean_accepted_length == (2 + 2) / 2
    with pytest.raises(ValueError):
        s.record(2, 3)
