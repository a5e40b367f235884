"""RMSNorm and the residual add fused into it.

Semantics (the references below, equal to `RMSNorm.forward`): in fp32, `n = x * rsqrt(mean(x²) + eps)`,
rounded once to x's dtype; the result is `weight * n`, computed in fp32 and rounded once to x's dtype.
The fused op first forms `residual = x + residual` in x's dtype (one rounding, as torch adds) and
normalises that; it updates `residual` in place on every path, so callers see one behaviour.
`zero_centred` (Qwen3-Next's norms, a weight stored as an offset from one): `n * (1 + weight)` all in
fp32, rounded once. The gated norm (Qwen3-Next's Gated DeltaNet output, per value head): `n` rounded
to x's dtype, times the weight in their promoted dtype, times SiLU(z) in fp32, rounded once.

Kernels: one row per program, a block fixed by the row length alone, so a row's result never depends
on how many rows the batch has. The reciprocal square root is IEEE (`sqrt_rn`, `div_rn`), not the
approximate instruction, so fp32 differs from torch only by the order of the sum of squares.
"""

from __future__ import annotations

import torch

import torch.nn.functional as F

from strata.kernels import use_pdl, use_triton
from strata.kernels.pdl import pdl_prologue
from strata.kernels.triton_import import jit, libdevice, tl, triton


# Widest row block kept in registers; longer rows loop over blocks in two passes.
MAX_ROW_BLOCK = 8192


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                 zero_centred: bool = False) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = (x32 * (1.0 + weight.float())).to(dtype) if zero_centred else (weight * x32.to(dtype)).to(dtype)
    if out is None:
        return y
    return out.copy_(y)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           out: torch.Tensor | None = None, zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    residual.add_(x)
    return rms_norm_ref(residual, weight, eps, out, zero_centred), residual


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] → the same shape: each D-row normalised, times weight, times SiLU of z's row (z of
    x's shape, or [N, G, H // G, D] for x [N, H, D])."""
    d = x.shape[-1]
    x32 = x.reshape(-1, d).float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(z.reshape(-1, d).float())).to(x.dtype).view(x.shape)


@jit
def _load_row_chunk(x_row, res_row, offs, mask, HAS_RESIDUAL: tl.constexpr):
    """The chunk in fp32; with a residual, first the sum rounded to the row's dtype, stored back."""
    v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        v = v + tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
        v = v.to(res_row.dtype.element_ty)
        tl.store(res_row + offs, v, mask=mask)
        v = v.to(tl.float32)
    return v


@jit
def _store_normed_chunk(v, inv_rms, w_ptr, out_row, offs, mask, ZERO_CENTRED: tl.constexpr):
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        tl.store(out_row + offs, (v * inv_rms) * (w + 1.0), mask=mask)
    else:
        n = (v * inv_rms).to(out_row.dtype.element_ty).to(tl.float32)  # out has x's dtype
        tl.store(out_row + offs, w * n, mask=mask)


@jit
def _rms_norm_kernel(x_ptr, x_stride, res_ptr, res_stride, w_ptr, out_ptr, out_stride, n_cols, n_cols_f, eps,
                     HAS_RESIDUAL: tl.constexpr, ZERO_CENTRED: tl.constexpr, BLOCK: tl.constexpr,
                     NUM_CHUNKS: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    res_row = res_ptr + row * res_stride
    out_row = out_ptr + row * out_stride
    cols = tl.arange(0, BLOCK)
    if NUM_CHUNKS == 1:
        mask = cols < n_cols
        v = _load_row_chunk(x_row, res_row, cols, mask, HAS_RESIDUAL)
        inv_rms = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(v * v, axis=0), n_cols_f) + eps))
        _store_normed_chunk(v, inv_rms, w_ptr, out_row, cols, mask, ZERO_CENTRED)
    else:
        squares = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < n_cols
            v = _load_row_chunk(x_row, res_row, offs, mask, HAS_RESIDUAL)
            squares += v * v
        inv_rms = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(squares, axis=0), n_cols_f) + eps))
        # Second pass: re-read the summed residual this program wrote above, once all its threads have.
        if HAS_RESIDUAL:
            tl.debug_barrier()
            src_row = res_row
        else:
            src_row = x_row
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < n_cols
            v = tl.load(src_row + offs, mask=mask, other=0.0).to(tl.float32)
            _store_normed_chunk(v, inv_rms, w_ptr, out_row, offs, mask, ZERO_CENTRED)


