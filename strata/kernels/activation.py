"""SwiGLU's `silu(gate) * up` over the fused gate|up projection output.

`x` [N, 2I] holds gate in its first I columns and up in the last I; the result [N, I] has x's dtype
and torch's rounding for `F.silu(gate) * up`: silu computed in fp32 as `g / (1 + exp(-g))` and rounded
to the dtype, then the product computed in fp32 and rounded. On CUDA the kernel uses libdevice's
`expf` and an IEEE division, the same operations torch's CUDA kernel compiles to, so it matches bit
for bit there; the interpreter's exp may differ from torch's CPU exp in the last fp32 bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels import use_pdl, use_triton
from strata.kernels.pdl import pdl_prologue

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    jit = triton.jit
except ImportError:  # CPU-only installs: the references work, the kernels are never launched

    def jit(fn):
        return fn


BLOCK_COLS = 1024


def silu_mul_ref(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    y = F.silu(gate) * up
    if out is None:
        return y
    return out.copy_(y)


@jit
def _silu_mul_kernel(x_ptr, x_stride, out_ptr, out_stride, inter, BLOCK: tl.constexpr, USE_LIBDEVICE: tl.constexpr,
                     USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    x_row = x_ptr + row * x_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_LIBDEVICE:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    silu = tl.div_rn(gate, 1.0 + e).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, silu * up, mask=mask)


def silu_mul_triton(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, 2I] with contiguous rows (any row stride) → [N, I] in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected [N, 2I] with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")
    n, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    elif out.shape != (n, inter) or out.dtype != x.dtype or out.stride(1) != 1 or out.device != x.device:
        raise ValueError(f"out: expected [{n}, {inter}] {x.dtype} with contiguous rows, got {tuple(out.shape)} "
                         f"{out.dtype} strides {out.stride()}")
    if n == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), BLOCK_COLS)
    on = use_pdl(x)
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](
        x, x.stride(0), out, out.stride(0), inter, BLOCK=block, USE_LIBDEVICE=x.is_cuda,
        USE_PDL=on, launch_pdl=on, num_warps=max(1, min(4, block // 256)))
    return out


def silu_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(x):
        return silu_mul_triton(x, out)
    return silu_mul_ref(x, out)
