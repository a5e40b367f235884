"""Per-head q/k RMSNorm and neox (rotate-half) RoPE, in place on the fused q|k|v projection output.

`qkv` is [N, (Hq + 2*Hkv) * D]: q heads, then k heads, then v heads, each D wide. For each q and k
head: optionally `weight * rms_normalize(head)` (the `RMSNorm.forward` semantics, q and k weights
apart), then the first `rotary_dim` dims rotated by the angle `position * inv_freq` with
`cos, sin` scaled by `attn_scale` (YaRN's attention factor); dims past `rotary_dim` pass through.
v is untouched. Returns the views (q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]) of `qkv`.
`zero_centred` (Qwen3-Next's q/k norms): `normalize(head) * (1 + weight)` in fp32, rounded to the dtype.

The reference follows `strata.models.layers` (cos/sin rounded to the dtype, the rotation computed in
the dtype). The kernel computes cos/sin and the rotation in fp32 and rounds once, so in bf16 it is
the more accurate of the two and they differ by a few bf16 ulps; in fp32 they agree to ~1e-6.
"""

from __future__ import annotations

import torch

from strata.kernels import use_pdl, use_triton
from strata.kernels.pdl import pdl_prologue
from strata.kernels.triton_import import jit, libdevice, tl, triton


def _split_heads(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int):
    heads = qkv.view(qkv.shape[0], num_q_heads + 2 * num_kv_heads, head_dim)
    return (heads[:, :num_q_heads], heads[:, num_q_heads:num_q_heads + num_kv_heads],
            heads[:, num_q_heads + num_kv_heads:])


def _rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return (x32 * (1.0 + weight.float())).to(dtype)
    return weight * x32.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def qk_norm_rope_ref(qkv, positions, inv_freq, attn_scale, q_weight, k_weight, eps, num_q_heads, num_kv_heads,
                     head_dim, rotary_dim, zero_centred=False):
    q, k, v = _split_heads(qkv, num_q_heads, num_kv_heads, head_dim)
    qn, kn = q, k
    if q_weight is not None:
        qn, kn = _rms_norm_heads(q, q_weight, eps, zero_centred), _rms_norm_heads(k, k_weight, eps, zero_centred)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = (emb.cos() * attn_scale).to(qkv.dtype), (emb.sin() * attn_scale).to(qkv.dtype)
    q.copy_(_rotate(qn, cos, sin))
    k.copy_(_rotate(kn, cos, sin))
    return q, k, v


