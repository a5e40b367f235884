"""Sampler transforms, seeding and the sampled distribution; stop strings and streaming text."""

from __future__ import annotations

import pytest
import torch

from strata.runner.generator import Detokenizer, StopChecker
from strata.sampling import Sampler, SamplingParams, apply_repetition_penalty, filtered_probs


def _logits(probs):
    return torch.tensor(probs).log()


def test_greedy_is_argmax():
    s = Sampler(SamplingParams())
    for _ in range(5):
        x = torch.randn(50)
        assert s(x) == int(x.argmax())


def test_top_p_keeps_smallest_prefix_reaching_mass():
    p = filtered_probs(_logits([0.05, 0.5, 0.15, 0.3]), SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([0, 0.5 / 0.8, 0, 0.3 / 0.8]))


def test_top_k_and_min_p():
    x = _logits([0.1, 0.4, 0.2, 0.3])
    assert torch.allclose(filtered_probs(x, SamplingParams(temperature=1.0, top_k=2)), torch.tensor([0, 4 / 7, 0, 3 / 7]))
    # min_p 0.6 of the top (0.4) = 0.24: keeps 0.4 and 0.3.
    assert torch.allclose(filtered_probs(x, SamplingParams(temperature=1.0, min_p=0.6)), torch.tensor([0, 4 / 7, 0, 3 / 7]))


def test_temperature_sharpens():
    x = _logits([0.2, 0.8])
    cold = filtered_probs(x, SamplingParams(temperature=0.5))
    assert torch.allclose(cold, torch.tensor([0.04, 0.64]) / 0.68)


def test_repetition_penalty_divides_positive_multiplies_negative():
    x = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repetition_penalty(x, torch.tensor([0, 1]), 2.0)
    assert torch.equal(out, torch.tensor([1.0, -4.0, 1.0]))


def test_seed_reproducible_and_distribution_matches():
    x = _logits([0.1, 0.2, 0.3, 0.4])
    params = SamplingParams(temperature=1.0, seed=123)
    s1, s2, s3 = Sampler(params), Sampler(params), Sampler(SamplingParams(temperature=1.0, seed=124))
    seq1, seq2, seq3 = ([s(x) for _ in range(200)] for s in (s1, s2, s3))
    assert seq1 == seq2 and seq1 != seq3
    s = Sampler(SamplingParams(temperature=1.0, seed=0))
    counts = torch.bincount(torch.tensor([s(x) for _ in range(20000)]), minlength=4).float() / 20000
    assert torch.allclose(counts, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.015)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(min_p=2), dict(top_k=-1), dict(max_tokens=-1)])
def test_invalid_params_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_stop_string_across_pieces_and_hold_back():
    sc = StopChecker(["END"])
    outs = [sc.push(d) for d in ["hello E", "N", "D tail"]]
    emitted = "".join(o for o, _ in outs)
    assert outs[-1][1] is True and emitted == "hello "
    # Text that merely starts like a stop string is released once it cannot be one.
    sc = StopChecker(["END"])
    got = [sc.push(d) for d in ["a E", "X b"]]
    assert "".join(o for o, _ in got) + sc.flush() == "a EX b" and not any(s for _, s in got)


def test_detokenizer_never_splits_characters(tiny_model_dirs):
    from strata.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(tiny_model_dirs["qwen3"][0])
    text = "naïve café — 日本語 ✓ done"
    ids = tok.encode(text)
    d = Detokenizer(tok)
    deltas = [d.push(i) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)
