"""Q3_K quantized weights (strata/kernels/quant/q3_k.py): repack, dequantize, the GEMV and GEMM kernels,
the dequantize-into-buffer kernel, the grouped MoE kernel on Q3_K stacks and the registry.

CPU: `dequantize` equals gguf's numpy dequantizer bit for bit on fresh random blocks; the kernels run in
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at K = 256/512, N ≤ 96, M in {1, 3, 16,
40}, fp32, fp16 and bf16 x. GPU (`pytest -m gpu`): the 8B shapes at M = 1, 8, 512, the kernels' weights
bit for bit, batch invariance and CUDA-graph replay.

Tolerances, relative Frobenius error of the product (Q4_K's, tests/kernels/test_quant_q4_k.py):
- against `matmul_ref` (the stated semantics: weights rounded to x's dtype, fp32 sums, one final
  rounding): fp32 1e-5 (summation order only); fp16/bf16 one output rounding, ≤ 2^-9 per value:
  fp16 2e-3, bf16 4e-3;
- against the fp32 dequantize-then-matmul reference: fp32 1e-5, fp16 2e-3, bf16 1e-2 (the weights'
  rounding to bf16 adds ~2^-9 relative per weight).

The tests imported from tests/kernels/test_quant_q4_k.py are every K-quant format's: collected here,
they take Q3_K from this module's `kquant` fixture.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_quant_q4_k import (  # noqa: F401  (the shared tests and the decode kernel's fixture)
    DEV,
    TOL_FP32_REF,
    KQuantFormat,
    check_gemv_split_k,
    check_real_shape,
    check_batch_invariant_and_graph,
    check_one_hot_gives_dequantized,
    dequantizing_decode,
    gemv_case_id,
    needs_cuda,
    rel_frobenius,
    repacked,
    seed_of,
    test_an_empty_batch_under_every_decode_kernel,
    test_dequantize_bit_exact_against_gguf,
    test_gemm_configs,
    test_kernels_dequantize_exactly,
    test_matmul_matches_reference,
    test_reference_path_off_the_kernels,
    test_rejects_bad_arguments,
)

from strata.kernels.quant import q3_k
from strata.kernels.quant.q3_k import (
    BLOCK_BYTES,
    BLOCK_VALUES,
    GemvConfig,
    dequantize,
    gemm_q3k,
    gemv_q3k,
    gemv_workspace_numel,
    matmul,
    random_raw,
    repack,
)

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

QT = gguf.GGMLQuantizationType.Q3_K
Q3K = KQuantFormat(q3_k, gemv_q3k, gemm_q3k, QT, gemm_block_k=256)
make_weight = Q3K.weight
gguf_bits = Q3K.gguf_bits
check_product = Q3K.check_product


@pytest.fixture
def kquant() -> KQuantFormat:
    return Q3K


def test_constants():
    assert (q3_k.GGML_TYPE, BLOCK_VALUES, BLOCK_BYTES) == ("Q3_K", 256, 110)
    assert gguf.GGML_QUANT_SIZES[QT] == (BLOCK_VALUES, BLOCK_BYTES)


def test_dequantize_extreme_fields():
    """Every quant, mask and scale bit set or clear (scales 31 and −32), alternating scale bits, and huge,
    tiny (subnormal), negative and signed-zero fp16 d: still gguf's bits, signs of zeros included."""
    n, k = 6, 512
    raw = random_raw(n, k, 5).reshape(n, -1, BLOCK_BYTES)
    raw[0, :, :108] = 0xFF
    raw[1, :, :108] = 0x00
    raw[2, :, 96:108] = np.array([0x5A, 0xA5, 0x0F, 0xF0] * 3, dtype=np.uint8)
    for row, d in zip(range(3, 6), ([60000.0, -0.5], [6e-8, -6e-8], [0.0, -0.0])):
        raw[row, :, 108:110] = np.array(d, dtype=np.float16).view(np.uint8).reshape(2, 2)
    raw = raw.reshape(n, -1)
    got = dequantize(repack(torch.from_numpy(raw)), n, k)
    assert torch.equal(got.view(torch.int32), gguf_bits(raw))


