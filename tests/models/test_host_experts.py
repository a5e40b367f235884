"""Routed experts in host RAM (strata/models/host_experts.py): each CPU format against its definition
on fresh random weights, and the grouped forward against a per-token loop over the same experts."""

import pytest
import torch
import torch.nn.functional as F

from strata.kernels.host_moe import one_token_moe
from strata.models.host_experts import (FBGEMM_REDUCE_RANGE, NEVER, HostExperts, HostProjection, StreamStack,
                                        dequantize_int4, dequantize_int8, fbgemm_chains_scripted, format_fits,
                                        has_fbgemm, host_step_seconds, int4_groups, int8_rows, int8_tokens,
                                        stream_crossover)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_int8_rows_round_each_value_to_its_row_scale():
    w = torch.randn(48, 64, generator=_gen(1)) * torch.rand(48, 1, generator=_gen(2)) * 3
    q, scale = int8_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (dequantize_int8(q, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-6).all())
    assert torch.equal(q.abs().amax(dim=1), torch.full((48,), 127, dtype=torch.int8))


def test_int4_groups_round_each_value_within_its_group():
    w = torch.randn(32, 96, generator=_gen(3))
    q, sz = int4_groups(w)
    assert sz.shape == (3, 32, 2) and int(q.min()) >= 0 and int(q.max()) <= 15
    err = (dequantize_int4(q, sz) - w).abs().reshape(32, 3, 32)
    assert bool((err <= sz[..., 0].t()[..., None] / 2 + 1e-5).all())


