"""The packed-int8 (dp4a) decode GEMVs for Q8_0 (strata/kernels/quant/dp4a.py), Q4_K (q4_k_dp4a.py)
and IQ3_S (iq3_s_dp4a.py) against their definitions.

CPU: the kernel in Triton's interpreter (dp4a emulated with shifts) at small shapes with forced
configurations: split-K with uneven shares, partial row tiles, M from 1 to 16, fp32 and bf16 x, a row
stride wider than K. GPU (`pytest -m gpu`): the 8B shapes, bitwise batch invariance, CUDA-graph replay.

Tolerances: against `gemv_dp4a_ref` (the same quantization, integer sums and summation order; no
split-K there) 2e-6 relative for fp32 x, where only split-K's partial sums differ, and 1e-2 of the
largest output for bf16 x (one rounding of the result to bf16 may flip by an ulp); against the fp32
product with the unquantized x, 1.5e-2 relative Frobenius: x rounded to 8 bits per run of 32 values
errs by up to half a step of amax/127, ~5e-3 RMS relative for normal x.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from strata.env import ENV, overridden
from strata.kernels.quant import dp4a, iq3_s, q4_k, q8_0
from strata.kernels.quant import iq3_s_dp4a as iqd
from strata.kernels.quant import q4_k_dp4a as q4d
from strata.kernels.quant.dp4a import Dp4aConfig

pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")]

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def planes_of(n, k, seed, device="cpu"):
    return q8_0.repack(torch.from_numpy(q8_0.random_raw(n, k, seed)).to(device))


def make_x(m, k, dtype, seed, device="cpu", pad=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k + pad, generator=gen, device=device).to(dtype)
    x[0, :32] = 0.0  # a zero run: dx 0
    return x[:, :k]


def check(got, x, planes, cfg):
    qs, d = planes["qs"], planes["d"]
    ref = dp4a.gemv_dp4a_ref(x, qs, d, cfg.block_k)
    exact = F.linear(x.float(), q8_0.dequantize(planes, *qs.shape))
    assert got.dtype == x.dtype and torch.isfinite(got).all()
    if x.dtype == torch.float32:
        assert ((got - ref).abs().max() / ref.abs().max()).item() <= 2e-6
    else:
        assert ((got.float() - ref).abs().max() / ref.abs().max()).item() <= 1e-2
    assert ((got.float() - exact).norm() / exact.norm()).item() <= 1.5e-2


@pytest.mark.skipif(CUDA, reason="the interpreter cases run without a GPU")
@pytest.mark.parametrize("n,k,m,cfg,dtype", [
    (96, 256, 1, None, torch.bfloat16),
    (40, 512, 3, Dp4aConfig(32, 128, split_k=3), torch.float32),  # 4 steps over 3 splits, a partial row tile
    (40, 512, 2, Dp4aConfig(32, 128, split_k=3), torch.bfloat16),
    (64, 1024, 5, Dp4aConfig(64, 256, split_k=2), torch.float32),
    (16, 256, 16, Dp4aConfig(16, 64, split_k=4), torch.float32),  # one step per split, every row of x
])
def test_matches_definition(n, k, m, cfg, dtype):
    planes = planes_of(n, k, seed_of("w", n, k))
    x = make_x(m, k, dtype, seed_of("x", n, k, m), pad=8)
    cfg = cfg or dp4a.gemv_config(n, k)
    ws = torch.zeros(max(1, dp4a.workspace_numel(n, k, cfg)), dtype=torch.int32)
    for _ in range(2):  # the counters are back at zero: a second call through the workspace agrees
        got = dp4a.q8_gemv_dp4a(x, planes["qs"], planes["d"], workspace=ws, config=cfg)
        check(got, x, planes, cfg)
    assert not ws.any() or cfg.split_k > 1 and not ws[: -(-n // cfg.block_n)].any()


@pytest.mark.skipif(CUDA, reason="the interpreter cases run without a GPU")
def test_rows_do_not_depend_on_the_batch():
    n, k = 40, 256
    planes = planes_of(n, k, 3)
    x = make_x(8, k, torch.float32, 4)
    full = dp4a.q8_gemv_dp4a(x, planes["qs"], planes["d"])
    for m in (1, 3):
        assert torch.equal(dp4a.q8_gemv_dp4a(x[:m].contiguous(), planes["qs"], planes["d"]), full[:m])


def test_q8_0_matmul_takes_it_when_switched(monkeypatch):
    n, k = 40, 256
    planes = planes_of(n, k, 5)
    x = make_x(2, k, torch.bfloat16, 6)
    calls = []
    real = dp4a.q8_gemv_dp4a
    monkeypatch.setattr(dp4a, "q8_gemv_dp4a", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with overridden(ENV.Q8_DECODE, "dp4a"):
        got = q8_0.matmul_triton(x, planes, n, k)
    assert calls and torch.equal(got, real(x, planes["qs"], planes["d"]))
    q8_0.matmul_triton(x, planes, n, k)  # the default: the dequantizing GEMV
    assert len(calls) == 1
    with overridden(ENV.Q8_DECODE, "fast"), pytest.raises(ValueError):
        q8_0.matmul_triton(x, planes, n, k)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)])
def test_gpu_shapes_batch_invariance_and_graph(n, k):
    planes = planes_of(n, k, seed_of("gpu", n, k), "cuda")
    x = make_x(16, k, torch.bfloat16, seed_of("gx", n, k), "cuda")
    cfg = dp4a.gemv_config(n, k)
    ws = torch.zeros(max(1, dp4a.workspace_numel(n, k)), dtype=torch.int32, device="cuda")
    full = dp4a.q8_gemv_dp4a(x, planes["qs"], planes["d"], workspace=ws)
    check(full, x, planes, cfg)
    for m in (1, 3, 8):
        assert torch.equal(dp4a.q8_gemv_dp4a(x[:m].contiguous(), planes["qs"], planes["d"], workspace=ws), full[:m])
    out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    x1 = x[:1].contiguous()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dp4a.q8_gemv_dp4a(x1, planes["qs"], planes["d"], out, workspace=ws)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, full[:1])


def q4k_planes(n, k, seed, device="cpu"):
    return q4_k.repack(torch.from_numpy(q4_k.random_raw(n, k, seed)).to(device))


def check_q4k(got, x, planes, n, k, cfg, fp32_tol=2e-6):
    ref = q4d.gemv_q4k_dp4a_ref(x, planes, n, k, cfg.block_k)
    exact = F.linear(x.float(), q4_k.dequantize(planes, n, k))
    assert got.dtype == x.dtype and torch.isfinite(got).all()
    tol = fp32_tol if x.dtype == torch.float32 else 1e-2
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() <= tol
    assert ((got.float() - exact).norm() / exact.norm()).item() <= 1.5e-2


@pytest.mark.skipif(CUDA, reason="the interpreter cases run without a GPU")
@pytest.mark.parametrize("n,k,m,cfg,dtype", [
    (64, 256, 1, None, torch.bfloat16),
    (40, 512, 3, Dp4aConfig(32, 128, split_k=3), torch.float32),  # 2 pairs per step, a partial row tile
    (16, 512, 2, Dp4aConfig(16, 64, split_k=4), torch.float32),  # one pair per step
    (32, 1024, 5, Dp4aConfig(32, 256, split_k=2), torch.float32),
])
def test_q4k_matches_definition(n, k, m, cfg, dtype):
    planes = q4k_planes(n, k, seed_of("w4", n, k))
    x = make_x(m, k, dtype, seed_of("x4", n, k, m), pad=8)
    cfg = cfg or q4d.gemv_config(n, k)
    ws = torch.zeros(max(1, q4d.workspace_numel(n, k, cfg)), dtype=torch.int32)
    for _ in range(2):
        check_q4k(q4d.q4k_gemv_dp4a(x, planes, n, k, workspace=ws, config=cfg), x, planes, n, k, cfg)
    assert not ws[: -(-n // cfg.block_n)].any()


def test_q4k_matmul_takes_it_when_switched():
    n, k = 32, 256
    planes = q4k_planes(n, k, 7)
    x = make_x(2, k, torch.bfloat16, 8)
    with overridden(ENV.Q4K_DECODE, "dp4a"):
        got = q4_k.matmul(x, planes, n, k)
    assert torch.equal(got, q4d.q4k_gemv_dp4a(x, planes, n, k))
    assert not torch.equal(q4_k.matmul(x, planes, n, k), got)  # the default dequantizes instead
    with overridden(ENV.Q4K_DECODE, "fast"), pytest.raises(ValueError):
        q4_k.matmul(x, planes, n, k)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)])
def test_gpu_q4k_shapes_and_batch_invariance(n, k):
    planes = q4k_planes(n, k, seed_of("gpu4", n, k), "cuda")
    x = make_x(8, k, torch.bfloat16, seed_of("gx4", n, k), "cuda")
    cfg = q4d.gemv_config(n, k)
    ws = torch.zeros(max(1, q4d.workspace_numel(n, k)), dtype=torch.int32, device="cuda")
    full = q4d.q4k_gemv_dp4a(x, planes, n, k, workspace=ws)
    check_q4k(full, x, planes, n, k, cfg)
    for m in (1, 3):
        assert torch.equal(q4d.q4k_gemv_dp4a(x[:m].contiguous(), planes, n, k, workspace=ws), full[:m])


@pytest.mark.skipif(CUDA, reason="the interpreter cases run without a GPU")
@pytest.mark.parametrize("n,k,m,cfg,dtype", [
    (64, 256, 1, None, torch.bfloat16),
    (40, 512, 3, Dp4aConfig(32, 128, split_k=3), torch.float32),  # half super-blocks, a partial row tile
    (16, 512, 2, Dp4aConfig(16, 64, split_k=4), torch.float32),  # two sub-blocks per step
])
def test_iq3s_matches_definition(n, k, m, cfg, dtype):
    planes = iq3_s.repack(torch.from_numpy(iq3_s.random_raw(n, k, seed_of("w3", n, k))))
    grid = iq3_s.grid_table(torch.device("cpu"))
    x = make_x(m, k, dtype, seed_of("x3", n, k, m), pad=8)
    cfg = cfg or iqd.gemv_config(n, k)
    ws = torch.zeros(max(1, iqd.workspace_numel(n, k, cfg)), dtype=torch.int32)
    for _ in range(2):
        got = iqd.iq3s_gemv_dp4a(x, planes, grid, n, k, workspace=ws, config=cfg)
        ref = iqd.gemv_iq3s_dp4a_ref(x, planes, n, k, cfg.block_k)
        exact = F.linear(x.float(), iq3_s.dequantize(planes, n, k))
        tol = 2e-6 if dtype == torch.float32 else 1e-2
        assert ((got.float() - ref).abs().max() / ref.abs().max()).item() <= tol
        assert ((got.float() - exact).norm() / exact.norm()).item() <= 1.5e-2
    assert not ws[: -(-n // cfg.block_n)].any()


def test_iq3s_matmul_takes_it_when_switched():
    n, k = 32, 256
    planes = iq3_s.repack(torch.from_numpy(iq3_s.random_raw(n, k, 9)))
    x = make_x(2, k, torch.bfloat16, 10)
    with overridden(ENV.IQ3S_DECODE, "dp4a"):
        got = iq3_s.matmul(x, planes, n, k)
    assert torch.equal(got, iqd.iq3s_gemv_dp4a(x, planes, iq3_s.grid_table(x.device), n, k))
    with overridden(ENV.IQ3S_DECODE, "fast"), pytest.raises(ValueError):
        iq3_s.matmul(x, planes, n, k)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288)])
def test_gpu_iq3s_shapes_and_batch_invariance(n, k):
    planes = iq3_s.repack(torch.from_numpy(iq3_s.random_raw(n, k, seed_of("gpu3", n, k))).cuda())
    grid = iq3_s.grid_table(torch.device("cuda"))
    x = make_x(8, k, torch.bfloat16, seed_of("gx3", n, k), "cuda")
    # Its own workspace: repack sizes planes["workspace"] for the dp4a GEMV only under STRATA_IQ3S_DECODE=dp4a.
    ws = torch.zeros(max(1, iqd.workspace_numel(n, k)), dtype=torch.int32, device="cuda")
    full = iqd.iq3s_gemv_dp4a(x, planes, grid, n, k, workspace=ws)
    ref = iqd.gemv_iq3s_dp4a_ref(x, planes, n, k)
    assert ((full.float() - ref).abs().max() / ref.abs().max()).item() <= 1e-2
    for m in (1, 3):
        assert torch.equal(iqd.iq3s_gemv_dp4a(x[:m].contiguous(), planes, grid, n, k, workspace=ws), full[:m])
