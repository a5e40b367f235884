"""Scheduler on the CPU with a fake runner: chunked reads, mixed steps, slots, give-way, preemption.

The fake runner keeps a paged "KV cache" (a dict keyed by (block, offset)) written through each
request's block table, and checks before every chunk that all earlier positions of the request are
still there. So a block freed while in use, shared by two requests, or a recompute that does not
start from 0 fails the test, not just a counter.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from strata.kvcache import NULL_BLOCK
from strata.params import SamplingParams
from strata.sched import Request, RequestStatus, Scheduler, SchedulerConfig

REPO = Path(__file__).resolve().parents[2]


def make_sched(**kw) -> Scheduler:
    kw.setdefault("num_blocks", 1024)
    kw.setdefault("max_model_len", 8192)
    clock = itertools.count(1)
    return Scheduler(SchedulerConfig(**kw), now=lambda: float(next(clock)))


def req(rid: str, n_prompt: int, max_tokens: int = 8, eos=(), **params) -> Request:
    prompt = [1000 + (zlib.crc32(rid.encode()) + i) % 5000 for i in range(n_prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_ids=frozenset(eos))


def next_token(ids) -> int:
    # Depends on the whole context, like a model: a recompute that lost or changed anything shows.
    return 100 + zlib.crc32(repr(list(ids)).encode()) % 800


class FakeRunner:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.kv: dict[tuple[int, int], tuple[str, int, int]] = {}
        self.bs = sched.config.block_size

    def _where(self, r: Request, pos: int) -> tuple[int, int]:
        return r.block_ids[pos // self.bs], pos % self.bs

    def __call__(self, out) -> dict[str, int]:
        sampled = {}
        for c in out.chunks:
            r = c.request
            ids = r.all_ids
            for pos in range(c.start):
                assert self.kv[self._where(r, pos)] == (r.request_id, pos, ids[pos]), (r, pos)
            assert c.token_ids == ids[c.start : c.end]
            for pos in range(c.start, c.end):
                self.kv[self._where(r, pos)] = (r.request_id, pos, ids[pos])
            if c.sample:
                sampled[r.request_id] = next_token(ids[: c.end])
        return sampled


def check_step(sched: Scheduler, out) -> None:
    cfg = sched.config
    assert out.num_batched_tokens == sum(c.num_tokens for c in out.chunks) <= cfg.max_num_batched_tokens
    running = sched.running
    assert len(running) <= cfg.parallel
    assert sorted(r.slot for r in running) == sorted(set(r.slot for r in running))
    assert all(r.slot in range(cfg.parallel) for r in running)
    owned = [b for r in running for b in r.block_ids]
    assert len(owned) == len(set(owned)) == sched.allocator.num_used and NULL_BLOCK not in owned
    assert len({c.request.request_id for c in out.chunks}) == len(out.chunks)
    decode_flags = []
    for c in out.chunks:
        r = c.request
        assert r.status is RequestStatus.RUNNING and r not in out.preempted
        assert c.start == r.num_computed_tokens and 1 <= c.num_tokens <= max(1, cfg.chunk_size)
        assert c.end <= r.num_tokens and c.sample == (c.end == r.num_tokens)
        assert len(r.block_ids) >= sched.allocator.blocks_for(c.end)
        decode_flags.append(r.remaining_read == 1)
    assert decode_flags == sorted(decode_flags, reverse=True), "decodes must come before reads"
    for r in out.preempted:
        assert r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0 and not r.block_ids
        assert r.slot is None and r in sched.waiting


def drive(sched: Scheduler, arrivals=None, max_steps=2000, watch=None):
    """Run to completion. arrivals: {step: [requests]} added just before that step's schedule().

    Returns (log, done): log[i] = ({rid: (start, n, sample)}, preempted ids); done = [(step, rid)].
    watch(step, sched, out), if given, sees the scheduler right after each schedule().
    """
    arrivals = dict(arrivals or {})
    runner = FakeRunner(sched)
    log, done = [], []
    for step in range(max_steps):
        for r in arrivals.pop(step, []):
            sched.add(r)
        if not sched.has_unfinished() and not arrivals:
            return log, done
        out = sched.schedule()
        check_step(sched, out)
        if watch:
            watch(step, sched, out)
        log.append(({c.request.request_id: (c.start, c.num_tokens, c.sample) for c in out.chunks},
                    [r.request_id for r in out.preempted]))
        for r in sched.update(out, runner(out)):
            assert r.is_finished and r.slot is None and not r.block_ids
            done.append((step, r.request_id))
    raise AssertionError("scheduler did not drain")


def starts_of(log, rid):
    return [(i, s[rid][0], s[rid][1]) for i, (s, _) in enumerate(log) if rid in s]


# ---------------------------------------------------------------- chunking, budget, mixing


def test_long_prompt_is_read_in_chunks_then_decoded():
    s = make_sched(chunk_size=256)
    r = req("a", 1000, max_tokens=3)
    log, done = drive(s, {0: [r]})
    reads = [(0, 256, False), (256, 256, False), (512, 256, False), (768, 232, True)]
    assert [log[i][0]["a"] for i in range(4)] == reads
    assert [log[i][0]["a"] for i in range(4, 6)] == [(1000, 1, True), (1001, 1, True)]
    assert len(log) == 6 and done == [(5, "a")]
    assert r.output_ids == [next_token(r.all_ids[:n]) for n in (1000, 1001, 1002)]
    assert r.finish_reason == "length" and r.num_computed_tokens == r.num_tokens - 1
    assert s.kv_blocks_used == 0 and s.slots_busy == 0


def test_token_budget_splits_reads_first_come_first_served():
    s = make_sched(chunk_size=256, max_num_batched_tokens=300, parallel=2, give_way=False)
    log, _ = drive(s, {0: [req("a", 400, 1), req("b", 400, 1)]})
    assert log[0][0] == {"a": (0, 256, False), "b": (0, 44, False)}
    assert log[1][0] == {"a": (256, 144, True), "b": (44, 156, False)}
    assert log[2][0] == {"b": (200, 200, True)}


def test_step_mixes_decodes_and_reads_decodes_first():
    s = make_sched(chunk_size=64, parallel=2)
    s.add(req("a", 10, max_tokens=50))
    runner = FakeRunner(s)
    out = s.schedule()
    s.update(out, runner(out))
    s.add(req("b", 300, max_tokens=2))
    out = s.schedule()
    check_step(s, out)
    assert [(c.request.request_id, c.start, c.num_tokens, c.sample) for c in out.chunks] == [
        ("a", 10, 1, True),
        ("b", 0, 64, False),
    ]
    assert out.num_batched_tokens == 65


def test_a_short_lone_read_gets_a_step_of_its_own_and_decodes_never_wait_twice():
    """solo_read_tokens: a read whose whole remainder fits runs alone while others decode (the runner
    replays a prompt-chunk graph for it); the decodes go on the step after, never held two in a row;
    a longer read, or two reads at once, mix with the decodes as before."""
    s = make_sched(chunk_size=64, parallel=4, solo_read_tokens=16)
    log, _ = drive(s, {0: [req("a", 10, max_tokens=30)], 2: [req("b", 12, 3)], 3: [req("c", 14, 3)],
                       8: [req("d", 40, 3)], 12: [req("e", 5, 2), req("f", 6, 2)]})
    steps = [set(chunks) for chunks, _ in log]
    assert steps[2] == {"b"} and log[2][0]["b"] == (0, 12, True)  # a decodes meanwhile: held one step
    assert steps[3] == {"a", "b", "c"}  # after a solo step everyone goes, the newcomer c too
    assert steps[8] == {"a", "d"}  # 40 tokens: more than solo_read_tokens, read beside the decodes
    assert steps[12] >= {"a", "e", "f"}  # two reads at once: mixed as before
    assert [i for i, st in enumerate(steps) if "a" in st] == [i for i in range(len(steps)) if i != 2][:30]


def test_without_solo_reads_a_short_read_joins_the_decodes():
    s = make_sched(chunk_size=64, parallel=2)
    log, _ = drive(s, {0: [req("a", 10, max_tokens=10)], 2: [req("b", 12, 3)]})
    assert set(log[2][0]) == {"a", "b"}


def test_a_one_token_prompt_is_a_decode():
    s = make_sched()
    log, done = drive(s, {0: [req("a", 1, max_tokens=2)]})
    assert log[0][0] == {"a": (0, 1, True)} and log[1][0] == {"a": (1, 1, True)} and done == [(1, "a")]


# ---------------------------------------------------------------- slots and the queue


def test_parallel_limit_fifo_queue_and_slot_reuse():
    s = make_sched(parallel=2)
    reqs = [req(f"r{i}", 5, max_tokens=2 + i) for i in range(5)]
    for r in reqs:
        s.add(r)
    assert s.queue_len == 5 and s.slots_busy == 0
    runner = FakeRunner(s)
    admitted, slots, done = [], {}, []
    while s.has_unfinished():
        out = s.schedule()
        check_step(s, out)
        for r in s.running:
            if r.request_id not in slots:
                admitted.append(r.request_id)
                slots[r.request_id] = r.slot
        assert s.slots_busy == min(2, s.slots_busy + s.queue_len)
        done += [r.request_id for r in s.update(out, runner(out))]
    assert admitted == ["r0", "r1", "r2", "r3", "r4"]
    assert (slots["r0"], slots["r1"]) == (0, 1)
    # r0 (2 tokens) frees slot 0 first, r1 slot 1 next; each newcomer takes the slot just freed.
    assert (slots["r2"], slots["r3"]) == (0, 1)
    assert done == ["r0", "r1", "r2", "r3", "r4"]
    assert all(len(r.output_ids) == r.params.max_tokens for r in reqs)
    assert s.queue_len == 0 and s.kv_blocks_used == 0


# ---------------------------------------------------------------- give-way


@pytest.mark.parametrize("budget", [2048, 256])
def test_long_read_gives_way_to_a_short_request_and_resumes_where_it_stopped(budget):
    s = make_sched(chunk_size=256, max_num_batched_tokens=budget, parallel=2)
    long, short = req("long", 3000, max_tokens=2), req("short", 20, max_tokens=4)
    log, done = drive(s, {0: [long], 3: [short]})
    assert [log[i][0] for i in range(3)] == [{"long": (256 * i, 256, False)} for i in range(3)]
    assert log[3][0] == {"short": (0, 20, True)}  # read the very next step; the long read got nothing
    # Resumes exactly at 768, beside the short one's first decode (which the budget counts first).
    assert log[4][0] == {"short": (20, 1, True), "long": (768, min(256, budget - 1), False)}
    reads = [c for c in starts_of(log, "long") if c[1] < 3000]
    assert [c[0] for c in reads[:4]] == [0, 1, 2, 4]
    assert all(nxt[1] == cur[1] + cur[2] for cur, nxt in zip(reads, reads[1:]))  # no gap, no overlap
    assert reads[-1][1] + reads[-1][2] == 3000 and [log[c[0]][0]["long"][2] for c in reads].count(True) == 1
    assert done[0][1] == "short" and done[0][0] < reads[-1][0]
    assert long.give_ways == 1 and short.give_ways == 0 and s.give_ways_total == 1
    assert long.output_ids[0] == next_token(long.prompt_ids)


def test_without_give_way_the_short_request_waits_for_the_long_read():
    s = make_sched(chunk_size=256, max_num_batched_tokens=256, parallel=2, give_way=False)
    long, short = req("long", 3000, max_tokens=2), req("short", 20, max_tokens=4)
    log, done = drive(s, {0: [long], 3: [short]})
    long_chunks, short_chunks = starts_of(log, "long"), starts_of(log, "short")
    assert [c[0] for c in long_chunks[:12]] == list(range(12))  # never interrupted
    assert short_chunks[0][0] > long_chunks[10][0]  # read only once the long read left room in the budget
    assert s.give_ways_total == 0 and long.give_ways == 0


def test_each_interruption_counts_once_and_long_reads_do_not_interleave():
    s = make_sched(chunk_size=100, parallel=3)
    a, b, c = req("a", 1000, max_tokens=1), req("b", 450, max_tokens=1), req("c", 30, max_tokens=1)
    log, done = drive(s, {0: [a], 2: [b], 9: [c]})
    # b is newer and itself long: a yields for all of b's read (counted once), then resumes.
    assert log[2][0] == {"b": (0, 100, False)} and log[6][0] == {"b": (400, 50, True)}
    assert log[7][0] == {"a": (200, 100, False)}
    assert log[9][0] == {"c": (0, 30, True)}  # a yields again: a second give-way
    assert log[10][0] == {"a": (400, 100, False)}
    assert a.give_ways == 2 and b.give_ways == 0 and s.give_ways_total == 2
    assert [rid for _, rid in done] == ["b", "c", "a"]


def test_a_read_shorter_than_a_chunk_never_yields():
    s = make_sched(chunk_size=256, parallel=2)
    log, _ = drive(s, {0: [req("a", 600, max_tokens=1)], 2: [req("b", 300, max_tokens=1)]})
    # At step 2 a has 88 left (< chunk): it is not a long read, so both read in the same step.
    assert log[2][0] == {"a": (512, 88, True), "b": (0, 256, False)}
    assert s.give_ways_total == 0


def test_a_long_read_does_not_yield_to_a_newer_read_that_gets_no_tokens():
    s = make_sched(chunk_size=100, block_size=64, num_blocks=6, parallel=2)  # 5 usable blocks: 320 positions
    long, new = req("long", 310, 1), req("new", 90, 1)
    queues = {}
    log, done = drive(s, {0: [long], 2: [new]}, watch=lambda i, s, out: queues.setdefault(i, s.waiting))
    # Step 2: "new" needs 2 blocks, only 1 is free, so it goes back to the queue; the long read uses the step.
    assert log[2] == ({"long": (200, 100, False)}, []) and queues[2] == (new,)
    assert s.give_ways_total == 0 and new.preemptions == 0 and s.preemptions_total == 0
    assert [rid for _, rid in done] == ["long", "new"] and long.output_ids == [next_token(long.prompt_ids)]


# ---------------------------------------------------------------- blocks and preemption


def roomy_outputs(specs):
    s = make_sched(parallel=len(specs), block_size=4)
    reqs = {rid: req(rid, n, mt, ignore_eos=True) for rid, n, mt in specs}
    drive(s, {0: list(reqs.values())})
    return {rid: r.output_ids for rid, r in reqs.items()}


def test_running_out_of_blocks_preempts_the_newest_which_recomputes_with_its_output_kept():
    specs = [("a", 8, 16), ("b", 8, 16), ("c", 8, 16)]
    s = make_sched(parallel=3, block_size=4, num_blocks=13)  # 12 usable: 48 positions for 3 x 24 tokens
    reqs = {rid: req(rid, n, mt, ignore_eos=True) for rid, n, mt in specs}
    seen = {}
    orig_update = s.update

    def spy(out, sampled):
        for r in out.preempted:
            seen.setdefault(r.request_id, list(r.output_ids))
        return orig_update(out, sampled)

    s.update = spy
    log, done = drive(s, {0: list(reqs.values())})
    first = next(i for i, (_, p) in enumerate(log) if p)
    assert log[first][1] == ["c"] and "c" not in log[first][0] and {"a", "b"} <= set(log[first][0])
    assert seen["c"] and len(seen["c"]) < 16
    recompute = next(v for i, (st, _) in enumerate(log) if i > first and "c" in st for v in [st["c"]])
    assert recompute[0] == 0 and recompute[1] == 8 + len(seen["c"]) and recompute[2]
    assert reqs["c"].output_ids[: len(seen["c"])] == seen["c"]
    assert s.preemptions_total == reqs["c"].preemptions == 1 and reqs["a"].preemptions == reqs["b"].preemptions == 0
    assert {rid: r.output_ids for rid, r in reqs.items()} == roomy_outputs(specs)
    assert all(r.finish_reason == "length" and len(r.output_ids) == 16 for r in reqs.values())
    assert s.allocator.num_used == 0


def test_the_newest_request_preempts_itself_rather_than_an_older_one():
    s = make_sched(parallel=3, block_size=4, num_blocks=7)  # 6 usable
    a, b, c = req("a", 6, 3, ignore_eos=True), req("b", 6, 3, ignore_eos=True), req("c", 8, 3, ignore_eos=True)
    queues = {}
    log, done = drive(s, {0: [a, b, c, req("d", 2, 1)]}, watch=lambda i, s, out: queues.setdefault(i, s.waiting))
    assert [r.request_id for r in queues[1]] == ["c", "d"]  # back at the front of the queue, ahead of d
    assert log[0][0] == {"a": (0, 6, True), "b": (0, 6, True), "c": (0, 8, True)}
    # Step 1: c needs a third block at position 8; it is the newest, so it goes, a and b are untouched.
    assert log[1] == ({"a": (6, 1, True), "b": (6, 1, True)}, ["c"])
    assert a.preemptions == b.preemptions == 0 and c.preemptions == 1
    assert {r.request_id: r.output_ids for r in (a, b, c)} == roomy_outputs([("a", 6, 3), ("b", 6, 3), ("c", 8, 3)])


def test_an_older_read_withdraws_the_newest_requests_decode_in_the_same_step():
    s = make_sched(parallel=2, block_size=4, num_blocks=13, chunk_size=8)  # 12 usable
    a, c = req("a", 40, 2, ignore_eos=True), req("c", 4, 30, ignore_eos=True)
    log, done = drive(s, {0: [a, c]})
    step = next(i for i, (_, p) in enumerate(log) if p)
    chunks, preempted = log[step]
    assert preempted == ["c"] and chunks == {"a": (32, 8, True)}
    assert log[step - 1][0]["c"][1] == 1  # c was decoding the step before
    assert s.preemptions_total == 1
    assert {r.request_id: r.output_ids for r in (a, c)} == roomy_outputs([("a", 40, 2), ("c", 4, 30)])


def test_a_request_that_cannot_fit_the_pool_alone_finishes_with_length():
    s = make_sched(block_size=4, num_blocks=4, parallel=2)  # 3 usable blocks: 12 positions
    big, grows = req("big", 20, 5), req("grows", 8, 100, ignore_eos=True)
    log, done = drive(s, {0: [big], 1: [grows]})
    assert big.finish_reason == "length" and big.output_ids == []
    assert grows.finish_reason == "length" and grows.num_tokens == 13  # the 13th position needs a 4th block
    assert [rid for _, rid in done] == ["big", "grows"] and s.kv_blocks_used == 0


# ---------------------------------------------------------------- abort and finishing


def test_abort_frees_blocks_and_slots_at_once_running_or_waiting():
    s = make_sched(parallel=2, block_size=4, num_blocks=64)
    reqs = [req(f"r{i}", 30, 10) for i in range(4)]
    for r in reqs:
        s.add(r)
    runner = FakeRunner(s)
    out = s.schedule()
    s.update(out, runner(out))
    out = s.schedule()  # aborting r0 while this step is in flight: update() must skip its chunk
    assert s.kv_blocks_used > 0 and s.slots_busy == 2 and s.queue_len == 2
    sampled = runner(out)
    assert s.abort("r0") and reqs[0].finish_reason == "abort"
    assert reqs[0].slot is None and not reqs[0].block_ids and s.slots_busy == 1
    finished = s.update(out, sampled)
    assert reqs[0] not in finished and reqs[0].num_tokens == 31
    assert s.abort("r3") and s.queue_len == 1  # waiting: leaves the queue
    assert s.abort("r1") and s.abort("r2")
    assert s.kv_blocks_used == 0 and s.slots_busy == 0 and s.queue_len == 0 and not s.has_unfinished()
    assert not s.abort("r1") and not s.abort("nobody")
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in reqs)


def scripted(s: Scheduler, r: Request, tokens):
    s.add(r)
    it = iter(tokens)
    for _ in range(100):
        out = s.schedule()
        sampled = {c.request.request_id: next(it) for c in out.chunks if c.sample}
        if s.update(out, sampled):
            return r
    raise AssertionError("not finished")


def test_eos_stop_tokens_ignore_eos_and_max_tokens():
    r = scripted(make_sched(), req("a", 5, 10, eos=(2,)), [7, 5, 2, 9])
    assert r.output_ids == [7, 5, 2] and r.finish_reason == "stop"
    r = scripted(make_sched(), req("a", 5, 4, eos=(2,), ignore_eos=True), [2, 2, 2, 2, 2])
    assert r.output_ids == [2, 2, 2, 2] and r.finish_reason == "length"
    r = scripted(make_sched(), req("a", 5, 10, eos=(2,), ignore_eos=True, stop_token_ids=[7]), [2, 3, 7, 1])
    assert r.output_ids == [2, 3, 7] and r.finish_reason == "stop"
    r = scripted(make_sched(), req("a", 5, 3), [4, 4, 4, 4])
    assert r.output_ids == [4, 4, 4] and r.finish_reason == "length"


def test_max_model_len_finishes_with_length():
    s = make_sched(max_model_len=14)
    log, _ = drive(s, {0: [r := req("a", 10, 100)]})
    assert len(r.output_ids) == 4 and r.finish_reason == "length" and r.num_tokens == 14
    assert max(st["a"][0] + st["a"][1] for st, _ in log) <= 14
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(req("b", 15))


def test_first_token_time_comes_from_the_clock_and_is_set_once():
    s = make_sched(chunk_size=4)
    r = req("a", 10, 3)
    s.add(r)
    runner = FakeRunner(s)
    times = []
    while s.has_unfinished():
        out = s.schedule()
        s.update(out, runner(out))
        times.append(r.first_token_time)
    assert times[:2] == [None, None] and times[2] is not None and len(set(times[2:])) == 1


def test_engine_finish_max_tokens_zero_and_duplicate_ids():
    s = make_sched(parallel=1)
    s.add(a := req("a", 5, 10))
    s.add(b := req("b", 5, 10))
    with pytest.raises(ValueError, match="already"):
        s.add(req("a", 5))
    s.add(z := req("z", 5, 0))
    assert z.finish_reason == "length" and s.has_unfinished()
    out = s.schedule()
    assert out.finished == [z]
    assert s.finish("a", "stop") and a.finish_reason == "stop" and a.slot is None
    assert s.update(out, {"a": 3}) == [z] and a.output_ids == []  # a's chunk is ignored
    assert s.schedule().chunks[0].request is b and b.slot == 0
    with pytest.raises(ValueError):
        s.finish("b", "done")


# ---------------------------------------------------------------- no torch


def test_scheduler_and_allocator_never_import_torch():
    files = list((REPO / "strata" / "sched").glob("*.py")) + list((REPO / "strata" / "kvcache").glob("allocator*.py"))
    assert len(files) >= 3
    for f in files:
        assert "import torch" not in f.read_text(), f
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import strata.kvcache, strata.kvcache.allocator, strata.sched, strata.sched.request, strata.sched.scheduler\n"
        "from strata.sched import Scheduler, SchedulerConfig, Request\n"
        "from strata.params import SamplingParams\n"
        "s = Scheduler(SchedulerConfig(num_blocks=8, max_model_len=64, block_size=4))\n"
        "s.add(Request('a', [1, 2, 3], SamplingParams(max_tokens=2)))\n"
        "out = s.schedule()\n"
        "assert s.update(out, {'a': 5}) == [] and s.schedule().chunks[0].start == 3\n"
        "assert sys.modules['torch'] is None\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_batch_groups_decode_in_turn():
    from strata.kvcache.allocator import BlockAllocator
    from strata.params import SamplingParams
    from strata.sched.request import Request
    from strata.sched.scheduler import Scheduler, SchedulerConfig

    cfg = SchedulerConfig(parallel=4, num_blocks=64, max_model_len=256, batch_groups=2)
    s = Scheduler(cfg, BlockAllocator(64, 16))
    for i in range(4):
        s.add(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True)))
    out = s.schedule()  # the four reads (reads are not grouped)
    s.update(out, {c.request.request_id: 7 for c in out.chunks if c.sample})
    seen = []
    for _ in range(4):
        out = s.schedule()
        seen.append(sorted(c.request.slot for c in out.chunks))
        s.update(out, {c.request.request_id: 7 for c in out.chunks if c.sample})
    assert seen == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # A group with nothing to decode is skipped.
    for r in list(s.running):
        if r.slot % 2 == 1:
            s.abort(r.request_id)
    assert [sorted(c.request.slot for c in s.schedule().chunks)] == [[0, 2]]


def test_long_read_is_not_starved_by_a_stream_of_short_reads():
    from strata.kvcache.allocator import BlockAllocator
    from strata.params import SamplingParams
    from strata.sched.request import Request
    from strata.sched.scheduler import Scheduler, SchedulerConfig

    cfg = SchedulerConfig(parallel=2, num_blocks=512, max_model_len=4096, chunk_size=64,
                          max_num_batched_tokens=128, max_hold_steps=3)
    s = Scheduler(cfg, BlockAllocator(512, 16))
    s.add(Request("long", list(range(2000)), SamplingParams(max_tokens=1)))
    progress = []
    for i in range(40):
        # A new 30-token request every step (it reads, samples and finishes: max_tokens=1).
        s.add(Request(f"s{i}", [1] * 30, SamplingParams(max_tokens=1)))
        out = s.schedule()
        s.update(out, {c.request.request_id: 5 for c in out.chunks if c.sample})
        progress.append(s.get("long").num_computed_tokens if s.get("long") else 2000)
    # Held at most 3 steps in a row, then one chunk: the long read advances every 4 steps at least.
    assert all(progress[i + 4] > progress[i] for i in range(len(progress) - 4) if progress[i] < 2000)
    assert s.give_ways_total >= 5


# ---------------------------------------------------------------- overlapped steps (batch groups)


def drive_overlapped(sched: Scheduler, arrivals=None, max_steps=4000):
    """Like drive(), but each step is scheduled (and "computed") before the previous one's update, as
    the engine does with batch groups. Returns {rid: output_ids} of the finished requests."""
    arrivals = dict(arrivals or {})
    runner = FakeRunner(sched)
    pending = None
    outputs = {}
    for step in range(max_steps):
        for r in arrivals.pop(step, []):
            sched.add(r)
        if not sched.has_unfinished() and not arrivals and pending is None:
            return outputs
        out = sched.schedule()
        check_step(sched, out)
        if pending is not None:
            assert not {c.request.request_id for c in out.chunks} & {c.request.request_id for c in pending[0].chunks}
            assert not {r.request_id for r in out.preempted} & {c.request.request_id for c in pending[0].chunks}
        sampled = runner(out)
        if pending is not None:
            for r in sched.update(*pending):
                outputs[r.request_id] = list(r.output_ids)
        pending = (out, sampled) if out.chunks or out.finished else None
    raise AssertionError("scheduler did not drain")


@pytest.mark.parametrize("num_blocks", [1024, 24])
def test_overlapped_steps_give_the_same_tokens(num_blocks):
    def reqs():
        return [req(f"r{i}", 40 + 37 * i, max_tokens=30) for i in range(6)]

    arrivals = {0: reqs()[:4], 9: reqs()[4:]}
    plain = make_sched(parallel=4, batch_groups=2, chunk_size=32, num_blocks=num_blocks, max_model_len=512)
    _, done = drive(plain, arrivals)
    expected = {r.request_id: r.output_ids for rs in arrivals.values() for r in rs}
    arrivals = {0: reqs()[:4], 9: reqs()[4:]}
    s = make_sched(parallel=4, batch_groups=2, chunk_size=32, num_blocks=num_blocks, max_model_len=512)
    got = drive_overlapped(s, arrivals)
    assert got == expected and len(got) == 6
    if num_blocks == 24:
        assert s.preemptions_total > 0  # the small pool forced preemptions, deferred past their flight
    assert s.kv_blocks_used == 0 and s.slots_busy == 0


def test_in_flight_request_is_neither_rescheduled_nor_preempted():
    s = make_sched(parallel=2, batch_groups=2, num_blocks=3, block_size=16, max_model_len=64)
    a, b = req("a", 15, max_tokens=40), req("b", 15, max_tokens=40)
    s.add(a)
    out_a = s.schedule()  # a reads, and is in flight
    s.add(b)
    out_b = s.schedule()  # b reads; a must not appear
    assert [c.request.request_id for c in out_a.chunks] == ["a"]
    assert [c.request.request_id for c in out_b.chunks] == ["b"]
    assert s.schedule().chunks == []  # both in flight: nothing to do
    s.update(out_a, {"a": 5})
    out = s.schedule()  # a decodes position 15, still in its first block
    assert [(c.request.request_id, c.start) for c in out.chunks] == [("a", 15)]
    s.update(out, {"a": 6})
    # Position 16 needs a second block; the pool (2 usable blocks) is full and the newest request, b,
    # is in flight: it is marked, not preempted, and a waits a step.
    out = s.schedule()
    assert out.chunks == [] and out.preempted == [] and b.status is RequestStatus.RUNNING and b.block_ids
    s.update(out_b, {"b": 7})
    out = s.schedule()  # b's step is back: now it is preempted and a gets its block
    assert [r.request_id for r in out.preempted] == ["b"] and b.status is RequestStatus.PREEMPTED
    assert [(c.request.request_id, c.start) for c in out.chunks] == [("a", 16)]
    assert b.output_ids == [7] and not b.block_ids
