"""Decode GEMV kernel against its torch reference.

CPU: the Triton kernel runs in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at small
shapes, in fp32 and fp16 (the interpreter's bf16 dot is not usable), with configurations forced to
cover split-K (even and uneven splits), column tiles that N does not fill, and the SwiGLU prologue.
GPU (`pytest -m gpu`): the real Qwen3 shapes in bf16 against F.linear, bitwise batch invariance and
run-to-run determinism, and CUDA-graph replay (timings: benchmarks/kernels/gemv.py).

Every case draws fresh inputs from its own seed; outputs start as NaN and are compared whole.
Tolerances (max error / max |reference|): fp32 1e-5 (summation order only); fp16 2e-3 (the fp32 sum
order can flip the final rounding by one fp16 ulp, ~1e-3 of the value); bf16 on the GPU 1e-2.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from strata.kernels.gemv import (
    GEMV_CONFIGS,
    GemvConfig,
    check_config,
    gemv,
    gemv_config,
    gemv_ref,
    gemv_supported,
    gemv_triton,
    gemv_workspace,
    gemv_workspace_numel,
    gemv_workspace_parts,
)
from strata.kernels import choices
from strata.kernels.splitk import shared_split_k_numel

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
QWEN3_SHAPES = [  # (name, N, K): the projections GEMV_CONFIGS is tuned for
    ("8B qkv", 6144, 4096), ("8B o_proj", 4096, 4096), ("8B gate_up", 24576, 4096), ("8B down", 4096, 12288),
    ("8B lm_head", 151936, 4096), ("30B qkv", 5120, 2048), ("30B o_proj", 2048, 4096),
    ("30B lm_head", 151936, 2048),
]


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def make_inputs(seed, m, n, k, dtype, *, bias=False, silu_mul=False, x_pad=0, device=DEV):
    """x [m, K or 2K] as a column slice of a wider buffer when x_pad > 0 (row stride > width)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width = 2 * k if silu_mul else k
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
    x = (randn(m, width) * 1.5).to(dtype)
    w = (randn(n, k) * k ** -0.5).to(dtype)
    b = randn(n).to(dtype) if bias else None
    if x_pad:
        wide = torch.full((m, width + x_pad), float("nan"), dtype=dtype, device=device)
        wide[:, :width] = x
        x = wide[:, :width]
    return x, w, b


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def run_checked(x, w, b, act, config, out_pad=0):
    """gemv_triton into a NaN-poisoned out (a column slice of a wider buffer whose extra columns hold
    a sentinel) through a zeroed workspace; checks nothing outside out was written and the counters
    are back to zero."""
    m, n = x.shape[0], w.shape[0]
    wide = torch.full((m, n + out_pad), 7.0, dtype=x.dtype, device=x.device)
    out = wide[:, :n]
    out.fill_(float("nan"))
    cfg = config or gemv_config(n, w.shape[1])
    ws = gemv_workspace(n, w.shape[1], x.device, cfg) if cfg.split_k > 1 else None
    got = gemv_triton(x, w, b, out, act=act, workspace=ws, config=config)
    assert got.data_ptr() == out.data_ptr()
    if out_pad:
        assert (wide[:, n:] == 7.0).all(), "write outside out"
    if ws is not None:
        tiles = -(-n // cfg.block_n)
        assert (ws[:tiles] == 0).all(), "split counters not reset"
    return out


# (m, n, k, config or None for the heuristic, bias, act, x_pad, out_pad)
CASES = [
    (1, 16, 64, None, False, None, 0, 0),
    (3, 200, 256, GemvConfig(64, 64, split_k=3, num_stages=2), True, None, 0, 0),  # uneven 4 blocks / 3
    (5, 100, 128, GemvConfig(32, 64, split_k=2), False, None, 8, 4),
    (2, 48, 192, GemvConfig(16, 64, split_k=1), True, None, 0, 0),
    (4, 130, 256, GemvConfig(128, 128, split_k=2), False, None, 0, 0),
    (5, 70, 64, None, True, "silu_mul", 0, 3),
    (3, 96, 128, GemvConfig(32, 32, split_k=4), False, "silu_mul", 16, 0),
    (1, 200, 256, GemvConfig(64, 128, split_k=2), True, "silu_mul", 0, 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[0]}-n{c[1]}-k{c[2]}-{c[5] or 'plain'}-"
                         f"{'s%d' % c[3].split_k if c[3] else 'auto'}")
def test_matches_reference(case, dtype):
    m, n, k, config, bias, act, x_pad, out_pad = case
    x, w, b = make_inputs(seed_of(case, dtype), m, n, k, dtype, bias=bias, silu_mul=act == "silu_mul", x_pad=x_pad)
    out = run_checked(x, w, b, act, config, out_pad)
    ref = gemv_ref(x, w, b, act=act)
    assert out.dtype == dtype and torch.isfinite(out).all(), "unwritten NaN poison"
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("act", [None, "silu_mul"], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("config", [None, GemvConfig(32, 64, split_k=3)], ids=["auto", "split3"])
def test_batch_invariant(config, act):
    """A row alone, and the same row among 4 other (fresh, different) rows, agree bit for bit."""
    n, k = 80, 192
    dtype = torch.float16
    x5, w, b = make_inputs(seed_of("inv", act), 5, n, k, dtype, bias=True, silu_mul=act == "silu_mul")
    full = run_checked(x5, w, b, act, config)
    for row in (0, 3):
        alone = run_checked(x5[row:row + 1], w, b, act, config)
        assert torch.equal(alone[0], full[row])
    other, _, _ = make_inputs(seed_of("inv-other", act), 5, n, k, dtype, silu_mul=act == "silu_mul")
    other[2] = x5[2]
    assert torch.equal(run_checked(other, w, b, act, config)[2], full[2])


def test_silu_mul_rounds_like_torch():
    """With an identity weight the output is the kernel's SwiGLU value itself: it must be torch's
    `F.silu(g) * u` (silu rounded to fp16, then the product rounded). Skipping the first rounding
    changes a large share of the values; the interpreter's exp may differ from torch's in the last
    fp32 bit, which flips an fp16 rounding about once in 8000 values, hence the 1% allowance."""
    k = 256
    x, _, _ = make_inputs(seed_of("silu-round"), 5, k, k, torch.float16, silu_mul=True)
    eye = torch.eye(k, dtype=torch.float16, device=DEV)
    out = run_checked(x, eye, None, "silu_mul", GemvConfig(64, 64, split_k=2))
    expect = F.silu(x[:, :k]) * x[:, k:]
    assert (out != expect).float().mean().item() <= 0.01


def test_workspace_reuse_and_sharing():
    """One workspace, sized for the larger of two shapes, serves both in turn, repeatedly."""
    cfg = GemvConfig(32, 64, split_k=2)
    shapes = [(48, 128), (100, 256)]
    ws = torch.zeros(max(gemv_workspace_numel(n, k, cfg) for n, k in shapes), dtype=torch.int32, device=DEV)
    for rep in range(2):
        for n, k in shapes:
            x, w, _ = make_inputs(seed_of("ws", rep, n), 3, n, k, torch.float32)
            out = gemv_triton(x, w, workspace=ws, config=cfg)
            assert rel_err(out, gemv_ref(x, w)) <= TOL[torch.float32]
            assert (ws[:-(-n // cfg.block_n)] == 0).all()
    with pytest.raises(ValueError, match="workspace"):
        gemv_triton(x, w, workspace=ws[:5], config=cfg)


def test_dispatch_and_validation():
    x, w, b = make_inputs(seed_of("dispatch"), 2, 40, 64, torch.float32, bias=True)
    if not CUDA:
        assert torch.equal(gemv(x, w, b), gemv_ref(x, w, b))
    with pytest.raises(ValueError):
        gemv_triton(torch.zeros(17, 64, device=DEV), w)  # M > 16
    with pytest.raises(ValueError):
        gemv_triton(x, w, act="gelu")
    with pytest.raises(ValueError):
        gemv_triton(x, w, act="silu_mul")  # x is [M, K], not [M, 2K]
    with pytest.raises(ValueError):
        gemv_triton(x, w, config=GemvConfig(32, 128))  # BLOCK_K does not divide K
    assert gemv_supported(1, 4096, 4096, torch.bfloat16) and gemv_supported(16, 7, 64, torch.float16)
    assert not gemv_supported(17, 4096, 4096, torch.bfloat16)
    assert not gemv_supported(0, 4096, 4096, torch.bfloat16)
    assert not gemv_supported(4, 4096, 4000, torch.bfloat16)
    assert not gemv_supported(4, 4096, 4096, torch.float32)


def test_configs_valid():
    for (n, k), cfg in GEMV_CONFIGS.items():
        check_config(cfg, k)
        assert cfg.smem_bytes() <= 113 << 10, (n, k, cfg)  # two programs per SM
    for n in (1, 7, 200, 2048, 5120, 6144, 12345, 151936):
        for k in (64, 192, 1024, 4096, 12288):
            cfg = gemv_config(n, k)
            check_config(cfg, k)
            assert gemv_supported(1, n, k, torch.bfloat16)
    assert {(n, k) for _, n, k in QWEN3_SHAPES} <= set(GEMV_CONFIGS)


# ---------------------------------------------------------------------------------------------- GPU

GPU_SHAPES = [(n, k) for _, n, k in QWEN3_SHAPES]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_matches_linear_and_batch_invariant(shape):
    n, k = shape
    x, w, b = make_inputs(seed_of("gpu", shape), 16, n, k, torch.bfloat16, bias=True, device="cuda")
    ws = gemv_workspace(n, k, "cuda")
    results = {}
    for m in (1, 3, 8, 16):
        out = gemv(x[:m], w, b, workspace=ws)
        assert torch.isfinite(out).all()
        err = rel_err(out, F.linear(x[:m], w, b))
        assert err <= 1e-2, f"M={m}: relative error {err:.3g}"
        results[m] = out
    for m in (1, 3, 8):
        assert torch.equal(results[m], results[16][:m]), f"M={m} differs from the same rows in M=16"
    assert torch.equal(gemv(x[5:6], w, b, workspace=ws)[0], results[16][5])
    assert torch.equal(gemv(x, w, b, workspace=ws), results[16]), "not deterministic run to run"
    no_ws = gemv(x, w, b)  # allocated workspace
    assert torch.equal(no_ws, results[16])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 12288), (151936, 4096)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_pdl_changes_nothing(shape):
    """Programmatic dependent launch only moves the launch: the same bits with it and without it
    (the kernel choice `pdl`)."""
    n, k = shape
    x, w, b = make_inputs(seed_of("pdl", shape), 8, n, k, torch.bfloat16, bias=True, device="cuda")
    ws = gemv_workspace(n, k, "cuda")
    with choices.using(pdl=True):
        on = gemv(x, w, b, workspace=ws)
    with choices.using(pdl=False):
        off = gemv(x, w, b, workspace=ws)
    assert torch.equal(on, off)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_silu_mul_down(dtype):
    n, k = 4096, 12288
    x, w, _ = make_inputs(seed_of("gpu-silu", dtype), 16, n, k, dtype, silu_mul=True, x_pad=64, device="cuda")
    h = F.silu(x[:, :k]) * x[:, k:]
    full = gemv(x, w, act="silu_mul")
    exact = gemv(h, w)  # the same kernel on torch's SwiGLU: bit-equal if the prologue rounds like torch
    assert torch.equal(full, exact), "fused SwiGLU does not round like F.silu(g) * u"
    assert rel_err(full, F.linear(h, w)) <= TOL[dtype]
    for m in (1, 8):
        assert torch.equal(gemv(x[:m], w, act="silu_mul"), full[:m])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 4096), (4096, 12288)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_cuda_graph_replay(shape):
    """Capture gemv (split-K shapes included) once, replay with new inputs in the same tensors."""
    n, k = shape
    silu_mul = k == 12288
    act = "silu_mul" if silu_mul else None
    x, w, b = make_inputs(seed_of("graph", shape), 8, n, k, torch.bfloat16, bias=True, silu_mul=silu_mul,
                          device="cuda")
    ws = gemv_workspace(n, k, "cuda")
    out = torch.empty(8, n, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemv(x, w, b, out, act=act, workspace=ws)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv(x, w, b, out, act=act, workspace=ws)
    for step in range(3):
        new_x, _, _ = make_inputs(seed_of("graph", shape, step), 8, n, k, torch.bfloat16, silu_mul=silu_mul,
                                  device="cuda")
        x.copy_(new_x)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gemv(x, w, b, act=act, workspace=ws))
        assert rel_err(out, gemv_ref(x, w, b, act=act)) <= 1e-2


def test_one_workspace_serves_shapes_of_different_tile_counts():
    """A model shares one split-K workspace between its GEMV shapes (`shared_split_k_numel`). Shape A
    has 40 column tiles, shape B 20: laid out as counters then partials right after them, B's partials
    would start at slot 32 and land on A's counters 32-39, and A's next call would never see its last
    split arrive for those tiles (what left rows of the 8B qkv projection unwritten). Partials at the
    workspace's end keep every shape's counters clear."""
    k, m = 256, 3
    configs = {640: GemvConfig(16, 64, split_k=2), 320: GemvConfig(16, 64, split_k=4)}
    ws = torch.zeros(shared_split_k_numel([gemv_workspace_parts(n, k, cfg) for n, cfg in configs.items()]),
                     dtype=torch.int32, device=DEV)
    for rep in range(2):
        for n, cfg in configs.items():
            x, w, _ = make_inputs(seed_of("shared", n, rep), m, n, k, torch.float32)
            out = torch.full((m, n), float("nan"), device=DEV)
            gemv_triton(x, w, None, out, workspace=ws, config=cfg)
            assert rel_err(out, gemv_ref(x, w)) <= TOL[torch.float32], f"N={n}, call {rep}"
            assert not ws[: -(-n // cfg.block_n)].any(), "split counters not reset"


def test_shared_workspace_regions_never_overlap_for_the_table_shapes():
    """Every pair of the tuned shapes (one model's GEMVs share a workspace): A's counters end before the
    start of B's partials in a workspace sized by `shared_split_k_numel`."""
    shapes = [(n, k) for n, k in GEMV_CONFIGS]
    parts = {s: gemv_workspace_parts(*s) for s in shapes}
    total = shared_split_k_numel(parts.values())
    for a in shapes:
        tiles_a = -(-a[0] // gemv_config(*a).block_n) if parts[a][0] else 0
        for b in shapes:
            assert tiles_a <= total - parts[b][1], f"{b}'s partials overlap {a}'s counters"
    assert any(parts[s][0] > 32 for s in shapes)  # the case the layout is for: more than 32 tiles


@pytest.mark.gpu
@needs_cuda
def test_gpu_layer_sequence_on_one_shared_workspace():
    """The 8B layer's GEMVs in the order a decode step runs them, twice, through one workspace sized as
    `CausalLM.pack` sizes it: each output against F.linear (the shapes with > 32 tiles that broke the
    old layout)."""
    shapes = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
    ws = torch.zeros(shared_split_k_numel(gemv_workspace_parts(n, k) for n, k in shapes), dtype=torch.int32,
                     device="cuda")
    for rep in range(2):
        for n, k in shapes:
            x, w, _ = make_inputs(seed_of("layer", n, k, rep), 1, n, k, torch.bfloat16, device="cuda")
            out = gemv_triton(x, w, None, workspace=ws)
            assert rel_err(out, F.linear(x.float(), w.float())) <= TOL[torch.bfloat16], f"{n}x{k}, pass {rep}"
