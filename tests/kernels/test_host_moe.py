"""The expert kernels torch.compile generates (strata/kernels/host_moe.py) against their eager
definitions and against the dequantized float math, on fresh random int8 rows."""

import pytest
import torch
import torch.nn.functional as F

from strata.kernels.host_moe import (dequantize_int4_words, int4_levels, int4_words, one_token_moe, one_token_moe_int4,
                                     one_token_moe_int4_ref, one_token_moe_ref, pairs_moe, pairs_moe_int4,
                                     pairs_moe_int4_ref, pairs_moe_ref)


def _layer(seed, e, h, inter):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randint(-127, 128, (e * 2 * inter, h), generator=g, dtype=torch.int8)
    w2 = torch.randint(-127, 128, (e * h, inter), generator=g, dtype=torch.int8)
    s13 = torch.rand(e * 2 * inter, generator=g) / (127 * h**0.5)
    s2 = torch.rand(e * h, generator=g) / (127 * inter**0.5)
    return g, w13, s13, w2, s2


@pytest.mark.parametrize("e,h,inter,k", [(8, 64, 32, 2), (5, 80, 48, 5)])
def test_compiled_kernel_is_its_definition(e, h, inter, k):
    kernel = one_token_moe()
    if kernel is None:
        pytest.skip("torch.compile cannot build for this host")
    g, w13, s13, w2, s2 = _layer(e * h, e, h, inter)
    x = torch.randn(1, h, generator=g)
    ids = torch.randperm(e, generator=g)[:k]
    wts = torch.rand(k, generator=g)
    got = kernel(x, ids, wts, w13, s13, w2, s2)
    ref = one_token_moe_ref(x, ids, wts, w13, s13, w2, s2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    want = torch.zeros(1, h)
    for j, ex in enumerate(ids.tolist()):
        up_rows = slice(ex * 2 * inter, (ex + 1) * 2 * inter)
        gate, up = (x @ (w13[up_rows].float() * s13[up_rows, None]).t()).chunk(2, dim=-1)
        down_rows = slice(ex * h, (ex + 1) * h)
        want += wts[j] * ((F.silu(gate) * up) @ (w2[down_rows].float() * s2[down_rows, None]).t())
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-6)


def test_one_pairs_kernel_serves_every_pair_count():
    """Steps of different sizes through one kernel (the pair count is a size of it, not a constant),
    each pair's rows weighted by its own weight, pairs of one expert side by side or apart."""
    if one_token_moe() is None:
        pytest.skip("torch.compile cannot build for this host")
    e, h, inter = 6, 48, 32
    g, w13, s13, w2, s2 = _layer(11, e, h, inter)
    for p in (3, 8, 13):
        xs = torch.randn(p, h, generator=g)
        ids = torch.randint(0, e, (p,), generator=g)
        wts = torch.rand(p, generator=g)
        got = pairs_moe(xs, ids, wts, w13, s13, w2, s2)
        torch.testing.assert_close(got, pairs_moe_ref(xs, ids, wts, w13, s13, w2, s2), rtol=1e-5, atol=1e-6)
        for q in range(p):
            alone = one_token_moe_ref(xs[q:q + 1], ids[q:q + 1], wts[q:q + 1], w13, s13, w2, s2)
            torch.testing.assert_close(got[q:q + 1], alone, rtol=1e-5, atol=1e-6)