@jit
def _norm_part(x, inv_rms, qkv_ptr, q_w_ptr, k_w_ptr, offs, mask, is_q, ROUND_NORMED: tl.constexpr,
               ZERO_CENTRED: tl.constexpr):
    """weight * (x * inv_rms rounded to qkv's dtype), each row with its q or k weight; zero-centred:
    (x * inv_rms) * (1 + weight) in fp32."""
    round_ty = qkv_ptr.dtype.element_ty
    w_q = tl.load(q_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w_k = tl.load(k_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.where(is_q[:, None], w_q[None, :], w_k[None, :])
    if ZERO_CENTRED:
        y = (x * inv_rms[:, None]) * (w + 1.0)
    else:
        y = w * (x * inv_rms[:, None]).to(round_ty).to(tl.float32)
    if ROUND_NORMED:
        y = y.to(round_ty).to(tl.float32)
    return y


@jit
def _qk_norm_rope_kernel(qkv_ptr, row_stride, pos_ptr, inv_freq_ptr, q_w_ptr, k_w_ptr, attn_scale, eps, head_dim_f,
                         NUM_Q_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HALF: tl.constexpr, PASS_DIM: tl.constexpr, BLOCK_HEADS: tl.constexpr,
                         BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
                         HAS_NORM: tl.constexpr, ROUND_NORMED: tl.constexpr, ZERO_CENTRED: tl.constexpr,
                         USE_LIBDEVICE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    head_ok = heads < NUM_HEADS  # q heads then k heads: contiguous in the row
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    mask = head_ok[:, None] & d_ok[None, :]
    head_base = qkv_ptr + tok * row_stride + heads[:, None] * HEAD_DIM
    lo_ptrs = head_base + d[None, :]
    hi_ptrs = lo_ptrs + HALF
    x1 = tl.load(lo_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(hi_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        is_q = heads < NUM_Q_HEADS
        squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if PASS_DIM > 0:
            p = tl.arange(0, BLOCK_PASS)
            p_mask = head_ok[:, None] & (p < PASS_DIM)[None, :]
            pass_ptrs = head_base + 2 * HALF + p[None, :]
            x3 = tl.load(pass_ptrs, mask=p_mask, other=0.0).to(tl.float32)
            squares += tl.sum(x3 * x3, axis=1)
        inv_rms = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(squares, head_dim_f) + eps))
        x1 = _norm_part(x1, inv_rms, qkv_ptr, q_w_ptr, k_w_ptr, d, d_ok, is_q, ROUND_NORMED, ZERO_CENTRED)
        x2 = _norm_part(x2, inv_rms, qkv_ptr, q_w_ptr + HALF, k_w_ptr + HALF, d, d_ok, is_q, ROUND_NORMED,
                            ZERO_CENTRED)
        if PASS_DIM > 0:
            x3 = _norm_part(x3, inv_rms, qkv_ptr, q_w_ptr + 2 * HALF, k_w_ptr + 2 * HALF, p, p < PASS_DIM, is_q,
                            ROUND_NORMED, ZERO_CENTRED)
            tl.store(pass_ptrs, x3, mask=p_mask)
    # The angle is one fp32 product, as in the reference; large angles need the accurate cos/sin.
    angle = tl.load(pos_ptr + tok).to(tl.float32) * tl.load(inv_freq_ptr + d, mask=d_ok, other=0.0)
    if USE_LIBDEVICE:
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    else:
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    cos = (cos * attn_scale)[None, :]
    sin = (sin * attn_scale)[None, :]
    lo = (x1 * cos - x2 * sin).to(qkv_ptr.dtype.element_ty)
    hi = (x2 * cos + x1 * sin).to(qkv_ptr.dtype.element_ty)
    tl.store(lo_ptrs, lo, mask=mask)
    tl.store(hi_ptrs, hi, mask=mask)


def qk_norm_rope_triton(qkv, positions, inv_freq, attn_scale, q_weight, k_weight, eps, num_q_heads, num_kv_heads,
                        head_dim, rotary_dim, zero_centred=False):
    n = qkv.shape[0]
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv: expected [N, {width}] with contiguous rows, got {tuple(qkv.shape)} "
                         f"strides {qkv.stride()}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
    if positions.shape != (n,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions: expected int32/int64 [{n}], got {positions.dtype} {tuple(positions.shape)}")
    if inv_freq.shape != (rotary_dim // 2,) or inv_freq.dtype != torch.float32 or not inv_freq.is_contiguous():
        raise ValueError(f"inv_freq: expected contiguous fp32 [{rotary_dim // 2}], got {inv_freq.dtype} "
                         f"{tuple(inv_freq.shape)}")
    has_norm = q_weight is not None
    if has_norm != (k_weight is not None):
        raise ValueError("q_weight and k_weight: give both or neither")
    if has_norm:
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            if w.shape != (head_dim,) or not w.is_contiguous():
                raise ValueError(f"{name}: expected contiguous ({head_dim},), got {tuple(w.shape)}")
        # The reference's normed q/k have the promoted dtype (fp32 weights keep bf16 q/k in fp32); a
        # zero-centred norm returns the dtype whatever its weight's.
        round_normed = zero_centred or torch.promote_types(q_weight.dtype, qkv.dtype) == qkv.dtype
    else:
        q_weight = k_weight = inv_freq  # never read
        round_normed = False
    q, k, v = _split_heads(qkv, num_q_heads, num_kv_heads, head_dim)
    if n == 0:
        return q, k, v
    half, pass_dim = rotary_dim // 2, head_dim - rotary_dim
    num_heads = num_q_heads + num_kv_heads
    block_half = triton.next_power_of_2(half)
    # About 1024 q/k elements per program, 8 per thread in each half (16-byte loads in bf16 when the
    # rotation spans the head): a function of the shapes only, never of N.
    block_dim = triton.next_power_of_2(head_dim)
    block_heads = min(triton.next_power_of_2(num_heads), max(1, 1024 // block_dim))
    grid = (n, triton.cdiv(num_heads, block_heads))
    on = use_pdl(qkv)
    _qk_norm_rope_kernel[grid](
        qkv, qkv.stride(0), positions, inv_freq, q_weight, k_weight, float(attn_scale), eps, float(head_dim),
        NUM_Q_HEADS=num_q_heads, NUM_HEADS=num_heads, HEAD_DIM=head_dim, HALF=half, PASS_DIM=pass_dim,
        BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, BLOCK_PASS=triton.next_power_of_2(max(pass_dim, 1)),
        HAS_NORM=has_norm, ROUND_NORMED=round_normed, ZERO_CENTRED=zero_centred,
        USE_LIBDEVICE=qkv.is_cuda, USE_PDL=on, launch_pdl=on,
        num_warps=min(4, max(1, block_heads * block_dim // 512)))
    return q, k, v


def qk_norm_rope(qkv, positions, inv_freq, attn_scale, q_weight, k_weight, eps, num_q_heads, num_kv_heads,
                 head_dim, rotary_dim, zero_centred=False):
    """See the module docstring; in place on qkv's q and k parts, returns (q, k, v) views."""
    args = (qkv, positions, inv_freq, attn_scale, q_weight, k_weight, eps, num_q_heads, num_kv_heads, head_dim,
            rotary_dim, zero_centred)
    if use_triton(qkv):
        return qk_norm_rope_triton(*args)
    return qk_norm_rope_ref(*args)
