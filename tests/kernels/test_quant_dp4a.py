"""The packed-int8 (dp4a) decode GEMVs for Q8_0 (strata/kernels/quant/dp4a.py), Q4_K (q4_k_dp4a.py)
and IQ3_S (iq3_s_dp4a.py) against their definitions.

CPU: the kernel in Triton's interpreter (dp4a emulated with shifts) at small shapes with forced
configurations: split-K with uneven shares, partial row tiles, M from 1 to 16, fp32 and bf16 x, a row
stride wider than K. The kernel choice `quant_decode`: 'auto' runs dp4a up to the format's DP4A_MAX_ROWS
and the dequantizing GEMV above (which kernel ran, bit for bit), one workspace serving both, the
split-K rule of `config_for` at the 8B shapes. GPU (`pytest -m gpu`): the 8B shapes, bitwise batch
invariance, CUDA-graph replay, 'auto' through `QWeight` alternating both kernels.

Tolerances: against `gemv_dp4a_ref` (the same quantization, integer sums and summation order; no
split-K there) 2e-6 relative for fp32 x, where only split-K's partial sums differ, and 1e-2 of the
largest output for bf16 x (one rounding of the result to bf16 may flip by an ulp); against the fp32
product with the unquantized x, 1.5e-2 relative Frobenius: x rounded to 8 bits per run of 32 values
errs by up to half a step of amax/127, ~5e-3 RMS relative for normal x. The dequantizing GEMVs, where
'auto' takes them, against the product with the weights rounded to x's dtype as their own tests state
it: Q8_0 1e-3, Q4_K 2e-3, IQ3_S 5e-3 (those cases take fp16 x: the interpreter multiplies bf16 dot
operands as raw integers, which only Q4_K's own tests patch).
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import choices
from strata.kernels.quant import QWeight, dp4a, iq3_s, q4_k, q8_0
from strata.kernels.quant import iq3_s_dp4a as iqd
from strata.kernels.quant import q4_k_dp4a as q4d
from strata.kernels.quant.dp4a import Dp4aConfig
from strata.kernels.splitk import split_k_parts

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
    (32, 512, 8, Dp4aConfig(16, 256, split_k=2, num_warps=8), torch.bfloat16),  # DP4A_MAX_ROWS rows
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


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288)])
def test_gpu_iq3s_shapes_and_batch_invariance(n, k):
    planes = iq3_s.repack(torch.from_numpy(iq3_s.random_raw(n, k, seed_of("gpu3", n, k))).cuda())
    grid = iq3_s.grid_table(torch.device("cuda"))
    x = make_x(8, k, torch.bfloat16, seed_of("gx3", n, k), "cuda")
    ws = planes["workspace"]  # repack sizes it for the dp4a GEMV too
    full = iqd.iq3s_gemv_dp4a(x, planes, grid, n, k, workspace=ws)
    ref = iqd.gemv_iq3s_dp4a_ref(x, planes, n, k)
    assert ((full.float() - ref).abs().max() / ref.abs().max()).item() <= 1e-2
    for m in (1, 3):
        assert torch.equal(iqd.iq3s_gemv_dp4a(x[:m].contiguous(), planes, grid, n, k, workspace=ws), full[:m])


# ----------------------------------------------------------------------------------------------
# The kernel choice quant_decode: 'auto' by rows, one workspace for both kernels


class Format:
    """A format's two decode GEMVs called directly (each with a fresh workspace)."""

    def __init__(self, name, module, dp4a_module, max_rows, rounded_tol, round_ref):
        self.name, self.module, self.dp4a_module = name, module, dp4a_module
        self.max_rows, self.rounded_tol, self.round_ref = max_rows, rounded_tol, round_ref

    def rounded_ref(self, x, w):
        """The product with the weights rounded to x's dtype (and the result too, as the format's tests
        state it for Q8_0 and Q4_K)."""
        y = F.linear(x.float(), w.to(x.dtype).float())
        return y.to(x.dtype).float() if self.round_ref else y

    def raw(self, n, k, seed):
        return torch.from_numpy(self.module.random_raw(n, k, seed))

    def dp4a(self, x, planes, n, k):
        if self.name == "Q8_0":
            return dp4a.q8_gemv_dp4a(x, planes["qs"], planes["d"])
        if self.name == "Q4_K":
            return q4d.q4k_gemv_dp4a(x, planes, n, k)
        return iqd.iq3s_gemv_dp4a(x, planes, iq3_s.grid_table(x.device), n, k)

    def dequant(self, x, planes, n, k):
        if self.name == "Q8_0":
            return q8_0.matmul_triton(x, planes, n, k, config=q8_0.gemv_config(n, k))
        if self.name == "Q4_K":
            return q4_k.gemv_q4k(x, planes, n, k)
        return iq3_s.matmul(x, {key: t for key, t in planes.items() if key != "workspace"}, n, k,
                            config=iq3_s.gemv_config(n, k))

    def dp4a_config(self, n, k):
        return self.dp4a_module.gemv_config(n, k)

    def dequant_parts(self, n, k):
        cfg = self.module.gemv_config(n, k)
        return split_k_parts(n, cfg.block_n, cfg.split_k, 16)


