"""Q4_K (strata/kernels/quant/q4_k.py) beyond the checks every format passes
(tests/kernels/test_quant_formats.py): its scales and mins repacked as 6-bit values, and its GPU tests
(`pytest -m gpu`): the 8B shapes at M = 1, 8, 512 (fp32 x through the GEMM above 16 rows), rows alone
and in a batch, the split-K GEMV's CUDA-graph replay (timings: benchmarks/kernels/quant_formats.py).
"""

from __future__ import annotations

import pytest
import torch
from test_quant_formats import (  # noqa: F401  (dequantizing_decode: an autouse fixture)
    GPU_SHAPES,
    Q4K,
    check_real_shape,
    check_split_gemv_graph,
    dequantizing_decode,
    needs_cuda,
    repacked,
)

from strata.kernels.quant.q4_k import matmul

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def test_repacked_scales_and_mins_are_six_bit():
    _, planes = repacked(Q4K, 10, 768)
    assert int(planes["scales"].max()) < 64


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 512])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_real_shapes(n, k, m):
    planes, _ = check_real_shape(Q4K, n, k, m)
    if m > 16:
        x = torch.randn(m, k, device="cuda") * 0.5
        Q4K.check_product(matmul(x, planes, n, k), x, planes, n, k)  # fp32 x through the IEEE dot


@needs_cuda
@pytest.mark.gpu
def test_gpu_rows_alone_and_in_a_batch_and_graph():
    n, k = 4096, 4096
    _, planes = Q4K.weight(n, k, 11, device="cuda")
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    full = matmul(x, planes, n, k)
    for rows in (slice(5, 6), slice(2, 9)):
        assert torch.equal(matmul(x[rows].clone(), planes, n, k), full[rows])
    check_split_gemv_graph(Q4K, x, planes, n, k)
