"""Gathering int8 K/V of some pool slots into a dense bf16/fp16 buffer, dequantized.

A prompt chunk's attention is bound by arithmetic, not by K/V bytes, so over an int8 pool it runs
faster on a dequantized copy of the context (the same dense kernel as a bf16 pool) than converting
every key tile in registers once per query tile. The copy costs one read of the int8 context and one
write of it in 16 bits per layer, small beside the chunk's attention.

Values follow the pool's definition (`KVPool.gather`): int8 x scale in fp32, rounded once.
"""

from __future__ import annotations

import torch

from strata.kernels import use_pdl, use_triton
from strata.kernels.pdl import pdl_prologue
from strata.kernels.triton_import import jit, tl


def gather_dequant_ref(cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """cache [S, H, D] int8, scale [S, H] fp32, slots [T] → out[:T] = cache[slots] * scale[slots]."""
    s = slots.long()
    out[: s.shape[0]] = (cache[s].float() * scale[s][..., None]).to(out.dtype)
    return out


@jit
def _gather_dequant_kernel(cache_ptr, scale_ptr, slots_ptr, out_ptr, stride_slot, stride_scale, stride_out,
                           HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, HEADS)
    offs_d = tl.arange(0, HEAD_DIM)
    x = tl.load(cache_ptr + slot * stride_slot + offs_h[:, None] * HEAD_DIM + offs_d[None, :])
    sc = tl.load(scale_ptr + slot * stride_scale + offs_h)
    y = x.to(tl.float32) * sc[:, None]
    tl.store(out_ptr + t.to(tl.int64) * stride_out + offs_h[:, None] * HEAD_DIM + offs_d[None, :],
             y.to(out_ptr.dtype.element_ty))


def gather_dequant_triton(cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    t, (_, h, d) = slots.shape[0], cache.shape
    if h & (h - 1) or d & (d - 1):
        raise ValueError(f"heads {h} and head dim {d} must be powers of two")
    if not (cache.is_contiguous() and scale.is_contiguous() and out.stride(-1) == 1 and out.stride(1) == d):
        raise ValueError("cache, scale and out rows must be contiguous")
    if t:
        on = use_pdl(cache)
        _gather_dequant_kernel[(t,)](cache, scale, slots, out, cache.stride(0), scale.stride(0), out.stride(0),
                                     HEADS=h, HEAD_DIM=d, USE_PDL=on, launch_pdl=on, num_warps=4)
    return out


def gather_dequant(cache, scale, slots, out):
    return (gather_dequant_triton if use_triton(out) else gather_dequant_ref)(cache, scale, slots, out)
