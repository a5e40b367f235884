"""Device sampling: the counter-based hash, the sampled distribution against `filtered_probs`,
determinism, greedy rows, repetition penalty, logprobs, batch independence, device-side verification,
the Triton race kernel (interpreted on CPU), and on CUDA repeatability, graph replay and no syncs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.runner.device_sampling import (
    STREAM_DRAFT,
    DeviceSampler,
    RowParams,
    _row_keys_np,
    _top_k_sorted,
    draw_from,
    filtered_probs_batched,
    mix32,
    noise_bits,
    race_ref,
    race_triton,
    row_keys,
    verify_sampled_device,
)
from strata.sampling import SamplingParams, apply_repetition_penalty, filtered_probs

N_DRAWS = 20_000
V_SMALL = 12


def _row_logits(v=V_SMALL, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(v, generator=g) * 2


def _tv(tokens: torch.Tensor, ref: torch.Tensor) -> float:
    hist = torch.bincount(tokens.cpu(), minlength=ref.numel()).double() / tokens.numel()
    return float((hist - ref.double()).abs().sum() / 2)


def _mixed_rows(m: int, v: int, seed: int) -> list[RowParams]:
    """A batch that exercises every stage: greedy, plain, top-k, top-p, min-p, penalised rows."""
    g = np.random.default_rng(seed)
    kinds = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=1.0, top_k=5),
             dict(temperature=1.2, top_p=0.7), dict(temperature=0.9, min_p=0.1),
             dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3),
             dict(temperature=0.0, repetition_penalty=1.5)]
    rows = []
    for j in range(m):
        kw = dict(kinds[j % len(kinds)])
        if kw.get("repetition_penalty", 1.0) != 1.0:
            kw["seen"] = g.integers(0, v, size=int(g.integers(1, 30))).tolist()
        rows.append(RowParams(seed=int(g.integers(0, 2**63)), counter=int(g.integers(0, 1000)), **kw))
    return rows


# ---- the hash ---------------------------------------------------------------------------------------
def test_hash_pinned_and_identical_across_implementations():
    # Pinned values: the documented hash must not drift (seeds reproduce across versions).
    assert mix32(1) == 2261973619 and mix32(0xDEADBEEF) == 707447538
    assert row_keys(0, 0) == (4007080336, 2087156423)
    assert row_keys(2**64 - 1, 5, 1) == row_keys(-1, 5, 1) == (648402245, 3887397020)
    k1, k2 = row_keys(42, 7)
    bits = noise_bits(torch.tensor([k1]), torch.tensor([k2]), torch.tensor([0, 1, 151935]))
    assert bits.tolist() == [[3660768141, 2673170654, 2829202193]]
    # Host vector form == scalar form, for huge and negative seeds too; torch form == scalar form.
    seeds, counters = [0, 1, 2**63 + 5, -3, 123456789123], [0, 2**40, 7, 99, 5]
    n1, n2 = _row_keys_np(seeds, counters, [0, 1, 0, 1, 2])
    expected = [row_keys(s, c, st) for s, c, st in zip(seeds, counters, [0, 1, 0, 1, 2])]
    assert [(int(a), int(b)) for a, b in zip(n1, n2)] == expected
    ids = [0, 5, 2**20, 2**32 - 1]
    for v, b in zip(ids, noise_bits(torch.tensor([k1]), torch.tensor([k2]), torch.tensor(ids))[0].tolist()):
        assert b == mix32(mix32(v ^ k1) ^ k2)


def test_triton_race_matches_reference_interpreted():
    g = torch.Generator().manual_seed(3)
    m, v = 5, 100
    score = torch.randn(m, v, generator=g)
    score[1, ::3] = float("-inf")
    ids = torch.stack([torch.randperm(v, generator=g) for _ in range(m)])
    k1, k2 = torch.randint(0, 2**32, (2, m), generator=g)
    noise = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])
    for cols in (None, ids):
        ref = race_ref(score, cols, k1, k2, noise)
        assert torch.equal(race_triton(score, cols, k1, k2, noise, block=16), ref)  # 7 blocks per row
        assert torch.equal(race_triton(score, cols, k1, k2, noise), ref)
    # Ties go to the smallest id whatever the column order.
    flat = torch.zeros(2, 8)
    perm = torch.tensor([[3, 1, 7, 0, 2, 5, 4, 6]] * 2)
    zero = torch.zeros(2)
    assert race_ref(flat, perm, k1[:2], k2[:2], zero).tolist() == [0, 0]
    assert race_triton(flat, perm, k1[:2], k2[:2], zero, block=4).tolist() == [0, 0]


# ---- the distribution -------------------------------------------------------------------------------
PARAM_SETS = [
    dict(temperature=0.7), dict(temperature=1.3), dict(temperature=1.0, top_k=5),
    dict(temperature=1.0, top_p=0.8), dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05),
    dict(temperature=1.1, top_k=9, top_p=0.95, repetition_penalty=1.5),
]


@pytest.mark.parametrize("kw", PARAM_SETS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_distribution_matches_filtered_probs(kw):
    x = _row_logits()
    seen = [0, 3, 3, 7] if kw.get("repetition_penalty", 1.0) != 1.0 else None
    ref_logits = apply_repetition_penalty(x, torch.tensor(seen), kw["repetition_penalty"]) if seen else x
    ref = filtered_probs(ref_logits, SamplingParams(**kw))
    rows = [RowParams(seed=7, counter=c, seen=seen, **kw) for c in range(N_DRAWS)]
    sampler = DeviceSampler(N_DRAWS, V_SMALL, "cpu", max_seen=8, chunk_rows=N_DRAWS)
    tokens, _ = sampler.sample(x.expand(N_DRAWS, -1), rows)
    assert _tv(tokens, ref) <= 0.02
    assert not bool((ref[tokens] == 0).any()), "a filtered token was drawn"
    # The functional pair gives the same filtering and an equally distributed draw.
    probs = filtered_probs_batched(x[None], rows[:1])[0]
    assert torch.allclose(probs, ref, atol=1e-6)
    drawn = draw_from(probs.expand(N_DRAWS, -1), [11] * N_DRAWS, range(N_DRAWS))
    assert _tv(drawn, ref) <= 0.02 and not bool((ref[drawn] == 0).any())


def test_determinism_and_fresh_noise_per_counter():
    x = torch.zeros(2, 50)  # uniform: every draw is decided by the noise alone
    sampler = DeviceSampler(2, 50, "cpu")
    a = [int(sampler.sample(x, [RowParams(temperature=1.0, seed=5, counter=c)] * 2)[0][0]) for c in range(200)]
    # Same (seed, counter), another sampler, another batch position: the same token.
    b = [int(DeviceSampler(3, 50, "cpu").sample(torch.zeros(3, 50), [RowParams(temperature=0.5, seed=1, counter=0),
                                                                    RowParams(temperature=1.0, seed=5, counter=c),
                                                                    RowParams()])[0][1]) for c in range(200)]
    assert a == b
    assert sum(p != q for p, q in zip(a, a[1:])) > 180  # 1/50 chance each to repeat
    other = [int(sampler.sample(x, [RowParams(temperature=1.0, seed=6, counter=c)] * 2)[0][0]) for c in range(200)]
    assert sum(p != q for p, q in zip(a, other)) > 180
    drafted = draw_from(torch.full((200, 50), 0.02), [5] * 200, range(200), stream=STREAM_DRAFT).tolist()
    assert sum(p != q for p, q in zip(a, drafted)) > 180  # another stream, other noise


def test_greedy_rows_are_argmax_of_penalised_logits():
    g = torch.Generator().manual_seed(1)
    m, v = 14, 64
    x = torch.randn(m, v, generator=g)
    rows = _mixed_rows(m, v, seed=2)
    tokens, _ = DeviceSampler(m, v, "cpu", max_seen=32).sample(x, rows)
    for j, r in enumerate(rows):
        if r.temperature == 0:
            xi = apply_repetition_penalty(x[j], torch.tensor(r.seen), r.repetition_penalty) if r.seen else x[j]
            assert int(tokens[j]) == int(xi.argmax())
    greedy_only = [RowParams(repetition_penalty=1.5, seen=[int(x[0].argmax())]), RowParams()]
    tokens, _ = DeviceSampler(2, v, "cpu").sample(x[:2], greedy_only)
    assert tokens.tolist() == [int(apply_repetition_penalty(x[0], torch.tensor(greedy_only[0].seen), 1.5).argmax()),
                               int(x[1].argmax())]


def test_repetition_penalty_and_logprobs_match_reference():
    g = torch.Generator().manual_seed(4)
    m, v = 14, 64
    x = torch.randn(m, v, generator=g) * 3
    rows = _mixed_rows(m, v, seed=5)
    probs = filtered_probs_batched(x, rows)
    tokens, logprobs = DeviceSampler(m, v, "cpu", max_seen=32).sample(x, rows)
    for j, r in enumerate(rows):
        xi = apply_repetition_penalty(x[j], torch.tensor(r.seen), r.repetition_penalty) if r.seen else x[j]
        if r.temperature == 0:
            assert probs[j, int(xi.argmax())] == 1.0
        else:
            p = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, min_p=r.min_p)
            assert torch.allclose(probs[j], filtered_probs(xi, p), atol=1e-6)
            assert probs[j, int(tokens[j])] > 0
        expected = xi[int(tokens[j])] - torch.logsumexp(xi, -1)
        assert torch.allclose(logprobs[j], expected, atol=1e-5)


def test_batch_independence_and_static_plan():
    g = torch.Generator().manual_seed(6)
    m, v = 21, 80
    x = torch.randn(m, v, generator=g) * 2
    rows = _mixed_rows(m, v, seed=7)
    tokens, logprobs = DeviceSampler(m, v, "cpu", max_seen=32, chunk_rows=8).sample(x, rows)
    for j in range(m):
        alone_t, alone_lp = DeviceSampler(1, v, "cpu", max_seen=32).sample(x[j : j + 1], rows[j : j + 1])
        assert int(alone_t[0]) == int(tokens[j])
        assert torch.allclose(alone_lp[0], logprobs[j], atol=1e-6)
    # Plain rows alone take the unsorted path: the same tokens as inside the sorted batch.
    plain = [j for j, r in enumerate(rows) if r.top_k == 0 and r.top_p == 1.0]
    t_plain, _ = DeviceSampler(m, v, "cpu", max_seen=32).sample(x[plain], [rows[j] for j in plain])
    assert t_plain.tolist() == tokens[plain].tolist()
    # The graph's static plan (every stage, full width, padded rows) agrees with the eager plan.
    s = DeviceSampler(32, v, "cpu", max_seen=32, chunk_rows=16)
    for _ in range(2):  # both host sets
        plan = s.fill(rows, pad_to=32, static=True)
        t_static, lp_static = s.run(torch.cat([x, torch.zeros(32 - m, v)]), plan)
        assert t_static[:m].tolist() == tokens.tolist()
        assert torch.allclose(lp_static[:m], logprobs, atol=1e-6)


def test_top_k_candidates_give_the_full_sorts_tokens():
    """Rows that all have top-k on: the CPU sorts the k + 1 largest only and races over the kept prefix;
    the same tokens and logprobs as sorting the whole vocabulary, ties at the k-th value included (the
    full sort serves those)."""
    import dataclasses

    g = torch.Generator().manual_seed(9)
    m, v = 40, 300
    x = torch.randn(m, v, generator=g) * 3
    x[::4, :45] = x[::4, :1].abs() + 8  # rows whose k-th value ties values past the candidates
    x[1::4] = torch.round(x[1::4])  # rows with many ties among the candidates
    rows = [RowParams(temperature=0.7 + j % 3 * 0.2, top_k=[1, 5, 40][j % 3], top_p=[1.0, 0.9, 0.95][j % 3],
                      min_p=[0.0, 0.05][j % 2], seed=j, counter=3 * j,
                      repetition_penalty=1.3 if j % 5 == 0 else 1.0, seen=[1, 2, 3] if j % 5 == 0 else None)
            for j in range(m)]
    s = DeviceSampler(m + 1, v, "cpu", max_seen=8)
    plan = s.fill(rows)
    assert plan.top_k == 40
    fast = s.run(x, plan)
    full = s.run(x, dataclasses.replace(plan, top_k=0))
    assert fast[0].tolist() == full[0].tolist() and torch.equal(fast[1], full[1])
    assert _top_k_sorted(x[:1], s.d_i[:1], 40) is None  # a tie past the candidates: the full sort
    # A row without top-k in the batch: every row sorts the whole vocabulary.
    assert s.fill(rows + [RowParams(temperature=1.0, top_p=0.9)]).top_k == 0


def test_seen_lists_deduplicated_or_rejected():
    x = torch.randn(1, 16)
    s = DeviceSampler(1, 16, "cpu", max_seen=4)
    long_dupes = [1, 2, 1, 2, 1, 2, 3]  # 7 ids, 3 distinct: fits after deduplication
    t, lp = s.sample(x, [RowParams(repetition_penalty=2.0, seen=long_dupes)])
    xi = apply_repetition_penalty(x[0], torch.tensor(long_dupes), 2.0)
    assert int(t[0]) == int(xi.argmax()) and torch.allclose(lp[0], xi.max() - torch.logsumexp(xi, -1))
    with pytest.raises(ValueError):
        s.fill([RowParams(repetition_penalty=2.0, seen=list(range(6)))])
    with pytest.raises(ValueError):
        s.fill([RowParams(repetition_penalty=2.0, seen=[16])])


# ---- speculative verification -----------------------------------------------------------------------
def test_verify_sampled_device_is_exact():
    """Drafts from q (draft stream), verified against p: the first emitted token is distributed as p_0,
    and with q == p every draft is accepted and the bonus follows p_k."""
    g = torch.Generator().manual_seed(8)
    v, k, b = 6, 2, N_DRAWS
    p = torch.rand(k + 1, v, generator=g) ** 2
    p /= p.sum(-1, keepdim=True)
    q = torch.rand(k, v, generator=g)
    q /= q.sum(-1, keepdim=True)
    seeds, counters = [3] * b, [10 * c for c in range(b)]
    drafts = torch.stack([draw_from(q[j].expand(b, -1), seeds, [c + j for c in counters], stream=STREAM_DRAFT)
                          for j in range(k)], 1)
    tokens, emitted = verify_sampled_device(drafts, q.expand(b, -1, -1), p.expand(b, -1, -1), seeds, counters)
    assert _tv(tokens[:, 0], p[0]) <= 0.02
    assert bool((emitted >= 1).all() and (emitted <= k + 1).all())
    accepted = emitted - 1
    assert bool((tokens[:, :k] == drafts)[torch.arange(k)[None] < accepted[:, None]].all())
    again, emitted_again = verify_sampled_device(drafts, q.expand(b, -1, -1), p.expand(b, -1, -1), seeds, counters)
    assert torch.equal(again, tokens) and torch.equal(emitted_again, emitted)
    same_drafts = torch.stack([draw_from(p[j].expand(b, -1), seeds, [c + j for c in counters], stream=STREAM_DRAFT)
                               for j in range(k)], 1)
    tokens, emitted = verify_sampled_device(same_drafts, p[:k].expand(b, -1, -1), p.expand(b, -1, -1), seeds, counters)
    assert bool((emitted == k + 1).all()) and _tv(tokens[:, k], p[k]) <= 0.02


# ---- CUDA ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_repeatable_and_close_to_cpu():
    m, v = 96, 151_936
    g = torch.Generator().manual_seed(9)
    x = torch.randn(m, v, generator=g) * 3
    rows = _mixed_rows(m, v, seed=10)
    s = DeviceSampler(m, v, "cuda", max_seen=64)
    xc = x.cuda()
    t1, lp1 = s.sample(xc, rows)
    t2, lp2 = s.sample(xc, rows)
    assert torch.equal(t1, t2) and torch.equal(lp1, lp2)
    t_cpu, lp_cpu = DeviceSampler(m, v, "cpu", max_seen=64).sample(x, rows)
    same = int((t1.cpu() == t_cpu).sum())
    print(f"CUDA vs CPU device sampling agreement: {same}/{m} tokens")
    assert same >= m - 2
    k1, k2 = torch.randint(0, 2**32, (2, m), generator=g)
    noise = torch.ones(m)
    ref = race_ref(x, None, k1, k2, noise).cuda()
    got = race_triton(xc, None, k1.cuda(), k2.cuda(), noise.cuda())
    assert torch.equal(race_ref(xc, None, k1.cuda(), k2.cuda(), noise.cuda()), got)
    print(f"Triton race vs CPU reference: {int((ref == got).sum())}/{m} tokens")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_with_new_parameters():
    r, v = 16, 32_000
    s = DeviceSampler(r, v, "cuda", max_seen=64, chunk_rows=8)
    static_logits = torch.zeros(r, v, device="cuda")
    plan = s.static_plan(r)
    s.fill([], pad_to=r, static=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            s.run(static_logits, plan)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, logprobs = s.run(static_logits, plan)
    eager = DeviceSampler(r, v, "cuda", max_seen=64)
    for trial in range(4):
        m = 11 + trial
        rows = _mixed_rows(m, v, seed=20 + trial)
        x = torch.randn(m, v, device="cuda") * 3
        static_logits[:m].copy_(x)
        static_logits[m:].zero_()
        s.fill(rows, pad_to=r, static=True)
        graph.replay()
        ref_t, ref_lp = eager.sample(x, rows)
        assert torch.equal(tokens[:m], ref_t)
        assert torch.allclose(logprobs[:m], ref_lp, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_part_never_syncs():
    m, v = 32, 32_000
    rows = _mixed_rows(m, v, seed=30)
    s = DeviceSampler(m, v, "cuda", max_seen=64)
    x = torch.randn(m, v, device="cuda")
    s.run(x, s.fill(rows))  # compile the kernels first
    plan = s.fill(rows)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s.run(x, plan)
        probs = filtered_probs_batched(x, rows)
        draw_from(probs, [1] * m, range(m))
        d = torch.zeros(m, 2, dtype=torch.long, device="cuda")
        verify_sampled_device(d, probs[:, None].expand(-1, 2, -1), probs[:, None].expand(-1, 3, -1), [1] * m, range(m))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
