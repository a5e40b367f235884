"""Read-ahead (`read_ahead`, pipeline stages): one prompt's next chunks are scheduled while its earlier
ones are in flight, up to one per stage, none of them sampling; the positions in flight are counted on
the request. Pure Python, with test_scheduler's fake runner, which "computes" each step when it is
scheduled (as the stages run their steps in order) and checks every earlier position's K/V first."""

from __future__ import annotations

from collections import deque

import pytest

from strata.sched import RequestStatus, SchedulerConfig
from test_scheduler import FakeRunner, make_sched, req


def chunks_of(out) -> list[tuple[str, int, int, bool]]:
    return [(c.request.request_id, c.start, c.num_tokens, c.sample) for c in out.chunks]


def check_flights(sched, out, flights) -> int:
    """Invariants after a schedule(), `flights` holding the steps not applied yet (without `out`);
    returns the most chunks one request has in flight."""
    cfg = sched.config
    owned = [b for r in sched.running for b in r.block_ids]
    assert len(owned) == len(set(owned)) == sched.allocator.num_used
    assert len(sched.running) <= cfg.parallel and out.num_batched_tokens <= cfg.max_num_batched_tokens
    per: dict[str, list] = {}
    for o, _ in list(flights) + [(out, None)]:
        for c in o.chunks:
            per.setdefault(c.request.request_id, []).append(c)
    most = 0
    for chunks in per.values():
        r = chunks[0].request
        if r.status is not RequestStatus.RUNNING:
            continue  # aborted with chunks in flight: they come back to nothing
        assert r.num_in_flight_chunks == len(chunks) <= cfg.read_ahead
        assert r.num_in_flight_tokens == sum(c.num_tokens for c in chunks)
        # Consecutive, from the first position not computed yet; with more than one, none samples.
        ends = [r.num_computed_tokens] + [c.end for c in chunks[:-1]]
        assert [c.start for c in chunks] == ends
        assert len(chunks) == 1 or not any(c.sample or c.drafts for c in chunks)
        assert len(r.block_ids) >= sched.allocator.blocks_for(chunks[-1].end)
        most = max(most, len(chunks))
    for r in out.preempted:
        assert r.request_id not in per and r.num_in_flight_chunks == r.num_in_flight_tokens == 0
    return most


def drive_pipelined(sched, arrivals, depth: int, max_steps: int = 4000):
    """Up to `depth` steps out at once, as the engine has with stages (1: each applied before the next is
    scheduled): each step is computed when it is scheduled, and the oldest is applied once `depth` are
    out or when nothing new was scheduled. Returns ({rid: output_ids} of finished requests, the most chunks of one
    request in flight at once)."""
    arrivals = dict(arrivals)
    runner = FakeRunner(sched)
    flights: deque = deque()
    outputs, most = {}, 0
    for step in range(max_steps):
        for r in arrivals.pop(step, []):
            sched.add(r)
        if not sched.has_unfinished() and not arrivals and not flights:
            return outputs, most
        out = sched.schedule()
        most = max(most, check_flights(sched, out, flights))
        launched = bool(out.chunks or out.finished)
        if launched:
            flights.append((out, runner(out)))
        if flights and (not launched or len(flights) >= depth):
            for r in sched.update(*flights.popleft()):
                outputs[r.request_id] = list(r.output_ids)
    raise AssertionError("scheduler did not drain")


