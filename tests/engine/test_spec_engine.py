"""MTP speculation in the serving engine (embedded model, fp32, CPU): greedy output identical with
speculation on and off — alone, batched, with a give-way mid-read, with preemption, with either MTP
K/V mode — rollback of rejected drafts, min-p early stop, statistics."""

from __future__ import annotations

import time

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.params import SamplingParams

PROMPTS = [
    "It is a truth universally acknowledged, that",
    "In the beginning God created the heaven and the earth. And the earth was",
    "To be, or not to be:",
    "The list type in Python supports",
]
LONG = open(__file__.replace("tests/engine/test_spec_engine.py", "strata/assets/default-model/README.md")).read()


def run(prompts=PROMPTS, max_tokens=24, arrive: dict[int, int] | None = None, **kw):
    """Runs the prompts (prompt i added before step arrive[i], default 0); returns (tokens, engine)."""
    cfg = dict(device="cpu", parallel=4, chunk_size=256, max_num_batched_tokens=512)
    e = LLMEngine(EngineConfig(**{**cfg, **kw}))
    arrive = arrive or {}
    out: dict[str, list[int]] = {}
    pending = dict(enumerate(prompts))
    step = 0
    while pending or e.has_work():
        for i in [i for i in pending if arrive.get(i, 0) <= step]:
            ids = e.tokenizer.encode(pending.pop(i))
            e.add_request(EngineRequest(f"r{i}", tuple(ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                        time.monotonic()))
        for ev in e.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
        step += 1
    return out, e


@pytest.fixture(scope="module")
def plain():
    return run()[0]


@pytest.mark.parametrize("kw", [dict(spec=1), dict(spec=3), dict(spec=3, batch_mtp=True),
                                dict(spec=2, spec_adaptive=True), dict(spec=3, spec_min_p=0.7, batch_mtp=True)])
def test_greedy_identical_with_speculation(plain, kw):
    out, e = run(**kw)
    assert out == plain
    st = e.stats().spec
    assert st["drafts_proposed"] > 0 and 0 < st["acceptance"] <= 1
    assert st["mean_accepted_length"] > 1.0  # speculation emitted more than one token per step


def test_alone_equals_batched_with_speculation(plain):
    for i in range(2):
        out, _ = run(prompts=[PROMPTS[i]], spec=3, parallel=1)
        assert out["r0"] == plain[f"r{i}"]


def test_speculation_through_give_way_and_preemption():
    prompts = [LONG[:6000], PROMPTS[0]]
    base, _ = run(prompts=prompts, max_tokens=12, arrive={1: 2})
    out, e = run(prompts=prompts, max_tokens=12, arrive={1: 2}, spec=3, batch_mtp=True)
    assert out == base and e.scheduler.give_ways_total >= 1
    base, _ = run(max_tokens=24, kv_size=96)
    out, e = run(max_tokens=24, kv_size=96, spec=3, batch_mtp=True)
    assert e.scheduler.preemptions_total >= 1 and out == base


def test_split_mtp_batch_mode_gives_valid_drafts(plain, monkeypatch):
    monkeypatch.setenv("STRATA_SPLIT_MTP_BATCH", "1")
    out, e = run(spec=3, batch_mtp=True)
    assert e.drafter.split and out == plain
    split_acc = e.stats().spec["acceptance"]
    monkeypatch.delenv("STRATA_SPLIT_MTP_BATCH")
    _, e2 = run(spec=3, batch_mtp=True)
    assert not e2.drafter.split
    # Both modes feed the MTP layer the same rows; in fp32 only rounding differs.
    assert abs(split_acc - e2.stats().spec["acceptance"]) < 0.05 and split_acc > 0.2


def test_rejected_drafts_roll_back(plain, monkeypatch):
    """Drafts that are always wrong: every one is rejected, and the output is still plain greedy."""
    from strata.speculative import drafter as drafter_mod

    original = drafter_mod.MTPDrafter._picks

    def wrong(self, reqs, rows, logits, top, top_p):
        return [((tok + 1) % logits.shape[-1], prob, q) for tok, prob, q in original(self, reqs, rows, logits, top, top_p)]

    monkeypatch.setattr(drafter_mod.MTPDrafter, "_picks", wrong)
    out, e = run(spec=3, batch_mtp=True)
    st = e.stats().spec
    assert out == plain
    assert st["drafts_proposed"] > 0 and st["drafts_accepted"] < st["drafts_proposed"] * 0.2


def test_min_p_stops_drafting_early():
    _, loose = run(spec=3, batch_mtp=True)
    _, strict = run(spec=3, batch_mtp=True, spec_min_p=0.7)
    _, never = run(spec=3, batch_mtp=True, spec_min_p=1.0)
    a, b = loose.stats().spec, strict.stats().spec
    assert b["drafts_proposed"] < a["drafts_proposed"] and b["acceptance"] > a["acceptance"]
    assert never.stats().spec["drafts_proposed"] == 0


def test_per_request_stats_on_the_last_event():
    e = LLMEngine(EngineConfig(device="cpu", parallel=1, spec=2))
    e.add_request(EngineRequest("x", tuple(e.tokenizer.encode(PROMPTS[0])),
                                SamplingParams(max_tokens=16, ignore_eos=True), time.monotonic()))
    evs = e.run_to_completion()["x"]
    spec = evs[-1].spec
    assert spec is not None and spec["drafts_proposed"] > 0
    assert len(spec["accepted_per_position"]) == 2
    assert sum(len(ev.token_ids) for ev in evs) == 16


def test_sampled_speculation_is_seeded_and_valid():
    def sample(seed):
        e = LLMEngine(EngineConfig(device="cpu", parallel=2, spec=3, batch_mtp=True))
        for i, p in enumerate(PROMPTS[:2]):
            e.add_request(EngineRequest(f"s{i}", tuple(e.tokenizer.encode(p)),
                                        SamplingParams(max_tokens=20, temperature=0.8, seed=seed, ignore_eos=True),
                                        time.monotonic()))
        out = {k: [t for ev in v for t in ev.token_ids] for k, v in e.run_to_completion().items()}
        return out, e.stats().spec

    a, st = sample(7)
    b, _ = sample(7)
    c, _ = sample(8)
    assert a == b and a != c
    assert all(len(v) == 20 for v in a.values()) and st["drafts_proposed"] > 0


def test_batch_groups_keep_greedy_output(plain):
    out, e = run(spec=3, batch_mtp=True, batch_groups=2)
    assert out == plain and e.stats().spec["drafts_proposed"] > 0
    out, _ = run(batch_groups=4)
    assert out == plain
    out, _ = run(spec=2, batch_groups=2, overlap=False)
    assert out == plain


def _trace(e: LLMEngine) -> list[str]:
    """Records the order of the runner's launches and collects."""
    calls: list[str] = []
    launch, collect = e.runner.launch, e.runner.collect

    def traced_launch(chunks):
        calls.append("L")
        return launch(chunks)

    def traced_collect(step, probs=None):
        calls.append("C")
        return collect(step, probs)

    e.runner.launch, e.runner.collect = traced_launch, traced_collect
    return calls


def test_batch_groups_overlap_launches_before_collecting(plain):
    """With G > 1 the next group's step is launched before the previous one is collected (the host
    work of one overlaps the device work of the other); without overlap they strictly alternate."""
    for overlap in (True, False):
        e = LLMEngine(EngineConfig(device="cpu", parallel=4, batch_groups=2, overlap=overlap, spec=2, batch_mtp=True))
        calls = _trace(e)
        for i, p in enumerate(PROMPTS):
            e.add_request(EngineRequest(f"r{i}", tuple(e.tokenizer.encode(p)),
                                        SamplingParams(max_tokens=24, ignore_eos=True), time.monotonic()))
        got = {k: [t for ev in v for t in ev.token_ids] for k, v in e.run_to_completion().items()}
        assert got == plain
        seq = "".join(calls)
        assert seq.count("L") == seq.count("C")
        assert ("LL" in seq) == overlap and e.pipelined == overlap


def test_batch_groups_overlap_through_give_way_preemption_and_abort():
    prompts = [LONG[:6000], PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    base, _ = run(prompts=prompts, max_tokens=12, arrive={1: 2, 2: 3, 3: 3})
    out, e = run(prompts=prompts, max_tokens=12, arrive={1: 2, 2: 3, 3: 3}, spec=3, batch_mtp=True, batch_groups=2)
    assert out == base and e.scheduler.give_ways_total >= 1 and e.pipelined
    base, _ = run(max_tokens=24, kv_size=96)
    out, e = run(max_tokens=24, kv_size=96, spec=3, batch_mtp=True, batch_groups=2)
    assert e.scheduler.preemptions_total >= 1 and out == base
    # Aborting a request whose step is in flight: its tokens are dropped, the others are unchanged.
    e = LLMEngine(EngineConfig(device="cpu", parallel=4, batch_groups=2, spec=2, batch_mtp=True))
    for i, p in enumerate(PROMPTS):
        e.add_request(EngineRequest(f"r{i}", tuple(e.tokenizer.encode(p)),
                                    SamplingParams(max_tokens=24, ignore_eos=True), time.monotonic()))
    got: dict[str, list[int]] = {}
    for _ in range(4):
        for ev in e.step():
            got.setdefault(ev.request_id, []).extend(ev.token_ids)
    victim = e.in_flight.out.chunks[0].request.request_id
    assert e.abort(victim).finish_reason == "abort"
    while e.has_work():
        for ev in e.step():
            assert ev.request_id != victim
            got.setdefault(ev.request_id, []).extend(ev.token_ids)
    plain = run(max_tokens=24)[0]
    assert all(got[k] == plain[k] for k in got if k != victim) and len(got) == 4


def test_batch_groups_overlap_keeps_seeded_sampling():
    def sample(overlap: bool):
        e = LLMEngine(EngineConfig(device="cpu", parallel=4, batch_groups=2, overlap=overlap, spec=2,
                                   batch_mtp=True, seed=11))
        for i, p in enumerate(PROMPTS):
            e.add_request(EngineRequest(f"r{i}", tuple(e.tokenizer.encode(p)),
                                        SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True),
                                        time.monotonic()))
        return {k: [t for ev in v for t in ev.token_ids] for k, v in e.run_to_completion().items()}

    assert sample(True) == sample(False)


def test_sampled_verification_targets_the_penalised_distribution():
    """Rows with drafts are verified against the same penalised distribution a row without drafts
    samples from: the request's tokens and the drafts before the row count as seen."""
    from types import SimpleNamespace

    from strata.runner.picks import Picker
    from strata.sampling import apply_repetition_penalty

    row = torch.randn(50)
    req = SimpleNamespace(params=SamplingParams(temperature=0.8, repetition_penalty=1.3), all_ids=[3, 7, 7],
                          output_ids=[7, 7])
    got = Picker.penalised(row, req, (11, 12))
    assert torch.equal(got, apply_repetition_penalty(row, torch.tensor([3, 7, 7, 11, 12]), 1.3))
    assert not torch.equal(got, row)
    plain = SimpleNamespace(params=SamplingParams(temperature=0.8), all_ids=[3], output_ids=[])
    assert Picker.penalised(row, plain, (4,)) is row


def test_sampled_speculation_with_penalty_is_seeded():
    def sample():
        e = LLMEngine(EngineConfig(device="cpu", parallel=1, spec=2, batch_mtp=True))
        e.add_request(EngineRequest("p", tuple(e.tokenizer.encode(PROMPTS[0])),
                                    SamplingParams(max_tokens=12, temperature=0.8, repetition_penalty=1.2, seed=5,
                                                   ignore_eos=True), time.monotonic()))
        return [t for ev in e.run_to_completion()["p"] for t in ev.token_ids], e.stats().spec

    a, st = sample()
    assert a == sample()[0] and len(a) == 12 and st["drafts_proposed"] > 0
