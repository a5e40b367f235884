"""Stream-K Q8_0 GEMM and its scratch context (strata/kernels/quant/streamk.py).

CPU (Triton's interpreter; tests/conftest.py sets TRITON_INTERPRET=1 and makes fp32 -> bf16 casts
round to nearest even, like the GPU): products for ragged tiles, iteration counts that P does not
divide (shared tiles with 1 to 4 sharers, a worker inside one tile, P clamped to the iteration
count), P in {1, 2, 3, 5}; one worker equals q8_0's tiled GEMM bit for bit; run-to-run bit equality
with garbage in the partial slots; launches of different P and tiles sharing one context; the flag
words left zero; the pool's growth (once, on the first launch with a shared tile) and reservation.
GPU (`pytest -m gpu`): N = K = 4096 at M = 512 and 4096 against the reference and run to run, the
pool with the real SM count and CUDA-graph replay (and growth refused during capture). Timings against
q8_0.matmul: benchmarks/kernels/quant_formats.py --streamk.

Tolerances, relative Frobenius error of the product:
- against q8_0.matmul_ref (fp32 F.linear of the dequantized weight): fp32 x 1e-5 (summation order
  only); bf16 / fp16 x 1e-2 (each weight is rounded to x's dtype, ~2^-9 relative, the result once);
- against the reference with the weights rounded to x's dtype first (the kernel's semantics): 1e-3,
  where only the fp32 summation order differs and may flip an output's last bit.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from strata.kernels.quant import q8_0, streamk
from strata.kernels.quant.q8_0 import Q8Config
from strata.kernels.quant.streamk import QMatmulContext, q8_0_matmul_streamk
from test_quant_q8_0 import make_x, rel_fro  # the same inputs and error measure as the tiled GEMM

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
TOL_REF = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
TOL_ROUNDED_REF = 1e-3

# (M, N, K, config): tiles x K-blocks = T iterations
CASES = [
    (40, 40, 256, Q8Config(16, 16, 64)),  # 3 x 3 ragged tiles x 4 = 36: P = 2, 5 share, P = 3 does not
    (33, 96, 256, Q8Config(16, 32, 32, group_m=2)),  # 3 x 3 tiles (one row in the last) x 8 = 72, grouped
    (16, 16, 512, Q8Config(16, 16, 32)),  # one tile x 16: with P = 5, four sharers, three inside the tile
    (3, 24, 64, Q8Config(16, 16, 32, num_stages=1)),  # 2 tiles x 2 = 4 iterations: P = 5 clamped to 4
]


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def planes_of(n, k, seed, device=DEV):
    return q8_0.repack(torch.from_numpy(q8_0.random_raw(n, k, seed)).to(device))


def check_product(got, x, planes, n, k):
    assert got.shape == (x.shape[0], n) and got.dtype == x.dtype
    assert torch.isfinite(got).all()
    assert rel_fro(got, q8_0.matmul_ref(x, planes, n, k)) <= TOL_REF[x.dtype]
    if x.dtype != torch.float32:
        rounded = F.linear(x.float(), q8_0.dequantize(planes, n, k).to(x.dtype).float()).to(x.dtype)
        assert rel_fro(got, rounded) <= TOL_ROUNDED_REF


def flags_zero(ctx: QMatmulContext) -> bool:
    if ctx.pool_bytes == 0:
        return True
    return bool((ctx.take(streamk.FLAG_BYTES) == 0).all())


# ----------------------------------------------------------------------------------------------
# CPU (interpreted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("programs", [1, 2, 3, 5])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference(case, programs, dtype):
    m, n, k, cfg = CASES[case]
    planes = planes_of(n, k, seed_of("w", n, k))
    x = make_x(m, k, dtype, seed_of("x", m, k), pad=4 if programs == 5 else 0)
    ctx = QMatmulContext(DEV)
    wide = torch.full((m, n + 3), 7.0, dtype=dtype, device=DEV)
    out = wide[:, :n]
    out.fill_(float("nan"))
    got = q8_0_matmul_streamk(x, planes, n, k, ctx, out, num_programs=programs, config=cfg)
    assert got.data_ptr() == out.data_ptr() and (wide[:, n:] == 7.0).all()
    check_product(got, x, planes, n, k)
    assert ctx.pool_bytes == streamk.fixup_bytes(m, n, k, cfg, programs)
    assert flags_zero(ctx)


def test_fp16_and_default_config():
    m, n, k = 20, 48, 256
    planes = planes_of(n, k, seed_of("w", n, k))
    x = make_x(m, k, torch.float16, seed_of("x16", m))
    check_product(q8_0_matmul_streamk(x, planes, n, k, QMatmulContext(DEV)), x, planes, n, k)  # 64 x 128 tile
    x32 = make_x(m, k, torch.float32, seed_of("x32", m))
    check_product(q8_0_matmul_streamk(x32, planes, n, k, QMatmulContext(DEV)), x32, planes, n, k)


@pytest.mark.skipif(CUDA, reason="the interpreter's products; compiled kernels may order their FMAs differently")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_program_equals_tiled_gemm(dtype):
    """One worker finishes every tile alone, K-blocks in order: q8_0's GEMM, bit for bit."""
    m, n, k, cfg = CASES[1]
    planes = planes_of(n, k, seed_of("w", n, k))
    x = make_x(m, k, dtype, seed_of("x1", m))
    ctx = QMatmulContext(DEV)
    got = q8_0_matmul_streamk(x, planes, n, k, ctx, num_programs=1, config=cfg)
    assert torch.equal(got, q8_0.matmul_triton(x, planes, n, k, config=cfg))
    assert ctx.grows == 0 and ctx.pool_bytes == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bitwise_run_to_run_with_garbage_slots(dtype):
    m, n, k, cfg = CASES[0]
    programs = 5
    planes = planes_of(n, k, seed_of("w", n, k))
    x = make_x(m, k, dtype, seed_of("det", m))
    ctx = QMatmulContext(DEV)
    first = q8_0_matmul_streamk(x, planes, n, k, ctx, num_programs=programs, config=cfg)
    for garbage in (0xFF, 0x7F):  # NaN and huge fp32 patterns in every partial slot
        ctx.take(ctx.pool_bytes)[streamk.FLAG_BYTES:] = garbage
        again = q8_0_matmul_streamk(x, planes, n, k, ctx, num_programs=programs, config=cfg)
        assert torch.equal(again, first)
        assert flags_zero(ctx)
    assert ctx.grows == 1


