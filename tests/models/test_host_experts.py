"""Routed experts in host RAM (strata/models/host_experts.py): each CPU format against its definition
on fresh random weights, and the grouped forward against a per-token loop over the same experts."""

import pytest
import torch
import torch.nn.functional as F

from strata.models.host_experts import (HostExperts, HostWeight, dequantize_int4, dequantize_int8, format_fits,
                                        int4_groups, int8_rows)


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


@pytest.mark.parametrize("fmt", ["float", "int8", "int4"])
def test_host_weight_matmul_is_its_dequantized_definition(fmt):
    w = torch.randn(64, 96, generator=_gen(4))
    x = torch.randn(5, 96, generator=_gen(5))
    hw = HostWeight(w, fmt)
    if fmt == "float":
        want = x @ w.t()
    elif fmt == "int8":
        want = x @ dequantize_int8(*int8_rows(w)).t()
    else:
        want = x @ dequantize_int4(*int4_groups(w)).t()
    torch.testing.assert_close(hw.mm(x), want, rtol=1e-5, atol=1e-4)


def test_int4_needs_row_tiles_and_groups():
    assert format_fits("int4", 32, 64) and not format_fits("int4", 24, 64) and not format_fits("int4", 32, 48)
    with pytest.raises(ValueError, match="cannot be held as int4"):
        HostWeight(torch.zeros(24, 64), "int4")


@pytest.mark.parametrize("fmt,tol", [("float", 1e-5), ("int8", 2e-2), ("int4", 0.15)])
def test_grouped_forward_matches_a_loop_over_tokens(fmt, tol):
    e, h, inter, t, k = 6, 64, 32, 7, 2
    w13 = torch.randn(e, 2 * inter, h, generator=_gen(6)) / h**0.5
    w2 = torch.randn(e, h, inter, generator=_gen(7)) / inter**0.5
    x = torch.randn(t, h, generator=_gen(8))
    ids = torch.stack([torch.randperm(e, generator=_gen(9 + i))[:k] for i in range(t)])
    wts = torch.rand(t, k, generator=_gen(20))
    got = HostExperts.from_stacks(w13, w2, fmt).forward(x, ids, wts)
    want = torch.zeros(t, h)
    for i in range(t):
        for j in range(k):
            gate, up = (x[i] @ w13[ids[i, j]].t()).chunk(2)
            want[i] += wts[i, j] * ((F.silu(gate) * up) @ w2[ids[i, j]].t())
    assert got.dtype == torch.float32
    assert float((got - want).norm() / want.norm()) <= tol


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="host expert format"):
        HostExperts([torch.zeros(4, 4)], [torch.zeros(4, 2)], "int2")