@pytest.mark.parametrize("fmt", ["float", "int8", "w8a8", "int4"])
def test_projection_matmul_is_its_dequantized_definition(fmt):
    w = torch.randn(3, 64, 96, generator=_gen(4))
    x = torch.randn(5, 96, generator=_gen(5))
    p = HostProjection(fmt, 3, 64, 96)
    p.set(0, w)
    for e in range(3):
        if fmt == "float":
            want = x @ w[e].t()
        elif fmt == "int8":
            want = x @ dequantize_int8(*int8_rows(w[e])).t()
        elif fmt == "w8a8":  # both sides rounded: the activations per token
            xq, xs = int8_tokens(x)
            want = dequantize_int8(xq, xs[:, 0]) @ dequantize_int8(*int8_rows(w[e])).t()
        else:
            want = x @ dequantize_int4(*int4_groups(w[e])).t()
        torch.testing.assert_close(p.mm(e, x), want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(p.mm(e, p.prepare(x), slice(1, 4)), want[1:4], rtol=1e-5, atol=1e-4)
        if fmt != "w8a8":
            torch.testing.assert_close(x @ p.dequantize(e).t(), want, rtol=1e-5, atol=1e-4)


def test_fbgemm_rounds_the_weights_per_row_and_the_rows_it_takes_to_one_uint8_grid():
    """FBGEMM's weights are `int8_rows`; its activations one uint8 grid over the rows of the call (7
    bits without VNNI), so each output is the exact product within the grid's rounding: half a step
    per activation, times the row's weights."""
    if not has_fbgemm():
        pytest.skip("torch has no FBGEMM here")
    w = torch.randn(2, 64, 96, generator=_gen(4))
    x = torch.randn(5, 96, generator=_gen(5))
    x[:, :3] *= 20  # outliers widen the grid
    p = HostProjection("fbgemm", 2, 64, 96)
    p.set(0, w)
    levels = 127 if FBGEMM_REDUCE_RANGE else 255
    for e in range(2):
        wq = dequantize_int8(*int8_rows(w[e]))
        assert torch.equal(p.dequantize(e), wq)
        for rows in (slice(0, 5), slice(2, 3)):
            xs = x[rows]
            step = (xs.max().clamp(min=0) - xs.min().clamp(max=0)) / levels
            bound = step / 2 * wq.abs().sum(dim=1) * 1.01 + 1e-4
            got = p.mm(e, p.prepare(x), rows)
            assert bool(((got - xs @ wq.t()).abs() <= bound).all())
            assert float((got - xs @ wq.t()).abs().max()) > 0  # the activations are rounded: not the float product


def test_int4_needs_row_tiles_and_groups():
    assert format_fits("int4", 32, 64) and not format_fits("int4", 24, 64) and not format_fits("int4", 32, 48)
    with pytest.raises(ValueError, match="cannot be held as int4"):
        HostProjection("int4", 1, 24, 64)


def _loop_over_pairs(host: HostExperts, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
    """The weighted sum over each token's experts, one (token, expert) pair at a time, through the
    weights `host` holds (dequantized)."""
    want = torch.zeros(x.shape)
    for i in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            ex = int(ids[i, j])
            gate, up = (x[i] @ host.gate_up.dequantize(ex).t()).chunk(2)
            want[i] += wts[i, j] * ((F.silu(gate) * up) @ host.down.dequantize(ex).t())
    return want


@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("fmt,tol", [("float", 1e-5), ("int8", 1e-5), ("w8a8", 3e-2), ("fbgemm", 3e-2), ("int4", 1e-5),
                                     ("compiled", 1e-5)])
def test_grouped_forward_matches_a_loop_over_tokens(fmt, tol, t):
    """Each format against a per-(token, expert) loop over the weights it holds (w8a8 and fbgemm also
    round the activations, hence their tolerance)."""
    if fmt == "fbgemm" and not has_fbgemm():
        pytest.skip("torch has no FBGEMM here")
    e, h, inter, k = 6, 64, 32, 2
    w13 = torch.randn(e, 2 * inter, h, generator=_gen(6)) / h**0.5
    w2 = torch.randn(e, h, inter, generator=_gen(7)) / inter**0.5
    x = torch.randn(t, h, generator=_gen(8))
    ids = torch.stack([torch.randperm(e, generator=_gen(9 + i))[:k] for i in range(t)])
    wts = torch.rand(t, k, generator=_gen(20))
    host = HostExperts.from_stacks(w13, w2, fmt)
    got = host.forward(x, ids, wts)
    want = _loop_over_pairs(host, x, ids, wts)
    assert got.dtype == torch.float32
    assert float((got - want).norm() / want.norm()) <= tol


@pytest.mark.parametrize("t", [1, 7])
def test_fbgemm_steps_from_torchscript_give_the_calls_from_python_to_the_bit(t):
    """fbgemm's groups run as one TorchScript function (`fbgemm_chains`): the same FBGEMM calls on the
    same rows in the same order as the Python path, so the same bits."""
    if not has_fbgemm():
        pytest.skip("torch has no FBGEMM here")
    e, h, inter, k = 12, 64, 32, 4
    host = HostExperts.from_stacks(torch.randn(e, 2 * inter, h, generator=_gen(60)) / h**0.5,
                                   torch.randn(e, h, inter, generator=_gen(61)) / inter**0.5, "fbgemm")
    x = torch.randn(t, h, generator=_gen(62))
    ids = torch.stack([torch.randperm(e, generator=_gen(63 + i))[:k] for i in range(t)])
    wts = torch.rand(t, k, generator=_gen(80))
    assert host.scripted and isinstance(fbgemm_chains_scripted(), torch.jit.ScriptFunction)
    scripted = host.forward(x, ids, wts)
    host.scripted = False
    assert torch.equal(host.forward(x, ids, wts), scripted)


@pytest.mark.parametrize("t", [1, 3, 6])
def test_compiled_steps_are_the_int8_rows_in_fp32(t):
    """A step of the compiled format runs its layer as one generated kernel with float activations: the
    int8 format's result (the same rows and scales) to fp32 rounding, into `out`."""
    if one_token_moe() is None:
        pytest.skip("torch.compile cannot build for this host")
    e, h, inter, k = 9, 96, 48, 3
    w13 = torch.randn(e, 2 * inter, h, generator=_gen(90)) / h**0.5
    w2 = torch.randn(e, h, inter, generator=_gen(91)) / inter**0.5
    compiled, int8 = HostExperts.from_stacks(w13, w2, "compiled"), HostExperts.from_stacks(w13, w2, "int8")
    x, wts = torch.randn(t, h, generator=_gen(92)), torch.rand(t, k, generator=_gen(93))
    experts = 0
    for seed in range(3):  # fresh experts each step: one compiled kernel serves every choice
        ids = torch.stack([torch.randperm(e, generator=_gen(94 + 7 * seed + i))[:k] for i in range(t)])
        buf = torch.full((t + 1, h), float("nan"))
        got = compiled.forward(x, ids, wts, out=buf[:t])
        assert got.data_ptr() == buf.data_ptr()
        torch.testing.assert_close(got, int8.forward(x, ids, wts), rtol=1e-5, atol=1e-5)
        experts += len(ids.unique())
    assert compiled.bytes_read == experts * (compiled.gate_up.nbytes + compiled.down.nbytes) // e


@pytest.mark.parametrize("t", [1, 5])
def test_compiled_int4_steps_are_their_4_bit_groups(t):
    """compiled-int4 holds each expert in 4-bit groups (6 bits a weight with the scales and offsets) and
    runs a step as one generated kernel: a loop over (token, expert) pairs through its dequantized
    weights, to fp32 rounding; within a group's half step of the float weights."""
    if one_token_moe() is None:
        pytest.skip("torch.compile cannot build for this host")
    e, h, inter, k = 6, 128, 256, 2
    w13 = torch.randn(e, 2 * inter, h, generator=_gen(40)) / h**0.5
    w2 = torch.randn(e, h, inter, generator=_gen(41)) / inter**0.5
    host = HostExperts.from_stacks(w13, w2, "compiled-int4")
    assert host.gate_up.nbytes == e * 2 * inter * h * 6 // 8
    assert float((host.down.dequantize(1) - w2[1]).abs().max()) <= float(w2[1].abs().max()) / 15 + 1e-6
    x, wts = torch.randn(t, h, generator=_gen(42)), torch.rand(t, k, generator=_gen(43))
    ids = torch.stack([torch.randperm(e, generator=_gen(44 + i))[:k] for i in range(t)])
    got = host.forward(x, ids, wts)
    want = _loop_over_pairs(host, x, ids, wts)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert host.bytes_read == len(ids.unique()) * (host.gate_up.nbytes + host.down.nbytes) // e
    # Where the kernels cannot be built, the per-expert path computes the same from the same groups.
    torch.testing.assert_close(host.gate_up.mm(ids[0, 0].item(), x), x @ host.gate_up.dequantize(ids[0, 0].item()).t())
    assert format_fits("compiled-int4", 64, 256) and not format_fits("compiled-int4", 64, 96)


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="host expert format"):
        HostExperts("int2", 4, 2, 4)


def test_forward_writes_into_the_given_buffer():
    w13, w2 = torch.randn(4, 16, 32, generator=_gen(30)), torch.randn(4, 32, 8, generator=_gen(31))
    host = HostExperts.from_stacks(w13, w2, "float")
    x, ids, wts = torch.randn(3, 32, generator=_gen(32)), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2)
    buf = torch.full((5, 32), float("nan"))
    got = host.forward(x, ids, wts, out=buf[:3])
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(got, host.forward(x, ids, wts))