def test_repack_planes():
    n, k = 10, 768
    raw, planes = repacked(Q3K, n, k)
    want = {"qs": ((n, k // 4), torch.uint8), "hmask": ((n, k // 8), torch.uint8),
            "scales": ((n, k // 16), torch.int8), "d": ((n, k // 256), torch.float32)}
    assert {name: (tuple(t.shape), t.dtype) for name, t in planes.items()} == want
    blocks = raw.reshape(n, -1, BLOCK_BYTES)
    assert np.array_equal(planes["qs"].cpu().numpy(), blocks[:, :, 32:96].reshape(n, -1))
    assert np.array_equal(planes["hmask"].cpu().numpy(), blocks[:, :, 0:32].reshape(n, -1))
    assert np.array_equal(planes["d"].cpu().numpy(), blocks[:, :, 108:].copy().view(np.float16)[..., 0])
    scales = planes["scales"].cpu().numpy().reshape(n, -1, 16)
    for i in range(16):  # scale i: nibble i // 8 of byte i % 8, bits 2(i // 4) and up of byte 8 + i % 4
        low = (blocks[:, :, 96 + i % 8] >> (4 * (i // 8))) & 15
        high = (blocks[:, :, 104 + i % 4] >> (2 * (i // 4))) & 3
        assert np.array_equal(scales[:, :, i], (low | (high << 4)).astype(np.int32) - 32)


def test_quants_follow_the_block_layout():
    """Value 128h + 32s + j of a block: low bits 2s, 2s+1 of qs byte 32h + j, high bit 4h + s of hmask
    byte j (the docstring's layout, value by value)."""
    n, k = 3, 512
    raw, planes = Q3K.weight(n, k, seed_of("layout"), device="cpu")
    blocks = raw.reshape(n, -1, BLOCK_BYTES).astype(np.int32)
    got = q3_k.quants(planes, n, k).numpy().reshape(n, -1, 256)
    for h in range(2):
        for s in range(4):
            for j in range(32):
                low = (blocks[:, :, 32 + 32 * h + j] >> (2 * s)) & 3
                high = (blocks[:, :, j] >> (4 * h + s)) & 1
                assert np.array_equal(got[:, :, 128 * h + 32 * s + j], low | (high << 2))


def test_plane_and_shape_validation():
    """Missing, mistyped, misshapen or strided planes, raw blocks of another width or dtype, a K that is
    not whole super-blocks and a QWeight of the wrong shape are refused with a ValueError."""
    from strata.kernels.quant import QWeight

    n, k = 8, 512
    raw, planes = make_weight(n, k, 4, device="cpu")
    x = torch.randn(2, k)
    bad = [{name: t for name, t in planes.items() if name != "hmask"},
           {**planes, "hmask": planes["hmask"].to(torch.int8)},
           {**planes, "qs": planes["qs"][:, :-4]},
           {**planes, "scales": torch.cat([planes["scales"]] * 2, dim=1)[:, ::2]}]
    for p in bad:
        with pytest.raises(ValueError):
            dequantize(p, n, k)
        with pytest.raises(ValueError):
            matmul(x, p, n, k)
    with pytest.raises(ValueError):
        dequantize(planes, n, k - 128)
    with pytest.raises(ValueError):
        matmul(x, planes, n + 1, k)
    with pytest.raises(ValueError):
        repack(torch.from_numpy(raw).view(torch.int8))
    with pytest.raises(ValueError):
        repack(torch.from_numpy(raw)[:, :-1])
    with pytest.raises(ValueError, match="expected raw blocks"):
        QWeight.from_raw("Q3_K", torch.from_numpy(raw), n, k - 256)


# (m, n, k, config): split-K even and uneven, wider tiles, 256-value steps
GEMV_CASES = [
    (3, 80, 512, GemvConfig(32, 128, split_k=4)),
    (5, 40, 768, GemvConfig(16, 256, split_k=3)),
    (2, 70, 512, GemvConfig(64, 128, split_k=3)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", GEMV_CASES, ids=gemv_case_id)
def test_gemv_split_k(case, dtype):
    check_gemv_split_k(Q3K, case, dtype)


@pytest.mark.parametrize("config", [None, GemvConfig(16, 128, split_k=2)], ids=["auto", "split2"])
def test_gemv_batch_invariant(config):
    """Each of the m rows of a batch of m ≤ 16 has the bits it has in the batch of 16."""
    n, k = 32, 256
    _, planes = make_weight(n, k, seed_of("inv"))
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(7)).to(DEV, torch.bfloat16)
    ws = torch.zeros(max(1, gemv_workspace_numel(n, k, config)), dtype=torch.int32, device=DEV)
    full = gemv_q3k(x, planes, n, k, workspace=ws, config=config)
    for m in (1, 6, 15):
        assert torch.equal(gemv_q3k(x[:m], planes, n, k, workspace=ws, config=config), full[:m]), m


def test_dequantize_into_buffer():
    """dequant.py's kernel: `dequantize` rounded to bf16 / fp16 bit for bit, two and three K tiles,
    ragged row tiles, nothing written past N·K."""
    from strata.kernels.quant import DEQUANT_READ_FORMATS
    from strata.kernels.quant.dequant import DequantConfig, dequantize_into, dequantize_into_triton

    assert "Q3_K" in DEQUANT_READ_FORMATS
    n = 40
    for k in (512, 768):
        _, planes = make_weight(n, k, seed_of("into", k))
        for dtype in (torch.bfloat16, torch.float16):
            out = torch.full((n * k + 9,), 7.0, dtype=dtype, device=DEV)
            got = dequantize_into("Q3_K", planes, n, k, out)
            assert got.data_ptr() == out.data_ptr() and torch.equal(got, dequantize(planes, n, k).to(dtype))
            assert torch.all(out[n * k:] == 7.0)
    out = torch.empty(n * k, dtype=torch.bfloat16, device=DEV)
    got = dequantize_into_triton("Q3_K", planes, n, k, out, config=DequantConfig(16, 128, num_warps=4))
    assert torch.equal(got, dequantize(planes, n, k).to(torch.bfloat16))


def test_registered_format():
    """Q3_K is kept quantized: in FORMATS, a QWeight with its split-K workspace, `random_blocks` valid."""
    from strata.kernels.quant import FORMATS, QWeight, format_module, random_blocks

    assert "Q3_K" in FORMATS and format_module("Q3_K") is q3_k
    assert gemv_workspace_numel(4096, 4096) > 0  # the default 8B configuration splits K
    raw = torch.from_numpy(random_raw(8, 256, 3))
    w = QWeight.from_raw("Q3_K", raw, 8, 256)
    assert torch.equal(w.dequantize().view(torch.int32), gguf_bits(raw.numpy()))
    blocks = random_blocks("Q3_K", 32, 512, torch.Generator().manual_seed(0), "cpu")
    values = gguf.quants.dequantize(blocks.numpy(), QT)
    assert np.isfinite(values).all() and 0.005 < values.std() < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_moe_grouped_kernel_on_q3_k_stacks(dtype):
    """moe_q's grouped kernel takes Q3_K stacks: decode (swap AB) and 64-row tiles, empty experts,
    uneven groups, against the reference."""
    from strata.kernels.quant.moe_q import GroupedConfig, QExpertStack, grouped_matmul_ref, grouped_matmul_triton

    e, n, k = 4, 48, 256
    raw = torch.from_numpy(random_raw(e * n, k, seed_of("moe"))).view(e, n, -1)
    stack = QExpertStack.from_raw("Q3_K", raw)
    assert torch.equal(stack.dequantize().view(e * n, k).view(torch.int32), gguf_bits(raw.view(e * n, -1).numpy()))
    offs = torch.tensor([0, 5, 5, 21], dtype=torch.int32)  # each expert's end row: experts 0 and 2 empty
    xs = torch.randn(21, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = grouped_matmul_ref(xs, stack, offs)
    if dtype == torch.float32:  # the FMA dot's tiles (`grouped_config`)
        configs = (GroupedConfig(16, 32, 128), GroupedConfig(32, 32, 256, num_warps=8))
    else:
        configs = (GroupedConfig(16, 64, 128, swap_ab=True), GroupedConfig(64, 32, 256, num_warps=8))
    for cfg in configs:
        got = grouped_matmul_triton(xs, stack, offs, config=cfg)
        assert rel_frobenius(got, ref) <= TOL_FP32_REF[dtype], cfg


@pytest.mark.parametrize("config", ["wide", "loop"])
def test_moe_decode_kernels_on_q3_k_stacks(config):
    """moe_decode_q's fused decode kernels take Q3_K stacks: the shipped K steps (64-row blocks) and the
    least K step (several steps in both kernels), against the exact-weight reference with the tolerances
    of tests/kernels/test_quant_moe_decode.py; a token alone has its bits in the batch."""
    from strata.kernels.quant import moe_decode_q as mdq
    from test_quant_moe_decode import FRO_TOL, MAX_TOL, fro_err, looping, max_err, routing, stacks, wide

    w13, w2 = stacks("Q3_K", 6, 256, 256, seed_of("mdq", config) % 10_000)
    x, ids, w = routing(seed_of("mdq-route", config), 2, 2, 6, 256, torch.bfloat16)
    assert mdq.supported(2, 2, "Q3_K", 256, 256, torch.bfloat16)
    cfg = looping("Q3_K") if config == "loop" else wide(mdq.decode_config("Q3_K", 256, 256))
    out = torch.full((2, 256), float("nan"), dtype=torch.bfloat16)
    got = mdq.moe_decode_q_triton(x, ids, w, w13, w2, out, config=cfg)
    assert got is out and torch.isfinite(out).all()
    ref = mdq.reference(x, ids, w, w13, w2, cfg)
    assert max_err(got, ref) <= MAX_TOL[torch.bfloat16] and fro_err(got, ref) <= FRO_TOL
    alone = mdq.moe_decode_q_triton(x[-1:].clone(), ids[-1:].clone(), w[-1:].clone(), w13, w2, config=cfg)
    assert torch.equal(alone, got[-1:])


# ----------------------------------------------------------------------------------------------
# GPU (pytest -m gpu)

GPU_SHAPES = [(4096, 4096), (4096, 12288), (12288, 4096)]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 512])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_real_shapes(n, k, m):
    planes, ws = check_real_shape(Q3K, n, k, m)
    x = torch.randn(m, k, device="cuda") * 0.5
    check_product(matmul(x, planes, n, k, workspace=ws), x, planes, n, k)  # fp32 x through the IEEE dot


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 512], ids=["gemv", "gemm"])
def test_gpu_kernels_dequantize_exactly(m):
    check_one_hot_gives_dequantized(Q3K, m)


@needs_cuda
@pytest.mark.gpu
def test_gpu_batch_invariant_and_graph():
    check_batch_invariant_and_graph(Q3K)


@needs_cuda
@pytest.mark.gpu
def test_gpu_dequantize_into_real_shape():
    from strata.kernels.quant.dequant import dequantize_into

    n, k = 4100, 4096  # a ragged last row tile
    _, planes = make_weight(n, k, 13, device="cuda")
    out = torch.full((n * k + 64,), 7.0, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(dequantize_into("Q3_K", planes, n, k, out), dequantize(planes, n, k).to(torch.bfloat16))
    assert torch.all(out[n * k:] == 7.0)
