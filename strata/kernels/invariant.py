"""Batch-invariant products for `--batch-invariant`: a row's result does not depend on the
other rows computed with it, on how many there are, or on how long the longest context in the step is.

These are the torch forms the CPU runs (and the definitions the GPU kernels of the mode follow). BLAS
picks its kernels and K blocking from the problem's shape: a matrix of 1-3 rows takes another path
than one of 8 (a different summation order, so other low bits), and a product over 320 keys is
blocked differently from one over 384. So every product here has a shape that leaves a row's order
alone:
- rows are padded to a multiple of ROW_MULTIPLE (at least ROW_MULTIPLE): measured with torch's MKL, a
  row's fp32 result is then the same at any row count, from 8 rows up on an AVX2 machine and from 16 up
  with AVX-512 (where 8 rows take another kernel than 16); `tests/engine/test_batch_invariance.py`
  checks it end to end, so a BLAS for which it fails shows there;
- attention's keys are cut at absolute multiples of KEY_BLOCK, and the blocks' P·V products (each over
  exactly KEY_BLOCK keys) are added in key order: a query's sum has the same grouping whatever the
  step's longest context. Masked keys carry probability 0 and add exact zeros.

The padding costs compute, not memory traffic: a CPU decode step multiplies 16 rows where it had 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_MULTIPLE = 16
KEY_BLOCK = 256


def padded_rows(n: int) -> int:
    return max(ROW_MULTIPLE, -(-n // ROW_MULTIPLE) * ROW_MULTIPLE)


def _pad(x: torch.Tensor, dim: int, size: int, value: float = 0.0) -> torch.Tensor:
    if x.shape[dim] == size:
        return x
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_full(shape, value)], dim)


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x with zero rows appended up to `padded_rows`. Also for elementwise functions on few values:
    torch's CPU loops take a scalar path below a vector's worth of elements and a vectorized one above,
    whose exp (sigmoid, SiLU) differ in the last bit, so a router's [rows, experts] scores must not be
    computed on a tensor whose size follows the batch."""
    return _pad(x, 0, padded_rows(x.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over x [..., K] with the rows padded to `padded_rows`; returns x's rows only."""
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    out = F.linear(_pad(flat, 0, padded_rows(n)), weight, bias)[:n]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
              scale: float | None = None) -> torch.Tensor:
    """Softmax attention, q [B, Hq, Q, D], k/v [B, Hkv, L, D] (grouped-query aware), allowed [B, Q, L]
    (True where a query sees a key) -> [B, Hq, Q, D] in q's dtype. Scores and sums in fp32. Every query
    must see at least one key."""
    b, hq, nq, d = q.shape
    group = hq // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    keys = -(-k.shape[2] // KEY_BLOCK) * KEY_BLOCK
    k, v = _pad(k.float(), 2, keys), _pad(v.float(), 2, keys)
    allowed = _pad(allowed, 2, keys, False)
    qp = _pad(q.float(), 2, padded_rows(nq))
    s = torch.matmul(qp, k.transpose(-1, -2))[:, :, :nq] * (scale if scale is not None else d ** -0.5)
    p = torch.softmax(s.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
    p = _pad(p, 2, qp.shape[2])
    out = torch.zeros(b, hq, qp.shape[2], d, dtype=torch.float32, device=q.device)
    for j in range(0, keys, KEY_BLOCK):
        out = out + torch.matmul(p[..., j : j + KEY_BLOCK], v[:, :, j : j + KEY_BLOCK])
    return out[:, :, :nq].to(q.dtype)
