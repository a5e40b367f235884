"""The host KV tier in the engine (embedded model, fp32, CPU): with a resident window smaller than the
prompt, greedy output is identical to a run with every block in the device pool: two slots, chunked
reads with a give-way, speculation (MTP, a prompt longer than the device pool), preemption (with the
prefix cache and speculation too), the concurrent read (a long read beside a decode, giving way to a
short one), a hybrid model (the tiny Qwen3-Next: only its full-attention layer tiers), and under
--batch-invariant bitwise, logprobs included; the prefix cache's host tier serves a hit; a decode step
with a host part takes the graphs cut at each attention layer, never another graph (the decisions, with
stand-in graphs); a context that does not fit both tiers is refused naming the sizes; and with copies
that finish late (the device behind the host), a read whose pool is full waits for its blocks to move,
alone, beside the concurrent read and with two decode groups."""

from __future__ import annotations

import time

import pytest
import torch

from strata.attention.reference import PagedAttention
from strata.config import EngineConfig
from strata.engine.engine import LLMEngine, RequestError
from strata.engine.types import EngineRequest
from strata.params import SamplingParams

TEXT = open(__file__.replace("tests/engine/test_kv_tier_engine.py", "strata/assets/default-model/README.md")).read()


def run(prompts, max_tokens=20, arrive=None, logprobs=False, **kw):
    """Greedy tokens per request (with `logprobs`, (tokens, logprobs)); `arrive`: request index -> the step
    it is added at (the others at the start)."""
    base = dict(device="cpu", ctx=1024, parallel=2, chunk_size=64, max_num_batched_tokens=128, prefix_cache=False)
    e = LLMEngine(EngineConfig(**{**base, **kw}), progress=False)
    arrive = arrive or {}
    out: dict[str, list] = {}
    steps = 0

    def add(i):
        e.add_request(EngineRequest(f"r{i}", tuple(prompts[i]), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                    time.monotonic()), logprobs=logprobs)

    for i in range(len(prompts)):
        if i not in arrive:
            add(i)
    while e.has_work() or any(s >= steps for s in arrive.values()):
        for i, s in arrive.items():
            if s == steps:
                add(i)
        for ev in e.step():
            got = out.setdefault(ev.request_id, ([], []) if logprobs else [])
            if logprobs:
                got[0].extend(ev.token_ids)
                got[1].extend(ev.logprobs)
            else:
                got.extend(ev.token_ids)
        steps += 1
    e.close()
    return out, e


@pytest.fixture(scope="module")
def prompts():
    e = LLMEngine(EngineConfig(device="cpu", ctx=256), progress=False)
    ids = e.tokenizer.encode(TEXT)
    return [ids[:230], ids[300:420], ids[500:540]]


@pytest.fixture(scope="module")
def plain(prompts):
    return run(prompts[:2])[0]


def test_window_smaller_than_the_prompt_gives_identical_greedy_output(prompts, plain):
    out, e = run(prompts[:2], kv_resident=48)
    assert out == plain
    s = e.stats()
    assert s.kv_blocks_moved_total > 10 and e.runner.attn.host_rows_total > 0
    assert type(e.runner.attn.inner) is PagedAttention  # the torch reference on the CPU (Triton on CUDA)
    assert s.kv_host_blocks_used == 0  # every request finished: its host blocks are free again


@pytest.fixture
def late_copies(monkeypatch):
    """Copies of moves report done only once the engine waits for them: the device far behind the host."""
    from strata.kvcache.host_pool import BlockCopier

    waited = set()
    monkeypatch.setattr(BlockCopier, "ready", lambda self, ticket: ticket in waited)
    monkeypatch.setattr(BlockCopier, "wait", lambda self, ticket: waited.add(ticket))
    finish = BlockCopier.finish

    def finished(self, ticket):
        waited.discard(ticket)
        finish(self, ticket)

    monkeypatch.setattr(BlockCopier, "finish", finished)


def test_decode_rows_streaming_their_host_part_give_identical_greedy_output(prompts, plain):
    """`--kv-tier-decode stream`: every decode row's host part goes through the streamed path (on the CPU
    the "device" copy is the pinned one), the same tokens."""
    out, e = run(prompts[:2], kv_resident=48, kv_tier_decode="stream")
    assert out == plain
    assert e.runner.tier_decode == "stream" and e.runner.attn.stream_decode
    assert e.runner.attn.host_rows_total > 0 and e.runner.attn.host_seconds_total == 0