def test_stream_stack_carves_the_same_layout_from_any_region():
    w13, w2 = torch.randn(3, 8, 16), torch.randn(3, 16, 4)
    stack = StreamStack.of_float(w13.bfloat16(), w2.bfloat16())
    assert stack.nbytes % 256 == 0 and stack.nbytes >= (w13.numel() + w2.numel()) * 2
    copy = stack.region.clone()
    a13, a2 = stack.stacks(copy)
    assert torch.equal(a13, w13.bfloat16()) and torch.equal(a2, w2.bfloat16())
    assert a13.data_ptr() == copy.data_ptr()


def test_stream_stack_of_quantized_blocks_gives_back_the_stacks():
    from strata.kernels.quant import random_blocks
    from strata.kernels.quant.moe_q import QExpertStack

    q13 = QExpertStack.from_raw("Q8_0", random_blocks("Q8_0", 3 * 16, 64, _gen(1), "cpu").view(3, 16, -1))
    q2 = QExpertStack.from_raw("Q8_0", random_blocks("Q8_0", 3 * 64, 32, _gen(2), "cpu").view(3, 64, -1))
    stack = StreamStack.of_quant(q13, q2)
    b13, b2 = stack.stacks(stack.region.clone())
    assert (b13.ggml_type, b13.num_experts, b13.n, b13.k) == ("Q8_0", 3, 16, 64) and (b2.n, b2.k) == (64, 32)
    torch.testing.assert_close(b13.dequantize(), q13.dequantize(), rtol=0, atol=0)
    torch.testing.assert_close(b2.dequantize(), q2.dequantize(), rtol=0, atol=0)


def test_stream_crossover_is_the_first_step_size_whose_cpu_time_passes_the_copy():
    assert stream_crossover({1: 1.0, 2: 1.5, 4: 2.5, 8: 4.0}, copy_seconds=2.0) == 4
    assert stream_crossover({1: 3.0, 2: 4.0}, copy_seconds=2.0) == 1
    # Past the largest size measured: along the last two sizes (4 ms more each 4 tokens -> 4 + 2 tokens).
    assert stream_crossover({1: 1.0, 4: 2.0, 8: 6.0}, copy_seconds=8.0) == 10
    assert stream_crossover({1: 1.0, 2: 1.0}, copy_seconds=2.0) == NEVER


def test_host_step_seconds_times_a_step_and_leaves_the_counters():
    g = torch.Generator().manual_seed(3)
    host = HostExperts.from_stacks(torch.randn(8, 32, 16, generator=g), torch.randn(8, 16, 16, generator=g))
    host.forward(torch.randn(2, 16), torch.tensor([[0, 1], [2, 3]]), torch.full((2, 2), 0.5))
    seconds, read = host.seconds, host.bytes_read
    assert host_step_seconds(host, 4, 2) > 0
    assert (host.seconds, host.bytes_read) == (seconds, read)


@pytest.mark.parametrize("fmt", ["float", "int8", "compiled", "compiled-int4", "file"])
def test_a_projections_size_is_what_its_format_holds(fmt):
    from strata.models.host_experts import HostProjection, projection_bytes

    p = HostProjection(fmt, 3, 64, 256)
    held = sum(t.numel() * t.element_size() for t in (getattr(p, a, None) for a in ("w", "scale", "offset"))
               if t is not None)
    assert p.nbytes == held == projection_bytes(fmt, 3, 64, 256)
