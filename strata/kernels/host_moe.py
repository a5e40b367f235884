"""A MoE layer's routed experts for a few tokens on the CPU, from int8 rows, as kernels that torch.compile
generates (its C++ backend: loops vectorized and split over torch's OpenMP threads, no hand-written SIMD).

FBGEMM's dynamic-quantized linear reads a large int8 matrix at the host's memory bandwidth, but an
80B-A3B expert is 1 MiB: a decode step makes two calls per expert and ten experts per layer, and each
call's fixed cost (its parallel region, rounding the activations, the output) outweighs its reading.
Here a step's (token, expert) pairs are one flat range of work: a single parallel loop over every
gate|up row of every pair, then one over every down row, in one call per layer. A pair reads its
expert's rows itself; pairs of one expert sit side by side, so the rows a second pair reads are still in
the core's cache.

Weights are int8 with one fp32 scale per output row (`host_experts.int8_rows`), held flat:
gate|up [E * 2I, H] and down [E * H, I]. `pairs_moe_ref` and `one_token_moe_ref` are the computation
eagerly (they gather the chosen rows, so they are slow); `one_token_moe` (one token, its k experts: a
decode step) and `pairs_moe` (any number of pairs) compile them once per layer shape, or return None
where torch.compile cannot build for this host (no C++ compiler), and callers keep their other path.

The same layer from 4-bit levels (`int4_words`): groups of 32 values along each row with an fp32 scale
and offset each (w = level * scale + offset, the group's minimum at level 0 and its maximum at 15), the
levels packed eight to an int32 word so that a vector of 16 words, shifted by 4 n, holds 16 consecutive
levels (value 128 b + 16 n + l of a row is nibble n of word 16 b + l): the generated loop widens a
whole vector of words per shift instead of a partial vector of bytes. 0.75 bytes a weight against
int8's 1; `pairs_moe_int4` and `one_token_moe_int4` as above.
"""

from __future__ import annotations

import functools
import logging
import shutil

import torch
import torch.nn.functional as F

log = logging.getLogger("strata")


def has_cpp_compiler() -> bool:
    """Whether a C++ compiler torch.compile's C++ backend can use is on the PATH."""
    return any(shutil.which(cxx) for cxx in ("g++", "clang++", "c++"))


