"""Decode MoE expert kernels against their torch reference and the MoE module's own paths.

CPU: the kernels run in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at small shapes in
fp32, fp16 and bf16, with the default configuration and one forced to loop (several H steps, several
I chunks, masked tails). GPU (`pytest -m gpu`): Qwen3-30B-A3B shapes in bf16 against the reference,
batch invariance and CUDA-graph replay (timings: benchmarks/kernels/moe_decode.py).

Every case draws fresh inputs from its own seed; outputs start as NaN and are compared whole.
Tolerances (max error / max |reference|): fp32 1e-5 (summation order only); fp16 3e-3 and bf16 2e-2
(the fp32 order can flip a rounding of h13 or y by one ulp, which the later steps carry).
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest
import torch

from strata.kernels.moe_decode import (
    MoeDecodeConfig,
    moe_decode_supported,
    moe_experts_decode,
    moe_experts_decode_ref,
    moe_experts_decode_triton,
)
from strata.models.moe import MoE
from test_moe_packed import BASE, random_moe

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# Loops in both kernels at H 64 / I 48: 4 H steps of 16, 3 I chunks of 16 (and uneven row blocks at I 40).
LOOPING = MoeDecodeConfig(gate_up_block_i=16, gate_up_block_h=16, gate_up_warps=1, gate_up_stages=2,
                          down_block_h=16, down_block_k=16, down_warps=1, down_stages=2)


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def make_inputs(seed, t, k, e, h, inter, dtype, device=DEV, shared=False):
    """Routing without repeats inside a token (as topk gives); `shared`: every token the same experts."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=gen) * inter ** -0.5).to(dtype)
    first = torch.randperm(e, generator=gen)[:k]
    ids = torch.stack([first if shared else torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen) + 0.1
    w = w / w.sum(-1, keepdim=True)
    return tuple(v.to(device) for v in (x, ids, w, w13, w2))


def nan_out(t, h, dtype, device=DEV):
    return torch.full((t, h), float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", [(1, 2, 64, 48, None), (3, 3, 64, 32, LOOPING), (5, 2, 64, 48, LOOPING),
                                  (4, 3, 80, 40, None), (2, 3, 80, 40, LOOPING)],
                         ids=["t1k2", "t3k3-loop", "t5k2-loop", "t4k3-h80-i40", "t2k3-h80-i40-loop"])
def test_matches_reference(dtype, case):
    t, k, h, inter, cfg = case
    x, ids, w, w13, w2 = make_inputs(seed_of("ref", dtype, case), t, k, 8, h, inter, dtype)
    out = nan_out(t, h, dtype)
    got = moe_experts_decode_triton(x, ids, w, w13, w2, out, config=cfg)
    assert got is out and torch.isfinite(out).all()
    ref = moe_experts_decode_ref(x, ids, w, w13, w2)
    assert got.dtype == ref.dtype == dtype
    err = rel_err(got, ref)
    print(f"{dtype} {case[:4]}: rel err {err:.2e}, bitwise {torch.equal(got, ref)}")
    assert err <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shared_experts_int32_ids_and_strides(dtype):
    """Every token on the same experts; int32 ids and id/weight views with non-unit strides."""
    t, k, h, inter = 4, 3, 64, 32
    x, ids, w, w13, w2 = make_inputs(seed_of("shared", dtype), t, k, 8, h, inter, dtype, shared=True)
    ref = moe_experts_decode_ref(x, ids, w, w13, w2)
    ids_t = ids.to(torch.int32).t().contiguous().t()  # strides (1, t)
    w_wide = torch.full((t, 2 * k), float("nan"), device=DEV)
    w_wide[:, ::2] = w
    got = moe_experts_decode_triton(x, ids_t, w_wide[:, ::2], w13, w2)
    assert rel_err(got, ref) <= TOL[dtype]
    rows = torch.stack([moe_experts_decode_triton(x[i:i + 1], ids[i:i + 1], w[i:i + 1], w13, w2)[0] for i in (0, 3)])
    assert torch.equal(rows, got[[0, 3]])


def test_batch_invariant_bitwise():
    """A token's output is the same bits alone and among four others, in any position."""
    t, k, h, inter = 5, 2, 64, 48
    x, ids, w, w13, w2 = make_inputs(seed_of("invariant"), t, k, 8, h, inter, torch.float16)
    full = moe_experts_decode_triton(x, ids, w, w13, w2)
    alone = moe_experts_decode_triton(x[2:3], ids[2:3], w[2:3], w13, w2)
    assert torch.equal(alone[0], full[2])
    perm = torch.tensor([4, 2, 0, 1, 3])
    assert torch.equal(moe_experts_decode_triton(x[perm], ids[perm], w[perm], w13, w2), full[perm])


