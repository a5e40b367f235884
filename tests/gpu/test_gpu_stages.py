"""Pipeline stages on one GPU: two stages as two processes sharing the card (gloo through pinned host
buffers, as NCCL refuses two ranks on one device) give the greedy tokens of one stage in fp32, with
speculation and two slots in two batch groups. Correctness only: two stages on one card measure nothing."""

from __future__ import annotations

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


def _run(**kw) -> tuple[dict[str, list[int]], LLMEngine]:
    cfg = dict(device="cuda", dtype="float32", parallel=2, batch_groups=2, spec=3, chunk_size=64,
               max_num_batched_tokens=128)
    e = LLMEngine(EngineConfig(**{**cfg, **kw}), progress=False)
    try:
        for i, p in enumerate(PROMPTS):
            e.add_request(EngineRequest(f"r{i}", tuple(e.tokenizer.encode(p)),
                                        SamplingParams(max_tokens=24, ignore_eos=True), time.monotonic()))
        out: dict[str, list[int]] = {}
        while e.has_work():
            for ev in e.step():
                assert ev.error is None, ev.error
                out.setdefault(ev.request_id, []).extend(ev.token_ids)
        return out, e
    finally:
        e.close()


def test_two_stages_sharing_the_card_give_the_tokens_of_one():
    # One stage without graphs: the split runs eagerly on rank 0, and graphs change no greedy token in fp32.
    one, _ = _run(cuda_graph=False)
    two, e = _run(split_mode="layer", tensor_split="1,1", devices="0,0")
    assert e.stages.plan.world == 2 and e.stages.steps > 0 and e.stages.via_host
    assert two == one
