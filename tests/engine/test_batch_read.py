"""The concurrent read (STRATA_PIPED_CONCURRENT, STRATA_SPLIT_MTP_BATCH, STRATA_PIPED_CONCURRENT_SMB) on
the embedded model, fp32, CPU: the switches' decision and log lines, greedy output identical with the
read on its own stage and off (through a give-way, a hand-off, speculation in both draft-K/V modes), an
abort during a read, and the allocation guard, which fails when the reservation is removed."""

from __future__ import annotations

import logging
import time

import pytest

from strata.config import EngineConfig
from strata.engine.concurrent import OFF_BESIDE_SPLIT, SMB_ON, ConcurrentReadSetup
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.params import SamplingParams
from strata.runner.read_stage import AllocationGrowth, ReadStage

FILLER = open(__file__.replace("tests/engine/test_batch_read.py", "strata/assets/default-model/README.md")).read() * 4
SWITCHES = ("STRATA_PIPED_CONCURRENT", "STRATA_SPLIT_MTP_BATCH", "STRATA_PIPED_CONCURRENT_SMB")


def _set(monkeypatch, piped=False, split=False, smb=False):
    for name, on in zip(SWITCHES, (piped, split, smb)):
        monkeypatch.setenv(name, "1" if on else "0")


@pytest.mark.parametrize("piped,split,smb,enabled,reserved,off", [
    (False, False, False, False, False, None),
    (False, True, True, False, False, None),
    (True, False, False, True, False, None),
    (True, False, True, True, False, None),
    (True, True, False, False, False, OFF_BESIDE_SPLIT),
    (True, True, True, True, True, None),
])
def test_the_switches_decide(monkeypatch, caplog, piped, split, smb, enabled, reserved, off):
    _set(monkeypatch, piped, split, smb)
    setup = ConcurrentReadSetup.from_env()
    assert (setup.enabled, setup.split_mtp_batch_reserved, setup.concurrent_read_off()) == (enabled, reserved, off)
    with caplog.at_level(logging.INFO, logger="strata"):
        setup.log_decision()
    assert (OFF_BESIDE_SPLIT in caplog.text) == (off == OFF_BESIDE_SPLIT)
    assert (SMB_ON in caplog.text) == reserved
    hybrid = ConcurrentReadSetup.from_env(model_reason="a reason")
    assert not hybrid.enabled and (hybrid.concurrent_read_off() is not None) == piped


def _engine(**kw) -> LLMEngine:
    base = dict(device="cpu", ctx=4096, parallel=3, chunk_size=64, max_num_batched_tokens=128)
    return LLMEngine(EngineConfig(**{**base, **kw}), progress=False)


def _req(rid, ids, n):
    return EngineRequest(rid, tuple(ids), SamplingParams(max_tokens=n, ignore_eos=True), time.monotonic())


def _scenario(e: LLMEngine):
    """A decoding slot, then a 1500-token read beside it, then a short request during the read."""
    tok = e.tokenizer
    e.add_request(_req("dec", tok.encode("To be, or not to be:"), 40))
    out, order, steps = {}, [], 0
    while e.has_work() or steps < 3:
        if steps == 2:
            e.add_request(_req("long", tok.encode(FILLER)[:1500], 8))
        if steps == 6:
            e.add_request(_req("short", tok.encode("It is a truth universally"), 8))
        for ev in e.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finish_reason:
                order.append(ev.request_id)
        steps += 1
    return out, order


@pytest.mark.parametrize("kw,split", [({}, False), (dict(spec=2), False), (dict(spec=2), True)])
def test_greedy_output_identical_on_and_off(monkeypatch, kw, split):
    _set(monkeypatch, split=split)
    plain = _engine(**kw)
    want, _ = _scenario(plain)
    _set(monkeypatch, piped=True, split=split, smb=split)
    e = _engine(**kw, alloc_guard=True)
    assert isinstance(e.read_stage, ReadStage) and (e.read_stage.prefill is not None) == split
    got, order = _scenario(e)
    assert got == want
    assert order.index("short") < order.index("long")  # it did not wait for the long read
    assert e.scheduler.give_ways_total >= 1 and e.read_stage.reads_total >= 1500 // 64
    if kw:
        # The same draft K/V (the stage's own MTP calls with SPLIT_MTP_BATCH), so the same drafts.
        st, st_plain = e.stats().spec, plain.stats().spec
        assert st["drafts_proposed"] > 0
        assert (st["drafts_proposed"], st["drafts_accepted"]) == (st_plain["drafts_proposed"], st_plain["drafts_accepted"])
    e.close()


def test_abort_during_a_read_frees_its_blocks_after_the_step(monkeypatch):
    _set(monkeypatch, piped=True)
    e = _engine()
    e.add_request(_req("long", e.tokenizer.encode(FILLER)[:1500], 8))
    for _ in range(3):
        e.step()
    assert e.read_stage.busy
    ev = e.abort("long")
    assert ev is not None and ev.finish_reason == "abort"
    assert not e.read_stage.busy and e.allocator.num_used == 0
    e.add_request(_req("next", e.tokenizer.encode("In the beginning"), 4))
    assert len([t for evs in e.run_to_completion().values() for x in evs for t in x.token_ids]) == 4
    e.close()


def test_the_guard_fails_without_the_reservation(monkeypatch):
    """With `reserve()` a no-op the upload ring starts at 16 bytes and grows during the first read that
    uploads more: two prompts of different lengths read in one step (their layout's per-sequence vectors;
    without give-way, so the newer does not read first alone)."""
    _set(monkeypatch, piped=True)
    monkeypatch.setattr(ReadStage, "reserve", lambda self: None)
    e = _engine(alloc_guard=True, give_way=False)
    ids = e.tokenizer.encode(FILLER)
    e.add_request(_req("a", ids[:300], 4))
    e.add_request(_req("b", ids[:10], 4))
    with pytest.raises(AllocationGrowth, match="up_ring"):
        e.run_to_completion()
    e.close()


