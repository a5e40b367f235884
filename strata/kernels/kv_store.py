"""Writing a step's new K/V into one layer of the KV pool, at the given slots.

`k`, `v` [N, Hkv, D] may be strided views (of the q|k|v projection output: any token and head stride,
contiguous last dim); `k_cache`, `v_cache` [S, Hkv, D] are one layer of the pool. Dense caches get a
copy cast to the cache's dtype. With `k_scale`, `v_scale` [S, Hkv] fp32 given, the caches are int8
and each (token, head) is quantized as `strata.kvcache.pool.quantize_int8` does: scale =
max(amax / 127, 1e-8), value = round-half-to-even(x / scale) clamped to ±127.

`amax / 127` is itself device-dependent in torch: the CPU divides, CUDA multiplies by the fp32
reciprocal of 127 (its fast path for a Python-scalar divisor). The kernel follows the device it runs on,
so it matches `quantize_int8` bit for bit on both.
"""

from __future__ import annotations

import torch

from strata.kernels import use_pdl, use_triton
from strata.kernels.pdl import pdl_prologue
from strata.kernels.triton_import import jit, libdevice, tl, triton


def _quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.float().abs().amax(dim=-1)
    scale = (amax / 127.0).clamp(min=1e-8)
    q = torch.round(x.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def store_kv_ref(k, v, k_cache, v_cache, slots, k_scale=None, v_scale=None) -> None:
    slots = slots.long()
    if k_scale is None:
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
        return
    for cache, scales, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        q, s = _quantize_int8(x)
        cache.index_copy_(0, slots, q)
        scales.index_copy_(0, slots, s)


@jit
def _store_heads(src_ptr, src_offs, dst_ptr, dst_offs, scale_ptr, scale_offs, head_ok, mask,
                 QUANTIZE: tl.constexpr, RECIPROCAL_SCALE: tl.constexpr, USE_LIBDEVICE: tl.constexpr):
    x = tl.load(src_ptr + src_offs, mask=mask, other=0.0)
    if QUANTIZE:
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        if RECIPROCAL_SCALE:
            scale = amax * (1.0 / 127.0)
        else:
            scale = tl.div_rn(amax, 127.0)
        scale = tl.maximum(scale, 1e-8)
        y = tl.div_rn(x, scale[:, None])
        if USE_LIBDEVICE:
            y = libdevice.rint(y)
        else:
            # Round half to even: adding 1.5 * 2**23 leaves no fraction bits (|y| <= 127.5 here).
            y = (y + 12582912.0) - 12582912.0
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        tl.store(dst_ptr + dst_offs, y.to(tl.int8), mask=mask)
        tl.store(scale_ptr + scale_offs, scale, mask=head_ok)
    else:
        tl.store(dst_ptr + dst_offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


@jit
def _store_kv_kernel(k_ptr, k_tok_stride, k_head_stride, v_ptr, v_tok_stride, v_head_stride,
                     k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slots_ptr,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HEADS: tl.constexpr,
                     BLOCK_D: tl.constexpr, QUANTIZE: tl.constexpr, RECIPROCAL_SCALE: tl.constexpr,
                     USE_LIBDEVICE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    head_ok = heads < NUM_KV_HEADS
    d = tl.arange(0, BLOCK_D)
    mask = head_ok[:, None] & (d < HEAD_DIM)[None, :]
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    dst_offs = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :]
    scale_offs = slot * NUM_KV_HEADS + heads
    _store_heads(k_ptr, tok * k_tok_stride + heads[:, None] * k_head_stride + d[None, :], k_cache_ptr, dst_offs,
                 k_scale_ptr, scale_offs, head_ok, mask, QUANTIZE, RECIPROCAL_SCALE, USE_LIBDEVICE)
    _store_heads(v_ptr, tok * v_tok_stride + heads[:, None] * v_head_stride + d[None, :], v_cache_ptr, dst_offs,
                 v_scale_ptr, scale_offs, head_ok, mask, QUANTIZE, RECIPROCAL_SCALE, USE_LIBDEVICE)


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, n: int) -> None:
    """The pool layout `store_kv` takes: caches
    [S, Hkv, D], contiguous and alike, and one int32/int64 slot for each of the n tokens."""
    if k_cache.dim() != 3:
        raise ValueError(f"k_cache: expected [S, Hkv, D], got {tuple(k_cache.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.shape != k_cache.shape or not c.is_contiguous() or c.dtype != k_cache.dtype:
            raise ValueError(f"{name}: expected contiguous {tuple(k_cache.shape)} {k_cache.dtype}, got "
                             f"{tuple(c.shape)} {c.dtype}")
    if slots.shape != (n,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots: expected int32/int64 [{n}], got {slots.dtype} {tuple(slots.shape)}")


def store_kv_triton(k, v, k_cache, v_cache, slots, k_scale=None, v_scale=None) -> None:
    n = k.shape[0]
    check_caches(k_cache, v_cache, slots, n)
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    for name, x in (("k", k), ("v", v)):
        if x.shape != (n, num_kv_heads, head_dim) or x.stride(2) != 1:
            raise ValueError(f"{name}: expected [N, {num_kv_heads}, {head_dim}] with a contiguous last dim, got "
                             f"{tuple(x.shape)} strides {x.stride()}")
    quantize = k_scale is not None
    if quantize:
        if k_cache.dtype != torch.int8:
            raise ValueError(f"scales given but the cache is {k_cache.dtype}, not int8")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None or s.shape != k_cache.shape[:2] or s.dtype != torch.float32 or not s.is_contiguous():
                raise ValueError(f"{name}: expected contiguous fp32 {tuple(k_cache.shape[:2])}")
    elif k_cache.dtype == torch.int8:
        raise ValueError("an int8 cache needs k_scale and v_scale")
    else:
        k_scale = v_scale = k_cache  # never read
    if n == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_heads = min(triton.next_power_of_2(num_kv_heads), max(1, 1024 // block_d))
    on = use_pdl(k)
    _store_kv_kernel[(n, triton.cdiv(num_kv_heads, block_heads))](
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), k_cache, v_cache, k_scale, v_scale, slots,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_HEADS=block_heads, BLOCK_D=block_d,
        QUANTIZE=quantize, RECIPROCAL_SCALE=quantize and k.is_cuda, USE_LIBDEVICE=k.is_cuda,
        USE_PDL=on, launch_pdl=on, num_warps=min(4, max(1, block_heads * block_d // 256)))


def store_kv(k, v, k_cache, v_cache, slots, k_scale=None, v_scale=None) -> None:
    """See the module docstring. Writes only the rows at `slots`; returns nothing."""
    if use_triton(k):
        store_kv_triton(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slots, k_scale, v_scale)
