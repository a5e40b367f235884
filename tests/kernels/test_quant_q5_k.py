"""Q5_K quantized weights (strata/kernels/quant/q5_k.py): repack, dequantize, the GEMV and GEMM kernels,
the dequantize-into-buffer kernel, the MoE kernels on Q5_K stacks and the registry.

CPU: `dequantize` equals gguf's numpy dequantizer bit for bit; the kernels run in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1) at K = 256/512/768, N ≤ 96, M in {1, 3, 16, 40}, fp32, fp16
and bf16 x. GPU (`pytest -m gpu`): the 8B shapes at M = 1, 8, 512, the kernels' weights bit for bit,
CUDA-graph replay.

Tolerances, relative Frobenius error of the product (tests/kernels/test_quant_q4_k.py's):
- against `matmul_ref` (weights rounded to x's dtype, fp32 sums, one final rounding): fp32 1e-5,
  fp16 2e-3, bf16 4e-3;
- against the fp32 dequantize-then-matmul reference: fp32 1e-5, fp16 2e-3, bf16 1e-2.

The tests imported from tests/kernels/test_quant_q4_k.py are the K-quant formats' shared ones:
collected here, they take Q5_K from this module's `kquant` fixture.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_quant_q4_k import (  # noqa: F401  (the shared tests)
    DEV,
    TOL_FP32_REF,
    KQuantFormat,
    check_gemv_split_k,
    check_real_shape,
    check_batch_invariant_and_graph,
    check_one_hot_gives_dequantized,
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

from strata.kernels.quant import q4_k, q5_k
from strata.kernels.quant.q5_k import (
    BLOCK_BYTES,
    BLOCK_VALUES,
    GemvConfig,
    dequantize,
    gemm_q5k,
    gemv_q5k,
    gemv_workspace_numel,
    matmul,
    random_raw,
    repack,
)

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

QT5 = gguf.GGMLQuantizationType.Q5_K
Q5K = KQuantFormat(q5_k, gemv_q5k, gemm_q5k, QT5, gemm_block_k=128)
make_weight = Q5K.weight
gguf_bits = Q5K.gguf_bits
check_product = Q5K.check_product


@pytest.fixture
def kquant() -> KQuantFormat:
    return Q5K


def test_constants():
    assert (q5_k.GGML_TYPE, BLOCK_VALUES, BLOCK_BYTES) == ("Q5_K", 256, 176)
    assert gguf.GGML_QUANT_SIZES[QT5] == (BLOCK_VALUES, BLOCK_BYTES)


def test_dequantize_extreme_fields():
    """Every low quant bit and every high bit set or clear (apart and together), every scale/min bit
    set, and huge, tiny (subnormal), negative and signed-zero fp16 d and dmin: still gguf's bits."""
    n, k = 8, 512
    raw = random_raw(n, k, 5).reshape(n, -1, BLOCK_BYTES)
    raw[0, :, 16:] = 0xFF  # qh and qs: every quant 31
    raw[1, :, 16:] = 0x00
    raw[2, :, 16:48] = 0xFF  # high bits only
    raw[2, :, 48:] = 0x00
    raw[3, :, 4:16] = 0xFF
    for row, fields in zip(range(4, 8), ([60000.0, -1e-7], [-0.5, 6e-8], [6e-8, -60000.0], [0.0, -0.0])):
        raw[row, :, 0:4] = np.array(fields, dtype=np.float16).view(np.uint8).reshape(1, 4)
    raw = raw.reshape(n, -1)
    got = dequantize(repack(torch.from_numpy(raw)), n, k)
    assert torch.equal(got.view(torch.int32), gguf_bits(raw))