def test_kv_tier_decode_takes_its_three_ways():
    with pytest.raises(ValueError, match="kv_tier_decode"):
        EngineConfig(kv_tier_decode="gpu")
    # Off CUDA, auto keeps decode rows on the CPU (nothing to stream to).
    _, e = run([[5, 6, 7]], kv_resident=48)
    assert e.runner.tier_decode == "cpu" and not e.runner.attn.stream_decode


def test_a_read_waits_for_its_blocks_to_leave_a_full_pool(prompts, plain, late_copies):
    """On CUDA the host schedules a read's chunks ahead of the device, so a move's copy is not done by the
    next step and the pool (the window and two chunks) fills: the read waits for the copy, and neither
    ends ("length") nor changes its output."""
    out, e = run(prompts[:1], kv_resident=48, parallel=1)
    assert out == {"r0": plain["r0"]}
    assert e.stats().kv_blocks_moved_total >= (230 - 48 - 2 * 64) // 16


def test_late_copies_with_batch_groups(prompts, plain, late_copies):
    """The seed's two decode groups, whose steps are pipelined: the same output, blocks moved."""
    out, e = run(prompts[:2], kv_resident=48, batch_groups=2)
    assert out == plain and e.pipelined and e.stats().kv_blocks_moved_total > 0


def test_late_copies_beside_the_concurrent_read(prompts, late_copies, monkeypatch):
    """The same with the read on the read stage beside a decode and a short request arriving: no lane
    waits forever on a copy, and the output is the one without the tier."""
    three = [prompts[1], prompts[0], prompts[2]]
    kw = dict(arrive={1: 2, 2: 4}, max_num_batched_tokens=64, parallel=3)
    want, _ = run(three, **kw)
    monkeypatch.setenv("STRATA_PIPED_CONCURRENT", "1")
    got, e = run(three, kv_resident=32, kv_size=224, **kw)
    assert got == want and e.read_stage.reads_total > 3 and e.stats().kv_blocks_moved_total > 0


def test_tier_with_int8_storage_matches_int8_without(prompts):
    base, _ = run(prompts[:1], kv="int8")
    out, _ = run(prompts[:1], kv="int8", kv_resident=32)
    assert out == base


def test_tier_through_give_way_and_preemption(prompts, plain):
    two = [prompts[0], prompts[2]]
    want, _ = run(two, arrive={1: 2}, max_num_batched_tokens=64)
    out, e = run(two, arrive={1: 2}, kv_resident=32, max_num_batched_tokens=64)
    assert out == want and e.scheduler.give_ways_total > 0
    # A device pool of 7 blocks for two slots: requests are preempted and recomputed.
    out, e = run(prompts[:2], kv_resident=32, kv_size=112)
    assert out == plain and e.scheduler.preemptions_total > 0


@pytest.mark.parametrize("way", ["cpu", "stream"])
def test_tier_with_speculation(prompts, plain, way):
    out, e = run(prompts[:2], kv_resident=48, spec=3, batch_mtp=True, kv_tier_decode=way)
    assert out == plain
    assert e.drafter.attn.stream_decode == (way == "stream")  # the MTP layer's rows go the target's way
    assert e.stats().spec["mean_accepted_length"] > 1.0 and e.stats().kv_blocks_moved_total > 0
    # The drafter writes a read's MTP K/V chunk by chunk, so its blocks move before the read ends: one
    # slot whose device pool (12 blocks) is smaller than its 230-token prompt.
    out, e = run(prompts[:1], kv_resident=32, spec=2, parallel=1)
    assert out == {"r0": plain["r0"]} and e.allocator.capacity * 16 < len(prompts[0])
    assert e.drafter.split and e.drafter.prompt_hidden is None


def test_preemption_with_the_prefix_cache_and_speculation(prompts, plain):
    """A device pool of 7 blocks for two slots: requests are preempted with blocks in both tiers and read
    again, their registered blocks kept by the prefix cache (keys in the host allocator), or under
    speculation (the MTP layer's K/V tier with the rest)."""
    for kw in (dict(prefix_cache=True), dict(spec=2, batch_mtp=True)):
        out, e = run(prompts[:2], kv_resident=32, kv_size=112, **kw)
        assert out == plain and e.scheduler.preemptions_total > 0 and e.stats().kv_blocks_moved_total > 0, kw


