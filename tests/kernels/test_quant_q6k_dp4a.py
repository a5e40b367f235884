"""The packed-int8 (dp4a) decode GEMV for Q6_K (strata/kernels/quant/q6_k_dp4a.py) and the kernel choice
`quant_decode` in `q6_k.matmul`.

CPU: the kernel in Triton's interpreter (dp4a emulated with shifts) at small shapes: forced
configurations with split-K in uneven shares, 128- and 256-value steps, partial row tiles, M from 1 to
8, fp32 / fp16 / bf16 x, a row stride wider than K, extreme quants, scales and x. Against
`gemv_q6k_dp4a_ref` (the same quantization of x, the same integers, summation order and split-K
shares) the result is equal bit for bit (bf16: conftest rounds the interpreter's casts to nearest
even, as the GPU does). The reference itself: within 1e-6 (max, relative to the largest output) of
the fp64 product of x's quantized values and the dequantized weight (its integer form is that product
up to fp32 rounding); against the product with the unquantized x and the dequantized weight,
1.5e-2 relative Frobenius, the other dp4a tests' bound (x rounded to 8 bits per run of 32 values errs
by up to half a step of amax/127, ~5e-3 RMS relative). The choice: 'auto' runs dp4a up to
DP4A_MAX_ROWS = 2 rows and the dequantizing GEMV above (which kernel ran, spied; each result that
kernel's own, bit for bit), one workspace serving both. The dequantizing GEMV's own tolerance, where
'auto' takes it, is test_quant_formats.py's 2e-3 for fp16 x (fp16: the interpreter multiplies
bf16 dot operands as raw integers in that kernel). GPU (`pytest -m gpu`): the Qwen3-8B shapes against
the reference, rows independent of M, CUDA-graph replay, 'auto' through `QWeight` at every M.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import choices
from strata.kernels.quant import QWeight, dp4a, q6_k
from strata.kernels.quant import q4_k_dp4a as q4d
from strata.kernels.quant import q6_k_dp4a as q6d
from strata.kernels.quant.dp4a import Dp4aConfig
from strata.kernels.splitk import split_k_parts

pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")]

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
interpreter_only = pytest.mark.skipif(CUDA, reason="the interpreter cases run without a GPU")
SHAPES_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def raw_of(n, k, seed):
    return torch.from_numpy(q6_k.random_raw(n, k, seed))


def planes_of(n, k, seed, device="cpu"):
    return q6_k.repack(raw_of(n, k, seed).to(device))


def make_x(m, k, dtype, seed, device="cpu", pad=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k + pad, generator=gen, device=device).to(dtype)
    x[0, :32] = 0.0  # a zero run: dx 0
    return x[:, :k]


def rel_frobenius(got, ref) -> float:
    return ((got.to(ref.dtype) - ref).norm() / ref.norm()).item()


def check(got, x, planes, n, k, cfg):
    ref = q6d.gemv_q6k_dp4a_ref(x, planes, n, k, cfg.block_k, cfg.split_k)
    assert got.dtype == x.dtype and torch.isfinite(got).all()
    assert torch.equal(got, ref.to(x.dtype))
    w = q6_k.dequantize(planes, n, k).double()
    # The reference's integer form is the product of x's quantized values and the weight (fp64 here).
    xq, dx = dp4a.quantize_ref(x)
    x_quantized = (xq.double().view(-1, k // 32, 32) * dx.double()[..., None]).view(-1, k)
    same = F.linear(x_quantized, w)
    assert ((ref.double() - same).abs().max() / same.abs().max()).item() <= 1e-6
    exact = F.linear(x.double(), w)
    assert rel_frobenius(got.double(), exact) <= 1.5e-2


@interpreter_only
@pytest.mark.parametrize("n,k,m,cfg,dtype", [
    (64, 256, 1, None, torch.float16),
    (40, 512, 3, Dp4aConfig(32, 128, split_k=3), torch.float32),  # 4 steps over 3 splits, a partial row tile
    (16, 1024, 2, Dp4aConfig(16, 256, split_k=4), torch.bfloat16),  # one super-block per split
])
def test_matches_reference(n, k, m, cfg, dtype):
    planes = planes_of(n, k, seed_of("w", n, k))
    x = make_x(m, k, dtype, seed_of("x", n, k, m), pad=8)
    cfg = cfg or q6d.gemv_config(n, k)
    ws = torch.zeros(max(1, q6d.workspace_numel(n, k, cfg)), dtype=torch.int32)
    for _ in range(2):  # the counters are back at zero: a second call through the workspace agrees
        check(q6d.q6k_gemv_dp4a(x, planes, n, k, workspace=ws, config=cfg), x, planes, n, k, cfg)
    assert not ws[: -(-n // cfg.block_n)].any()


@interpreter_only
def test_extreme_fields():
    """Quants all 0 and all 63, scales −128 and 127, x at ±amax in every value (q = ±127): the integers'
    extremes (|T| = 2·128·16·32·127, just under 2^24) still give the reference's bits."""
    n, k = 8, 256
    raw = raw_of(n, k, 4).view(n, 1, q6_k.BLOCK_BYTES)
    raw[0:2, :, :192] = 0x00  # q = 0: q − 32 = −32
    raw[2:4, :, :192] = 0xFF  # q = 63
    raw[0::2, :, 192:208] = 0x80  # scale −128
    raw[1::2, :, 192:208] = 0x7F  # scale 127
    planes = q6_k.repack(raw.view(n, -1))
    x = torch.full((2, k), 3.0)
    x[1, 1::2] = -3.0
    x[1, :16] = 0.5
    cfg = Dp4aConfig(8, 256)
    check(q6d.q6k_gemv_dp4a(x, planes, n, k, config=cfg), x, planes, n, k, cfg)