FORMATS = {f.name: f for f in (Format("Q8_0", q8_0, dp4a, 3, 1e-3, True),
                                Format("Q4_K", q4_k, q4d, 2, 2e-3, True),
                                Format("IQ3_S", iq3_s, iqd, 4, 5e-3, False))}


def test_quant_decode_picks_by_rows():
    assert choices.KernelChoices().quant_decode == "auto"
    for fmt in FORMATS.values():
        limit = fmt.max_rows
        assert fmt.module.DP4A_MAX_ROWS == limit
        rows = range(1, dp4a.MAX_ROWS + 1)
        with choices.using(quant_decode="auto"):
            assert [dp4a.decode_kernel(m, limit) for m in rows] == ["dp4a"] * limit + ["dequant"] * (16 - limit)
        for choice in ("dequant", "dp4a", "auto"):
            with choices.using(quant_decode=choice):
                picks = {dp4a.decode_kernel(m, limit) for m in rows}
                assert picks == ({choice} if choice != "auto" else {"dp4a", "dequant"})
    with pytest.raises(ValueError, match="quant_decode"), choices.using(quant_decode="fast"):
        pass


def test_config_for_splits_by_powers_of_two():
    """About four programs per SM, the split a power of two: the 8B shapes' splits."""
    splits = {(4096, 4096): 8, (6144, 4096): 4, (24576, 4096): 1, (4096, 12288): 8}
    for (n, k), split in splits.items():
        assert dp4a.config_for(n, k) == Dp4aConfig(64, 256, split)
        assert dp4a.gemv_config(n, k) == Dp4aConfig(64, 256, split)
    # Q4_K: 128 rows where that leaves >= 2 programs per SM after the split; IQ3_S: 128 rows always.
    wide = {(4096, 4096): Dp4aConfig(64, 256, 8), (6144, 4096): Dp4aConfig(128, 256, 8),
            (24576, 4096): Dp4aConfig(128, 256, 2), (4096, 12288): Dp4aConfig(64, 256, 8)}
    for (n, k), cfg in wide.items():
        assert q4d.gemv_config(n, k) == cfg
        assert iqd.gemv_config(n, k) == Dp4aConfig(128, 256, cfg.split_k)
    assert dp4a.config_for(64, 256) == Dp4aConfig(64, 256, 1)  # one step: no split
    assert dp4a.config_for(40, 192, block_ks=(256, 128, 64)) == Dp4aConfig(64, 64, 1)


@pytest.mark.skipif(CUDA, reason="the interpreter cases run without a GPU")
@pytest.mark.parametrize("name,extra", [("Q8_0", 0), ("Q8_0", 1), ("Q4_K", 0), ("Q4_K", 1), ("IQ3_S", 0),
                                        ("IQ3_S", 1)])