def test_one_context_across_programs_and_tiles():
    """Launches of different P and tiles share one pool (earlier partials lie where later flags would
    be if the flag region moved): each equals the same launch on a fresh context, bit for bit."""
    ctx = QMatmulContext(DEV)
    ctx.reserve_fixup(QMatmulContext.largest_fixup(12, 16, 32))
    for case, programs in [(1, 12), (0, 5), (1, 2), (2, 5), (1, 12)]:
        m, n, k, cfg = CASES[case]
        planes = planes_of(n, k, seed_of("w", n, k))
        x = make_x(m, k, torch.float32, seed_of("mix", case, programs))
        got = q8_0_matmul_streamk(x, planes, n, k, ctx, num_programs=programs, config=cfg)
        fresh = q8_0_matmul_streamk(x, planes, n, k, QMatmulContext(DEV), num_programs=programs, config=cfg)
        assert torch.equal(got, fresh)
        assert flags_zero(ctx)
    assert ctx.grows == 1


def test_fixup_bytes_and_largest():
    cfg = Q8Config(16, 16, 64)
    flags = streamk.FLAG_BYTES
    assert flags == 4096 and streamk.MAX_PROGRAMS == 1023
    assert QMatmulContext.largest_fixup(132) == 132 * 128 * 128 * 4 + flags == 8_654_848
    assert QMatmulContext.largest_fixup(5, 16, 32) == 5 * 16 * 32 * 4 + flags
    # 36 iterations of 4 K-blocks: P = 3 cuts at tile boundaries, P = 2 and 5 do not
    assert streamk.fixup_bytes(40, 40, 256, cfg, 1) == 0
    assert streamk.fixup_bytes(40, 40, 256, cfg, 3) == 0
    assert streamk.fixup_bytes(40, 40, 256, cfg, 2) == flags + 2 * 16 * 16 * 4
    assert streamk.fixup_bytes(40, 40, 256, cfg, 5) == flags + 5 * 16 * 16 * 4
    assert streamk.fixup_bytes(40, 40, 256, cfg, 200) == flags + 36 * 16 * 16 * 4  # clamped to 36 workers
    assert streamk.fixup_bytes(16, 16, 512, Q8Config(16, 16, 32), 200) == flags + 16 * 16 * 16 * 4


