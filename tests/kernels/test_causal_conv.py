"""The varlen causal conv kernel (Triton, interpreted on the CPU) against its torch reference on fresh
random inputs: sequences fresh and continuing, shorter and longer than the window, and the windows
written back."""

from __future__ import annotations

import pytest
import torch

from strata.kernels.causal_conv import causal_conv1d_varlen_ref, causal_conv1d_varlen_triton
from strata.kernels.gated_delta import causal_conv1d_ref

CUDA = torch.cuda.is_available()


def _case(lengths, c, k, seed, dtype, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    x = torch.randn(t, c, generator=g).to(dtype)
    w = torch.randn(c, k, generator=g).to(dtype)
    states = torch.randn(len(lengths) + 2, c, k - 1, generator=g).to(dtype)
    spans, r0 = [], 0
    for i, n in enumerate(lengths):
        spans.append((r0, n, len(lengths) + 1 - i, i % 3 == 0))  # distinct slots, as slots are
        r0 += n
    return x.to(device), w.to(device), states.to(device), spans


@pytest.mark.skipif(CUDA, reason="the interpreter cases run without a GPU")
@pytest.mark.parametrize("lengths,c,k", [([1, 5, 2, 9], 40, 4), ([3], 128, 4), ([1, 1, 1], 16, 4), ([20, 2], 24, 3)])
def test_kernel_matches_reference(lengths, c, k):
    x, w, states, spans = _case(lengths, c, k, seed=c + k, dtype=torch.float32)
    ref_states = states.clone()
    ref = causal_conv1d_varlen_ref(x, w, ref_states, spans)
    got = causal_conv1d_varlen_triton(x, w, states, spans)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, ref_states)


def test_reference_equals_one_sequence_at_a_time():
    x, w, states, spans = _case([4, 1, 7], 12, 4, seed=0, dtype=torch.float32)
    before = states.clone()
    out = causal_conv1d_varlen_ref(x, w, states, spans)
    for r0, n, slot, fresh in spans:
        o, win = causal_conv1d_ref(x[r0 : r0 + n], w, None if fresh else before[slot])
        torch.testing.assert_close(out[r0 : r0 + n], o)
        torch.testing.assert_close(states[slot], win)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_matches_reference(dtype):
    x, w, states, spans = _case([1, 37, 2048, 3, 500], 8192, 4, seed=1, dtype=dtype, device="cuda")
    ref_states = states.clone()
    ref = causal_conv1d_varlen_ref(x, w, ref_states, spans)
    got = causal_conv1d_varlen_triton(x, w, states, spans)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(states, ref_states)