def test_batch_invariant_with_the_tier_is_bitwise_the_run_without_it(prompts):
    """--batch-invariant: each tiered sequence is attended whole at its real positions (the same keys and
    arithmetic as without the tier), so tokens and logprobs are bitwise those of the run without the
    tier, which --batch-invariant makes the same alone and in a batch: here read beside another request,
    giving way to it, and with speculation's verification rows."""
    two = [prompts[0], prompts[2]]
    want, _ = run(two, max_tokens=12, logprobs=True, batch_invariant=True)
    got, e = run(two, max_tokens=12, logprobs=True, batch_invariant=True, kv_resident=32, arrive={1: 2},
                 max_num_batched_tokens=64)
    assert got == want
    assert e.scheduler.give_ways_total > 0 and e.runner.attn.whole_sequences_total > 0
    got, e = run(two, max_tokens=12, logprobs=True, batch_invariant=True, kv_resident=32, spec=2)
    assert got == want and e.stats().spec["drafts_accepted"] > 0


@pytest.mark.parametrize("spec", [0, 2])
def test_tier_beside_the_concurrent_read(prompts, monkeypatch, spec):
    """The concurrent read (STRATA_PIPED_CONCURRENT): a long read on the read stage beside a decoding
    request, giving way to a short one that arrives during it; the stage's runner has its own tiered
    backend, the long read's blocks move between its chunks, and with speculation the stage writes the
    chunks' MTP K/V (through a tiered backend too)."""
    three = [prompts[1], prompts[0], prompts[2]]
    kw = dict(arrive={1: 2, 2: 4}, max_num_batched_tokens=64, parallel=3)
    want, _ = run(three, **kw)
    monkeypatch.setenv("STRATA_PIPED_CONCURRENT", "1")
    # 14 blocks for three slots: without moves between its chunks the long read could never finish.
    got, e = run(three, kv_resident=32, kv_size=224, spec=spec, **kw)
    assert got == want and e.read_stage.reads_total > 3 and e.scheduler.give_ways_total > 0
    assert e.read_stage.runner.attn.host_rows_total > 0 and e.runner.attn.host_rows_total > 0
    if spec:
        assert e.read_stage.prefill is not None and e.read_stage.prefill.attn.host_rows_total > 0


@pytest.fixture(scope="module")
def hybrid(tiny_model_dirs):
    path, hf = tiny_model_dirs["qwen3_next"]
    g = torch.Generator().manual_seed(5)
    return path, [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (130, 40, 300)]


def test_hybrid_model_tiers_only_its_full_attention_layers(hybrid, monkeypatch):
    """The tiny Qwen3-Next (one full-attention layer, three linear ones): the host pool holds K/V for the
    full-attention layer only, the linear-attention states stay in their device pool; identical output
    chunked beside another slot, through preemptions, and on the concurrent read."""
    path, ps = hybrid
    kw = dict(model=path, ctx=512, chunk_size=32, max_num_batched_tokens=64)
    want, _ = run(ps, max_tokens=12, **kw)
    got, e = run(ps, max_tokens=12, kv_resident=32, **kw)
    assert got == want and e.stats().kv_blocks_moved_total > 0 and e.runner.attn.host_rows_total > 0
    assert e.host_pool.num_layers == e.pool.num_layers == 1 and e.states.device == e.pool.device
    got, e = run(ps, max_tokens=12, kv_resident=32, kv_size=96, **kw)
    assert got == want and e.scheduler.preemptions_total > 0
    monkeypatch.setenv("STRATA_PIPED_CONCURRENT", "1")
    got, e = run(ps, max_tokens=12, kv_resident=32, **kw)
    assert got == want and e.read_stage.runner.attn.host_rows_total > 0


