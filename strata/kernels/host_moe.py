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


def _compiled(ref, probe_rows: int):
    """`ref` compiled with every size a constant (one build per layer shape) but the pair count where the
    caller marks it (`_mark_pairs`), tried once on a small probe."""
    try:
        fn = torch.compile(ref, fullgraph=True, dynamic=False)
        h, i, e = 64, 32, 4
        xs, ids, weights = torch.zeros(probe_rows, h), torch.arange(2) % e, torch.ones(2)
        if probe_rows > 1:
            _mark_pairs(xs, ids, weights)
        fn(xs, ids, weights, torch.zeros(e * 2 * i, h, dtype=torch.int8), torch.ones(e * 2 * i),
           torch.zeros(e * h, i, dtype=torch.int8), torch.ones(e * h))
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