@interpreter_only
def test_rows_do_not_depend_on_the_batch():
    n, k = 24, 256
    planes = planes_of(n, k, 3)
    x = make_x(8, k, torch.float16, 4)
    cfg = Dp4aConfig(32, 128, split_k=2)  # split-K, a partial row tile
    full = q6d.q6k_gemv_dp4a(x, planes, n, k, config=cfg)
    for m in (1, 3):
        assert torch.equal(q6d.q6k_gemv_dp4a(x[:m].contiguous(), planes, n, k, config=cfg), full[:m])


def test_rejects_64_value_steps():
    planes = planes_of(16, 256, 1)
    with pytest.raises(ValueError, match="block_k"):
        q6d.q6k_gemv_dp4a(torch.zeros(1, 256, dtype=torch.float16), planes, 16, 256, config=Dp4aConfig(16, 64))


def test_configs():
    """Q4_K's tiles at the 8B shapes (the same 64 quant words per row and step); the LM head: 128 rows,
    no split (1,187 tiles already fill the GPU)."""
    for n, k in SHAPES_8B:
        assert q6d.gemv_config(n, k) == q4d.gemv_config(n, k)
    assert q6d.gemv_config(*q6d.LM_HEAD_SHAPE) == Dp4aConfig(128, 256, 1)


# ----------------------------------------------------------------------------------------------
# quant_decode: 'auto' by rows, one workspace for both kernels


def dequant_gemv(x, planes, n, k):
    return q6_k.gemv_q6k(x, planes, n, k)


def test_quant_decode_picks_by_rows():
    # 'auto' by default, as for the other formats (the limit from the H200 sweep).
    assert choices.KernelChoices().quant_decode == "auto" and q6_k.DP4A_MAX_ROWS == 2
    rows = range(1, dp4a.MAX_ROWS + 1)
    assert [q6_k._decode_kernel(m) for m in rows] == ["dp4a"] * 2 + ["dequant"] * 14
    with choices.using(quant_decode="auto"):
        assert [q6_k._decode_kernel(m) for m in rows] == ["dp4a"] * 2 + ["dequant"] * 14
    for choice in ("dequant", "dp4a"):
        with choices.using(quant_decode=choice):
            assert {q6_k._decode_kernel(m) for m in rows} == {choice}