def test_repack_planes():
    """Q4_K's planes of the same block without qh, and qh the file's bytes."""
    n, k = 10, 768
    raw, planes = repacked(Q5K, n, k)
    want = {"qs": ((n, k // 2), torch.uint8), "scales": ((n, k // 16), torch.uint8),
            "d_dmin": ((n, k // 128), torch.float16), "qh": ((n, k // 8), torch.uint8)}
    assert {name: (tuple(t.shape), t.dtype) for name, t in planes.items()} == want
    blocks = raw.reshape(n, -1, BLOCK_BYTES)
    as_q4_k = np.concatenate([blocks[:, :, :16], blocks[:, :, 48:]], axis=-1).reshape(n, -1)
    for name, plane in q4_k.repack(torch.from_numpy(as_q4_k)).items():
        assert torch.equal(planes[name].cpu(), plane), name
    assert np.array_equal(planes["qh"].cpu().numpy(), blocks[:, :, 16:48].reshape(n, -1))


# (m, n, k, config): split-K even and uneven, wider tiles, 256-value steps
GEMV_CASES = [
    (3, 80, 512, GemvConfig(32, 128, split_k=4)),
    (5, 40, 768, GemvConfig(16, 256, split_k=3)),
    (2, 70, 512, GemvConfig(64, 128, split_k=3)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", GEMV_CASES, ids=gemv_case_id)
def test_gemv_split_k(case, dtype):
    check_gemv_split_k(Q5K, case, dtype)


@pytest.mark.parametrize("config", [None, GemvConfig(16, 128, split_k=2)], ids=["auto", "split2"])
def test_gemv_batch_invariant(config):
    """Rows 0..m-1 of a batch of m ≤ 16 have the bits they have in the batch of 16."""
    n, k = 32, 256
    _, planes = make_weight(n, k, seed_of("inv"))
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(7)).to(DEV, torch.bfloat16)
    ws = torch.zeros(max(1, gemv_workspace_numel(n, k, config)), dtype=torch.int32, device=DEV)
    full = gemv_q5k(x, planes, n, k, workspace=ws, config=config)
    for m in (1, 6, 15):
        assert torch.equal(gemv_q5k(x[:m], planes, n, k, workspace=ws, config=config), full[:m]), m


def test_rejects_bad_planes():
    n, k = 16, 256
    _, planes = make_weight(n, k, 1)
    x = torch.randn(2, k, device=DEV)
    for bad in ({k_: v for k_, v in planes.items() if k_ != "qh"}, {**planes, "qh": planes["qh"][:, :16]},
                {**planes, "qh": planes["qh"].view(torch.int8)}):
        with pytest.raises(ValueError):
            matmul(x, bad, n, k)
        with pytest.raises(ValueError):
            dequantize(bad, n, k)
    with pytest.raises(ValueError):
        random_raw(4, 128, 0)  # K not a multiple of 256
    with pytest.raises(ValueError):
        repack(torch.zeros(2, 144, dtype=torch.uint8))  # a Q4_K row


def test_registered_format():
    """Q5_K is kept quantized: in FORMATS and DEQUANT_READ_FORMATS, a QWeight with its split-K workspace,
    `random_blocks` valid; no writer."""
    from strata.kernels.quant import DEQUANT_READ_FORMATS, FORMATS, WRITTEN, QWeight, format_module, random_blocks

    assert "Q5_K" in FORMATS and "Q5_K" in DEQUANT_READ_FORMATS and "Q5_K" not in WRITTEN
    assert format_module("Q5_K") is q5_k
    assert gemv_workspace_numel(4096, 4096) > 0  # the 8B shape splits K
    raw = torch.from_numpy(random_raw(8, 256, 3))
    w = QWeight.from_raw("Q5_K", raw, 8, 256)
    assert w.nbytes == 8 * 180 and torch.equal(w.dequantize().view(torch.int32), gguf_bits(raw.numpy()))
    with pytest.raises(ValueError):
        QWeight.from_raw("Q5_K", raw[:, :-1], 8, 256)
    blocks = random_blocks("Q5_K", 32, 512, torch.Generator().manual_seed(0), "cpu")
    values = gguf.quants.dequantize(blocks.numpy(), QT5)
    assert np.isfinite(values).all() and 0.005 < values.std() < 0.1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dequantize_into_buffer(dtype):
    """dequant.py's kernel: `dequantize` rounded to the buffer's dtype bit for bit, two and three K
    tiles, a ragged row tile, only the first N·K elements written; then a QWeight read of
    `dequant_read_rows` rows goes through it."""
    from strata.kernels import choices
    from strata.kernels.quant import QWeight
    from strata.kernels.quant.dequant import DequantConfig, dequantize_into_triton

    n = 40
    for k, config in ((512, None), (768, DequantConfig(16, 256, num_warps=4))):
        _, planes = make_weight(n, k, seed_of("deq-into", k))
        out = torch.full((n * k + 9,), 7.0, dtype=dtype, device=DEV)
        got = dequantize_into_triton("Q5_K", planes, n, k, out, config=config)
        assert got.data_ptr() == out.data_ptr() and torch.equal(got, dequantize(planes, n, k).to(dtype))
        assert torch.all(out[n * k:] == 7.0)
    raw = torch.from_numpy(random_raw(n, 256, 4)).to(DEV)
    w = QWeight.from_raw("Q5_K", raw, n, 256)
    w.dequant_buf = torch.zeros(n * 256, dtype=dtype, device=DEV)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    with choices.using(dequant_read_rows=8):
        got = w.matmul(x)
    want_w = w.dequantize().to(dtype)
    assert torch.equal(w.dequant_buf.view(n, 256), want_w) and torch.equal(got, x @ want_w.t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_moe_grouped_kernel_on_q5_k_stacks(dtype):
    """moe_q's grouped kernel takes Q5_K stacks: decode (swap AB) and 64-row tiles, empty experts,
    uneven groups, against the reference."""
    from strata.kernels.quant.moe_q import GroupedConfig, QExpertStack, grouped_matmul_ref, grouped_matmul_triton

    e, n, k = 4, 48, 256
    raw = torch.from_numpy(random_raw(e * n, k, seed_of("moe"))).view(e, n, -1)
    stack = QExpertStack.from_raw("Q5_K", raw)
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


def test_moe_decode_kernels_on_q5_k_stacks():
    """moe_decode_q's two launches on Q5_K stacks against their reference (its tolerances: the largest
    error within 2e-2 of the largest |reference|, Frobenius 5e-3 in bf16), 64-row blocks; a token alone
    gives its bits in the batch."""
    import dataclasses

    from strata.kernels.quant import moe_decode_q as mdq
    from strata.kernels.quant.moe_q import QExpertStack

    e, h, inter, t, top_k = 6, 256, 256, 2, 2
    raw13 = torch.from_numpy(random_raw(e * 2 * inter, h, 21)).view(e, 2 * inter, -1)
    raw2 = torch.from_numpy(random_raw(e * h, inter, 22)).view(e, h, -1)
    w13, w2 = QExpertStack.from_raw("Q5_K", raw13), QExpertStack.from_raw("Q5_K", raw2)
    assert mdq.supported(t, top_k, "Q5_K", h, inter, torch.bfloat16)
    assert not mdq.supported(9, top_k, "Q5_K", h, inter, torch.bfloat16)  # Q4_K's limit
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)])
    w = torch.rand(t, top_k, generator=gen) + 0.1
    w = (w / w.sum(-1, keepdim=True)).float()
    cfg = dataclasses.replace(mdq.decode_config("Q5_K", h, inter), gate_up_block_i=64, down_block_h=64)
    got = mdq.moe_decode_q_triton(x, ids, w, w13, w2, config=cfg)
    ref = mdq.reference(x, ids, w, w13, w2, cfg)
    err = (got.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err <= 2e-2 and rel_frobenius(got, ref) <= 5e-3
    alone = mdq.moe_decode_q_triton(x[1:].clone(), ids[1:].clone(), w[1:].clone(), w13, w2, config=cfg)
    assert torch.equal(alone, got[1:])


# ----------------------------------------------------------------------------------------------
# GPU (pytest -m gpu)

GPU_SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288)]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 512])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_real_shapes(n, k, m):
    planes, ws = check_real_shape(Q5K, n, k, m)
    x = torch.randn(m, k, device="cuda") * 0.5
    check_product(matmul(x, planes, n, k, workspace=ws), x, planes, n, k)  # fp32 x through the IEEE dot


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 512], ids=["gemv", "gemm"])
def test_gpu_kernels_dequantize_exactly(m):
    check_one_hot_gives_dequantized(Q5K, m)


