"""Per-row FP8 quantization of activations for the FP8 reads (`fp8.scaled_mm_matmul`): x [M, K] →
(e4m3 [M + pad, K], fp32 scale [M + pad]) with x ≈ q · scale per row, scale = max(amax, 1e-12) / 448.

The torch form (`quantize_rows_ref`) makes an fp32 copy of x, its absolute values, the quotient and
then the e4m3 cast: five passes over an fp32 [M, K] per projection, ~15% of a 4K read at the 8B
shape. The kernel reads each bf16 row twice (amax, then the quotient; the second read hits L2) and
writes the e4m3 row and its scale once. Division and the scale use round-to-nearest fp32 division
(`div_rn`), as torch's `/` does, so the e4m3 codes are the reference's (the GPU test checks them
bitwise; the interpreter's fp8 cast is wrong on a carry, see `quantize_rows`).

Rows from M to M + pad come out as zeros with scale 1: cuBLASLt's FP8 GEMM wants every dimension a
multiple of 16, and this writes the padding instead of a `torch.cat` of two more copies.

`silu_mul_quantize_rows` quantizes SwiGLU's `silu(gate) * up` (the down projection's input) straight
from the gate|up row: the values `activation.silu_mul` would store, rounded the same way, so the codes
are bitwise those of `quantize_rows(silu_mul(gate_up))`, without writing and reading back the [M, I]
bf16 product (~2/3 of the bytes of the two passes it replaces; docs/QUANTIZATION.md, "FP8 reads").
"""

from __future__ import annotations

import torch

from strata.kernels import kernels_run, use_pdl
from strata.kernels.activation import silu_mul_ref, silu_mul_values
from strata.kernels.pdl import pdl_prologue
from strata.kernels.triton_import import jit, tl


E4M3_MAX = 448.0
BLOCK_K = 1024


def quantize_rows_ref(x: torch.Tensor, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = x.float()
    amax = x32.abs().amax(dim=1).clamp(min=1e-12)
    # A tensor divisor: torch turns division by a Python scalar into multiplication by its reciprocal,
    # one ulp off the kernel's IEEE division, which moves codes that sit on a rounding tie.
    scale = amax / torch.full_like(amax, E4M3_MAX)
    q = (x32 / scale[:, None]).to(torch.float8_e4m3fn)
    if pad:
        q = torch.cat([q, q.new_zeros(pad, x.shape[1])])
        scale = torch.cat([scale, scale.new_ones(pad)])
    return q, scale


@jit
def _row_values(x_row, k, cols, mask, SILU_MUL: tl.constexpr, USE_LIBDEVICE: tl.constexpr):
    """fp32 values at `cols` of a row of k: x's, or SwiGLU's product from a gate|up row of 2k."""
    if SILU_MUL:
        return silu_mul_values(x_row, k, cols, mask, USE_LIBDEVICE)
    else:
        return tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)


@jit(do_not_specialize=["m"])
def _quantize_rows_kernel(x_ptr, x_stride, q_ptr, s_ptr, m, k, FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr,
                          SILU_MUL: tl.constexpr, USE_LIBDEVICE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    q_row = q_ptr + row.to(tl.int64) * k
    if row < m:
        x_row = x_ptr + row.to(tl.int64) * x_stride
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            v = _row_values(x_row, k, k0 + offs, k0 + offs < k, SILU_MUL, USE_LIBDEVICE)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), FP8_MAX)
        for k0 in range(0, k, BLOCK_K):
            ok = k0 + offs < k
            v = _row_values(x_row, k, k0 + offs, ok, SILU_MUL, USE_LIBDEVICE)
            tl.store(q_row + k0 + offs, tl.math.div_rn(v, scale).to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + row, scale)
    else:
        zeros = tl.zeros([BLOCK_K], dtype=tl.float32).to(q_ptr.dtype.element_ty)
        for k0 in range(0, k, BLOCK_K):
            tl.store(q_row + k0 + offs, zeros, mask=k0 + offs < k)
        tl.store(s_ptr + row, 1.0)


def quantize_rows(x: torch.Tensor, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (16-bit or fp32, contiguous rows) → (e4m3 [M + pad, K], fp32 scale [M + pad]): the
    kernel on CUDA, the reference elsewhere. Not the interpreter: its fp8 cast drops the carry when a
    value rounds up to the next power of two (124.3 → 64 instead of 128) and truncates subnormals, so
    off CUDA the kernel would be wrong where the device is right."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x [M, K] with contiguous rows expected, got {tuple(x.shape)} strides {x.stride()}")
    if not (x.is_cuda and kernels_run(x, _quantize_rows_kernel)):
        return quantize_rows_ref(x, pad)
    return quantize_rows_triton(x, pad)


def quantize_rows_triton(x: torch.Tensor, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1, where the codes that round up to a
    power of two come out halved: `quantize_rows`)."""
    m, k = x.shape
    q = torch.empty(m + pad, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m + pad, dtype=torch.float32, device=x.device)
    if m + pad:
        on = use_pdl(x)
        _quantize_rows_kernel[(m + pad,)](x, x.stride(0), q, scale, m, k, FP8_MAX=E4M3_MAX, BLOCK_K=BLOCK_K,
                                          SILU_MUL=False, USE_LIBDEVICE=x.is_cuda, USE_PDL=on, launch_pdl=on,
                                          num_warps=4)
    return q, scale


def silu_mul_quantize_rows_ref(gate_up: torch.Tensor, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows_ref(silu_mul_ref(gate_up), pad)


def silu_mul_quantize_serves(gate_up: torch.Tensor) -> bool:
    """Whether `silu_mul_quantize_rows_triton` is the read path for gate_up: 16-bit rows on CUDA where
    the kernel runs (fp32 correctness runs and other devices take the two steps)."""
    return (gate_up.is_cuda and gate_up.dtype != torch.float32 and gate_up.dim() == 2 and gate_up.stride(1) == 1
            and kernels_run(gate_up, _quantize_rows_kernel))


def silu_mul_quantize_rows_triton(gate_up: torch.Tensor, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] (16-bit or fp32, contiguous rows) → (e4m3 [M + pad, I], fp32 scale [M + pad]) of
    silu(gate) * up: the kernel (CUDA, or the interpreter with its fp8 cast, as `quantize_rows_triton`)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up: expected [M, 2I] with contiguous rows, got {tuple(gate_up.shape)} "
                         f"strides {gate_up.stride()}")
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    q = torch.empty(m + pad, inter, dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = torch.empty(m + pad, dtype=torch.float32, device=gate_up.device)
    if m + pad:
        on = use_pdl(gate_up)
        _quantize_rows_kernel[(m + pad,)](gate_up, gate_up.stride(0), q, scale, m, inter, FP8_MAX=E4M3_MAX,
                                          BLOCK_K=BLOCK_K, SILU_MUL=True, USE_LIBDEVICE=gate_up.is_cuda, USE_PDL=on,
                                          launch_pdl=on, num_warps=4)
    return q, scale