def test_the_warm_up_takes_small_steps_after_the_largest(monkeypatch):
    """The stage's warm-up reads the largest step, then the small ones (a short prompt, a read's last
    chunk), each until the cache stops growing (on the CPU: two steps each)."""
    from strata.runner.read_stage import WARM_UP_SMALL_STEPS

    _set(monkeypatch, piped=True)
    sizes = []
    submit = ReadStage.submit

    def spy(self, out):
        sizes.append(sum(c.num_tokens for c in out.chunks))
        return submit(self, out)

    monkeypatch.setattr(ReadStage, "submit", spy)
    e = _engine(alloc_guard=True)
    n = e.read_stage.max_tokens
    want = [n] + [k for k in WARM_UP_SMALL_STEPS if k < n]
    assert sizes == [k for k in want for _ in range(2)] and sizes[-1] == 1
    e.close()


# ---- on the device ------------------------------------------------------------------------------------

def _gpu_reads_beside_decoding(e: LLMEngine, lengths, vocab: int):
    """Reads of `lengths` one after another, each beside a decoding slot; returns each read's tokens."""
    import random

    rng = random.Random(0)
    outs = []
    for i, n in enumerate(lengths):
        e.add_request(_req(f"dec{i}", [rng.randrange(vocab) for _ in range(16)], 64))
        e.add_request(_req(f"read{i}", [rng.randrange(vocab) for _ in range(n)], 4))
        got = e.run_to_completion()
        outs.append([t for ev in got[f"read{i}"] for t in ev.token_ids])
    return outs


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_reads_beside_decoding_allocate_nothing(monkeypatch):
    """Qwen3-8B shapes, bf16: 8K-64K reads beside a decoding slot with all three switches and the guard
    on (AllocationGrowth on any growth), the same tokens as with the concurrent read off. Two reads end
    in a short chunk and one is short: their activations come from the allocator's small-block pool,
    which grew by a segment before the warm-up took small steps too."""
    import torch

    from strata.bench.random_model import random_model

    loaded = random_model("qwen3-8b-128k", "cuda", torch.bfloat16)
    lengths = [8192, 16384 + 32, 24, 32768 + 5, 65536]
    cfg = EngineConfig(device="cuda", dtype="bfloat16", ctx=65536 + 64, parallel=2, chunk_size=2048,
                       max_num_batched_tokens=2048, kv_size=2 * (65536 + 128))
    _set(monkeypatch, piped=True, split=True, smb=True)
    e = LLMEngine(cfg.replace(alloc_guard=True), progress=False, loaded=loaded)
    got = _gpu_reads_beside_decoding(e, lengths, loaded.config.vocab_size)
    print(f"concurrent reads: {e.read_stage.reads_total} steps, region {e.read_stage.region_bytes / 2**20:.1f} MiB, "
          f"up_ring {e.read_stage.up_ring.nbytes} B (high water {e.read_stage.up_ring.high_water} B)")
    e.close()
    del e
    _set(monkeypatch)
    e = LLMEngine(cfg, progress=False, loaded=loaded)
    want = _gpu_reads_beside_decoding(e, lengths, loaded.config.vocab_size)
    same = sum(a == b for a, b in zip(got, want))
    print(f"reads with the same first tokens on and off: {same}/{len(lengths)} (bf16: batch shapes differ)")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_embedded_model_with_speculation_identical(monkeypatch):
    """The embedded model on CUDA in fp32 with --spec 2 and all three switches: the same output and the
    same drafts as without the concurrent read, and nothing grows."""
    kw = dict(device="cuda", dtype="float32", spec=2)
    _set(monkeypatch, split=True)
    want, _ = _scenario(_engine(**kw))
    _set(monkeypatch, piped=True, split=True, smb=True)
    e = _engine(**kw, alloc_guard=True)
    got, order = _scenario(e)
    assert got == want and order.index("short") < order.index("long")
    e.close()


def test_through_the_server(monkeypatch, tmp_path):
    """`strata serve` with STRATA_PIPED_CONCURRENT=1: a short request overtakes a long read through the
    OpenAI API, and the long answer is the one it gets alone."""
    import openai

    from serving import running_server
    from test_server_scenarios import SHORT, complete, long_then_short

    _set(monkeypatch, piped=True)
    # Chunks of 64: the long read takes enough steps that the short request, sent once it is under way,
    # still finds it reading on a loaded machine (a give-way is counted only then).
    config = {"device": "cpu", "alloc_guard": True, "parallel": 2, "ctx": 4096, "chunk_size": 64, "max_num_batched_tokens": 128,
              "log_level": "info", "prefix_cache": False}
    with running_server(tmp_path, config) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        from strata.loaders import default_model_path
        from strata.tokenizer import Tokenizer

        tok = Tokenizer.from_hf_dir(default_model_path())
        long_prompt = tok.decode(tok.encode(FILLER)[:3000])
        solo = complete(client, long_prompt)
        order, text, give_ways = long_then_short(base, client, long_prompt)
        assert complete(client, SHORT, 4)
        from test_server_scenarios import metric

        assert metric(base, "strata_read_stage_steps_total") >= 3000 // 64
    log = (tmp_path / "server.log").read_text()
    assert "concurrent read on" in log, log[-2000:]
    assert order == ["short", "long"] and give_ways >= 1 and text == solo
