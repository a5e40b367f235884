"""`logit_bias` on the device sampler (embedded model, fp32, CPU): added to a row's logits before
every other transform, greedy and sampled, with and without speculation; -100 bans a token, +100
all but forces it; its logprobs are those of the biased distribution."""

from __future__ import annotations

import time

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import LLMEngine, RequestError
from strata.engine.types import EngineRequest
from strata.params import SamplingParams
from strata.runner.device_sampling import DeviceSampler, RowParams
from strata.sampling import Sampler

PROMPT = "It is a truth universally acknowledged, that"
TOKENS = 16


def run(eng: LLMEngine, rid: str, **kw) -> list[int]:
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, **kw)
    eng.add_request(EngineRequest(rid, tuple(eng.tokenizer.encode(PROMPT)), params, time.monotonic()), logprobs=True)
    events = eng.run_to_completion()[rid]
    assert events[-1].finish_reason == "length" and events[-1].error is None
    return [t for ev in events for t in ev.token_ids]


@pytest.fixture(scope="module", params=[0, 2], ids=["plain", "spec2"])
def eng(request):
    return LLMEngine(EngineConfig(device="cpu", ctx=256, parallel=2, spec=request.param))


def test_greedy_bans_and_forces(eng):
    plain = run(eng, "g0")
    banned = set(plain[:4])
    got = run(eng, "g1", logit_bias={t: -100.0 for t in banned})
    assert not banned & set(got) and got != plain
    forced = run(eng, "g2", logit_bias={plain[5]: 100.0})
    assert forced == [plain[5]] * TOKENS
    assert run(eng, "g3", logit_bias={plain[0]: 0.0}) == plain  # a zero bias changes nothing


def test_sampling_never_draws_a_banned_token(eng):
    free = run(eng, "s0", temperature=1.0, seed=3)
    banned = set(free)
    for seed in range(3):
        got = run(eng, f"s{seed + 1}", temperature=1.0, seed=seed, logit_bias={t: -100.0 for t in banned})
        assert not banned & set(got)


def test_speculation_keeps_biased_greedy_output():
    plain = LLMEngine(EngineConfig(device="cpu", ctx=256, parallel=1))
    spec = LLMEngine(EngineConfig(device="cpu", ctx=256, parallel=1, spec=2))
    base = run(plain, "x")
    bias = {base[1]: -100.0, base[3]: 5.0}
    assert run(spec, "b", logit_bias=bias) == run(plain, "b", logit_bias=bias)


def test_ids_outside_the_vocabulary_are_refused(eng):
    vocab = eng.model_config.vocab_size
    with pytest.raises(RequestError, match="logit_bias"):
        eng.add_request(EngineRequest("bad", (1, 2, 3), SamplingParams(logit_bias={vocab: 1.0}), time.monotonic()))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101.0})


def test_device_sampler_matches_the_host_reference():
    """The device sampler's biased greedy pick and logprob are the host sampler's and the biased
    log-softmax's."""
    torch.manual_seed(0)
    x = torch.randn(3, 50)
    rows = [RowParams(bias=((7, 30.0), (3, -100.0))), RowParams(), RowParams(bias=((int(x[2].argmax()), -100.0),))]
    tokens, logprobs = DeviceSampler(4, 50, "cpu").sample(x, rows)
    for i, r in enumerate(rows):
        bias = dict(r.bias or ())
        want = Sampler(SamplingParams(logit_bias=bias))(x[i])
        biased = x[i].clone()
        for t, b in bias.items():
            biased[t] += b
        assert int(tokens[i]) == want
        assert float(logprobs[i]) == pytest.approx(float(biased.log_softmax(-1)[want]), abs=1e-5)
    assert int(tokens[0]) == 7 and int(tokens[2]) != int(x[2].argmax())
