"""The scheduler's lanes (the concurrent read): reads and decodes scheduled apart, a read step in flight
for several decode steps, with the fake runner of tests/sched/test_scheduler.py checking every position."""

from __future__ import annotations

import pytest

from test_scheduler import FakeRunner, drive, make_sched, req
from strata.sched import Scheduler


def drive_lanes(sched: Scheduler, arrivals, read_steps: int = 3, max_steps=5000):
    """Concurrent reads: a read step stays in flight for `read_steps` decode steps (its own stage),
    while the decode lane is scheduled and updated every step. Returns ({rid: output}, finish order)."""
    arrivals = dict(arrivals)
    runner = FakeRunner(sched)
    outputs, order, read = {}, [], None  # read: (out, sampled, steps left)
    for step in range(max_steps):
        for r in arrivals.pop(step, []):
            sched.add(r)
        if not sched.has_unfinished() and not arrivals and read is None:
            return outputs, order
        if read is not None and read[2] == 0:
            for r in sched.update(read[0], read[1]):
                outputs[r.request_id] = list(r.output_ids)
                order.append(r.request_id)
            read = None
        if read is None:
            out_r = sched.schedule("read")
            assert all(c.request.remaining_read > 1 for c in out_r.chunks)
            read = (out_r, runner(out_r), read_steps) if out_r.chunks or out_r.finished else None
        out = sched.schedule("decode")
        assert all(c.request.remaining_read == 1 for c in out.chunks)
        if read is not None:
            assert not {c.request.request_id for c in out.chunks} & {c.request.request_id for c in read[0].chunks}
            read = (read[0], read[1], read[2] - 1)
        for r in sched.update(out, runner(out)):
            outputs[r.request_id] = list(r.output_ids)
            order.append(r.request_id)
    raise AssertionError("scheduler did not drain")


@pytest.mark.parametrize("num_blocks", [1024, 24])
def test_read_lane_gives_the_same_tokens(num_blocks):
    def reqs():
        return [req(f"r{i}", 30 + 61 * i, max_tokens=20) for i in range(5)]

    kw = dict(parallel=3, chunk_size=32, max_num_batched_tokens=64, num_blocks=num_blocks, max_model_len=512)
    arrivals = {0: reqs()[:3], 7: reqs()[3:]}
    _, _ = drive(make_sched(**kw), arrivals)
    expected = {r.request_id: r.output_ids for rs in arrivals.values() for r in rs}
    s = make_sched(read_lane=True, **kw)
    got, _ = drive_lanes(s, {0: reqs()[:3], 7: reqs()[3:]})
    assert got == expected and len(got) == 5
    if num_blocks == 24:
        assert s.preemptions_total > 0
    assert s.kv_blocks_used == 0 and s.slots_busy == 0


def test_read_lane_gives_way_to_a_short_request():
    s = make_sched(read_lane=True, parallel=2, chunk_size=32, max_num_batched_tokens=32)
    got, order = drive_lanes(s, {0: [req("long", 600, max_tokens=4)], 3: [req("short", 10, max_tokens=4)]})
    assert order == ["short", "long"] and s.give_ways_total >= 1
    plain = make_sched(parallel=2, chunk_size=32, max_num_batched_tokens=32)
    _, _ = drive(plain, {0: [long_ := req("long", 600, max_tokens=4)], 3: [short := req("short", 10, max_tokens=4)]})
    assert got == {"long": long_.output_ids, "short": short.output_ids}


def test_lanes_are_checked():
    with pytest.raises(ValueError, match="lane"):
        make_sched().schedule("read")
    with pytest.raises(ValueError, match="lane"):
        make_sched(read_lane=True).schedule()
