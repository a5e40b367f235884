"""Pipeline stages on the CPU (separate gloo processes, the embedded model in fp32): 2 and 3 stages give
the same greedy tokens as one, with speculation, two slots in two batch groups, a long read in chunks
that gives way to a newer request, a prefix-cache hit and a preemption; `strata generate --split-mode
layer` prints the same text as one stage; a stage killed mid-run ends the command with an error naming it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.params import SamplingParams

README = os.path.join(os.path.dirname(__file__), "..", "..", "strata", "assets", "default-model", "README.md")
LONG = open(README).read()[:1600]
SHORT = "It is a truth universally acknowledged, that"
# Prompt i arrives before step ARRIVE[i]: the short one while the long one reads (a give-way), the last
# once the long one's blocks are cached (its prefix is the long prompt's).
PROMPTS = [LONG, SHORT, LONG + " And then"]
ARRIVE = {0: 0, 1: 2, 2: 12}
# A pool just short of both requests' blocks: a preemption too.
SCENARIO = dict(device="cpu", parallel=2, batch_groups=2, spec=3, chunk_size=64, max_num_batched_tokens=96,
                kv_size=608)


def run(prompts: list[str] = PROMPTS, **kw) -> tuple[dict[str, list[int]], LLMEngine]:
    e = LLMEngine(EngineConfig(**{**SCENARIO, **kw}), progress=False)
    try:
        out: dict[str, list[int]] = {}
        pending, step = dict(enumerate(prompts)), 0
        while pending or e.has_work():
            for i in [i for i in pending if ARRIVE[i] <= step]:
                ids = e.tokenizer.encode(pending.pop(i))
                e.add_request(EngineRequest(f"r{i}", tuple(ids), SamplingParams(max_tokens=12, ignore_eos=True),
                                            time.monotonic()))
            for ev in e.step():
                assert ev.error is None, ev.error
                out.setdefault(ev.request_id, []).extend(ev.token_ids)
            step += 1
        return out, e
    finally:
        e.close()


@pytest.fixture(scope="module")
def one_stage():
    out, e = run()
    s = e.scheduler
    # The scenario exercises what it names.
    assert s.give_ways_total >= 1 and s.prefix_hits_total >= 1 and s.preemptions_total >= 1
    assert e.stats().spec["drafts_proposed"] > 0
    return out


@pytest.mark.parametrize("split", ["1,1", "2,1,1"])
def test_stages_give_the_tokens_of_one(one_stage, split):
    out, e = run(split_mode="layer", tensor_split=split)
    assert out == one_stage
    stages = len(split.split(","))
    assert e.stages.plan.world == stages and e.stages.steps > 0
    # Rank 0 holds its own layers' K/V (and the MTP layer's), not the other stages'.
    a, b = e.stages.plan.layers
    assert e.pool.num_layers == (b - a) + len(e.model.mtp_layers) < e.model.config.num_hidden_layers + 1
    s = e.scheduler
    assert s.give_ways_total >= 1 and s.prefix_hits_total >= 1 and s.preemptions_total >= 1


def _strata(*args: str) -> list[str]:
    return [sys.executable, "-m", "strata.cli", *args]


GENERATE = ("generate", "--device", "cpu", "--temperature", "0", "--prompt", SHORT)


def test_generate_with_two_stages_prints_the_text_of_one(capsys):
    from strata.cli import main

    assert main([*GENERATE, "--max-tokens", "24"]) == 0
    one = capsys.readouterr().out
    two = subprocess.run(_strata(*GENERATE, "--max-tokens", "24", "--split-mode", "layer", "--tensor-split", "1,1"),
                         capture_output=True, text=True, timeout=120)
    assert two.returncode == 0, two.stderr
    assert two.stdout == one and len(one) > 20


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def test_a_killed_stage_ends_the_command_with_an_error_naming_it():
    p = subprocess.Popen(_strata(*GENERATE, "--max-tokens", "100000", "--ignore-eos", "--split-mode", "layer",
                                 "--tensor-split", "1,1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.read(1), "no token before the kill"  # the pipeline runs
        (stage,) = _children(p.pid)
        os.kill(stage, signal.SIGKILL)
        rc = p.wait(timeout=30)
        err = p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert rc != 0
    assert f"pipeline stage 1 (layers" in err and f"pid {stage}) was killed by signal 9" in err, err