@pytest.mark.parametrize("router", ["softmax", "softmax_k4", "sigmoid"])
def test_matches_moe_module(router):
    """Against the MoE module's loop and grouped paths (routed experts only) on its own routing, fp32."""
    moe = random_moe(router, seed=seed_of("module", router) % 1000)
    assert moe.pack_experts() == "grouped"
    for t in (1, 5):
        x = torch.randn(t, BASE["hidden_size"], generator=torch.Generator().manual_seed(seed_of(router, t)))
        with torch.no_grad():
            w, ids, _ = moe.gate(x)
            loop, grouped = moe._loop(x, w, ids), moe._grouped(x, w, ids)
        got = moe_experts_decode_triton(x, ids, w, moe.w13, moe.w2)
        assert rel_err(got, loop) <= 1e-6 and rel_err(got, grouped) <= 1e-6
        assert rel_err(moe_experts_decode_ref(x, ids, w, moe.w13, moe.w2), grouped) <= 1e-6


def test_dispatch_and_support():
    x, ids, w, w13, w2 = make_inputs(seed_of("dispatch"), 2, 2, 8, 64, 32, torch.float32)
    out = nan_out(2, 64, torch.float32)
    assert torch.equal(moe_experts_decode(x, ids, w, w13, w2, out), moe_experts_decode_ref(x, ids, w, w13, w2))
    assert torch.isfinite(out).all()
    assert moe_decode_supported(1, 8, 2048, 768, torch.bfloat16)
    assert moe_decode_supported(16, 8, 2048, 768, torch.float16)
    assert not moe_decode_supported(17, 8, 2048, 768, torch.bfloat16)
    assert not moe_decode_supported(0, 8, 2048, 768, torch.bfloat16)
    assert not moe_decode_supported(4, 8, 2040, 768, torch.bfloat16)
    assert not moe_decode_supported(4, 8, 2048, 760, torch.bfloat16)
    assert not moe_decode_supported(4, 8, 2048, 768, torch.float32)
    with pytest.raises(ValueError):
        moe_experts_decode_triton(x, ids, w, w13, w2.transpose(1, 2).contiguous())
    assert moe_experts_decode_ref(x[:0], ids[:0], w[:0], w13, w2).shape == (0, 64)


# ---------------------------------------------------------------------------------------------- GPU

SHAPE_30B = dict(experts=128, top_k=8, hidden=2048, inter=768)  # Qwen3-30B-A3B
E, K, H, INTER = (SHAPE_30B[n] for n in ("experts", "top_k", "hidden", "inter"))


@pytest.fixture(scope="module")
def weights_30b():
    gen = torch.Generator(device="cuda").manual_seed(7)
    w13 = (torch.randn(E, 2 * INTER, H, device="cuda", generator=gen) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, INTER, device="cuda", generator=gen) * INTER ** -0.5).to(torch.bfloat16)
    return w13, w2


def routing_30b(seed, t):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, H, device="cuda", generator=gen).to(torch.bfloat16)
    probs = torch.randn(t, E, device="cuda", generator=gen).softmax(-1)
    w, ids = probs.topk(K, dim=-1)
    return x, ids, w / w.sum(-1, keepdim=True)


@pytest.mark.gpu
@needs_cuda
def test_gpu_30b_matches_reference_and_batch_invariant(weights_30b):
    w13, w2 = weights_30b
    x, ids, w = routing_30b(1, 16)
    full = moe_experts_decode(x, ids, w, w13, w2, nan_out(16, H, torch.bfloat16, "cuda"))
    # What MoE._grouped reads:
    module = SimpleNamespace(num_experts=E, w13=w13, w2=w2, sort_ws=None, fp8=None, quant=None)
    for t in (1, 4, 16):
        got = moe_experts_decode(x[:t], ids[:t], w[:t], w13, w2)
        ref = moe_experts_decode_ref(x[:t], ids[:t], w[:t], w13, w2)
        err, same = rel_err(got, ref), torch.equal(got, ref)
        mismatch = (got != ref).float().mean().item()
        print(f"T={t}: rel err vs ref {err:.2e}, bitwise {same} (mismatched {mismatch:.2%}), "
              f"vs _grouped {rel_err(got, MoE._grouped(module, x[:t], w[:t], ids[:t])):.2e}")
        assert err <= 1e-2
        assert torch.equal(got, full[:t]), f"T={t} differs from the same rows in T=16"
    assert torch.equal(moe_experts_decode(x[9:10], ids[9:10], w[9:10], w13, w2)[0], full[9])
    assert torch.equal(moe_experts_decode(x, ids, w, w13, w2), full), "not deterministic run to run"


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replay(weights_30b):
    """Capture once, replay with new tokens and new routing written into the same tensors."""
    w13, w2 = weights_30b
    x, ids, w = routing_30b(2, 4)
    out = torch.empty(4, H, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_experts_decode(x, ids, w, w13, w2, out)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_experts_decode(x, ids, w, w13, w2, out)
    for step in range(3):
        new_x, new_ids, new_w = routing_30b(100 + step, 4)
        x.copy_(new_x)
        ids.copy_(new_ids)
        w.copy_(new_w)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe_experts_decode(x, ids, w, w13, w2))
        assert rel_err(out, moe_experts_decode_ref(x, ids, w, w13, w2)) <= 1e-2
