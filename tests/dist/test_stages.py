"""Pipeline stages on the CPU (separate gloo processes, the embedded model in fp32): 2 and 3 stages give
the same greedy tokens as one, with speculation (the MTP head on the last stage: the same drafts), two
slots in two batch groups, a long read in chunks that gives way to a newer request, a prefix-cache hit
and a preemption; sampled drafts; the next step computed by an earlier stage while the first is on the
last (the stages' traces); one prompt's chunks in flight together, one per stage (read ahead), the next
computed while the one before is held on the last stage; the concurrent read across stages; experts in
RAM placed by each stage; every stage's allocator counters asked for between steps; `strata generate
--split-mode layer` prints the same text as one stage; a stage killed mid-run ends the command with an
error naming it; what does not run across stages is refused before any starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

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


def record(e: LLMEngine) -> None:
    """From now on, `e.drafts`: the drafts each decode step verifies, by (request, position); `e.chunks`:
    each chunk scheduled, as (request, start, tokens, samples, its request's chunks in flight with it)."""
    e.drafts, e.chunks = {}, []
    schedule = e.scheduler.schedule

    def recording(*args, **kw):
        out = schedule(*args, **kw)
        for c in out.chunks:
            r = c.request
            e.chunks.append((r.request_id, c.start, c.num_tokens, c.sample, r.num_in_flight_chunks))
            if c.drafts:
                e.drafts[r.request_id, c.start] = c.drafts
        return out

    e.scheduler.schedule = recording


def steps_out(trace: list[tuple[str, int, int]]) -> int:
    """The most steps rank 0 had in flight at once (sent, not back)."""
    depth = most = 0
    for event, _, _ in trace:
        depth += 1 if event == "send" else -1 if event == "back" else 0
        most = max(most, depth)
    return most


def read_ahead(e: LLMEngine, rid: str, stages: int) -> None:
    """`rid`'s prompt chunks were in flight together, one per stage at most, and none that samples beside
    another of its chunks."""
    mine = [c for c in e.chunks if c[0] == rid]
    assert max(c[4] for c in mine) == stages and all(c[4] == 1 for c in mine if c[3]), mine


def same_drafts(a: dict, b: dict) -> None:
    """Two runs whose schedules differ (one prompt's chunks read ahead with stages, so a preemption may
    strike another request) proposed the same drafts wherever both decoded the same position."""
    common = a.keys() & b.keys()
    assert len(common) >= len(a) // 2 and all(a[k] == b[k] for k in common), (a, b)


def collector() -> tuple[dict[str, list[int]], Callable[[list], None]]:
    """(tokens by request, a function that adds a step's events to them, failing on an error event)."""
    out: dict[str, list[int]] = {}

    def keep(events) -> None:
        for ev in events:
            assert ev.error is None, ev.error
            out.setdefault(ev.request_id, []).extend(ev.token_ids)

    return out, keep


def add_long(e: LLMEngine) -> None:
    e.add_request(EngineRequest("r0", tuple(e.tokenizer.encode(LONG)), SamplingParams(max_tokens=12, ignore_eos=True),
                                time.monotonic()))


def run(prompts: list[str] = PROMPTS, params: dict | None = None, between=None,
        **kw) -> tuple[dict[str, list[int]], LLMEngine]:
    """`between(engine)`: called after every step."""
    e = LLMEngine(EngineConfig(**{**SCENARIO, **kw}), progress=False)
    record(e)
    try:
        out: dict[str, list[int]] = {}
        pending, step = dict(enumerate(prompts)), 0
        while pending or e.has_work():
            for i in [i for i in pending if ARRIVE[i] <= step]:
                ids = e.tokenizer.encode(pending.pop(i))
                e.add_request(EngineRequest(f"r{i}", tuple(ids), SamplingParams(**{"max_tokens": 12, "ignore_eos": True,
                                                                                  **(params or {})}),
                                            time.monotonic()))
            for ev in e.step():
                assert ev.error is None, ev.error
                out.setdefault(ev.request_id, []).extend(ev.token_ids)
            step += 1
            if between is not None:
                between(e)
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
    return out, e.drafts


@pytest.mark.parametrize("split", ["1,1", "2,1,1"])
def test_stages_give_the_tokens_of_one(one_stage, split):
    from strata.dist.draft import StageDrafter

    out, e = run(split_mode="layer", tensor_split=split)
    assert out == one_stage[0]
    stages = len(split.split(","))
    assert e.stages.plan.world == stages and e.stages.steps > 0
    # Rank 0 holds its own layers' K/V, not the other stages' nor the MTP layer's: the MTP head is the last
    # stage's, whose drafts (one stage's, position by position) rank 0 verifies.
    a, b = e.stages.plan.layers
    assert e.model.mtp_layers == [] and e.pool.num_layers == b - a < e.model.config.num_hidden_layers
    assert isinstance(e.drafter, StageDrafter) and e.stats().spec["drafts_accepted"] > 0
    same_drafts(one_stage[1], e.drafts)
    s = e.scheduler
    assert s.give_ways_total >= 1 and s.prefix_hits_total >= 1 and s.preemptions_total >= 1


@pytest.mark.parametrize("split", ["1,1", "1,1,1"])
def test_every_stage_reports_its_allocator_counters_between_steps(one_stage, split):
    """Rank 0 asks every stage for its allocator counters after every step, with steps in flight and
    drafting messages among them: each stage answers in its turn (zeros on the CPU), and the run gives
    the tokens of one stage."""
    from strata.dist.link import MEMORY_KEYS

    reports = []

    def ask(e: LLMEngine) -> None:
        in_flight = sum(r is not None for r in e.stages.recvs)
        reports.append((in_flight, e.stages.memory()))

    out, e = run(split_mode="layer", tensor_split=split, between=ask)
    assert out == one_stage[0]
    world = len(split.split(","))
    assert len(reports) > 10 and any(n for n, _ in reports)
    assert all(r == [dict.fromkeys(MEMORY_KEYS, 0)] * world for _, r in reports)


def test_prompt_draft_kv_chunk_by_chunk_on_the_last_stage(monkeypatch):
    """STRATA_SPLIT_MTP_BATCH=1: the last stage writes the MTP K/V of each read chunk as it passes (rank 0
    tells it which chunks do not sample); the tokens and drafts of one stage."""
    monkeypatch.setenv("STRATA_SPLIT_MTP_BATCH", "1")
    one, e1 = run()
    two, e2 = run(split_mode="layer", tensor_split="1,1")
    assert two == one and e2.drafter.split
    same_drafts(e1.drafts, e2.drafts)


def test_sampled_drafts_from_the_last_stage_give_the_tokens_of_one():
    """Sampled requests (a seed per request): the last stage draws the drafts from the seed's generator
    and sends their distributions back, against which rank 0 verifies: the tokens of one stage. (A pool
    that needs no preemption: a sampled request's tokens after a recompute depend on when it struck.)"""
    params = dict(temperature=0.8, top_p=0.95, seed=7)
    one, e1 = run(PROMPTS[:2], params, kv_size=2048)
    two, e2 = run(PROMPTS[:2], params, kv_size=2048, split_mode="layer", tensor_split="1,1")
    spec = e1.stats().spec
    assert two == one and e2.stats().spec == spec and 0 < spec["drafts_accepted"] < spec["drafts_proposed"]


def test_experts_in_ram_are_placed_by_each_stage():
    """--n-cpu-moe 3 names the model's first three MoE layers (1, 2, 3): rank 0 keeps the experts of the two
    it holds in RAM, the next stage those of layer 3 (rank 0 sends each stage its layers); the tokens are
    those of one stage with all experts on the device."""
    from strata.models.moe import MoE

    one, _ = run(PROMPTS[:2], spec=0)
    two, e = run(PROMPTS[:2], spec=0, split_mode="layer", tensor_split="1,1", n_cpu_moe=3, host_experts="float")
    host = [i for i, layer in enumerate(e.model.model.layers) for m in layer.modules()
            if isinstance(m, MoE) and m.host is not None]
    assert host == [1, 2] and two == one


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
    assert "pipeline stage 1 (layers" in err and f"pid {stage}) was killed by signal 9" in err, err


@pytest.mark.parametrize("split", ["1,1", "1,1,1"])
def test_the_next_step_runs_on_an_earlier_stage_while_the_first_is_on_the_last(tmp_path, monkeypatch, split):
    """The last stage is stopped (SIGSTOP) before the first step: request A's read cannot pass it, yet
    request B's read, which arrives next, is launched and computed by the stage before it (rank 0's
    layers with two stages, stage 1's with three) — the stages' traces show it, whatever the timing. Then
    the run completes with the tokens of one stage, and its decode steps of the two batch groups went
    through the pipeline two at a time."""
    from strata.dist.link import read_trace

    monkeypatch.setenv("STRATA_STAGE_TRACE", str(tmp_path))
    prompts = [SHORT, "To be, or not to be:"]
    cfg = dict(parallel=2, batch_groups=2, spec=3, chunk_size=64, max_num_batched_tokens=96)
    e = LLMEngine(EngineConfig(device="cpu", **cfg, split_mode="layer", tensor_split=split), progress=False)
    world = e.stages.plan.world
    before, (_, last) = world - 2, e.stages.children[-1]
    out, keep = collector()

    def add(i: int) -> None:
        e.add_request(EngineRequest(f"r{i}", tuple(e.tokenizer.encode(prompts[i])),
                                    SamplingParams(max_tokens=12, ignore_eos=True), time.monotonic()))

    try:
        add(0)
        os.kill(last.pid, signal.SIGSTOP)
        keep(e.step())  # launches A's read (step 0, slot 0): nothing to wait for yet
        add(1)
        b_done = ("send" if before == 0 else "out", 1, 1)  # B's step leaves the stage before the last

        def look() -> tuple:
            return (read_trace(str(tmp_path), before), read_trace(str(tmp_path), world - 1),
                    ("back", 0, 0) in read_trace(str(tmp_path), 0))

        # The step launches B's read (step 1, slot 1), then (two stages) waits for A's.
        (seen_before, seen_last, back_before), events = _steps_while_stopped(e, last.pid, 1, look,
                                                                             lambda seen: b_done in seen[0])
        assert b_done in seen_before, seen_before
        # A's step was in flight on the stopped stage: not computed there, not back at rank 0.
        assert seen_last == [] and not back_before
        keep(events)
        while e.has_work():
            keep(e.step())
    finally:
        e.close()
    # While both requests decode, each group's step is launched while the other group's is in flight: two
    # steps out at a time, never more (alone at the end, the one left decodes step by step).
    r0 = read_trace(str(tmp_path), 0)
    depth, overlapped = 0, 0
    for event, _, _ in r0:
        depth += 1 if event == "send" else -1 if event == "back" else 0
        assert depth <= 2
        overlapped += event == "send" and depth == 2
    sends = sum(ev == "send" for ev, _, _ in r0)
    assert depth == 0 and sends > 6 and overlapped >= 6, r0
    one = LLMEngine(EngineConfig(device="cpu", **cfg), progress=False)
    e, out_split = one, out
    out, keep = collector()
    try:
        add(0)
        keep(e.step())
        add(1)
        while e.has_work():
            keep(e.step())
    finally:
        e.close()
    assert out_split == out


@pytest.fixture(scope="module")
def lone_read():
    """One stage's tokens and drafts for the long prompt read alone."""
    out, e = run([LONG], kv_size=1024)
    return out, e.stats().spec


def _steps_while_stopped(e: LLMEngine, pid: int, steps: int, look: Callable, ready: Callable) -> tuple:
    """`steps` engine steps on a thread while the stage process `pid` is stopped (SIGSTOP): waits until
    `ready(look())` (60 s at most), resumes the stage and joins the steps. Returns (what `look` gave
    last, the steps' events)."""
    import threading

    failed: list[BaseException] = []
    events: list = []

    def run() -> None:
        try:
            for _ in range(steps):
                events.extend(e.step())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            failed.append(exc)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    seen = look()
    while not ready(seen) and time.monotonic() < deadline:
        time.sleep(0.05)
        seen = look()
    os.kill(pid, signal.SIGCONT)
    t.join(timeout=60)
    assert not failed and not t.is_alive()
    return seen, events


@pytest.mark.parametrize("split", ["1,1", "1,1,1"])
def test_one_prompts_next_chunk_runs_on_an_earlier_stage_while_the_one_before_is_on_the_last(
        tmp_path, monkeypatch, lone_read, split):
    """A long prompt read alone, the last stage stopped (SIGSTOP) before its first chunk: the engine
    launches the prompt's next chunks all the same, one per stage, and each stage before the last
    computes the chunk after the one it passed on (rank 0 chunk 1 with two stages; with three, stage 1
    chunk 1 and rank 0 chunk 2) while chunk 0 is held on the last: the traces show it, whatever the
    timing. Then the run completes with the tokens and drafts of one stage, the prompt's chunks in
    flight one per stage and the chunk that samples alone."""
    from strata.dist.link import read_trace

    monkeypatch.setenv("STRATA_STAGE_TRACE", str(tmp_path))
    e = LLMEngine(EngineConfig(**{**SCENARIO, "kv_size": 1024}, split_mode="layer", tensor_split=split),
                  progress=False)
    record(e)
    world, (_, last) = e.stages.plan.world, e.stages.children[-1]
    out, keep = collector()

    try:
        add_long(e)
        os.kill(last.pid, signal.SIGSTOP)
        for _ in range(world - 1):
            keep(e.step())  # launches the next chunk: fewer steps out than stages, nothing is waited for
        # Rank r < world - 1 has computed chunk world-1-r (step and slot k for chunk k).
        want = {r: ("send" if r == 0 else "out", world - 1 - r, world - 1 - r) for r in range(world - 1)}
        # The step launches chunk world-1, then waits for chunk 0.
        seen, events = _steps_while_stopped(e, last.pid, 1, lambda: {r: read_trace(str(tmp_path), r) for r in range(world)},
                                            lambda seen: all(want[r] in seen[r] for r in want))
        assert all(want[r] in seen[r] for r in want), seen
        # Chunk 0 is on the stopped stage: not computed there, not back at rank 0.
        assert seen[world - 1] == [] and not any(ev == "back" for ev, _, _ in seen[0])
        # Those steps are the prompt's first chunks, none sampling, all in flight together.
        assert e.chunks[:world] == [("r0", 64 * k, 64, False, k + 1) for k in range(world)]
        keep(events)
        while e.has_work():
            keep(e.step())
    finally:
        e.close()
    assert out == lone_read[0] and e.stats().spec == lone_read[1]
    read_ahead(e, "r0", world)
    assert steps_out(read_trace(str(tmp_path), 0)) == world


def test_with_speculation_the_next_chunk_is_launched_before_the_drafter_answers(tmp_path, monkeypatch, lone_read):
    """Two stages, the MTP head on the last: the last stage is stopped (SIGSTOP) as soon as chunk 0 is back
    at rank 0, before rank 0 tells it what to draft from chunk 0. A chunk that samples nothing needs no
    answer at once, so rank 0 goes on: it launches chunk 2 (its layers computed, step 2 sent) while the
    last stage holds both chunk 1 and chunk 0's drafting message. The tokens and drafts are one stage's."""
    from strata.dist.link import read_trace

    monkeypatch.setenv("STRATA_STAGE_TRACE", str(tmp_path))
    e = LLMEngine(EngineConfig(**{**SCENARIO, "kv_size": 1024}, split_mode="layer", tensor_split="1,1"),
                  progress=False)
    record(e)
    (_, last) = e.stages.children[-1]
    receive = e.stages.receive

    def stop_after_the_first(handle):
        hidden = receive(handle)
        if handle.step == 0:
            os.kill(last.pid, signal.SIGSTOP)
        return hidden

    e.stages.receive = stop_after_the_first
    out, keep = collector()

    try:
        add_long(e)
        keep(e.step())  # chunk 0
        # Chunk 1 launched, chunk 0 collected: the stage stops; chunk 2 launched, waiting for the stage.
        sent, events = _steps_while_stopped(e, last.pid, 2, lambda: read_trace(str(tmp_path), 0),
                                            lambda sent: ("send", 2, 0) in sent)
        assert ("send", 2, 0) in sent and ("back", 0, 0) in sent, sent
        assert e.chunks[:3] == [("r0", 64 * k, 64, False, 1 + min(k, 1)) for k in range(3)]
        keep(events)
        while e.has_work():
            keep(e.step())
    finally:
        e.close()
    assert out == lone_read[0] and e.stats().spec == lone_read[1]


def _concurrent_scenario(monkeypatch, piped: bool, **kw) -> tuple[dict[str, list[int]], list[str], LLMEngine]:
    """A decoding slot, then a long read beside it, then a short request during the read."""
    monkeypatch.setenv("STRATA_PIPED_CONCURRENT", "1" if piped else "0")
    e = LLMEngine(EngineConfig(device="cpu", parallel=3, spec=2, chunk_size=64, max_num_batched_tokens=128, **kw),
                  progress=False)
    try:
        tok = e.tokenizer
        arrivals = {0: ("dec", "To be, or not to be:", 24), 2: ("long", LONG * 2, 6), 5: ("short", SHORT, 6)}
        out, order, step = {}, [], 0
        while e.has_work() or step <= max(arrivals):
            if step in arrivals:
                rid, text, n = arrivals[step]
                e.add_request(EngineRequest(rid, tuple(tok.encode(text)[:700]),
                                            SamplingParams(max_tokens=n, ignore_eos=True), time.monotonic()))
            for ev in e.step():
                assert ev.error is None, ev.error
                out.setdefault(ev.request_id, []).extend(ev.token_ids)
                if ev.finish_reason:
                    order.append(ev.request_id)
            step += 1
        return out, order, e
    finally:
        e.close()


@pytest.mark.parametrize("split", ["1,1", "2,1,1"])
def test_the_concurrent_read_runs_across_stages(tmp_path, monkeypatch, split):
    """STRATA_PIPED_CONCURRENT=1 with stages: the read's steps go through every stage in a ring slot of
    their own beside the decode loop's; a short request overtakes the long read; the tokens are one
    stage's without the concurrent read."""
    from strata.dist.link import read_trace

    want, _, _ = _concurrent_scenario(monkeypatch, False)
    monkeypatch.setenv("STRATA_STAGE_TRACE", str(tmp_path))
    got, order, e = _concurrent_scenario(monkeypatch, True, split_mode="layer", tensor_split=split)
    assert e.read_stage is not None and e.read_stage.reads_total >= 700 // 64
    assert e.read_stage.runner.pipeline is e.stages
    last = read_trace(str(tmp_path), e.stages.last)
    reads = [s for ev, s, slot in last if ev == "out" and slot == e.stages.read_slot]
    assert len(reads) == e.read_stage.reads_total and len(last) > 2 * len(reads)  # decode steps between
    assert order.index("short") < order.index("long") and e.scheduler.give_ways_total >= 1
    assert got == want


def test_what_does_not_run_across_stages_is_refused_before_any_stage_starts(monkeypatch):
    with pytest.raises(ValueError, match="host KV tier"):
        LLMEngine(EngineConfig(device="cpu", split_mode="layer", tensor_split="1,1", kv_resident=64), progress=False)
    for name in ("STRATA_PIPED_CONCURRENT", "STRATA_SPLIT_MTP_BATCH", "STRATA_PIPED_CONCURRENT_SMB"):
        monkeypatch.setenv(name, "1")
    with pytest.raises(ValueError, match="STRATA_PIPED_CONCURRENT_SMB"):
        LLMEngine(EngineConfig(device="cpu", split_mode="layer", tensor_split="1,1"), progress=False)
    assert not _children(os.getpid())


def test_a_start_that_fails_after_the_stages_joined_leaves_no_stage_and_no_group(monkeypatch):
    """A refusal once the stages run (a memory plan that does not fit, say) stops them and leaves the
    process group, so the process can start another pipeline: a test after it, a server started again."""
    import torch.distributed as dist

    from strata.engine import engine as engine_module
    from strata.memory_plan import PlanError

    def refused(*args, **kw):
        raise PlanError("the model does not fit")

    monkeypatch.setattr(engine_module, "load_placed", refused)
    with pytest.raises(PlanError):
        LLMEngine(EngineConfig(device="cpu", split_mode="layer", tensor_split="1,1"), progress=False)
    assert not dist.is_initialized() and not _children(os.getpid())
    monkeypatch.undo()
    e = LLMEngine(EngineConfig(device="cpu", split_mode="layer", tensor_split="1,1"), progress=False)
    try:
        assert e.stages.plan.world == 2
    finally:
        e.close()


def test_a_closed_pipeline_leaves_nothing_holding_the_engine():
    """Once closed, nothing of a split engine outlives it (an exit hook held the stages' link, and through
    it the engine's runner and K/V pool, for the life of the process)."""
    import gc
    import weakref

    e = LLMEngine(EngineConfig(device="cpu", split_mode="layer", tensor_split="1,1"), progress=False)
    e.add_request(EngineRequest("r", tuple(e.tokenizer.encode(SHORT)), SamplingParams(max_tokens=4), time.monotonic()))
    e.run_to_completion()
    e.close()
    pool, link = weakref.ref(e.pool), weakref.ref(e.stages)
    del e
    gc.collect()
    assert pool() is None and link() is None
