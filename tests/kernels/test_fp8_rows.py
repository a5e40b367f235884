"""Per-row FP8 quantization of activations (strata/kernels/quant/fp8_rows.py), the kernel (the
interpreter on the CPU) against the torch reference: scales bitwise; codes bitwise on the GPU, and in
the interpreter wherever its fp8 cast is right (it halves a code that rounds up to a power of two and
truncates subnormals, so those are checked to be exactly that); padding rows zero with scale 1."""

from __future__ import annotations

import pytest
import torch

from strata.kernels.quant.fp8_rows import _quantize_rows_kernel, quantize_rows, quantize_rows_ref, quantize_rows_triton

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _x(m, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 7, (m, 1), generator=g).float())
    x[0, :] = 0.0  # a zero row: the scale's floor
    return x.to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m, k, pad", [(5, 300, 0), (3, 2100, 13), (1, 64, 15)])
def test_matches_reference(m, k, pad, dtype):
    x = _x(m, k, dtype, m * k + pad)
    q, s = quantize_rows_triton(x, pad)
    q_ref, s_ref = quantize_rows_ref(x, pad)
    assert q.shape == (m + pad, k) and q.dtype == torch.float8_e4m3fn and s.shape == (m + pad,)
    assert torch.equal(s, s_ref)
    assert torch.equal(q[m:].float(), torch.zeros(pad, k, device=DEV)) and torch.equal(s[m:], torch.ones(pad, device=DEV))
    got, want = q[:m].float(), q_ref[:m].float()
    if CUDA:
        assert torch.equal(got, want)
        back = q[:m].float() * s[:m, None]
        assert ((back - x.float()).abs() <= x.float().abs().amax(1, keepdim=True) * 2**-4 + 1e-30).all()
    else:
        # The interpreter's cast drops a carry into the next power of two and truncates subnormals
        # (|v| < 2^-6, steps of 2^-9); any other difference is the kernel's.
        carried = (got != want) & (got * 2 == want) & (torch.frexp(want)[0].abs() == 0.5)
        truncated = (got != want) & (want.abs() < 2**-6) & ((got - want).abs() <= 2**-9)
        ok = ~(carried | truncated)
        assert torch.equal(got[ok], want[ok])
    assert torch.equal(quantize_rows(x.cpu(), pad)[0].float(), quantize_rows_ref(x.cpu(), pad)[0].float())


def test_the_kernel_runs_here():
    """The CPU suite runs the kernel in the interpreter (conftest sets TRITON_INTERPRET=1), not only
    the reference; `quantize_rows` itself takes the reference off CUDA."""
    from strata.kernels import kernels_run

    assert kernels_run(torch.zeros(1, device=DEV), _quantize_rows_kernel)


def test_rejects_strided_rows():
    with pytest.raises(ValueError, match="contiguous rows"):
        quantize_rows(torch.zeros(8, 4, device=DEV).t())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("k", [4096, 12288])
def test_gpu_read_sizes_bitwise(k):
    """A 4K read's activations at the 8B shape: codes and scales bitwise the reference's, padding rows
    zero (timings: benchmarks/kernels/fp8.py --rows)."""
    x = _x(4090, k, torch.bfloat16, k)
    q, s = quantize_rows(x, 6)
    q_ref, s_ref = quantize_rows_ref(x, 6)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m, inter, pad", [(4, 300, 0), (3, 1100, 13)])
def test_silu_mul_quantize_rows_is_the_two_steps(m, inter, pad, dtype):
    """Quantizing silu(gate) * up straight from gate|up gives bitwise the codes and scales of the two
    kernels in a row (silu_mul, then quantize_rows; on the CPU both in the interpreter, whose fp8 cast
    they share), and is within e4m3's precision of the product."""
    from strata.kernels.activation import silu_mul_ref, silu_mul_triton
    from strata.kernels.quant.fp8_rows import silu_mul_quantize_rows_ref, silu_mul_quantize_rows_triton

    gate_up = _x(m, 2 * inter, dtype, m * inter + pad)
    q, s = silu_mul_quantize_rows_triton(gate_up, pad)
    q2, s2 = quantize_rows_triton(silu_mul_triton(gate_up), pad)
    assert q.shape == (m + pad, inter) and s.shape == (m + pad,)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    assert torch.equal(s[m:], torch.ones(pad, device=DEV)) and not q[m:].view(torch.uint8).any()
    product = silu_mul_ref(gate_up).float()
    back = q[:m].float() * s[:m, None]
    # e4m3 keeps 3 mantissa bits (half an ulp: 2^-4 relative; subnormal steps 2^-9 of the scale). The
    # interpreter's cast halves the rare code that carries into the next power of two.
    close = (back - product).abs() <= product.abs() * 2**-4 + s[:m, None] * 2**-9 + 1e-30
    assert close.all() if CUDA else close.float().mean() > 0.97
    q_ref, s_ref = silu_mul_quantize_rows_ref(gate_up, pad)
    assert torch.allclose(s, s_ref, rtol=2**-7)
    with pytest.raises(ValueError, match="contiguous rows"):
        silu_mul_quantize_rows_triton(gate_up[:, :-1])


@pytest.mark.parametrize("m", [3, 40])
def test_fp8_silu_mul_matmul_matches_the_two_steps(m):
    """fp8.silu_mul_matmul (the MLP's down projection) gives the values of matmul(silu_mul(gate_up)):
    bitwise on CUDA, where reads (more rows than the GEMV takes) run the fused quantization; elsewhere
    it is the two steps."""
    from strata.kernels.activation import silu_mul
    from strata.kernels.quant import fp8

    n, k = 96, 256
    planes = fp8.repack(torch.randn(n, k, generator=torch.Generator().manual_seed(m)).to(DEV) * k ** -0.5)
    dtype = torch.bfloat16 if CUDA else torch.float32
    gate_up = _x(m, 2 * k, dtype, m)
    got = fp8.silu_mul_matmul(gate_up, planes, n, k)
    want = fp8.matmul(silu_mul(gate_up), planes, n, k)
    assert got.shape == (m, n) and got.dtype == dtype
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_silu_mul_quantize_read_size_bitwise():
    """A 4K read's down-projection input at the 8B shape (I = 12288): the fused quantization bitwise the
    torch reference's (timings against the two kernels: benchmarks/kernels/fp8.py --rows)."""
    from strata.kernels.quant.fp8_rows import silu_mul_quantize_rows_ref, silu_mul_quantize_rows_triton

    gate_up = _x(4090, 2 * 12288, torch.bfloat16, 7)
    q, s = silu_mul_quantize_rows_triton(gate_up, 6)
    q_ref, s_ref = silu_mul_quantize_rows_ref(gate_up, 6)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