def test_auto_takes_dp4a_up_to_the_limit(monkeypatch, name, extra):
    """Unset ('auto'): `matmul` at DP4A_MAX_ROWS rows runs the dp4a GEMV, one row more the dequantizing
    one; each result is that kernel's own, bit for bit, and within its tolerance. 'dequant' and 'dp4a'
    force the other kernel at those rows."""
    fmt = FORMATS[name]
    n, k = 40, 256
    planes = fmt.module.repack(fmt.raw(n, k, seed_of("auto", name)))
    m = fmt.max_rows + extra
    x = make_x(m, k, torch.float16, seed_of("xauto", name, m))
    calls = []
    kernel_name = {"Q8_0": "q8_gemv_dp4a", "Q4_K": "q4k_gemv_dp4a", "IQ3_S": "iq3s_gemv_dp4a"}[name]
    real = getattr(fmt.dp4a_module, kernel_name)
    monkeypatch.setattr(fmt.dp4a_module, kernel_name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with choices.using(quant_decode="auto"):
        got = fmt.module.matmul(x, planes, n, k)
        fmt.module.matmul(x.float(), planes, n, k)  # fp32 x: always the dequantizing GEMV
    assert len(calls) == (1 if extra == 0 else 0)
    forced = "dequant" if extra == 0 else "dp4a"
    with choices.using(quant_decode=forced):
        other = fmt.module.matmul(x, planes, n, k)
    assert len(calls) == 1
    assert torch.equal(other, fmt.dequant(x, planes, n, k) if forced == "dequant" else fmt.dp4a(x, planes, n, k))
    w = fmt.module.dequantize(planes, n, k)
    exact = F.linear(x.float(), w)
    if extra == 0:
        assert torch.equal(got, fmt.dp4a(x, planes, n, k))
        ref = {"Q8_0": lambda: dp4a.gemv_dp4a_ref(x, planes["qs"], planes["d"], 256),
               "Q4_K": lambda: q4d.gemv_q4k_dp4a_ref(x, planes, n, k, fmt.dp4a_config(n, k).block_k),
               "IQ3_S": lambda: iqd.gemv_iq3s_dp4a_ref(x, planes, n, k)}[name]()
        assert ((got.float() - ref).abs().max() / ref.abs().max()).item() <= 1e-2
        assert ((got.float() - exact).norm() / exact.norm()).item() <= 1.5e-2
    else:
        assert torch.equal(got, fmt.dequant(x, planes, n, k))
        rounded = fmt.rounded_ref(x, w)
        assert ((got.float() - rounded).norm() / rounded.norm()).item() <= fmt.rounded_tol


@pytest.mark.parametrize("name", list(FORMATS))
def test_default_workspace_holds_both_kernels_apart(name):
    """At the 8B shapes the workspace made once per weight holds the larger counter region and the larger
    partial region of the two GEMVs: neither kernel's partials can land on the other's counters."""
    fmt = FORMATS[name]
    for n, k in [(4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288), (2048, 4096), (1024, 4096)]:
        cfg = fmt.dp4a_config(n, k)
        parts = [fmt.dequant_parts(n, k), split_k_parts(n, cfg.block_n, cfg.split_k, dp4a.MAX_ROWS)]
        numel = (iq3_s.decode_workspace_numel(n, k) if name == "IQ3_S" else fmt.module.gemv_workspace_numel(n, k))
        assert numel >= max(c for c, _ in parts) + max(p for _, p in parts)
        for choice in ("dequant", "dp4a"):  # made once, whatever quant_decode says then
            with choices.using(quant_decode=choice):
                again = (iq3_s.decode_workspace_numel(n, k) if name == "IQ3_S"
                         else fmt.module.gemv_workspace_numel(n, k))
            assert again == numel


@pytest.mark.skipif(CUDA, reason="the interpreter cases run without a GPU")
@pytest.mark.parametrize("name", list(FORMATS))
def test_one_workspace_serves_both_kernels(name):
    """A `QWeight` under 'auto', its calls alternating between the two GEMVs (both splitting K where the
    shape lets them) through its one workspace: each result is the kernel's own with a fresh
    workspace, and the counters are back at zero."""
    fmt = FORMATS[name]
    n, k = (16, 4096) if name == "IQ3_S" else (40, 1024)
    qw = QWeight.from_raw(name, fmt.raw(n, k, seed_of("ws", name)), n, k)
    planes = qw.planes
    ws = qw.workspace  # IQ3_S's repack makes it, QWeight keeps it beside the others'
    assert ws is not None and "workspace" not in planes
    assert fmt.dp4a_config(n, k).split_k > 1 and (name == "IQ3_S" or fmt.module.gemv_config(n, k).split_k > 1)
    if name == "IQ3_S":
        assert iq3_s.gemv_config(n, k).split_k > 1
    with choices.using(quant_decode="auto"):
        for rep, m in enumerate((1, fmt.max_rows + 1, 1)):
            x = make_x(m, k, torch.float16, seed_of("wsx", name, rep))
            got = qw.matmul(x)
            expect = fmt.dp4a(x, planes, n, k) if m <= fmt.max_rows else fmt.dequant(x, planes, n, k)
            assert torch.equal(got, expect), (m, rep)
            assert not ws[:32].any()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(FORMATS))
