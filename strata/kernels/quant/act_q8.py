"""Activations quantized to int8 per 32 values inside the decode GEMVs, so the weight side of the dot
runs on the int8 tensor cores with no per-weight conversion (llama.cpp's MMVQ does the same with its
q8_1 activations).

Why: a decode GEMV that dequantizes every weight to bf16 spends ~3 (Q8_0) to ~8 (Q4_K) instructions
per weight on conversions, and the H200's int->float conversions issue at 16 per clock per SM: the
kernel is ALU-bound at a fraction of HBM bandwidth. With x in int8 the weights' integer codes enter
the MMA as they are, and the scales apply once per 32 values.

Semantics, per row of x and per run of 32 values along K (`quantize_ref`, the definition):
  amax = max |x| in fp32;  dx = amax / 127;  q = round_half_even(x · (127 / amax)), in [-127, 127]
  (all three fp32 operations correctly rounded; a zero run has dx = 0 and q = 0). A product is then
  Σ_groups (Σ_j w_q[j]·q[j]) · w_scale · dx, the inner sum exact in int32. The error is x's rounding
  to 8 bits (~2⁻⁹ of the run's largest value per element), about the bf16 rounding the dequantizing
  kernels apply to each weight instead. Each row is quantized alone, so a row's result never depends
  on the other rows of the batch.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:  # CPU-only installs: the reference works, the kernels are never launched

    def jit(fn=None, **_options):
        return fn if fn is not None else (lambda f: f)


GROUP = 32


def quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 32 == 0) -> (q int8 [M, K], dx fp32 [M, K/32]), the definition above."""
    m, k = x.shape
    v = x.float().view(m, k // GROUP, GROUP)
    amax = v.abs().amax(-1)
    c127 = torch.full_like(amax, 127.0)
    # Tensor / tensor: one correctly rounded division (torch computes `127.0 / t` as 127 · (1 / t)).
    inv = torch.where(amax > 0, c127 / amax, torch.zeros_like(amax))
    q = torch.round(v * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(m, k), amax / c127


@jit
def quantize_groups(xv, GROUP_AXIS: tl.constexpr):
    """xv fp32 with runs of 32 along axis GROUP_AXIS (the others any) -> (q int8 of xv's shape, dx
    fp32 with that axis reduced): `quantize_ref` element for element."""
    amax = tl.max(tl.abs(xv), axis=GROUP_AXIS)
    inv = tl.where(amax > 0, tl.div_rn(tl.full(amax.shape, 127.0, tl.float32), amax), 0.0)
    v = xv * tl.expand_dims(inv, GROUP_AXIS)
    # Adding and subtracting 1.5 · 2²³ rounds |v| < 2²² to the nearest integer, ties to even.
    q = ((v + 12582912.0) - 12582912.0).to(tl.int8)
    return q, tl.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
