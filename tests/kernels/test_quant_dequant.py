"""Quantized weights dequantized into a bf16/fp16 buffer (strata/kernels/quant/dequant.py).

CPU: the kernels in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) for every format
at N = 40 (not a multiple of the row tile), K = 512 and 768 (two and three K tiles of 256), one run
with 16-row tiles (three row tiles, the last ragged), Q8_0 at K = 160 (BLOCK_K falls to 32); bf16 and
fp16. GPU (`pytest -m gpu`): 24576 x 4096 and 4096 x 12288, and a CUDA-graph replay.

Tolerance: none. The kernels round each weight's exact fp32 value once to out's dtype, as the
reference's `.to(dtype)` does, so the outputs are equal bit for bit (torch.equal, which counts -0
equal to +0: Q6_K's fma on the GPU gives +0 where the reference gives -0 for a negative scale).
"""

from __future__ import annotations

import pytest
import torch

from strata.kernels.quant import format_module, random_blocks
from strata.kernels.quant import dequant
from strata.kernels.quant.dequant import DequantConfig, dequantize_into, dequantize_into_ref

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
FORMATS = ("Q8_0", "Q4_K", "IQ3_S", "Q6_K")
DTYPES = (torch.bfloat16, torch.float16)


def make_planes(ggml_type, n, k, seed, device=DEV):
    mod = format_module(ggml_type)
    return mod.repack(torch.from_numpy(mod.random_raw(n, k, seed)).to(device))


def check_equal(ggml_type, planes, n, k, dtype, config=None, spare=0):
    out = torch.full((n * k + spare,), 7.0, dtype=dtype, device=DEV)
    if config is None:
        got = dequantize_into(ggml_type, planes, n, k, out)
    else:
        got = dequant.dequantize_into_triton(ggml_type, planes, n, k, out, config=config)
    expect = dequantize_into_ref(ggml_type, planes, n, k, torch.empty(n * k, dtype=dtype, device=DEV))
    assert got.shape == (n, k) and got.dtype == dtype and got.data_ptr() == out.data_ptr()
    assert torch.equal(got, expect), f"{ggml_type} {dtype}: {(got != expect).sum().item()} of {n * k} differ"
    return out


@pytest.mark.parametrize("ggml_type", FORMATS)
def test_kernel_equals_reference(ggml_type):
    """Bit for bit, bf16 and fp16, two and three K tiles, ragged row tiles; only the first N·K written."""
    n = 40
    for k in (512, 768):
        planes = make_planes(ggml_type, n, k, seed=k)
        for dtype in DTYPES:
            out = check_equal(ggml_type, planes, n, k, dtype, spare=100 if k == 512 else 0)
            assert torch.all(out[n * k:] == 7.0), "wrote past N·K"
    planes = make_planes(ggml_type, n, 512, seed=1)
    check_equal(ggml_type, planes, n, 512, torch.bfloat16, config=DequantConfig(16, 256, num_warps=4))


def test_q8_0_small_block_k():
    """K = 160 = 5·32: BLOCK_K falls to 32, five K tiles."""
    n, k = 40, 160
    assert dequant.block_k_for("Q8_0", k, 256) == 32
    check_equal("Q8_0", make_planes("Q8_0", n, k, seed=5), n, k, torch.bfloat16, spare=3)


def test_block_k_choice():
    for k in (2048, 4096, 12288, 5120, 768):
        for t in FORMATS:
            assert dequant.block_k_for(t, k, 256) == 256
    assert dequant.block_k_for("Q8_0", 4096 + 64, 256) == 64


def test_reference_off_kernels(monkeypatch):
    """Where the kernels do not run, `dequantize_into` is the reference; it too leaves the tail."""
    n, k = 8, 256
    planes = make_planes("Q4_K", n, k, seed=3, device="cpu")
    monkeypatch.setattr(dequant, "kernels_run", lambda t, kernel: False)
    out = torch.full((n * k + 5,), 7.0, dtype=torch.bfloat16)
    got = dequantize_into("Q4_K", planes, n, k, out)
    assert torch.equal(got, format_module("Q4_K").dequantize(planes, n, k).to(torch.bfloat16))
    assert torch.all(out[n * k:] == 7.0)


def test_rejects_bad_out():
    n, k = 8, 256
    planes = make_planes("Q8_0", n, k, seed=4, device="cpu")
    for bad in (torch.empty(n * k - 1, dtype=torch.bfloat16), torch.empty(n * k, dtype=torch.float32),
                torch.empty(2 * n, k, dtype=torch.bfloat16)[::2]):
        with pytest.raises(ValueError):
            dequantize_into("Q8_0", planes, n, k, bad)
    with pytest.raises(ValueError):
        dequantize_into("Q2_K", planes, n, k, torch.empty(n * k, dtype=torch.bfloat16))


# ----------------------------------------------------------------------------------------------
# GPU (pytest -m gpu)

needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def device_planes(ggml_type, n, k, seed):
    gen = torch.Generator("cuda").manual_seed(seed)
    return format_module(ggml_type).repack(random_blocks(ggml_type, n, k, gen, "cuda"))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(24576, 4096), (4096, 12288)])
@pytest.mark.parametrize("ggml_type", FORMATS)
def test_gpu_real_shapes(ggml_type, n, k):
    planes = device_planes(ggml_type, n, k, seed=n + k)
    for dtype in DTYPES:
        out = torch.full((n * k + 64,), 7.0, dtype=dtype, device="cuda")
        got = dequantize_into(ggml_type, planes, n, k, out)
        expect = format_module(ggml_type).dequantize(planes, n, k).to(dtype)
        assert torch.equal(got, expect), f"{(got != expect).sum().item()} of {n * k} differ"
        assert torch.all(out[n * k:] == 7.0)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", FORMATS)
def test_gpu_graph_capture(ggml_type):
    n, k = 4100, 4096  # a ragged last row tile
    planes = device_planes(ggml_type, n, k, seed=7)
    out = torch.zeros(n * k, dtype=torch.bfloat16, device="cuda")
    expect = format_module(ggml_type).dequantize(planes, n, k).to(torch.bfloat16)
    dequantize_into(ggml_type, planes, n, k, out)  # compiles outside the capture
    torch.cuda.synchronize()
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        view = dequantize_into(ggml_type, planes, n, k, out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(view, expect)