def test_int4_words_hold_each_value_within_half_its_group_step():
    """Each group of 32 at 16 levels between its minimum and maximum (both exact), levels packed so
    `int4_levels` gives them back in value order."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 256, generator=g) * torch.rand(6, 1, generator=g) * 4
    words, scale, offset = int4_words(w)
    assert words.dtype == torch.int32 and words.shape == (6, 32) and scale.shape == offset.shape == (6, 8)
    levels = int4_levels(words)
    assert int(levels.min()) == 0 and int(levels.max()) == 15
    back = dequantize_int4_words(words, scale, offset)
    groups = w.view(6, 8, 32)
    torch.testing.assert_close(back.view(6, 8, 32).amin(-1), groups.amin(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(back.view(6, 8, 32).amax(-1), groups.amax(-1), rtol=0, atol=1e-5)
    assert bool(((back - w).abs().view(6, 8, 32) <= scale[..., None] / 2 + 1e-5).all())
    with pytest.raises(ValueError, match="multiple of 128"):
        int4_words(torch.randn(2, 96))


@pytest.mark.parametrize("ggml_type", ["IQ3_S", "Q4_K", "Q4_0"])
def test_int4_words_keep_a_4_bit_files_weights_exactly(ggml_type):
    """A file's 4-bit groups (IQ3_S's odd multiples of a group scale, Q4_K's and Q4_0's levels) keep
    their own grid: the words give the dequantized file weights back exactly."""
    from strata.kernels.quant import format_module, random_blocks

    mod = format_module(ggml_type)
    raw = random_blocks(ggml_type, 12, 512, torch.Generator().manual_seed(5), "cpu")
    w = mod.dequantize(mod.repack(raw), 12, 512).float()
    back = dequantize_int4_words(*int4_words(w))
    assert torch.equal(back, w), float((back - w).abs().max())


def test_int4_words_of_a_stack_are_those_of_each_expert():
    """A chunk of experts rounded in one call (a GPU load's way) gives each expert's own words, scales and
    offsets (the host's way, one at a time): a file's grid and a float expert's range alike."""
    from strata.kernels.quant import format_module, random_blocks

    mod = format_module("IQ3_S")
    raw = random_blocks("IQ3_S", 3 * 16, 256, torch.Generator().manual_seed(6), "cpu")
    file = mod.dequantize(mod.repack(raw), 3 * 16, 256).float().view(3, 16, 256)
    floats = torch.randn(3, 16, 256, generator=torch.Generator().manual_seed(7))
    for stack in (file, floats):
        whole = int4_words(stack)
        for e in range(3):
            for got, want in zip(whole, int4_words(stack[e])):
                assert torch.equal(got[e], want)


def test_lattice_steps_find_a_groups_grid_or_none():
    """A grid with skipped levels is still found (its smallest gap is a multiple of the step); a group of
    one value has step 0; more than 16 distinct values, or values off any grid of 16 levels, have none."""
    from strata.kernels.host_moe import lattice_steps

    on = torch.tensor([-15.0, -9, -3, 3, 15] * 6 + [9, 9]) * 0.125  # odd multiples of 0.125, gaps of 6 and 12
    single = torch.full((32,), 0.5)
    wide = torch.arange(32.0)  # 32 levels
    halves = torch.tensor([0.0, 1, 2, 3.5] * 8)  # gaps of 1 and 1.5: a step of a half
    off = torch.tensor([0.0, 1, 2.7] * 10 + [0, 1])  # 2.7 is 27 tenths: no grid of 16 levels holds it
    groups = torch.stack([on, single, wide, halves, off])
    steps = lattice_steps(groups, groups.amin(-1))
    assert steps[0].item() == 0.75 and steps[1].item() == 0.0 and steps[3].item() == 0.5
    assert torch.isnan(steps[2]) and torch.isnan(steps[4])
    jitter = groups[:1] + torch.linspace(0, 1e-2, 32)  # a hundredth of a step off: no grid
    assert torch.isnan(lattice_steps(jitter, jitter.amin(-1))).all()


def _int4_layer(seed, e, h, inter):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e * 2 * inter, h, generator=g) / h**0.5
    w2 = torch.randn(e * h, inter, generator=g) / inter**0.5
    return g, (*int4_words(w13), *int4_words(w2))


@pytest.mark.parametrize("e,h,inter,k", [(8, 128, 128, 2), (5, 256, 384, 5)])
def test_compiled_int4_kernel_is_its_definition(e, h, inter, k):
    """The generated kernel against the eager definition, and that against the float math over the
    dequantized weights."""
    kernel = one_token_moe_int4()
    if kernel is None:
        pytest.skip("torch.compile cannot build for this host")
    g, planes = _int4_layer(e * h, e, h, inter)
    x = torch.randn(1, h, generator=g)
    ids = torch.randperm(e, generator=g)[:k]
    wts = torch.rand(k, generator=g)
    ref = one_token_moe_int4_ref(x, ids, wts, *planes)
    torch.testing.assert_close(kernel(x, ids, wts, *planes), ref, rtol=1e-5, atol=1e-5)
    w13, w2 = dequantize_int4_words(*planes[:3]), dequantize_int4_words(*planes[3:])
    want = torch.zeros(1, h)
    for j, ex in enumerate(ids.tolist()):
        gate, up = (x @ w13[ex * 2 * inter:(ex + 1) * 2 * inter].t()).chunk(2, dim=-1)
        want += wts[j] * ((F.silu(gate) * up) @ w2[ex * h:(ex + 1) * h].t())
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
    for p in (3, 9):  # the pairs kernel: one build for every pair count
        xs, pids, pw = torch.randn(p, h, generator=g), torch.randint(0, e, (p,), generator=g), torch.rand(p, generator=g)
        torch.testing.assert_close(pairs_moe_int4(xs, pids, pw, *planes),
                                   pairs_moe_int4_ref(xs, pids, pw, *planes), rtol=1e-5, atol=1e-5)
