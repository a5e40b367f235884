"""SwiGLU's `silu(gate) * up` over the fused gate|up projection output.

`x` [N, 2I] holds gate in its first I columns and up in the last I; the result [N, I] has x's dtype
and torch's rounding for `F.silu(gate) * up`: silu computed in fp32 as `g / (1 + exp(-g))` and rounded
to the dtype, then the product computed in fp32 and rounded. On CUDA the kernel uses libdevice's
`expf` and an IEEE division, the same operations torch's CUDA kernel compiles to, so it matches bit
for bit there; the interpreter's exp may differ from torch's CPU exp in the last fp32 bit.

Also the sigmoid-gated add of a shared expert (Qwen3-Next's MoE): `routed + sigmoid(x · g) * shared`
with torch's roundings in the dtype (the gate's dot rounded, its sigmoid rounded, the product rounded,
the sum rounded), one program per row instead of five launches (cuBLAS's dot and its reduce, sigmoid,
mul, add). Only the dot's summation order differs from cuBLAS's. Or, where the shared expert runs as
one more expert of the fused MoE kernels, `append_gated_expert`: its slot appended to each token's
routed (weight, id) pairs, the weight `sigmoid(x · g)` rounded as the module rounds it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels import use_pdl, use_triton
from strata.kernels.pdl import pdl_prologue
from strata.kernels.triton_import import jit, libdevice, tl, triton


BLOCK_COLS = 1024


def silu_mul_ref(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    y = F.silu(gate) * up
    if out is None:
        return y
    return out.copy_(y)


@jit
def silu_mul_values(x_row, inter, cols, mask, USE_LIBDEVICE: tl.constexpr):
    """fp32 [cols] of a gate|up row at x_row: silu(gate) * up with torch's roundings in x's dtype (the
    product rounded too, as the stored result would be; 0 where masked)."""
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_LIBDEVICE:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    silu = tl.div_rn(gate, 1.0 + e).to(x_row.dtype.element_ty).to(tl.float32)
    return (silu * up).to(x_row.dtype.element_ty).to(tl.float32)


@jit
def _silu_mul_kernel(x_ptr, x_stride, out_ptr, out_stride, inter, BLOCK: tl.constexpr, USE_LIBDEVICE: tl.constexpr,
                     USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    y = silu_mul_values(x_ptr + row * x_stride, inter, cols, mask, USE_LIBDEVICE)
    tl.store(out_ptr + row * out_stride + cols, y, mask=mask)


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


def sigmoid_gated_add_ref(routed: torch.Tensor, shared: torch.Tensor, x: torch.Tensor,
                          gate_weight: torch.Tensor) -> torch.Tensor:
    """routed, shared, x [N, H]; gate_weight [1, H] → routed + sigmoid(x @ gate_weightᵀ) * shared."""
    return routed + torch.sigmoid(F.linear(x, gate_weight)) * shared


@jit
def _sigmoid_gate(x_ptr, x_stride, g_ptr, row, h, BLOCK: tl.constexpr, USE_LIBDEVICE: tl.constexpr):
    """sigmoid(x[row] · g) as torch computes it in x's dtype (the dot and the sigmoid each rounded to it),
    returned in fp32: the dot over H in blocks of BLOCK, one fp32 lane each, summed at the end."""
    cols = tl.arange(0, BLOCK)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for h0 in range(0, h, BLOCK):
        ok = h0 + cols < h
        xv = tl.load(x_ptr + row * x_stride + h0 + cols, mask=ok, other=0.0).to(tl.float32)
        acc += xv * tl.load(g_ptr + h0 + cols, mask=ok, other=0.0).to(tl.float32)
    logit = tl.sum(acc, axis=0).to(dtype).to(tl.float32)
    if USE_LIBDEVICE:
        e = libdevice.exp(-logit)
    else:
        e = tl.exp(-logit)
    gate = tl.div_rn(1.0, 1.0 + e).to(dtype).to(tl.float32)
    return gate


@jit
def _sigmoid_gated_add_kernel(routed_ptr, shared_ptr, x_ptr, g_ptr, out_ptr, routed_stride, shared_stride, x_stride,
                              h, BLOCK: tl.constexpr, USE_LIBDEVICE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    dtype = out_ptr.dtype.element_ty
    gate = _sigmoid_gate(x_ptr, x_stride, g_ptr, row, h, BLOCK, USE_LIBDEVICE)
    for h0 in range(0, h, BLOCK):
        ok = h0 + cols < h
        sv = tl.load(shared_ptr + row * shared_stride + h0 + cols, mask=ok, other=0.0).to(tl.float32)
        rv = tl.load(routed_ptr + row * routed_stride + h0 + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * h + h0 + cols, rv + (gate * sv).to(dtype).to(tl.float32), mask=ok)


def sigmoid_gated_add_triton(routed: torch.Tensor, shared: torch.Tensor, x: torch.Tensor,
                             gate_weight: torch.Tensor) -> torch.Tensor:
    """As `sigmoid_gated_add_ref`, one launch; rows contiguous (any row stride), one dtype throughout."""
    n, h = x.shape
    for name, t, shape in (("routed", routed, (n, h)), ("shared", shared, (n, h)), ("x", x, (n, h)),
                           ("gate_weight", gate_weight, (1, h))):
        if t.shape != shape or t.dtype != x.dtype or t.stride(-1) != 1 or t.device != x.device:
            raise ValueError(f"{name}: expected {shape} {x.dtype} with contiguous rows, got {tuple(t.shape)} "
                             f"{t.dtype} strides {t.stride()}")
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block = min(triton.next_power_of_2(h), BLOCK_COLS)
    on = use_pdl(x)
    _sigmoid_gated_add_kernel[(n,)](routed, shared, x, gate_weight, out, routed.stride(0), shared.stride(0),
                                    x.stride(0), h, BLOCK=block, USE_LIBDEVICE=x.is_cuda, USE_PDL=on, launch_pdl=on,
                                    num_warps=max(1, min(4, block // 256)))
    return out


def sigmoid_gated_add(routed: torch.Tensor, shared: torch.Tensor, x: torch.Tensor,
                      gate_weight: torch.Tensor) -> torch.Tensor:
    if use_triton(x) and x.dim() == 2 and isinstance(gate_weight, torch.Tensor):
        return sigmoid_gated_add_triton(routed, shared, x, gate_weight)
    return sigmoid_gated_add_ref(routed, shared, x, gate_weight)


def append_gated_expert_ref(x: torch.Tensor, gate_weight: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                            slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], gate_weight [1, H], weights [T, k] fp32, ids [T, k] → ([T, k + 1] fp32, [T, k + 1]): the
    routed pairs, then expert `slot` at weight sigmoid(x @ gate_weightᵀ) (in x's dtype, then fp32)."""
    gate = torch.sigmoid(F.linear(x, gate_weight)).float()
    return torch.cat([weights, gate], dim=1), torch.cat([ids, torch.full_like(ids[:, :1], slot)], dim=1)