def _check_rows(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if t.dim() != 2 or t.shape != like.shape or t.dtype != like.dtype or t.stride(1) != 1 or t.device != like.device:
        raise ValueError(f"{name}: expected a {tuple(like.shape)} {like.dtype} tensor with contiguous rows on "
                         f"{like.device}, got {tuple(t.shape)} {t.dtype} strides {t.stride()} on {t.device}")


def _launch(x, residual, weight, eps, out, zero_centred):
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected 2-D with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")
    n_rows, n_cols = x.shape
    if weight.shape != (n_cols,) or not weight.is_contiguous():
        raise ValueError(f"weight: expected contiguous ({n_cols},), got {tuple(weight.shape)}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        _check_rows("out", out, x)
    res = x if residual is None else residual
    if residual is not None:
        _check_rows("residual", residual, x)
    if n_rows == 0:
        return out
    block = min(triton.next_power_of_2(n_cols), MAX_ROW_BLOCK)
    on = use_pdl(x)
    _rms_norm_kernel[(n_rows,)](
        x, x.stride(0), res, res.stride(0), weight, out, out.stride(0), n_cols, float(n_cols), eps,
        HAS_RESIDUAL=residual is not None, ZERO_CENTRED=zero_centred, BLOCK=block, NUM_CHUNKS=triton.cdiv(n_cols, block),
        USE_PDL=on, launch_pdl=on, num_warps=min(16, max(1, block // 512)))
    return out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                    zero_centred: bool = False) -> torch.Tensor:
    """x [N, H] with contiguous rows (any row stride) → out [N, H] in x's dtype."""
    return _launch(x, None, weight, eps, out, zero_centred)


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              out: torch.Tensor | None = None,
                              zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), residual), the sum written into `residual` in place."""
    return _launch(x, residual, weight, eps, out, zero_centred), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
             zero_centred: bool = False) -> torch.Tensor:
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, out, zero_centred)
    return rms_norm_ref(x, weight, eps, out, zero_centred)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out: torch.Tensor | None = None, zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps, out, zero_centred)
    return fused_add_rms_norm_ref(x, residual, weight, eps, out, zero_centred)


# ---- the gated norm: one (token, head) row per program ------------------------------------------

@jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, z_stride0, z_stride1, z_stride2, w_ptr, out_ptr, heads, group, d, d_f, eps,
                           BLOCK: tl.constexpr, ROUND_PRODUCT: tl.constexpr, USE_LIBDEVICE: tl.constexpr,
                           USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    token, head = row // heads, row % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    v = tl.load(x_ptr + row * d + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(v * v, axis=0), d_f) + eps))
    n = (v * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    scaled = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * n
    if ROUND_PRODUCT:  # weight and x both 16-bit: torch rounds their product to that dtype
        scaled = scaled.to(out_ptr.dtype.element_ty).to(tl.float32)
    z_row = z_ptr + token * z_stride0 + (head // group) * z_stride1 + (head % group) * z_stride2
    zz = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_LIBDEVICE:
        e = libdevice.exp(-zz)
    else:
        e = tl.exp(-zz)
    tl.store(out_ptr + row * d + cols, scaled * tl.div_rn(zz, 1.0 + e), mask=mask)


def gated_rms_norm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, H, D] contiguous; z [N, H, D], or [N, G, H // G, D] (head h in group h // (H // G)), with
    contiguous rows and any other strides: the projection's view, uncopied → [N, H, D] in x's dtype."""
    if x.dim() != 3 or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous [N, H, D], got {tuple(x.shape)} strides {x.stride()}")
    n, heads, d = x.shape
    z4 = z.unsqueeze(2) if z.dim() == 3 else z
    if (z4.dim() != 4 or z4.shape[0] != n or z4.shape[1] * z4.shape[2] != heads or z4.shape[3] != d
            or z4.stride(3) != 1 or z4.dtype != x.dtype):
        raise ValueError(f"z: expected {x.dtype} [N, H, D] or [N, G, H // G, D] with contiguous rows for x "
                         f"{tuple(x.shape)}, got {tuple(z.shape)} {z.dtype} strides {z.stride()}")
    if weight.shape != (d,) or not weight.is_contiguous() or weight.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"weight: expected contiguous ({d},) in {x.dtype} or float32, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    block = triton.next_power_of_2(d)
    if block > MAX_ROW_BLOCK:
        raise ValueError(f"rows of {d} values: the gated norm keeps a row in registers (at most {MAX_ROW_BLOCK})")
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    on = use_pdl(x)
    _gated_rms_norm_kernel[(n * heads,)](
        x, z4, z4.stride(0), z4.stride(1), z4.stride(2), weight, out, heads, z4.shape[2], d, float(d), eps,
        BLOCK=block, ROUND_PRODUCT=torch.promote_types(weight.dtype, x.dtype) != torch.float32,
        USE_LIBDEVICE=x.is_cuda, USE_PDL=on, launch_pdl=on, num_warps=max(1, min(4, block // 256)))
    return out


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return gated_rms_norm_triton(x, z, weight, eps)
    return gated_rms_norm_ref(x, z, weight, eps)
