"""`strata bench sm-split`: the split arithmetic (CPU) and the SM hold it measures with (CUDA)."""

import pytest

from strata.bench.sm_split import GOAL_ITL, GOAL_READ, _interpolate, frontier

needs_cuda = pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")


def _row(sms, itl, read, gbs):
    return {"sms": sms, "itl_p50_ms": itl, "read_tok_s": read, "stream_gbs": {"best": gbs}}


def test_interpolate_between_and_below_the_measured_counts():
    pts = [(20, 0.2), (100, 0.8), (132, 1.0)]
    assert _interpolate(pts, 60) == (pytest.approx(0.5), False)
    assert _interpolate(pts, 100) == (0.8, True)
    assert _interpolate(pts, 10) == (pytest.approx(0.1), False)  # proportional below the lowest


def test_frontier_pairs_the_decode_with_the_read_on_the_other_sms():
    """Decode with d SMs against the read with 132 - d: a split meets the goals only if both hold, and
    the bandwidth bound is the decode's bytes over what its SMs stream."""
    rows = [_row(132, 4.0, 20000.0, 4000.0), _row(100, 4.4, 16000.0, 3800.0), _row(32, 9.0, 6000.0, 1500.0)]
    pts = {p["decode_sms"]: p for p in frontier(rows, 132, stream_bytes=16e9)}
    assert set(pts) == {100, 32}
    p = pts[32]  # the read keeps 100 SMs: 0.8x, short of 0.85; the decode 9 / 4 = 2.25x
    assert p["read_sms"] == 100 and p["read_measured"]
    assert p["read_over_alone"] == pytest.approx(0.8) and p["decode_over_idle"] == pytest.approx(2.25)
    assert p["bound_over_idle"] == pytest.approx(16e9 / 1500e9 * 1e3 / 4.0)
    assert not p["meets_goals"]
    q = pts[100]  # the read keeps 32 SMs: 0.3x; the decode 1.1x
    assert q["read_over_alone"] == pytest.approx(6000 / 20000) and q["decode_over_idle"] == pytest.approx(1.1)
    assert q["decode_over_idle"] <= GOAL_ITL and q["read_over_alone"] < GOAL_READ and not q["meets_goals"]
    # A GPU where both hold: the read keeps 0.9x with 100 SMs and the decode 1.1x with 32.
    rows[2] = _row(32, 4.4, 6000.0, 3000.0)
    rows[1] = _row(100, 4.4, 18000.0, 3800.0)
    good = {p["decode_sms"]: p for p in frontier(rows, 132, stream_bytes=12e9)}[32]
    assert good["meets_goals"] and good["bound_meets_goals"]


def test_refuses_without_cuda(monkeypatch):
    import torch

    from strata.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["bench", "sm-split", "--device", "cpu"])


@pytest.mark.gpu
@needs_cuda
def test_sm_hold_leaves_only_the_other_sms():
    """With 64 SMs held, short programs reach only the rest; the spinners sat on 64 distinct SMs; after
    the release every SM is reached again. (The 68 SMs left stream as much as all 132 on an H100: the
    bench's table shows where the bandwidth starts to fall.)"""
    import torch

    from strata.bench.sm_hold import SmHold, num_sms, sms_used, stream_gbs

    dev = torch.device("cuda")
    total = num_sms(dev)
    assert sms_used(dev) == total
    full = stream_gbs(dev, nbytes=2**30)["best"]
    hold = SmHold(dev, 64, limit_s=30)
    try:
        reached = sms_used(dev)
        part = stream_gbs(dev, nbytes=2**30)["best"]
    finally:
        held = hold.release()
    print(f"{total} SMs: held {held}, reached {reached}; stream {full:.0f} GB/s all, {part:.0f} with the rest")
    assert held == 64 and reached == total - 64
    assert part > 0 and full > 0
    assert sms_used(dev) == total