def test_gpu_auto_through_qweight(name):
    """The 8B shapes under 'auto' through `QWeight`: every M from 1 to 16, twice, through the one
    workspace; each row block equals its kernel's own result, and a CUDA graph at M = 1 replays it."""
    fmt = FORMATS[name]
    for n, k in [(4096, 4096), (6144, 4096)]:
        qw = QWeight.from_raw(name, fmt.raw(n, k, seed_of("gauto", name, n)).cuda(), n, k)
        x = make_x(16, k, torch.bfloat16, seed_of("gautox", name, n), "cuda")
        with choices.using(quant_decode="auto"):
            for _ in range(2):
                for m in range(1, 17):
                    xm = x[:m].contiguous()
                    expect = fmt.dp4a(xm, qw.planes, n, k) if m <= fmt.max_rows else fmt.dequant(xm, qw.planes, n, k)
                    assert torch.equal(qw.matmul(xm), expect), (n, k, m)
            out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
            x1 = x[:1].contiguous()
            qw.matmul(x1, out)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                qw.matmul(x1, out)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fmt.dp4a(x1, qw.planes, n, k))


@pytest.mark.skipif(CUDA, reason="the interpreter cases run without a GPU")
def test_a_model_shares_one_workspace_across_formats():
    """`CausalLM._share_quant_workspace`: the weights of three formats (every one splitting K in both
    decode GEMVs) take one workspace; calls through it, alternating weights and kernels, give each
    kernel's own result with a fresh workspace, and leave every counter at zero."""
    from torch import nn

    from strata.models.transformer import CausalLM

    shapes = {"Q8_0": (40, 1024), "Q4_K": (40, 1024), "IQ3_S": (16, 4096)}
    holder = nn.Module()
    for name, (n, k) in shapes.items():
        setattr(holder, name.lower(), QWeight.from_raw(name, FORMATS[name].raw(n, k, seed_of("share", name)), n, k))
    weights = {name: getattr(holder, name.lower()) for name in shapes}
    own = {name: w.workspace.numel() for name, w in weights.items()}
    CausalLM._share_quant_workspace(holder)
    shared = {id(w.workspace) for w in weights.values()}
    assert len(shared) == 1 and weights["Q8_0"].workspace.numel() == 2 * max(own.values())
    ws = weights["Q8_0"].workspace
    with choices.using(quant_decode="auto"):
        for rep in range(2):
            for name, w in weights.items():
                fmt = FORMATS[name]
                for m in (1, fmt.max_rows + 1):
                    x = make_x(m, w.k, torch.float16, seed_of("share-x", name, m, rep))
                    expect = (fmt.dp4a if m <= fmt.max_rows else fmt.dequant)(x, w.planes, w.n, w.k)
                    assert torch.equal(w.matmul(x), expect), (name, m, rep)
                    assert not ws[:32].any(), "counters left non-zero"