def test_pool_grows_once_then_reservation_covers_every_launch():
    n_big, k = 96, 256
    planes = planes_of(n_big, k, seed_of("pool", n_big))
    programs = 5
    cfg = Q8Config(16, 32, 64)

    ctx = QMatmulContext(DEV)
    assert ctx.pool_bytes == 0 and ctx.grows == 0
    x = make_x(40, k, torch.float32, seed_of("pool-x"))
    # 3 x 3 tiles x 4 = 36 iterations over 5 workers: shared tiles, so the first launch grows the pool
    assert streamk.fixup_bytes(40, n_big, k, cfg, programs) > 0
    first = q8_0_matmul_streamk(x, planes, n_big, k, ctx, num_programs=programs, config=cfg)
    assert ctx.grows == 1 and ctx.pool_bytes == streamk.fixup_bytes(40, n_big, k, cfg, programs)
    assert torch.equal(q8_0_matmul_streamk(x, planes, n_big, k, ctx, num_programs=programs, config=cfg), first)
    assert ctx.grows == 1

    reserved = QMatmulContext(DEV)
    reserved.reserve_fixup(QMatmulContext.largest_fixup(programs, cfg.block_m, cfg.block_n))
    assert reserved.grows == 1 and reserved.pool_bytes == QMatmulContext.largest_fixup(programs, 16, 32)
    shapes = [(40, n_big, cfg), (17, n_big, Q8Config(16, 16, 32)), (33, 64, cfg), (16, 16, Q8Config(16, 16, 32))]
    for m, n, c in shapes:
        x = make_x(m, k, torch.float32, seed_of("pool", m, n))
        got = q8_0_matmul_streamk(x, planes if n == n_big else planes_of(n, k, seed_of("pool", n)), n, k, reserved,
                                  num_programs=programs, config=c)
        assert got.shape == (m, n)
        assert flags_zero(reserved)
    assert sum(streamk.fixup_bytes(m, n, k, c, programs) > 0 for m, n, c in shapes) >= 3
    assert reserved.grows == 1


def test_context_take():
    ctx = QMatmulContext("cpu")
    assert ctx.take(0).numel() == 0 and ctx.grows == 0
    view = ctx.take(100)
    assert view.dtype == torch.uint8 and view.numel() == 100 and (view == 0).all() and ctx.grows == 1
    view[:4] = 9
    small = ctx.take(10)
    assert small.data_ptr() == view.data_ptr() and int(small[0]) == 9 and ctx.grows == 1 and ctx.pool_bytes == 100
    grown = ctx.take(101)
    assert ctx.grows == 2 and ctx.pool_bytes == 101 and (grown == 0).all()  # reallocated to the size, zeroed
    with pytest.raises(ValueError):
        ctx.take(-1)


