"""The Q8_0 GEMM on int8 tensor cores with the dp4a GEMV's arithmetic (strata/kernels/quant/q8_0_mmq.py).

Its one claim is bitwise: each row of its result is the dp4a GEMV's row for the same x row, so a row's
bits do not depend on how many rows are computed with it. CPU: the interpreter (its int8 dot is an
exact integer product; dp4a emulated with shifts) at small shapes with split-K ranges that share steps
unevenly, partial row and column tiles, fp32 and bf16 x, a row stride wider than K; the quantization
kernel against `dp4a.quantize_ref`; the fp32 result against `mmq_ref` (the same operations in torch:
bitwise too, the group sums being exact integers). GPU (`pytest -m gpu`): the Qwen3-8B shapes, rows of
M = 4096 against the GEMV's and against M = 17.
"""

from __future__ import annotations

import pytest
import torch

from strata.kernels.quant import dp4a, q8_0
from strata.kernels.quant import q8_0_mmq as mmq
from strata.kernels.quant.dp4a import Dp4aConfig
from test_quant_dp4a import make_x as dp4a_make_x
from test_quant_dp4a import planes_of, seed_of

pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")]

CUDA = torch.cuda.is_available()


def make_x(m, k, dtype, seed, device="cpu", pad=0):
    x = dp4a_make_x(m, k, dtype, seed, device, pad)  # its first row opens with a zero group: dx 0
    x[-1, 32:64] *= 1e3  # a group far from the others' scale
    return x


def gemv_rows(x, planes, cfg: Dp4aConfig):
    """The GEMV's rows, sixteen (its MAX_ROWS) at a time."""
    n, k = planes["qs"].shape
    ws = torch.zeros(max(1, dp4a.workspace_numel(n, k, cfg)), dtype=torch.int32, device=x.device)
    return torch.cat([dp4a.q8_gemv_dp4a(x[i : i + 16], planes["qs"], planes["d"], workspace=ws, config=cfg)
                      for i in range(0, x.shape[0], 16)])


@pytest.mark.skipif(CUDA, reason="the interpreter cases run without a GPU")
@pytest.mark.parametrize("m,k,dtype", [(5, 96, torch.float32), (9, 512, torch.bfloat16), (1, 320, torch.float16)])
def test_quantize_rows_is_the_definition(m, k, dtype):
    x = make_x(m, k, dtype, seed_of("q", m, k), pad=32)
    xq, dx = mmq.quantize_rows(x)
    ref_q, ref_dx = dp4a.quantize_ref(x)
    assert torch.equal(xq, ref_q) and torch.equal(dx, ref_dx)


@pytest.mark.skipif(CUDA, reason="the interpreter cases run without a GPU")
@pytest.mark.parametrize("n,k,m,block_k,split,tile_m,tile_n,dtype", [
    (40, 512, 20, 128, 3, 16, 32, torch.float32),  # 4 steps over 3 ranges, partial row and column tiles
    (40, 512, 33, 128, 3, 32, 16, torch.bfloat16),
    (64, 1024, 18, 256, 2, 16, 64, torch.bfloat16),  # eight groups a step: the whole tree
    (32, 256, 17, 64, 4, 16, 32, torch.float32),  # two groups a step, one step a range
    (48, 384, 19, 128, 1, 32, 32, torch.bfloat16),  # no split
])
def test_rows_are_the_gemv_rows(n, k, m, block_k, split, tile_m, tile_n, dtype):
    planes = planes_of(n, k, seed_of("w", n, k))
    x = make_x(m, k, dtype, seed_of("x", n, k, m), pad=8)
    cfg = mmq.MmqConfig(tile_m, tile_n, block_k, split, num_warps=4)
    got = mmq.q8_mmq(x, planes["qs"], planes["d"], config=cfg)
    want = gemv_rows(x, planes, Dp4aConfig(32, block_k, split))
    assert got.dtype == x.dtype and torch.equal(got, want)
    if dtype == torch.float32:
        assert torch.equal(got, mmq.mmq_ref(x, planes["qs"], planes["d"], block_k, split))


@pytest.mark.skipif(CUDA, reason="the interpreter cases run without a GPU")
def test_matmul_row_does_not_depend_on_the_batch():
    n, k = 48, 512
    planes = planes_of(n, k, seed_of("b", n, k))
    x = make_x(24, k, torch.bfloat16, seed_of("bx", n, k))
    qs, d = planes["qs"], planes["d"]
    whole = mmq.matmul(x, qs, d)  # 24 rows: the MMQ kernel
    for rows in (slice(0, 1), slice(3, 11), slice(8, 24)):  # the GEMV (≤ 16 rows) and the MMQ kernel
        assert torch.equal(mmq.matmul(x[rows], qs, d), whole[rows])


def test_config_keeps_the_gemv_step_and_ranges():
    for n, k in dp4a.SWEEP_SHAPES:
        gemv, cfg = dp4a.gemv_config(n, k), mmq.mmq_config(n, k)
        assert (cfg.block_k, cfg.split_k) == (gemv.block_k, gemv.split_k)
    with pytest.raises(ValueError):
        mmq.q8_mmq(torch.zeros(2, 96), torch.zeros(4, 96, dtype=torch.int8), torch.zeros(4, 3, dtype=torch.float16))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("n,k", dp4a.SWEEP_SHAPES)
def test_gpu_rows_bitwise_at_8b_shapes(n, k):
    planes = planes_of(n, k, seed_of("gpu", n, k), "cuda")
    qs, d = planes["qs"], planes["d"]
    x = make_x(4096, k, torch.bfloat16, seed_of("gx", n, k), "cuda")
    big = mmq.matmul(x, qs, d)
    assert torch.equal(big[:16], mmq.matmul(x[:16], qs, d))  # the GEMV
    assert torch.equal(big[:17], mmq.matmul(x[:17], qs, d))  # MMQ at another M
    assert torch.equal(big[4000:4016], mmq.matmul(x[4000:4016], qs, d))
    exact = x.float() @ q8_0.dequantize(planes, n, k).t()
    assert ((big.float() - exact).norm() / exact.norm()).item() <= 1.5e-2