def test_steps_with_a_host_part_take_the_graphs_cut_for_it(prompts, monkeypatch):
    """CUDA graphs stay on with the tier. A decode/verify step in which some sequence has host blocks
    takes the family of graphs cut at each attention layer, where --kv-tier-graphs captured one (its host
    parts go through the CPU between the pieces; without it the family is empty and the step runs
    eagerly), a step without one the plain family; prompt-chunk graphs and the MTP call graphs are never
    taken with a host part (those steps run eagerly). Checked on the CPU by asking each chooser with
    stand-in graphs, then running the step eagerly."""
    from strata.runner.model_runner import ModelRunner
    from strata.runner.prompt_graphs import PromptGraphs
    from strata.speculative.mtp_step import MTPStep

    seen = {"decode": [], "prompt": [], "mtp": []}

    def asking(kind, choose, stand_in, host_of, tier_stand_in=None):
        def ask(self, *args):
            graphs, self.graphs = self.graphs, stand_in
            if tier_stand_in is not None:
                tier, self.tier_graphs = self.tier_graphs, tier_stand_in
            try:
                picked = choose(self, *args)
            finally:
                self.graphs = graphs
                if tier_stand_in is not None:
                    self.tier_graphs = tier
            seen[kind].append((host_of(self, *args), picked))
            return None
        return ask

    def host_of_chunks(_, chunks):
        return any(ch.request.host_blocks for ch in chunks)

    monkeypatch.setattr(ModelRunner, "_graph_for", asking("decode", ModelRunner._graph_for, {4: "plain"},
                                                          host_of_chunks, {4: "cut"}))
    monkeypatch.setattr(PromptGraphs, "graph_for", asking("prompt", PromptGraphs.graph_for, {64: "g"}, host_of_chunks))
    mtp_host: list[bool] = []
    run_mtp = MTPStep.run

    def mtp_run(self, reqs, *args):
        mtp_host.append(any(r.host_blocks for r in reqs))
        return run_mtp(self, reqs, *args)

    monkeypatch.setattr(MTPStep, "run", mtp_run)
    monkeypatch.setattr(MTPStep, "_graph_for", asking("mtp", MTPStep._graph_for, {(3, 4): "g", (1, 4): "g"},
                                                      lambda *_: mtp_host[-1]))
    short = prompts[2][:30]  # within the window: never tiered
    out, e = run([short, prompts[0]], kv_resident=64, spec=2, arrive={1: 12})
    assert out == run([short, prompts[0]], spec=2, arrive={1: 12})[0]
    decode = seen["decode"]
    assert all(picked in (None, "cut" if host else "plain") for host, picked in decode)
    assert ("cut" in [p for _, p in decode]) and ("plain" in [p for _, p in decode])
    for kind in ("prompt", "mtp"):
        assert not any(host and picked is not None for host, picked in seen[kind]), kind
        assert any(picked is not None for _, picked in seen[kind]), kind  # a step without a host part may replay
    assert True in mtp_host and len(seen["mtp"]) == mtp_host.count(False)  # never even asked with a host part


def test_prefix_cache_host_tier_serves_a_hit(prompts):
    """Blocks moved to the host keep their prefix keys: a second request with the same prompt, after the
    device pool has been reused by another one, takes them from the host tier."""
    kw = dict(prefix_cache=True, kv_resident=32, parallel=1, kv_size=320, kv_host_memory=0.01)
    first, _ = run([prompts[0]], prefix_cache=False, parallel=1)
    e = LLMEngine(EngineConfig(device="cpu", ctx=1024, chunk_size=64, max_num_batched_tokens=128, **kw), progress=False)
    outs = {}
    for rid, p in (("a", prompts[0]), ("b", prompts[1]), ("c", prompts[0])):
        e.add_request(EngineRequest(rid, tuple(p), SamplingParams(max_tokens=20, ignore_eos=True), time.monotonic()))
        evs = e.run_to_completion()[rid]
        outs[rid] = ([t for ev in evs for t in ev.token_ids], evs[-1].cached_tokens)
    s = e.stats()
    assert outs["c"][0] == outs["a"][0] == first["r0"]
    assert outs["c"][1] >= 160 and s.prefix_cache_host_hits_total == 1
    assert s.prefix_cache_host_cached_tokens_total >= 160


def test_context_beyond_both_tiers_is_refused_naming_the_sizes():
    e = LLMEngine(EngineConfig(device="cpu", ctx=4096, parallel=1, chunk_size=64, kv_size=256, kv_resident=64,
                               kv_host_memory=0.0005), progress=False)
    with pytest.raises(RequestError, match="device KV pool with --kv-resident 64 .* host KV pool"):
        e.add_request(EngineRequest("x", tuple([5] * 3000), SamplingParams(max_tokens=4), time.monotonic()))
