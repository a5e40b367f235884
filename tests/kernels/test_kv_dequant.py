"""The int8 K/V gather-and-dequantize kernel against its reference, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from strata.kernels.kv_dequant import gather_dequant_ref, gather_dequant_triton


def _case(seed: int, device: str, dtype: torch.dtype, slots=64, heads=2, dim=16, n=37):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randint(-127, 128, (slots, heads, dim), generator=g, dtype=torch.int8).to(device)
    scale = (torch.rand(slots, heads, generator=g) * 0.05).to(device)
    idx = torch.randint(0, slots, (n,), generator=g).to(device)
    return cache, scale, idx, torch.full((n + 3, heads, dim), float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_dequant_matches_reference(dtype):
    cache, scale, idx, out = _case(11, "cpu", dtype)
    ref = gather_dequant_ref(cache, scale, idx, out.clone())
    got = gather_dequant_triton(cache, scale, idx, out)
    n = idx.shape[0]
    assert torch.equal(got[:n], ref[:n])
    assert got[n:].isnan().all()  # rows past the slots are left alone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_gather_dequant_matches_reference():
    cache, scale, idx, out = _case(12, "cuda", torch.bfloat16, slots=4096, heads=8, dim=128, n=3000)
    ref = gather_dequant_ref(cache, scale, idx, out.clone())
    got = gather_dequant_triton(cache, scale, idx, out)
    assert torch.equal(got[:3000], ref[:3000])
