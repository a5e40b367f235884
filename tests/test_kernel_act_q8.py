"""The activations' int8 quantization inside the decode GEMVs (strata/kernels/quant/act_q8.py): the
Triton helper against `quantize_ref` element for element (interpreted on the CPU, and on the GPU with
`pytest -m gpu`), on normal rows, rows with zero runs, ties at half steps and extreme magnitudes."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from strata.kernels.quant.act_q8 import quantize_groups, quantize_ref

CUDA = torch.cuda.is_available()


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, dx_ptr, K: tl.constexpr):
    # One row per program, laid out [K/32, 32] with the runs along axis 1 (as the GEMVs' xᵀ tiles).
    row = tl.program_id(0)
    g = tl.arange(0, K // 32)
    j = tl.arange(0, 32)
    offs = row * K + g[:, None] * 32 + j[None, :]
    q, dx = quantize_groups(tl.load(x_ptr + offs).to(tl.float32), 1)
    tl.store(q_ptr + offs, q)
    tl.store(dx_ptr + row * (K // 32) + g, dx)


def _rows(k, device):
    gen = torch.Generator(device="cpu").manual_seed(5)
    x = torch.randn(6, k, generator=gen)
    x[1, :32] = 0.0  # a zero run: dx 0, q 0
    x[2, :32] = torch.arange(32) - 15.5  # amax 15.5: x·127/15.5 lands near half steps
    x[3] *= 1e30
    x[4] *= 1e-30
    x[5, 32:64] = 127 / 2 * (torch.arange(32) % 3)  # exact ties at .5 after scaling (amax 127: inv 1)
    # amax 2.296875 and values at its half: x·(127 / amax) rounds to 63.5 or just below, depending on
    # whether 127 / amax is one correctly rounded division or 127 · (1 / amax).
    x[0, 64:96] = 2.296875 * torch.tensor([1.0, -0.5, 0.5, 0.25] * 8)
    return x.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")])])
def test_quantize_groups_matches_reference(device, dtype):
    if device == "cpu" and CUDA:
        pytest.skip("the CPU case runs in the interpreter, without a GPU")
    k = 128
    x = _rows(k, device).to(dtype)
    q = torch.empty(x.shape, dtype=torch.int8, device=device)
    dx = torch.empty(x.shape[0], k // 32, dtype=torch.float32, device=device)
    _quantize_kernel[(x.shape[0],)](x, q, dx, K=k)
    q_ref, dx_ref = quantize_ref(x)
    assert torch.equal(dx, dx_ref)
    assert torch.equal(q, q_ref)
    assert q.abs().max() <= 127 and not q[1, :32].any() and dx[1, 0] == 0
    # Round half to even: 0.5 -> 0, 1.5 -> 2 (the reference's torch.round does the same).
    assert torch.equal(q_ref[5, 32:35].cpu(), torch.tensor([0, 64, 127], dtype=torch.int8))