def test_planning_for_fewer_sms_changes_only_the_16bit_gemv_tiles_inside_it():
    """Outside `planning_for` the GEMV and dp4a configurations are the tuned ones for all SMs. Inside it
    the 16-bit GEMVs take wider, fewer programs with the tuned split count and split boundaries (the
    same sums in the same order), and the dp4a GEMVs keep theirs: their split would change the sums."""
    from strata.kernels import gemv as k_gemv
    from strata.kernels.plan import DEFAULT_SMS, planned_sms, planning_for
    from strata.kernels.quant import dp4a

    shapes = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096), (1000, 512), (256, 192)]
    tuned = {s: (k_gemv.gemv_config(*s), dp4a.gemv_config(*s)) for s in shapes if s[1] % 64 == 0}
    assert tuned[(6144, 4096)][0] == k_gemv.GEMV_CONFIGS[(6144, 4096)]
    with planning_for(24):
        assert planned_sms() == 24
        planned = {s: (k_gemv.gemv_config(*s), dp4a.gemv_config(*s)) for s in tuned}
    assert planned_sms() == DEFAULT_SMS
    assert {s: (k_gemv.gemv_config(*s), dp4a.gemv_config(*s)) for s in tuned} == tuned
    for (n, k), (g, d) in planned.items():
        t = tuned[(n, k)][0]
        k_gemv.check_config(g, k)
        assert g.programs(n) <= t.programs(n) and g.block_n == 128 and g.split_k == t.split_k
        assert d == tuned[(n, k)][1]
        # Each split covers the same K values as the tuned configuration's.
        bounds = lambda c: [s * (k // c.block_k) // c.split_k * c.block_k for s in range(c.split_k + 1)]  # noqa: E731
        assert bounds(g) == bounds(t)
    assert planned[(4096, 4096)][0].block_k == 64  # o_proj: 128 x 64 tiles, 4 splits
    with pytest.raises(ValueError):
        with planning_for(0):
            pass


@pytest.mark.gpu
@needs_cuda
def test_few_sms_gemv_config_gives_the_tuned_bits():
    """The tiles `planning_for` gives the 16-bit GEMVs leave every output bit as the tuned ones do, at
    every M the kernel serves: the decode beside a read (STRATA_BESIDE_READ_GRAPHS) keeps its tokens."""
    import torch

    from strata.kernels import gemv as k_gemv

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(5)
    for n, k, act in [(6144, 4096, None), (4096, 4096, None), (4096, 12288, None), (4096, 12288, "silu_mul"),
                      (24576, 4096, None), (1000, 512, None)]:
        tuned = k_gemv.gemv_config(n, k)
        few = k_gemv.few_sms_config(tuned, k)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * k ** -0.5
        for m in (1, 3, 16):
            x = torch.randn(m, 2 * k if act else k, device=dev, dtype=torch.bfloat16, generator=gen)
            a = k_gemv.gemv_triton(x, w, act=act, config=tuned)
            b = k_gemv.gemv_triton(x, w, act=act, config=few)
            assert torch.equal(a, b), (n, k, act, m, tuned, few)


def test_frontier_reports_the_planned_decode_where_measured():
    rows = [_row(132, 4.0, 20000.0, 4000.0), {**_row(24, 8.0, 4000.0, 2400.0), "planned_itl_p50_ms": 5.0}]
    p = frontier(rows + [_row(108, 4.2, 18000.0, 3900.0)], 132, stream_bytes=8e9)
    by_d = {q["decode_sms"]: q for q in p}
    assert by_d[24]["planned_over_idle"] == pytest.approx(1.25) and by_d[24]["planned_meets_goals"]
    assert not by_d[24]["meets_goals"] and "planned_over_idle" not in by_d[108]


def test_decode_products_are_the_ones_a_decode_step_runs():
    """One layer's qkv, o_proj, gate_up, down and the LM head, with the shapes of the model's config."""
    import torch

    from strata.bench.random_model import random_model
    from strata.bench.sm_split import decode_products

    loaded = random_model("tiny", "cpu", torch.float32, seed=3)
    c = loaded.config
    shapes = {name: tuple(w.shape) for name, (w, _) in decode_products(loaded.model).items()}
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    assert shapes == {"qkv": (qkv, c.hidden_size), "o_proj": (c.hidden_size, c.num_attention_heads * c.head_dim),
                      "gate_up": (2 * c.intermediate_size, c.hidden_size),
                      "down": (c.hidden_size, c.intermediate_size), "lm_head": (c.vocab_size, c.hidden_size)}