@needs_cuda
@pytest.mark.gpu
def test_gpu_batch_invariant_and_graph():
    check_batch_invariant_and_graph(Q5K)


@needs_cuda
@pytest.mark.gpu
def test_gpu_dequantize_into_and_moe_decode():
    """The dequantize-into kernel at 24576 x 4096 bit for bit; the MoE decode kernels at Qwen3-30B-A3B
    sizes against their reference (the shipped configuration)."""
    from strata.kernels.quant import moe_decode_q as mdq
    from strata.kernels.quant.dequant import dequantize_into
    from strata.kernels.quant.moe_q import QExpertStack

    n, k = 24576, 4096
    _, planes = make_weight(n, k, 13, device="cuda")
    out = torch.empty(n * k, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(dequantize_into("Q5_K", planes, n, k, out), dequantize(planes, n, k).to(torch.bfloat16))
    e, h, inter = 128, 2048, 768
    w13 = QExpertStack.from_raw("Q5_K", torch.from_numpy(random_raw(e * 2 * inter, h, 1)).cuda().view(e, 2 * inter, -1))
    w2 = QExpertStack.from_raw("Q5_K", torch.from_numpy(random_raw(e * h, inter, 2)).cuda().view(e, h, -1))
    x = torch.randn(4, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device="cuda")[:8] for _ in range(4)])
    w = torch.softmax(torch.randn(4, 8, device="cuda"), -1)
    got, ref = mdq.moe_decode_q_triton(x, ids, w, w13, w2), mdq.reference(x, ids, w, w13, w2)
    assert rel_frobenius(got, ref) <= 5e-3
