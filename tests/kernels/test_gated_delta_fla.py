"""fla-core's chunked gated delta rule (kernel choice linear_attention_kernel=fla) against Strata's torch
reference, on CUDA, for several sequences of one varlen call with carried-in states. Run on the device
with fla-core on the path, apart from the HF comparisons (transformers switches its own CPU reference to
fla-core when it can import it): `scripts/gpu_round.sh fla`."""

from __future__ import annotations

import pytest
import torch

from strata.kernels import choices
from strata.kernels.gated_delta import gated_delta_varlen

fla = pytest.importorskip("fla", reason="fla-core is not installed")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _inputs(lengths, h, dk, dv, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lengths)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    q, k, v = rnd(t, h, dk).to(dtype), rnd(t, h, dk).to(dtype), rnd(t, h, dv).to(dtype)
    decay = -2 * torch.rand(t, h, generator=g, device="cuda")
    beta = torch.rand(t, h, generator=g, device="cuda").to(dtype)
    states = 0.3 * rnd(len(lengths), h, dk, dv)
    states[0] = 0  # a fresh sequence beside continuing ones
    return q, k, v, decay, beta, states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[1, 37, 64, 200], [4096]])
def test_fla_matches_the_reference(dtype, lengths):
    q, k, v, g, b, s0 = _inputs(lengths, 4, 128, 128, dtype, seed=len(lengths))
    with choices.using(linear_attention_kernel="ref"):
        ref_o, ref_s = gated_delta_varlen(q.float(), k.float(), v.float(), g, b.float(), lengths, s0)
    with choices.using(linear_attention_kernel="fla"):
        o, s = gated_delta_varlen(q, k, v, g, b, lengths, s0)
    err_o = ((o.float() - ref_o).abs().max() / ref_o.abs().max()).item()
    err_s = ((s - ref_s).abs().max() / ref_s.abs().max()).item()
    print(f"fla vs reference, {dtype}, lengths {lengths}: output {err_o:.2e}, states {err_s:.2e}")
    assert err_o < (2e-2 if dtype == torch.bfloat16 else 5e-3) and err_s < 2e-2