def test_validation_and_empty():
    n, k = 32, 256
    planes = planes_of(n, k, 9)
    ctx = QMatmulContext(DEV)
    x = make_x(2, k, torch.float32, 10)
    assert q8_0_matmul_streamk(x[:0], planes, n, k, ctx).shape == (0, n)
    out = torch.empty(2, n, device=DEV)
    assert q8_0_matmul_streamk(x, planes, n, k, ctx, out, num_programs=2, config=Q8Config(16, 16, 64)) is out
    bad_calls = [
        lambda: q8_0_matmul_streamk(x[:, :128], planes, n, k, ctx),
        lambda: q8_0_matmul_streamk(x.to(torch.int32), planes, n, k, ctx),
        lambda: q8_0_matmul_streamk(x, planes, n, k, ctx, out=torch.empty(2, n + 1, device=DEV)),
        lambda: q8_0_matmul_streamk(x, planes, n, k, ctx, num_programs=0),
        lambda: q8_0_matmul_streamk(x, planes, n, k, ctx, num_programs=streamk.MAX_PROGRAMS + 1),
        lambda: q8_0_matmul_streamk(x, planes, n, k, ctx, config=Q8Config(16, 16, 48)),
        lambda: q8_0_matmul_streamk(x, planes, n, k, QMatmulContext("meta")),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()


# ----------------------------------------------------------------------------------------------
# GPU (pytest -m gpu)


@pytest.fixture(scope="module")
def gpu_weights():
    cache = {}

    def get(n, k):
        if (n, k) not in cache:
            cache[(n, k)] = planes_of(n, k, seed_of("gpu", n, k), device="cuda")
        return cache[(n, k)]

    return get


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("m", [512, 4096])
def test_gpu_matches_reference_and_deterministic(gpu_weights, m, dtype):
    n = k = 4096
    if dtype == torch.float32 and m == 4096:
        pytest.skip("fp32 x (the FMA path) at M = 512 only")
    planes = gpu_weights(n, k)
    x = make_x(m, k, dtype, seed_of("gx", m), device="cuda", pad=64 if m == 512 else 0)
    ctx = QMatmulContext("cuda")
    got = q8_0_matmul_streamk(x, planes, n, k, ctx, torch.full((m, n), float("nan"), dtype=dtype, device="cuda"))
    check_product(got, x, planes, n, k)
    for _ in range(3):
        assert torch.equal(q8_0_matmul_streamk(x, planes, n, k, ctx), got)
    torch.cuda.synchronize()
    assert flags_zero(ctx)


@pytest.mark.gpu
@needs_cuda
def test_gpu_pool_with_real_sm_count(gpu_weights):
    sms = num_sms()
    k = 4096
    shapes = [(512, 4096), (4096, 4096), (100, 4096), (1000, 12288), (300, 1024)]
    needs = [streamk.fixup_bytes(m, n, k, streamk.streamk_config(m, n, k), sms) for m, n in shapes]
    assert needs[0] > 0 and sum(need > 0 for need in needs) >= 3
    fresh = QMatmulContext("cuda")
    q8_0_matmul_streamk(make_x(512, k, torch.bfloat16, 1, device="cuda"), gpu_weights(4096, k), 4096, k, fresh)
    assert fresh.grows == 1 and fresh.pool_bytes == needs[0]

    reserved = QMatmulContext("cuda")
    reserved.reserve_fixup(QMatmulContext.largest_fixup(sms))
    for m, n in shapes:
        x = make_x(m, k, torch.bfloat16, seed_of("gp", m, n), device="cuda")
        check_product(q8_0_matmul_streamk(x, gpu_weights(n, k), n, k, reserved), x, gpu_weights(n, k), n, k)
    assert reserved.grows == 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [512, 4096])
def test_gpu_cuda_graph_replay(gpu_weights, m):
    n = k = 4096
    planes = gpu_weights(n, k)
    ctx = QMatmulContext("cuda")
    ctx.reserve_fixup(QMatmulContext.largest_fixup(num_sms()))
    x = make_x(m, k, torch.bfloat16, seed_of("graph", m), device="cuda")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        q8_0_matmul_streamk(x, planes, n, k, ctx, out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q8_0_matmul_streamk(x, planes, n, k, ctx, out)
    assert ctx.grows == 1
    x.copy_(make_x(m, k, torch.bfloat16, seed_of("graph2", m), device="cuda"))
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, q8_0_matmul_streamk(x, planes, n, k, ctx))
    unreserved = QMatmulContext("cuda")
    with pytest.raises(RuntimeError):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            q8_0_matmul_streamk(x, planes, n, k, unreserved, out)


@pytest.mark.gpu
@needs_cuda
def test_gpu_packed_model_shares_one_reserved_context():
    """CausalLM.pack gives every Q8_0 weight of a model one context with the largest fix-up reserved, so
    a read in the stream-K range allocates nothing."""
    from strata.bench.random_model import random_model
    from strata.kernels.quant import STREAMK_ROWS, QWeight

    model = random_model("tiny-256", torch.device("cuda"), torch.bfloat16, quant="Q8_0").model
    weights = [q for m in model.modules() for q in vars(m).values() if isinstance(q, QWeight)]
    contexts = {id(q.context) for q in weights}
    assert weights and len(contexts) == 1 and weights[0].context is not None
    ctx = weights[0].context
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert ctx.pool_bytes >= QMatmulContext.largest_fixup(sms)
    grows = ctx.grows
    x = torch.randn(STREAMK_ROWS[0], weights[0].k, device="cuda", dtype=torch.bfloat16)
    weights[0].matmul(x)
    assert ctx.grows == grows