def test_a_lone_long_read_has_its_chunks_in_flight_one_per_stage_and_the_sampling_chunk_waits():
    s = make_sched(chunk_size=64, read_ahead=2)
    a = req("a", 300, max_tokens=3)
    s.add(a)
    runner = FakeRunner(s)
    first, second = s.schedule(), s.schedule()
    assert chunks_of(first) == [("a", 0, 64, False)] and chunks_of(second) == [("a", 64, 64, False)]
    assert (a.num_computed_tokens, a.num_in_flight_tokens, a.num_in_flight_chunks) == (0, 128, 2)
    assert s.schedule().chunks == []  # two in flight: as many as stages
    s.update(first, runner(first))
    assert (a.num_computed_tokens, a.num_in_flight_tokens, a.num_in_flight_chunks) == (64, 64, 1)
    third = s.schedule()
    assert chunks_of(third) == [("a", 128, 64, False)]
    s.update(second, runner(second))
    fourth = s.schedule()  # 108 positions left from 192: this chunk cannot reach the last one
    assert chunks_of(fourth) == [("a", 192, 64, False)]
    s.update(third, runner(third))
    # 44 left from 256: the chunk would sample, so it waits until everything before it is applied.
    assert s.schedule().chunks == [] and a.num_in_flight_chunks == 1
    s.update(fourth, runner(fourth))
    last = s.schedule()
    assert chunks_of(last) == [("a", 256, 44, True)] and a.num_in_flight_tokens == 44
    assert s.schedule().chunks == []  # a sampling chunk in flight: nothing follows it
    s.update(last, runner(last))
    assert (a.num_computed_tokens, a.num_in_flight_tokens, a.num_in_flight_chunks) == (300, 0, 0)
    assert len(a.output_ids) == 1 and chunks_of(s.schedule()) == [("a", 300, 1, True)]


def test_three_stages_three_chunks():
    s = make_sched(chunk_size=32, read_ahead=3)
    s.add(req("a", 200))
    outs = [s.schedule() for _ in range(4)]
    assert [chunks_of(o) for o in outs[:3]] == [[("a", 0, 32, False)], [("a", 32, 32, False)], [("a", 64, 32, False)]]
    assert outs[3].chunks == []


def test_without_read_ahead_the_next_chunk_waits():
    s = make_sched(chunk_size=64)
    s.add(req("a", 300))
    assert chunks_of(s.schedule()) == [("a", 0, 64, False)] and s.schedule().chunks == []


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("num_blocks", [1024, 40])
def test_pipelined_read_ahead_gives_the_tokens_of_steps_in_turn(depth, num_blocks):
    """Long and short reads arriving while others decode, two batch groups, and with a small pool
    preemptions: the fake model's tokens (each depends on the whole context it was computed from) are
    those of steps scheduled and applied one at a time."""
    def reqs():
        return [req(f"r{i}", n, max_tokens=12) for i, n in enumerate((300, 20, 170, 9, 260, 40))]

    cfg = dict(parallel=4, batch_groups=2, chunk_size=32, max_num_batched_tokens=48, num_blocks=num_blocks,
               max_model_len=512)
    arrivals = {0: [0, 1], 3: [2, 3], 9: [4, 5]}
    rs = reqs()
    want, most = drive_pipelined(make_sched(**cfg), {k: [rs[i] for i in v] for k, v in arrivals.items()}, 1)
    assert most == 1
    rs = reqs()
    s = make_sched(**cfg, read_ahead=depth)
    got, most = drive_pipelined(s, {k: [rs[i] for i in v] for k, v in arrivals.items()}, depth)
    assert got == want and len(got) == 6
    assert most == depth  # some read had a chunk on every stage
    assert s.give_ways_total >= 1
    if num_blocks == 40:
        assert s.preemptions_total >= 1
    assert s.kv_blocks_used == 0 and s.slots_busy == 0
    assert all(r.num_in_flight_chunks == r.num_in_flight_tokens == 0 for r in rs)


def test_a_long_read_reading_ahead_still_gives_way_to_a_short_request():
    s = make_sched(chunk_size=64, read_ahead=2, parallel=2)
    long = req("long", 1000)
    s.add(long)
    runner = FakeRunner(s)
    first, second = s.schedule(), s.schedule()
    s.add(req("short", 10))
    s.update(first, runner(first))
    out = s.schedule()  # the short read goes; the long one, with a chunk in flight, holds back
    assert chunks_of(out) == [("short", 0, 10, True)] and long.give_ways == 1
    s.update(second, runner(second))
    s.update(out, runner(out))
    assert chunks_of(s.schedule()) == [("short", 10, 1, True), ("long", 128, 64, False)]