def pairs_moe_ref(xs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                  s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """xs fp32 [P, H] (each pair's token row), ids int64 [P], weights fp32 [P], w13 int8 [E * 2I, H] with
    s13 [E * 2I], w2 int8 [E * H, I] with s2 [E * H] -> fp32 [P, H]:
    weights[p] * down_p(silu(gate_p(xs[p])) * up_p(xs[p])), expert ids[p]."""
    p, hidden = xs.shape
    inter = w2.shape[1]
    rows = (ids[:, None] * (2 * inter) + torch.arange(2 * inter)).reshape(-1)
    # Each row meets its pair's input: one flat loop over all P * 2I rows (then P * H), not P loops.
    x_rows = xs[:, None, :].expand(p, 2 * inter, hidden).reshape(p * 2 * inter, hidden)
    gate_up = ((w13[rows].float() * x_rows).sum(-1) * s13[rows]).view(p, 2 * inter)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    rows = (ids[:, None] * hidden + torch.arange(hidden)).reshape(-1)
    act_rows = act[:, None, :].expand(p, hidden, inter).reshape(p * hidden, inter)
    y = ((w2[rows].float() * act_rows).sum(-1) * s2[rows]).view(p, hidden)
    return y * weights[:, None]


def one_token_moe_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                      s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """x fp32 [1, H] and its k experts (ids [k], weights [k]) -> fp32 [1, H]: the sum of its pairs."""
    return pairs_moe_ref(x.expand(ids.shape[0], x.shape[-1]), ids, weights, w13, s13, w2, s2).sum(0, keepdim=True)


def _compiled(ref, probe_rows: int, int4: bool = False):
    """`ref` compiled with every size a constant (one build per layer shape) but the pair count where the
    caller marks it (`_mark_pairs`), tried once on a small probe."""
    try:
        fn = torch.compile(ref, fullgraph=True, dynamic=False)
        h, i, e = 128, 128, 4
        xs, ids, weights = torch.zeros(probe_rows, h), torch.arange(2) % e, torch.ones(2)
        if probe_rows > 1:
            _mark_pairs(xs, ids, weights)
        if int4:
            planes = (*int4_words(torch.zeros(e * 2 * i, h)), *int4_words(torch.zeros(e * h, i)))
        else:
            planes = (torch.zeros(e * 2 * i, h, dtype=torch.int8), torch.ones(e * 2 * i),
                      torch.zeros(e * h, i, dtype=torch.int8), torch.ones(e * h))
        fn(xs, ids, weights, *planes)
        return fn
    except Exception as exc:  # noqa: BLE001 - no C++ compiler or an inductor failure: the other path serves
        log.warning("the compiled expert kernels are unavailable here (%s); CPU expert steps keep the "
                    "per-expert path", str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return None


@functools.cache
def one_token_moe():
    """`one_token_moe_ref` through torch.compile (built on its first call per shape), or None."""
    return _compiled(one_token_moe_ref, 1)


@functools.cache
def _pairs_moe():
    return _compiled(pairs_moe_ref, 2)


def pairs_moe(xs, ids, weights, w13, s13, w2, s2) -> torch.Tensor | None:
    """`pairs_moe_ref` through torch.compile, one kernel for any number of pairs (built on its first call
    per layer shape), or None where it cannot be built."""
    fn = _pairs_moe()
    if fn is None:
        return None
    _mark_pairs(xs, ids, weights)
    return fn(xs, ids, weights, w13, s13, w2, s2)


def _mark_pairs(*tensors: torch.Tensor) -> None:
    """The pair count varies from step to step: a size of the kernel, not a constant compiled into it."""
    for t in tensors:
        torch._dynamo.mark_dynamic(t, 0)


INT4_GROUP = 32  # values sharing a scale and an offset
INT4_BLOCK = 128  # values of a row in one vector of 16 words


def int4_words(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., N, K] float (K a multiple of 128) -> (int32 words [..., N, K / 8], fp32 scale and offset
    [..., N, K / 32]): each group of 32 values as offset + scale * level, levels 0..15. A group whose values
    already lie on such a grid (`lattice_steps`: a 4-bit format's group, IQ3_S's, Q4_K's, Q4_0's) keeps
    that grid, so the file's weights come back exactly; any other takes 16 levels from its minimum to its
    maximum."""
    *lead, n, k = w.shape
    if k % INT4_BLOCK:
        raise ValueError(f"int4 words take rows of a multiple of {INT4_BLOCK} values, not {k}")
    g = w.float().reshape(*lead, n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    step = lattice_steps(g, lo)
    scale = torch.where(torch.isnan(step), (hi - lo) / 15.0, step)
    levels = torch.round((g - lo[..., None]) / scale.clamp(min=1e-30)[..., None]).clamp(0, 15).to(torch.int32)
    levels = levels.reshape(*lead, n, k // INT4_BLOCK, 8, 16)
    words = levels[..., 0, :].clone()
    for nibble in range(1, 8):
        words |= levels[..., nibble, :] << (4 * nibble)
    return words.reshape(*lead, n, k // 8).contiguous(), scale.contiguous(), lo.contiguous()


LATTICE_TOLERANCE = 1e-3  # of a step: how far a value may sit from its grid point (the file's rounding)


def lattice_steps(g: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Groups g [..., G, 32] and their minima lo [..., G] -> [..., G]: for each group the largest step s
    with every value at lo + j * s for a whole j in 0..15, NaN where there is none. Only groups of at most
    16 distinct values can have one; the candidate steps are the smallest gap between two of them divided
    by 1..15 (a 4-bit format's group may skip levels: its gaps are whole multiples of its step). A group of
    one value has step 0."""
    flat = g.reshape(-1, g.shape[-1])
    base = lo.reshape(-1)
    gaps = flat.sort(dim=-1).values.diff(dim=-1)
    distinct = (gaps > 0).sum(dim=-1) + 1
    smallest = torch.where(gaps > 0, gaps, torch.full_like(gaps, float("inf"))).amin(dim=-1)
    out = torch.full_like(base, float("nan"))
    out[distinct == 1] = 0.0
    todo = torch.nonzero((distinct > 1) & (distinct <= 16)).squeeze(1)
    for m in range(1, 16):
        if todo.numel() == 0:
            break
        s = smallest[todo] / m
        j = (flat[todo] - base[todo, None]) / s[:, None]
        whole = ((j - j.round()).abs() <= LATTICE_TOLERANCE).all(dim=-1) & (j.round().amax(dim=-1) <= 15)
        out[todo[whole]] = s[whole]
        todo = todo[~whole]
    return out.view(lo.shape)


def int4_levels(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., N, K / 8] -> the levels [..., N, K] (int32, 0..15) in value order."""
    *lead, n, kw = words.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32).view(8, 1)
    levels = (words.reshape(*lead, n, kw // 16, 1, 16) >> shifts) & 15
    return levels.reshape(*lead, n, kw * 8)


def dequantize_int4_words(words: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """`int4_words`' inverse: fp32 [..., N, K]."""
    levels = int4_levels(words).float()
    *lead, n, k = levels.shape
    g = levels.view(*lead, n, k // INT4_GROUP, INT4_GROUP)
    return (g * scale[..., None] + offset[..., None]).view(*lead, n, k)


def _int4_dot(x_rows: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
              rows: torch.Tensor) -> torch.Tensor:
    """x_rows [R, K] fp32, each against its row `rows[r]` of the 4-bit planes -> [R]."""
    r, k = x_rows.shape
    blocks = k // INT4_BLOCK
    w = words[rows].view(r, blocks, 1, 16)
    levels = ((w >> (torch.arange(0, 32, 4, dtype=torch.int32).view(1, 1, 8, 1))) & 15).float()
    # A group of 32 is two nibbles' 16 lanes: its scale and offset repeat over both.
    s = scale[rows].view(r, blocks, 4, 1).repeat_interleave(2, dim=2)
    m = offset[rows].view(r, blocks, 4, 1).repeat_interleave(2, dim=2)
    return ((levels * s + m) * x_rows.view(r, blocks, 8, 16)).sum((-1, -2, -3))


def pairs_moe_int4_ref(xs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                       s13: torch.Tensor, m13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                       m2: torch.Tensor) -> torch.Tensor:
    """`pairs_moe_ref` from 4-bit planes: w13 words [E * 2I, H / 8] with s13 / m13 [E * 2I, H / 32], w2
    words [E * H, I / 8] with s2 / m2 [E * H, I / 32]."""
    p, hidden = xs.shape
    inter = s2.shape[1] * INT4_GROUP
    rows = (ids[:, None] * (2 * inter) + torch.arange(2 * inter)).reshape(-1)
    x_rows = xs[:, None, :].expand(p, 2 * inter, hidden).reshape(p * 2 * inter, hidden)
    gate_up = _int4_dot(x_rows, w13, s13, m13, rows).view(p, 2 * inter)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    rows = (ids[:, None] * hidden + torch.arange(hidden)).reshape(-1)
    act_rows = act[:, None, :].expand(p, hidden, inter).reshape(p * hidden, inter)
    y = _int4_dot(act_rows, w2, s2, m2, rows).view(p, hidden)
    return y * weights[:, None]


def one_token_moe_int4_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *planes) -> torch.Tensor:
    return pairs_moe_int4_ref(x.expand(ids.shape[0], x.shape[-1]), ids, weights, *planes).sum(0, keepdim=True)


@functools.cache
def one_token_moe_int4():
    """`one_token_moe_int4_ref` through torch.compile, or None."""
    return _compiled(one_token_moe_int4_ref, 1, int4=True)


@functools.cache
def _pairs_moe_int4():
    return _compiled(pairs_moe_int4_ref, 2, int4=True)


def pairs_moe_int4(xs, ids, weights, *planes) -> torch.Tensor | None:
    """`pairs_moe_int4_ref` through torch.compile, or None where it cannot be built."""
    fn = _pairs_moe_int4()
    if fn is None:
        return None
    _mark_pairs(xs, ids, weights)
    return fn(xs, ids, weights, *planes)