@jit
def _append_gated_expert_kernel(x_ptr, x_stride, g_ptr, w_ptr, ids_ptr, w_out_ptr, ids_out_ptr, h, top_k, slot,
                                BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, USE_LIBDEVICE: tl.constexpr,
                                USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    gate = _sigmoid_gate(x_ptr, x_stride, g_ptr, row, h, BLOCK, USE_LIBDEVICE)
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < top_k
    tl.store(w_out_ptr + row * (top_k + 1) + ks, tl.load(w_ptr + row * top_k + ks, mask=k_ok), mask=k_ok)
    tl.store(ids_out_ptr + row * (top_k + 1) + ks, tl.load(ids_ptr + row * top_k + ks, mask=k_ok), mask=k_ok)
    tl.store(w_out_ptr + row * (top_k + 1) + top_k, gate)
    tl.store(ids_out_ptr + row * (top_k + 1) + top_k, slot)


def append_gated_expert_triton(x: torch.Tensor, gate_weight: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                               slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As `append_gated_expert_ref`, one launch; weights and ids contiguous."""
    t, h = x.shape
    k = ids.shape[1]
    if (x.stride(1) != 1 or gate_weight.shape != (1, h) or gate_weight.dtype != x.dtype
            or not gate_weight.is_contiguous() or weights.shape != (t, k) or weights.dtype != torch.float32
            or not weights.is_contiguous() or not ids.is_contiguous()):
        raise ValueError(f"expected x [T, H] with contiguous rows, gate_weight [1, H] in x's dtype, contiguous fp32 "
                         f"weights and ids [T, k]; got x {tuple(x.shape)} {x.dtype}, gate_weight "
                         f"{tuple(gate_weight.shape)} {gate_weight.dtype}, weights {tuple(weights.shape)} "
                         f"{weights.dtype}, ids {tuple(ids.shape)}")
    w_out = torch.empty((t, k + 1), dtype=torch.float32, device=x.device)
    ids_out = torch.empty((t, k + 1), dtype=ids.dtype, device=x.device)
    if t == 0:
        return w_out, ids_out
    block = min(triton.next_power_of_2(h), BLOCK_COLS)
    on = use_pdl(x)
    _append_gated_expert_kernel[(t,)](x, x.stride(0), gate_weight, weights, ids, w_out, ids_out, h, k, slot,
                                      BLOCK=block, BLOCK_K=triton.next_power_of_2(k), USE_LIBDEVICE=x.is_cuda,
                                      USE_PDL=on, launch_pdl=on, num_warps=max(1, min(4, block // 256)))
    return w_out, ids_out
