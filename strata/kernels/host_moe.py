"""A MoE layer's routed experts for one token on the CPU, from int8 rows, as one kernel that torch.compile
generates (its C++ backend: loops vectorized and split over torch's OpenMP threads, no hand-written SIMD).

FBGEMM's dynamic-quantized linear reads a large int8 matrix at the host's memory bandwidth, but an
80B-A3B expert is 1 MiB: a decode step makes two calls per expert and ten experts per layer, and each
call's fixed cost (its parallel region, rounding the activations, the output) outweighs its reading.
Here the chosen experts' rows are one flat range of work: a single parallel loop over every gate|up
row of the k experts, then one over every down row, then the weighted sum, in one call per layer.

Weights are int8 with one fp32 scale per output row (`host_experts.int8_rows`), held flat:
gate|up [E * 2I, H] and down [E * H, I]. `one_token_moe_ref` is the same computation eagerly (it
gathers the chosen rows, so it is slow); `one_token_moe` compiles it once per shape, or returns None
where torch.compile cannot build for this host (no C++ compiler), and callers keep their other path.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("strata")


def one_token_moe_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                      s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """x fp32 [1, H], ids int64 [k], weights fp32 [k], w13 int8 [E * 2I, H] with s13 [E * 2I], w2 int8
    [E * H, I] with s2 [E * H] -> fp32 [1, H]: sum_j weights[j] * down_j(silu(gate_j(x)) * up_j(x))."""
    k, hidden = ids.shape[0], x.shape[-1]
    inter = w2.shape[1]
    rows = (ids[:, None] * (2 * inter) + torch.arange(2 * inter)).reshape(-1)
    gate_up = ((w13[rows].float() * x).sum(-1) * s13[rows]).view(k, 2 * inter)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    rows = (ids[:, None] * hidden + torch.arange(hidden)).reshape(-1)
    # Each down row meets its expert's activation: one flat loop over all k * H rows, not k loops.
    act_rows = act[:, None, :].expand(k, hidden, inter).reshape(k * hidden, inter)
    y = ((w2[rows].float() * act_rows).sum(-1) * s2[rows]).view(k, hidden)
    return (y * weights[:, None]).sum(0, keepdim=True)


@functools.cache
def one_token_moe():
    """`one_token_moe_ref` through torch.compile (built on its first call per shape), or None where
    that build fails on this host (logged once)."""
    try:
        fn = torch.compile(one_token_moe_ref, fullgraph=True, dynamic=False)
        h, i, e, k = 64, 32, 4, 2
        fn(torch.zeros(1, h), torch.arange(k), torch.ones(k), torch.zeros(e * 2 * i, h, dtype=torch.int8),
           torch.ones(e * 2 * i), torch.zeros(e * h, i, dtype=torch.int8), torch.ones(e * h))
        return fn
    except Exception as exc:  # noqa: BLE001 - no C++ compiler or an inductor failure: the other path serves
        log.warning("the compiled one-token expert kernel is unavailable here (%s); single-token steps keep "
                    "the per-expert path", str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return None