def test_a_read_ahead_chunk_takes_free_blocks_only_and_an_in_flight_victim_waits_for_all_its_chunks():
    s = make_sched(chunk_size=32, read_ahead=2, parallel=2, num_blocks=11, block_size=16, max_model_len=512)
    runner = FakeRunner(s)
    dec = req("dec", 20, max_tokens=50)
    s.add(dec)
    out = s.schedule()
    s.update(out, runner(out))  # dec holds 2 blocks and decodes
    long = req("long", 200)
    s.add(long)
    # Steps as the engine launches them: each before the previous one is applied.
    a = s.schedule()  # dec decodes, long reads [0, 32)
    assert chunks_of(a) == [("dec", 20, 1, True), ("long", 0, 32, False)]
    b = s.schedule()  # long reads ahead [32, 64): 2 + 2 + 2 of the 10 usable blocks
    assert chunks_of(b) == [("long", 32, 32, False)]
    s.update(a, runner(a))
    c = s.schedule()
    assert chunks_of(c) == [("dec", 21, 1, True), ("long", 64, 32, False)]
    s.update(b, runner(b))
    d = s.schedule()  # [96, 128) ahead: the last 2 free blocks
    assert chunks_of(d) == [("long", 96, 32, False)] and s.allocator.num_free == 0
    s.update(c, runner(c))
    e = s.schedule()  # [128, 160) would need blocks: none free, and a chunk read ahead preempts nobody
    assert chunks_of(e) == [("dec", 22, 1, True)] and e.preempted == [] and long.num_in_flight_chunks == 1
    s.update(d, runner(d))
    s.update(e, runner(e))
    # Nothing in flight for long now: its chunk preempts the newest admission, long itself.
    f = s.schedule()
    assert [r.request_id for r in f.preempted] == ["long"] and long.num_computed_tokens == 0
    assert chunks_of(f) == [("dec", 23, 1, True)]

    # The victim in flight: dec, older, needs a block while long (the newest) has two chunks out.
    s = make_sched(chunk_size=32, read_ahead=3, parallel=2, num_blocks=7, block_size=16, max_model_len=512)
    runner = FakeRunner(s)
    dec = req("dec", 31, max_tokens=50)
    s.add(dec)
    out = s.schedule()
    s.update(out, runner(out))  # 31 positions: 2 blocks, the next decode fits
    long = req("long", 200)
    s.add(long)
    a = s.schedule()
    b = s.schedule()
    assert chunks_of(a) == [("dec", 31, 1, True), ("long", 0, 32, False)] and chunks_of(b) == [("long", 32, 32, False)]
    s.update(a, runner(a))
    c = s.schedule()  # dec's position 32 needs a third block: none free, long is in flight
    assert c.chunks == [] and c.preempted == [] and long.status is RequestStatus.RUNNING
    s.update(c, {})
    assert s.schedule().chunks == []  # long, marked, reads no further ahead and dec still waits
    s.update(b, runner(b))
    d = s.schedule()  # every chunk of long applied: now it is preempted and dec decodes
    assert [r.request_id for r in d.preempted] == ["long"] and chunks_of(d) == [("dec", 32, 1, True)]
    assert (long.num_computed_tokens, long.num_in_flight_chunks, long.num_in_flight_tokens) == (0, 0, 0)


def test_an_abort_with_chunks_in_flight_frees_at_once_and_their_results_are_dropped():
    s = make_sched(chunk_size=64, read_ahead=2)
    a = req("a", 300)
    s.add(a)
    first, second = s.schedule(), s.schedule()
    assert s.abort("a") and s.kv_blocks_used == 0 and s.slots_busy == 0
    s.update(first, {})
    s.update(second, {})
    assert a.num_computed_tokens == 0 and a.num_in_flight_chunks == a.num_in_flight_tokens == 0
    assert not s.has_unfinished()


def test_the_concurrent_reads_lane_does_not_read_ahead():
    s = make_sched(chunk_size=64, read_ahead=2, read_lane=True)
    s.add(req("a", 300))
    assert chunks_of(s.schedule("read")) == [("a", 0, 64, False)]
    assert s.schedule("read").chunks == [] and s.schedule("decode").chunks == []


def test_read_ahead_is_checked():
    with pytest.raises(ValueError, match="read_ahead"):
        SchedulerConfig(num_blocks=8, max_model_len=64, read_ahead=0)
    with pytest.raises(ValueError, match="run_ahead"):
        SchedulerConfig(num_blocks=8, max_model_len=64, read_ahead=2, run_ahead=True)
