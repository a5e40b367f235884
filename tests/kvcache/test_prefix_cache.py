"""Automatic prefix caching: the scheduler with a fake runner (shared blocks checked by content), then
the engine on the embedded model (fp32, CPU: greedy output identical with the cache on and off), then
the server (/metrics counters, usage.prompt_tokens_details.cached_tokens through the openai client)."""

from __future__ import annotations

import time

import pytest

from strata.kvcache import NULL_BLOCK
from strata.params import SamplingParams
from strata.sched import Request
from strata.sched.scheduler import PENDING_TOKEN
from test_scheduler import make_sched, next_token, req

# ---------------------------------------------------------------- scheduler


class ContentRunner:
    """A paged fake "KV cache" whose entry at a position names its content, (position, the tokens up to
    it): a block shared by requests must hold exactly what each of them would have written. Writes
    into a block that is shared or registered fail (shared blocks are read-only). Steps may be
    pipelined: a pending first input is the token the request's previous launched step sampled."""

    def __init__(self, sched):
        self.sched, self.bs = sched, sched.config.block_size
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}
        self.last: dict[str, int] = {}

    def _at(self, r, pos):
        return r.block_ids[pos // self.bs], pos % self.bs

    def __call__(self, out) -> dict[str, int]:
        sampled, alloc = {}, self.sched.allocator
        for c in out.chunks:
            r = c.request
            ctx = r.all_ids[: c.start]
            for pos in range(c.start):
                assert self.kv[self._at(r, pos)] == (pos, hash(tuple(ctx[: pos + 1]))), (r, pos)
            inputs = c.token_ids
            if c.pending:
                assert inputs[0] == PENDING_TOKEN
                inputs = [self.last[r.request_id]] + inputs[1:]
            for i, tok in enumerate(inputs):
                ctx.append(tok)
                block, off = self._at(r, c.start + i)
                assert alloc.refcount(block) == 1 and alloc.key_of(block) is None, f"{r} wrote shared block {block}"
                self.kv[(block, off)] = (c.start + i, hash(tuple(ctx)))
            if c.sample:
                sampled[r.request_id] = self.last[r.request_id] = next_token(ctx)
        return sampled


def check_shared(sched) -> None:
    tables = [r.block_ids for r in sched.running]
    owned = [b for t in tables for b in t]
    assert NULL_BLOCK not in owned and len(set(owned)) == sched.allocator.num_used
    for b in set(owned):
        assert sched.allocator.refcount(b) == owned.count(b)
    for t in tables:
        assert len(t) == len(set(t))


def drive(sched, arrivals, *, pipelined=False, mtp=False, max_steps=3000):
    """Run to completion (pipelined: step t is launched before step t-1's update, as async scheduling
    does). mtp: blocks are registered by cache_blocks() after each update, as the engine does with the
    drafter. Returns {rid: [(start, n)] of its chunks}, preempted ids."""
    arrivals = dict(arrivals)
    if not hasattr(sched, "content_runner"):  # kept across drives: later requests read earlier ones' K/V
        sched.content_runner = ContentRunner(sched)
    runner, previous = sched.content_runner, None
    chunks: dict[str, list[tuple[int, int]]] = {}
    preempted: list[str] = []
    for step in range(max_steps):
        for r in arrivals.pop(step, []):
            sched.add(r)
        if not sched.has_unfinished() and not arrivals and previous is None:
            return chunks, preempted
        out = sched.schedule()
        check_shared(sched)
        preempted += [r.request_id for r in out.preempted]
        for c in out.chunks:
            chunks.setdefault(c.request.request_id, []).append((c.start, c.num_tokens))
        launched = (out, runner(out))
        if not pipelined:
            previous, launched = launched, None
        if previous is not None:
            for r in sched.update(*previous):
                assert r.is_finished and r.slot is None and not r.block_ids
            if mtp:
                for c in previous[0].chunks:
                    sched.cache_blocks(c.request, c.request.num_computed_tokens)
        previous = launched if launched and (launched[0].chunks or launched[0].finished) else None
    raise AssertionError("scheduler did not drain")


def follow_up(first: Request, rid: str, extra: int, max_tokens=4) -> Request:
    """The next turn of a conversation: the first request's tokens and its reply, then new ones."""
    return Request(rid, first.all_ids + [7 + i for i in range(extra)], SamplingParams(max_tokens=max_tokens))


def reference(make, **cfg) -> dict[str, list[int]]:
    reqs = make()
    s = make_sched(**cfg)
    drive(s, {i: [r] for i, r in enumerate(reqs)})
    return {r.request_id: r.output_ids for r in reqs}


def test_a_follow_up_starts_after_the_cached_blocks_and_shares_them():
    s = make_sched(prefix_cache=True, block_size=4, chunk_size=8, parallel=3)
    a = req("a", 30, max_tokens=3)  # 33 tokens, 32 computed: 8 full blocks cached
    chunks, _ = drive(s, {0: [a]})
    assert chunks["a"][0] == (0, 8) and s.allocator.num_cached == 8
    b, c = follow_up(a, "b", 5), follow_up(a, "c", 9)
    exact = Request("d", a.all_ids[:32], SamplingParams(max_tokens=2))  # all 8 blocks match: 7 are taken
    chunks, _ = drive(s, {0: [b, c, exact]})
    assert chunks["b"][0][0] == chunks["c"][0][0] == 32 and chunks["d"][0] == (28, 4)
    assert (b.num_cached_tokens, c.num_cached_tokens, exact.num_cached_tokens) == (32, 32, 28)
    assert (s.prefix_queries_total, s.prefix_hits_total, s.prefix_cached_tokens_total) == (4, 3, 92)
    cold = make_sched(block_size=4, chunk_size=8, parallel=3)
    b2, c2, d2 = follow_up(a, "b", 5), follow_up(a, "c", 9), Request("d", a.all_ids[:32], SamplingParams(max_tokens=2))
    chunks, _ = drive(cold, {0: [b2, c2, d2]})
    assert chunks["b"][0] == (0, 8) and cold.allocator.num_cached == 0 and b2.num_cached_tokens is None
    assert (b.output_ids, c.output_ids, exact.output_ids) == (b2.output_ids, c2.output_ids, d2.output_ids)
    assert s.allocator.num_used == 0


def test_requests_reading_the_same_prompt_at_once_stay_correct_and_later_ones_hit():
    make = lambda: [req("p", 40, max_tokens=6) for _ in range(1)] + [  # noqa: E731
        Request(f"q{i}", req("p", 40).prompt_ids + [i + 1] * 3, SamplingParams(max_tokens=6)) for i in range(4)]
    expected = reference(make, block_size=4, chunk_size=16, parallel=4)
    reqs = make()
    s = make_sched(prefix_cache=True, block_size=4, chunk_size=16, parallel=4)
    chunks, _ = drive(s, {0: reqs[:3], 1: reqs[3:4], 9: reqs[4:]})
    assert {r.request_id: r.output_ids for r in reqs} == expected
    assert chunks["q3"][0][0] == 40  # arrived after the first reads finished: 10 blocks from the cache


def test_eviction_under_pool_pressure_takes_least_recently_used_blocks_and_never_preempts_for_them():
    s = make_sched(prefix_cache=True, block_size=4, chunk_size=64, num_blocks=13)  # 12 usable blocks
    a = req("a", 20, max_tokens=1)
    drive(s, {0: [a]})
    assert s.allocator.num_cached == 5
    big = req("big", 36, max_tokens=4)  # 10 blocks: 7 free plain ones, then the 3 least recent cached
    _, preempted = drive(s, {0: [big]})
    assert not preempted and big.finish_reason == "length"
    again = Request("a2", a.prompt_ids + [3], SamplingParams(max_tokens=1))
    chunks, _ = drive(s, {0: [again]})
    assert chunks["a2"][0][0] == 8  # a's head blocks survived; its tail was evicted first


@pytest.mark.parametrize("num_blocks", [11, 13])
def test_a_preempted_request_recomputes_from_its_own_cached_blocks(num_blocks):
    def make():
        return [req("a", 4, 12, ignore_eos=True), req("b", 4, 12, ignore_eos=True), req("c", 24, 6, ignore_eos=True)]

    expected = reference(make, block_size=4, parallel=3)
    reqs = make()
    s = make_sched(prefix_cache=True, block_size=4, parallel=3, num_blocks=num_blocks)
    chunks, preempted = drive(s, {0: reqs})
    assert preempted == ["c"] and s.preemptions_total == 1
    # c's head blocks outlived the preemption (its tail went first): the recompute starts after them.
    restart = next(start for start, n in chunks["c"][1:] if n > 1)
    assert restart >= 8 and restart % 4 == 0
    assert {r.request_id: r.output_ids for r in reqs} == expected


@pytest.mark.parametrize("num_blocks", [1024, 30])
def test_pipelined_run_ahead_with_the_cache_gives_the_same_tokens(num_blocks):
    def make():
        base = req("base", 37, 1).prompt_ids
        return [Request(f"r{i}", base + [i + 1] * (3 + 11 * i), SamplingParams(max_tokens=12)) for i in range(6)]

    expected = reference(make, block_size=4, chunk_size=16, parallel=3)
    reqs = make()
    s = make_sched(prefix_cache=True, block_size=4, chunk_size=16, parallel=3, run_ahead=True, num_blocks=num_blocks)
    drive(s, {0: reqs[:3], 20: reqs[3:]}, pipelined=True)
    assert {r.request_id: r.output_ids for r in reqs} == expected
    assert s.prefix_hits_total >= (3 if num_blocks > 100 else 2) and s.allocator.num_used == 0
    if num_blocks < 100:
        assert s.preemptions_total > 0


def test_with_mtp_keys_take_the_next_token_and_blocks_wait_for_cache_blocks():
    s = make_sched(prefix_cache=True, prefix_with_mtp=True, block_size=4, chunk_size=64, parallel=2)
    a = req("a", 30, max_tokens=1)
    drive(s, {0: [a]})
    assert s.allocator.num_cached == 0  # update() registers nothing: the MTP K/V are not known to be there
    drive(s, {0: [req("a", 30, max_tokens=3)]}, mtp=True)
    assert s.allocator.num_cached == 7  # 32 positions computed; block 7 waits for token 32's successor
    same_next = Request("b", a.prompt_ids[:29] + [5, 6], SamplingParams(max_tokens=1))
    other_next = Request("c", a.prompt_ids[:28] + [a.prompt_ids[28] + 1, 5], SamplingParams(max_tokens=1))
    chunks, _ = drive(s, {0: [same_next, other_next]}, mtp=True)
    assert chunks["b"][0][0] == 28 and chunks["c"][0][0] == 24  # block 6's key holds token 28


# ---------------------------------------------------------------- engine (embedded model, fp32, CPU)

FILLER = open(__file__.replace("tests/kvcache/test_prefix_cache.py", "strata/assets/default-model/README.md")).read()
TURN1 = [FILLER[:400], FILLER[900:1250]]
TURN2 = " Now say that again, briefly."


def cached_kv(e, ids: list[int], limit: int | None = None) -> tuple[list[int], list]:
    """The blocks (at most `limit`) a request with prompt `ids` would take from the cache, and their K/V
    in every layer (the MTP layer's too)."""
    import torch

    from strata.kvcache.prefix import PrefixKeys

    s = e.scheduler
    keys = PrefixKeys(s.config.block_size, s._salt, s.config.prefix_with_mtp).extend(lambda a, b: ids[a:b], len(ids))
    blocks = e.allocator.lookup(keys[: min((len(ids) - 1) // s.config.block_size, len(ids) if limit is None else limit)])
    e.allocator.free(blocks)
    bs = s.config.block_size
    slots = torch.tensor([b * bs + o for b in blocks for o in range(bs)], dtype=torch.long)
    layers = range(e.pool.num_layers)
    return blocks, [[t.tolist() for t in e.pool.gather(layer, slots, torch.float32)] for layer in layers]


def converse(n: int = 1, **kw):
    """Two conversations (each with n choices) of two turns: turn 2 re-sends turn 1 and the first
    choice's reply, then a new question; its requests come in reverse order, so each takes the other
    conversation's slot. Returns ({rid: tokens}, {rid: cached tokens}, engine); `engine.turn2_spec`:
    the turn-2 requests' draft statistics (with speculation)."""
    from strata.config import EngineConfig
    from strata.engine.engine import LLMEngine
    from strata.engine.types import EngineRequest

    cfg = dict(device="cpu", ctx=1024, parallel=4, chunk_size=256, max_num_batched_tokens=512)
    e = LLMEngine(EngineConfig(**{**cfg, **kw}), progress=False)
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    spec: dict[str, dict | None] = {}

    def turn(prompts: dict[str, list[int]]) -> None:
        for rid, ids in prompts.items():
            for j in range(n):
                e.add_request(EngineRequest(f"{rid}.{j}", tuple(ids), SamplingParams(max_tokens=4, ignore_eos=True),
                                            time.monotonic()))
        for rid, evs in e.run_to_completion().items():
            tokens[rid] = [t for ev in evs for t in ev.token_ids]
            cached[rid] = evs[-1].cached_tokens
            spec[rid] = evs[-1].spec

    first = {f"c{i}t1": e.tokenizer.encode(p) for i, p in enumerate(TURN1)}
    turn(first)
    second = {f"c{i}t2": ids + tokens[f"c{i}t1.0"] + e.tokenizer.encode(TURN2) for i, ids in enumerate(first.values())}
    before = {rid: cached_kv(e, ids) for rid, ids in second.items()}
    turn(dict(reversed(second.items())))
    for rid, (blocks, kv) in before.items():  # turn 2 read the cached blocks and wrote none of them
        assert len(blocks) * e.cfg.block_size == cached[f"{rid}.0"]
        if e.cfg.kv_size is None:  # (a small pool may evict them once turn 2 is done with them)
            assert cached_kv(e, second[rid], len(blocks)) == (blocks, kv)
    turn2 = [spec[rid] for rid in spec if "t2" in rid and spec[rid]]
    e.turn2_spec = sum(d["drafts_accepted"] for d in turn2) / max(1, sum(d["drafts_proposed"] for d in turn2))
    return tokens, cached, e


@pytest.fixture(scope="module")
def cold():
    """The reference: the prefix cache off, room for everything, no speculation."""
    tokens, cached, e = converse(n=2, prefix_cache=False)
    assert set(cached.values()) == {0} and e.stats().prefix_cache_queries_total == 0
    return tokens


def test_engine_multi_turn_and_n2_identical_with_the_cache_and_turn_2_reads_only_the_new_tokens(cold):
    tokens, cached, e = converse(n=2)
    assert tokens == cold
    for c in ("c0", "c1"):
        assert cached[f"{c}t1.0"] == 0
        # Turn 2: its whole turn-1 prefix but the block holding turn 1's last token (never computed).
        assert cached[f"{c}t2.0"] >= len(e.tokenizer.encode(TURN1[int(c[1])])) + 4 - 2 * e.cfg.block_size
    st = e.stats()
    assert st.prefix_cache_queries_total == 8 and st.prefix_cache_hits_total >= 4
    assert st.prefix_cache_cached_tokens_total == sum(cached.values())


@pytest.mark.parametrize("kw", [dict(n=2, async_scheduling=True, kv_size=192),  # run-ahead, a small pool
                                dict(spec=2, batch_mtp=True, batch_groups=2)])  # overlapped groups, MTP
def test_engine_with_the_cache_in_pipelined_steps(cold, kw):
    tokens, _, e = converse(**kw)
    assert e.pipelined and e.stats().prefix_cache_hits_total >= 2
    assert tokens == (cold if kw.get("n") == 2 else {k: v for k, v in cold.items() if k.endswith(".0")})


def shared_prefix(**kw):
    """Three requests on one prefix, the first alone for a step (so the others find its blocks)."""
    from strata.config import EngineConfig
    from strata.engine.engine import LLMEngine
    from strata.engine.types import EngineRequest

    e = LLMEngine(EngineConfig(device="cpu", ctx=1024, parallel=3, chunk_size=256, max_num_batched_tokens=512, **kw),
                  progress=False)
    base = e.tokenizer.encode(FILLER[:300])
    out: dict[str, list[int]] = {}
    for i in range(3):
        e.add_request(EngineRequest(f"r{i}", tuple(base + [100 + i] * (5 + 7 * i)),
                                    SamplingParams(max_tokens=10, ignore_eos=True), time.monotonic()))
        for ev in e.step() if i == 0 else ():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
    while e.has_work():
        for ev in e.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
    return out, e


def test_engine_with_the_cache_under_preemption():
    reference, _ = shared_prefix(prefix_cache=False)
    tokens, e = shared_prefix(kv_size=128)  # 8 blocks: the shared prefix takes 5, the third request does not fit
    assert tokens == reference
    assert e.scheduler.preemptions_total > 0 and e.stats().prefix_cache_hits_total == 2


@pytest.fixture(scope="module")
def spec_cold():
    """Speculation with the cache off: the drafts' acceptance to match."""
    return converse(spec=2, batch_mtp=True, prefix_cache=False)[2].turn2_spec


@pytest.mark.parametrize("split", [False, True])
def test_engine_with_speculation_reuses_the_mtp_layers_cached_k_v(cold, spec_cold, monkeypatch, split):
    if split:
        monkeypatch.setenv("STRATA_SPLIT_MTP_BATCH", "1")
    tokens, cached, e = converse(spec=2, batch_mtp=True)
    assert tokens == {k: v for k, v in cold.items() if k.endswith(".0")}
    assert cached["c0t2.0"] > 0 and cached["c1t2.0"] > 0
    # Wrong MTP K/V at the cached positions would show as drafts rejected in turn 2.
    assert e.turn2_spec >= spec_cold - 0.05


# ---------------------------------------------------------------- server: usage and /metrics


def test_server_reports_cached_tokens_in_usage_and_metrics(tmp_path):
    import httpx
    import openai

    from serving import running_server

    cfg = {"ctx": 1024, "parallel": 2, "device": "cpu", "api_key": "k", "model_name": "m", "log_level": "warning"}
    with running_server(tmp_path, cfg) as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=60)
        chat = [{"role": "user", "content": FILLER[:500]}]
        first = c.chat.completions.create(model="m", messages=chat, max_tokens=3)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        chat += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
        second = c.chat.completions.create(model="m", messages=chat, max_tokens=3)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 100 <= cached < second.usage.prompt_tokens
        stream = c.chat.completions.create(model="m", messages=chat, max_tokens=3, stream=True,
                                           stream_options={"include_usage": True})
        last = list(stream)[-1]
        assert last.usage.prompt_tokens_details.cached_tokens >= cached
        # n = 2: both choices are admitted together, before either has read the prompt: both may miss.
        c.completions.create(model="m", prompt=FILLER[:500], max_tokens=2, n=2)
        again = c.completions.create(model="m", prompt=FILLER[:500], max_tokens=2)
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        metrics = httpx.get(base + "/metrics", headers={"Authorization": "Bearer k"}).text
    values = {ln.split()[0]: float(ln.split()[1]) for ln in metrics.splitlines() if ln.startswith("strata_prefix")}
    assert values["strata_prefix_cache_queries_total"] == 6
    assert values["strata_prefix_cache_hits_total"] + values["strata_prefix_cache_misses_total"] == 6
    assert values["strata_prefix_cache_hits_total"] >= 3
    assert values["strata_prefix_cache_cached_tokens_total"] >= 2 * cached


def test_a_copy_of_a_prompt_being_read_waits_for_its_blocks_instead_of_reading_them_again():
    """n > 1: choices arrive together with one prompt; the second waits for the first's blocks."""
    make = lambda: [Request(f"c{i}", req("p", 40).prompt_ids, SamplingParams(max_tokens=5)) for i in range(2)]  # noqa: E731
    expected = reference(make, block_size=4, chunk_size=16, parallel=2)
    reqs = make()
    s = make_sched(prefix_cache=True, block_size=4, chunk_size=16, parallel=2)
    chunks, _ = drive(s, {0: reqs})
    assert {r.request_id: r.output_ids for r in reqs} == expected
    assert [c[0] for c in chunks["c0"][:3]] == [0, 16, 32]
    assert chunks["c1"][0][0] == 36  # after the 9 blocks c0 cached (the last token's block is computed)
    assert reqs[1].num_cached_tokens == 36 and s.allocator.num_used == 0