@interpreter_only
@pytest.mark.parametrize("extra", [0, 1])
def test_auto_takes_dp4a_up_to_the_limit(monkeypatch, extra):
    """Unset ('auto'): `matmul` at DP4A_MAX_ROWS rows runs the dp4a GEMV, one row more the dequantizing
    one, fp32 x always the dequantizing one; each result is that kernel's own, bit for bit, and within
    its tolerance. 'dequant' and 'dp4a' force the other kernel at those rows."""
    n, k = 40, 256
    planes = planes_of(n, k, seed_of("auto"))
    m = q6_k.DP4A_MAX_ROWS + extra
    x = make_x(m, k, torch.float16, seed_of("xauto", m))
    calls = []
    real = q6d.q6k_gemv_dp4a
    monkeypatch.setattr(q6d, "q6k_gemv_dp4a", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with choices.using(quant_decode="auto"):
        got = q6_k.matmul(x, planes, n, k)
        q6_k.matmul(x.float(), planes, n, k)
    assert len(calls) == (1 if extra == 0 else 0)
    forced = "dequant" if extra == 0 else "dp4a"
    with choices.using(quant_decode=forced):
        other = q6_k.matmul(x, planes, n, k)
        with pytest.raises(ValueError):  # the same argument checks on either side
            q6_k.matmul(x[:, :128], planes, n, k)
    assert len(calls) == 1
    own = {"dequant": dequant_gemv, "dp4a": real}
    assert torch.equal(other, own[forced](x, planes, n, k))
    if extra == 0:
        assert torch.equal(got, real(x, planes, n, k))
        check(got, x, planes, n, k, q6d.gemv_config(n, k))
    else:
        assert torch.equal(got, dequant_gemv(x, planes, n, k))
        assert rel_frobenius(got, q6_k.matmul_ref(x, planes, n, k).float()) <= 2e-3


def test_default_workspace_holds_both_kernels_apart():
    """At the 8B shapes and the LM head, the workspace made once per weight holds the larger counter
    region and the larger partial region of the two GEMVs, whatever quant_decode says then."""
    for n, k in SHAPES_8B + [q6d.LM_HEAD_SHAPE, (2048, 4096), (1024, 4096)]:
        cfg, dq = q6d.gemv_config(n, k), q6_k.gemv_config(n, k)
        parts = [split_k_parts(n, dq.block_n, dq.split_k, 16),
                 split_k_parts(n, cfg.block_n, cfg.split_k, dp4a.MAX_ROWS)]
        numel = q6_k.gemv_workspace_numel(n, k)
        assert numel >= max(c for c, _ in parts) + max(p for _, p in parts)
        for choice in ("dequant", "dp4a"):
            with choices.using(quant_decode=choice):
                assert q6_k.gemv_workspace_numel(n, k) == numel


@interpreter_only
def test_one_workspace_serves_both_kernels():
    """A `QWeight` under 'auto', its calls alternating between the two GEMVs (both splitting K) through
    its one workspace: each result is the kernel's own with a fresh workspace, counters back at zero."""
    n, k = 40, 1024
    qw = QWeight.from_raw("Q6_K", raw_of(n, k, seed_of("ws")), n, k)
    ws = qw.workspace
    assert ws is not None and ws.numel() == q6_k.gemv_workspace_numel(n, k)
    assert q6d.gemv_config(n, k).split_k > 1 and q6_k.gemv_config(n, k).split_k > 1
    with choices.using(quant_decode="auto"):
        for rep, m in enumerate((1, 3, 1)):
            x = make_x(m, k, torch.float16, seed_of("wsx", rep))
            expect = (q6d.q6k_gemv_dp4a if m <= q6_k.DP4A_MAX_ROWS else dequant_gemv)(x, qw.planes, n, k)
            assert torch.equal(qw.matmul(x), expect), (m, rep)
            assert not ws[:32].any()


# ----------------------------------------------------------------------------------------------
# GPU (pytest -m gpu)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n,k", SHAPES_8B)
def test_gpu_shapes_batch_invariance_and_graph(n, k):
    """The default configuration against the reference (no FMA contraction, the same integers and
    order: the bits are expected to match; asserted to 1e-2 of the largest output as the other dp4a
    GPU tests, the count of differing values printed), rows independent of M, a graph's replay."""
    planes = planes_of(n, k, seed_of("gpu", n, k), "cuda")
    x = make_x(8, k, torch.bfloat16, seed_of("gx", n, k), "cuda")
    cfg = q6d.gemv_config(n, k)
    ws = torch.zeros(max(1, q6_k.gemv_workspace_numel(n, k)), dtype=torch.int32, device="cuda")
    full = q6d.q6k_gemv_dp4a(x, planes, n, k, workspace=ws)
    ref = q6d.gemv_q6k_dp4a_ref(x, planes, n, k, cfg.block_k, cfg.split_k)
    differ = (full != ref.to(x.dtype)).sum().item()
    print(f"Q6_K dp4a {n}x{k}: {differ} of {full.numel()} values differ from the reference")
    assert ((full.float() - ref).abs().max() / ref.abs().max()).item() <= 1e-2
    exact = F.linear(x.float(), q6_k.dequantize(planes, n, k))
    assert rel_frobenius(full, exact) <= 1.5e-2
    for m in (1, 3):
        assert torch.equal(q6d.q6k_gemv_dp4a(x[:m].contiguous(), planes, n, k, workspace=ws), full[:m])
    out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    x1 = x[:1].contiguous()
    q6d.q6k_gemv_dp4a(x1, planes, n, k, out, workspace=ws)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q6d.q6k_gemv_dp4a(x1, planes, n, k, out, workspace=ws)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, full[:1])


@pytest.mark.gpu
@needs_cuda
def test_gpu_auto_through_qweight():
    """'auto' through `QWeight` at two 8B shapes and the LM head: every M from 1 to 16, twice, through
    the one workspace; each row block equals its kernel's own result, and a CUDA graph at M = 1
    replays it."""
    for n, k in [(4096, 4096), (6144, 4096), q6d.LM_HEAD_SHAPE]:
        from strata.kernels.quant import random_blocks

        raw = random_blocks("Q6_K", n, k, torch.Generator("cuda").manual_seed(n), "cuda")
        qw = QWeight.from_raw("Q6_K", raw, n, k)
        x = make_x(16, k, torch.bfloat16, seed_of("gautox", n), "cuda")
        with choices.using(quant_decode="auto"):
            for _ in range(2):
                for m in range(1, 17):
                    xm = x[:m].contiguous()
                    kernel = q6d.q6k_gemv_dp4a if m <= q6_k.DP4A_MAX_ROWS else dequant_gemv
                    assert torch.equal(qw.matmul(xm), kernel(xm, qw.planes, n, k)), (n, k, m)
            out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
            x1 = x[:1].contiguous()
            qw.matmul(x1, out)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                qw.matmul(x1, out)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, q6d.q6k_gemv_dp4a(x1, qw.planes, n, k))
