"""Row log-sum-exp whose result for a row does not depend on the other rows (`--batch-invariant`).

`torch.logsumexp` over [R, V] logits on CUDA lets PyTorch's reduction pick how many thread blocks share
one row from R: one row of 152K logits is split across many blocks, eight rows across fewer, so the
partial sums meet in another order and the low bits of a logprob follow the batch (seen on the H200:
one greedy logprob of 24 moved by 2 ulp between a request alone and in a batch of 8, its tokens equal).

The kernel gives every row one program that walks the vocabulary in BLOCK-sized tiles in order, with a
running maximum and a rescaled sum: the same instructions whatever R is. The reference does the same
walk in torch, one row at a time.
"""

from __future__ import annotations

import torch

from strata.kernels import use_triton
from strata.kernels.triton_import import jit, tl


BLOCK = 4096


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"expected [R, V] with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")


def row_logsumexp_ref(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim of [R, V], fp32 [R]; each row alone, tile by tile, as the kernel."""
    _check(x)
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    for r in range(x.shape[0]):
        m = torch.tensor(float("-inf"), device=x.device)
        s = torch.zeros((), device=x.device)
        for t in x[r].float().split(BLOCK):
            m_new = torch.maximum(m, t.max())
            if torch.isinf(m_new) and m_new < 0:  # nothing finite yet: the sum stays 0
                continue
            s = s * torch.exp(m - m_new) + torch.exp(t - m_new).sum()
            m = m_new
        out[r] = m + torch.log(s)
    return out


@jit
def _row_lse_kernel(x_ptr, stride, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(x_ptr + row * stride + start + offs, mask=start + offs < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        finite = m_new > float("-inf")
        shift = tl.where(finite, m_new, 0.0)  # all -inf so far: exp(-inf - 0) = 0 keeps the sum at 0
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new
    tl.store(out_ptr + row, m + tl.log(s))


def row_logsumexp_triton(x: torch.Tensor) -> torch.Tensor:
    _check(x)
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _row_lse_kernel[(x.shape[0],)](x, x.stride(0), out, x.shape[1], BLOCK=BLOCK, num_warps=8)
    return out


def row_logsumexp(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """logsumexp over the last dim of [R, V] logits, fp32 [R]: torch's (fastest) unless `invariant`,
    then a row's value is the same in any batch (the kernel on CUDA, the reference elsewhere: the CPU
    engine never runs Triton's interpreter, which is not thread-safe, and its read stage is a thread)."""
    if not invariant:
        return torch.logsumexp(x, -1)
    return row_logsumexp_triton(x) if use_triton(x) else row_logsumexp_ref(x)
