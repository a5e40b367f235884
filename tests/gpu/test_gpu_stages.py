"""Pipeline stages on one GPU: two stages as two processes sharing the card (gloo through pinned host
buffers, as NCCL refuses two ranks on one device) give the greedy tokens of one stage in fp32, with
speculation (the MTP head on the last stage, its draft graphs), two slots in two batch groups launched
two steps at a time, each stage's decode graphs of its layers (and without graphs), the concurrent read
across the stages, each stage's memory plan within its own --gpu-memory, and no stage's caching allocator
growing in steady decoding. Correctness only: two stages on one card measure nothing."""

from __future__ import annotations

import gc
import logging
import time

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["It is a truth universally acknowledged, that", "In the beginning God created",
           "To be, or not to be:", "The list type in Python supports"]
BASE = dict(device="cuda", dtype="float32", parallel=2, batch_groups=2, spec=3, chunk_size=64,
            max_num_batched_tokens=128)
SPLIT = dict(split_mode="layer", tensor_split="1,1", devices="0,0")


def _run(prompts=PROMPTS, **kw) -> tuple[dict[str, list[int]], LLMEngine, dict | None]:
    e = LLMEngine(EngineConfig(**{**BASE, **kw}), progress=False)
    try:
        for i, p in enumerate(prompts):
            e.add_request(EngineRequest(f"r{i}", tuple(e.tokenizer.encode(p)),
                                        SamplingParams(max_tokens=24, ignore_eos=True), time.monotonic()))
        out: dict[str, list[int]] = {}
        while e.has_work():
            for ev in e.step():
                assert ev.error is None, ev.error
                out.setdefault(ev.request_id, []).extend(ev.token_ids)
        return out, e, e.stats().spec
    finally:
        e.close()


@pytest.fixture(scope="module")
def one_stage():
    # One stage without graphs: the split runs eagerly on rank 0, and graphs change no greedy token in fp32.
    out, _, spec = _run(cuda_graph=False)
    return out, spec


def test_two_stages_sharing_the_card_give_the_tokens_of_one(one_stage, tmp_path, monkeypatch):
    from strata.dist.draft import StageDrafter
    from strata.dist.link import read_trace

    monkeypatch.setenv("STRATA_STAGE_TRACE", str(tmp_path))
    two, e, spec = _run(**SPLIT)
    assert e.stages.plan.world == 2 and e.stages.steps > 0 and e.stages.via_host
    assert two == one_stage[0]
    # The MTP head is the last stage's (with its draft graphs there): the same drafts as one stage's.
    assert isinstance(e.drafter, StageDrafter) and e.model.mtp_layers == [] and spec == one_stage[1]
    # Both stages replayed their layers' decode graphs (rank 0 the forward part of its runner's, its head
    # graph over what came back).
    first, last = read_trace(str(tmp_path), 0), read_trace(str(tmp_path), 1)
    assert e.runner.graphs and any(ev == "replay" for ev, _, _ in first), first[:20]
    assert any(ev == "replay" for ev, _, _ in last), last[:20]
    # Two steps in flight at a time: the two groups' decodes.
    depth, overlapped = 0, 0
    for ev, _, _ in read_trace(str(tmp_path), 0):
        depth += 1 if ev == "send" else -1 if ev == "back" else 0
        overlapped += ev == "send" and depth == 2
    assert overlapped >= 6


def test_stage_graphs_off_give_the_same_tokens(one_stage, tmp_path, monkeypatch):
    from strata.dist.link import read_trace

    monkeypatch.setenv("STRATA_STAGE_TRACE", str(tmp_path))
    two, _, _ = _run(**SPLIT, cuda_graph=False)
    assert two == one_stage[0]
    assert not any(ev == "replay" for r in (0, 1) for ev, _, _ in read_trace(str(tmp_path), r))


def test_the_concurrent_read_across_stages_on_the_card(monkeypatch):
    long = open(__file__.replace("tests/gpu/test_gpu_stages.py", "strata/assets/default-model/README.md")).read()[:3000]
    prompts = [PROMPTS[0], long, PROMPTS[2]]
    monkeypatch.setenv("STRATA_PIPED_CONCURRENT", "0")
    want, _, _ = _run(prompts, parallel=3, batch_groups=1, cuda_graph=False)
    monkeypatch.setenv("STRATA_PIPED_CONCURRENT", "1")
    got, e, _ = _run(prompts, parallel=3, batch_groups=1, **SPLIT)
    assert e.read_stage is not None and e.read_stage.runner.pipeline is e.stages and e.read_stage.reads_total > 0
    assert got == want


def test_each_stage_plans_its_own_memory(one_stage, caplog):
    with caplog.at_level(logging.INFO, logger="strata"):
        two, e, _ = _run(**SPLIT, gpu_memory=4.0)
    assert two == one_stage[0]
    a, b = e.stages.plan.ranges[1]
    assert f"pipeline stage 0, layers 0-{a - 1}: memory plan (GPU budget 4.00 GiB)" in caplog.text
    assert f"pipeline stage 1, layers {a}-{b - 1}: memory plan (GPU budget 4.00 GiB)" in caplog.text
    assert "MTP prompt hidden states" in caplog.text  # the last stage's drafter
    assert e.memory_plan is not None and e.memory_plan.gpu_budget == 4 << 30


def test_steady_decoding_grows_no_stages_memory():
    """A warm-up round, then the same round again (four prompts read, then decoded in two slots of two
    groups with speculation and each stage's graphs): neither rank 0's caching allocator nor the other
    stage's, which it reports to rank 0 (`Link.memory`), reserves more bytes or adds a segment."""
    keys = ("reserved_bytes.all.current", "segment.all.current")
    e = LLMEngine(EngineConfig(**{**BASE, **SPLIT, "prefix_cache": False}), progress=False)
    try:
        def round_(tag: str) -> None:
            for i, p in enumerate(PROMPTS):
                e.add_request(EngineRequest(f"{tag}{i}", tuple(e.tokenizer.encode(p)),
                                            SamplingParams(max_tokens=64, ignore_eos=True), time.monotonic()))
            for events in e.run_to_completion().values():
                assert all(ev.error is None for ev in events)

        round_("warm")
        gc.collect()
        torch.cuda.synchronize()
        before = e.stages.memory()
        round_("steady")
        torch.cuda.synchronize()
        after = e.stages.memory()
        own = torch.cuda.memory_stats()
        assert e.stages.plan.world == 2 and e.runner.graphs and e.stages.steps > 0
    finally:
        e.close()
    assert all(after[0][k] == own[k] for k in keys), (after[0], {k: own[k] for k in keys})
    assert all(after[1][k] > 0 for k in keys), after[1]  # the stage's own weights, pool and graphs
    for rank, (b, a) in enumerate(zip(before, after)):
        print(f"stage {rank}: segments {a['segment.all.current']}, "
              f"reserved {a['reserved_bytes.all.current'] / 2**20:.1f} MiB")
        grew = {k: (b[k], a[k]) for k in keys if a[k] > b[k]}
        assert not grew, f"stage {rank}'s allocator grew in the steady round: {grew}"
