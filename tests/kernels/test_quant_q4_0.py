"""Q4_0 quantized weights (strata/kernels/quant/q4_0.py): repack, dequantize, the GEMV and GEMM kernels,
the dequantize-into-buffer kernel, the MoE kernels on Q4_0 stacks, the writer and the registry.

CPU: `dequantize` equals gguf's numpy dequantizer bit for bit; the kernels run in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1) at K = 256/512 and at K that 256 does not divide (96: 32-value
K steps and the d plane read as fp16; 320: 64-value steps, d read as words), N ≤ 96, M in {1, 3, 16, 40},
fp32, fp16 and bf16 x. GPU (`pytest -m gpu`): the 8B shapes at M = 1, 8, 512, the kernels' weights bit
for bit, CUDA-graph replay.

Tolerances, relative Frobenius error of the product (tests/kernels/test_quant_q4_k.py's):
- against `matmul_ref` (weights rounded to x's dtype, fp32 sums, one final rounding): fp32 1e-5,
  fp16 2e-3, bf16 4e-3;
- against the fp32 dequantize-then-matmul reference: fp32 1e-5, fp16 2e-3, bf16 1e-2.

The tests imported from tests/kernels/test_quant_q4_k.py are the K-quant formats' shared ones that
hold for 32-value blocks too: collected here, they take Q4_0 from this module's `kquant` fixture.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_quant_q4_k import (  # noqa: F401  (the shared tests)
    DEV,
    DTYPE_IDS,
    DTYPES,
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
    run_poisoned,
    seed_of,
    test_an_empty_batch_under_every_decode_kernel,
    test_gemm_configs,
    test_kernels_dequantize_exactly,
    test_matmul_matches_reference,
    test_reference_path_off_the_kernels,
)

from strata.kernels.quant import q4_0
from strata.kernels.quant.q4_0 import (
    BLOCK_BYTES,
    BLOCK_VALUES,
    GemmConfig,
    GemvConfig,
    dequantize,
    gemm_q4_0,
    gemv_q4_0,
    gemv_workspace_numel,
    matmul,
    random_raw,
    repack,
)

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

QT40 = gguf.GGMLQuantizationType.Q4_0
Q40 = KQuantFormat(q4_0, gemv_q4_0, gemm_q4_0, QT40, gemm_block_k=64)
make_weight = Q40.weight
gguf_bits = Q40.gguf_bits
check_product = Q40.check_product


@pytest.fixture
def kquant() -> KQuantFormat:
    return Q40


def test_constants():
    assert (q4_0.GGML_TYPE, BLOCK_VALUES, BLOCK_BYTES) == ("Q4_0", 32, 18)
    assert gguf.GGML_QUANT_SIZES[QT40] == (BLOCK_VALUES, BLOCK_BYTES)


@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (9, 512), (33, 1024)])
def test_dequantize_bit_exact_against_gguf(n, k):
    raw, planes = make_weight(n, k, seed_of("deq", n, k), device="cpu")
    assert raw.dtype == np.uint8 and raw.shape == (n, k // 32 * BLOCK_BYTES)
    got = dequantize(planes, n, k)
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(got.view(torch.int32), gguf_bits(raw))
    ref = gguf.quants.dequantize(raw, QT40)
    assert np.isfinite(ref).all() and 0.005 < ref.std() < 0.05, "random_raw magnitudes"


def test_dequantize_extreme_fields():
    """Every quant 0, 8 (a zero of d's sign) and 15, and huge, tiny (subnormal), negative and
    signed-zero fp16 d: still gguf's bits, signs of zeros included."""
    n, k = 7, 256
    raw = random_raw(n, k, 5).reshape(n, -1, BLOCK_BYTES)
    raw[0, :, 2:] = 0xFF
    raw[1, :, 2:] = 0x00
    raw[2, :, 2:] = 0x88
    for row, d in zip(range(3, 7), ([60000.0], [-6e-8], [-0.0], [0.0])):
        raw[row, :, 0:2] = np.array(d, dtype=np.float16).view(np.uint8)
    raw[5, :, 2:] = 0x88  # −0 · 0
    raw = raw.reshape(n, -1)
    got = dequantize(repack(torch.from_numpy(raw)), n, k)
    assert torch.equal(got.view(torch.int32), gguf_bits(raw))


def test_repack_planes():
    """The file's bytes, split: quants in their order, d as fp16, the file's size."""
    n, k = 10, 768
    raw, planes = repacked(Q40, n, k)
    assert {name: (tuple(t.shape), t.dtype) for name, t in planes.items()} == {
        "qs": ((n, k // 2), torch.uint8), "d": ((n, k // 32), torch.float16)}
    blocks = raw.reshape(n, -1, BLOCK_BYTES)
    assert np.array_equal(planes["qs"].cpu().numpy(), blocks[:, :, 2:].reshape(n, -1))
    assert np.array_equal(planes["d"].cpu().numpy().view(np.uint8), blocks[:, :, :2].reshape(n, -1))
    assert sum(t.numel() * t.element_size() for t in planes.values()) == raw.nbytes


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m,n,k", [(1, 24, 96), (3, 40, 320), (16, 33, 96), (40, 24, 320)])
def test_matmul_at_k_that_256_does_not_divide(m, n, k, dtype):
    """K = 96 (32-value K steps, d read as fp16) and 320 (64-value steps, d read as words), through
    `matmul` (GEMV for M ≤ 16, GEMM above), x a column slice (a row stride wider than K)."""
    _, planes = make_weight(n, k, seed_of("oddk", m, n, k))
    wide = torch.randn(m, k + 32, generator=torch.Generator().manual_seed(seed_of("x", m, k))).to(DEV, dtype)
    x = wide[:, 32:]
    out = run_poisoned(matmul, x, n, planes, n, k)
    check_product(out, x, planes, n, k)
    assert q4_0.d_words(k, q4_0.gemv_config(n, k).block_k) == (k % 64 == 0)


# (m, n, k, config): split-K even and uneven, wider tiles, 32- and 256-value steps
GEMV_CASES = [
    (3, 80, 512, GemvConfig(32, 128, split_k=4)),
    (5, 40, 768, GemvConfig(16, 256, split_k=3)),
    (2, 70, 512, GemvConfig(64, 32, split_k=5)),
    (16, 48, 256, GemvConfig(16, 64, split_k=2)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", GEMV_CASES, ids=gemv_case_id)
def test_gemv_split_k(case, dtype):
    check_gemv_split_k(Q40, case, dtype)


@pytest.mark.parametrize("config", [None, GemvConfig(16, 64, split_k=2)], ids=["auto", "split2"])
def test_gemv_batch_invariant(config):
    """Rows 0..m-1 of a batch of m ≤ 16 have the bits they have in the batch of 16."""
    n, k = 32, 256
    _, planes = make_weight(n, k, seed_of("inv"))
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(7)).to(DEV, torch.bfloat16)
    ws = torch.zeros(max(1, gemv_workspace_numel(n, k, config)), dtype=torch.int32, device=DEV)
    full = gemv_q4_0(x, planes, n, k, workspace=ws, config=config)
    for m in (1, 6, 15):
        assert torch.equal(gemv_q4_0(x[:m], planes, n, k, workspace=ws, config=config), full[:m]), m


def test_configurations_divide_k():
    """The K step is the largest power of two up to the configuration's that divides K, at least 32."""
    assert q4_0.gemv_config(4096, 4096).block_k == 128 and q4_0.gemv_config(4096, 12288).block_k == 256
    assert q4_0.gemv_config(4096, 2880).block_k == 64 and q4_0.gemv_config(64, 96).block_k == 32
    assert q4_0.gemm_config(512, 4096, 1120).block_k == 32
    assert q4_0.gemm_config(512, 4096, 1152, torch.float32).block_k == 64
    assert q4_0.gemm_config(512, 4096, 1152).block_k == 128


def test_rejects_bad_arguments():
    n, k = 16, 256
    _, planes = make_weight(n, k, 1)
    x = torch.randn(2, k, device=DEV)
    with pytest.raises(ValueError):
        matmul(x[:, :128], planes, n, k)
    for bad in ({"qs": planes["qs"]}, {**planes, "d": planes["d"][:, :4]}, {**planes, "d": planes["d"].float()},
                {**planes, "qs": planes["qs"].view(torch.int8)}):
        with pytest.raises(ValueError):
            matmul(x, bad, n, k)
        with pytest.raises(ValueError):
            dequantize(bad, n, k)
    with pytest.raises(ValueError):
        matmul(x, planes, n, k, out=torch.empty(2, n, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError):
        gemv_q4_0(x, planes, n, k, config=GemvConfig(16, 16))  # K step under one block
    with pytest.raises(ValueError):
        gemm_q4_0(x, planes, n, k, config=GemmConfig(32, 32, 96))  # not a power of two
    with pytest.raises(ValueError):
        repack(torch.zeros(2, 20, dtype=torch.uint8))
    with pytest.raises(ValueError):
        dequantize(planes, n, 48)  # K not a multiple of 32
    with pytest.raises(ValueError):
        random_raw(2, 48, 0)


def test_registered_format_and_writer():
    """Q4_0 is kept quantized (FORMATS, DEQUANT_READ_FORMATS, a QWeight with its split-K workspace,
    `random_blocks` valid) and written by gguf's own quantizer, whose blocks this module reads back
    as gguf does."""
    from strata.kernels.quant import DEQUANT_READ_FORMATS, FORMATS, WRITTEN, QWeight, format_module, random_blocks
    from strata.kernels.quant.writers import quantize

    assert "Q4_0" in FORMATS and "Q4_0" in DEQUANT_READ_FORMATS and "Q4_0" in WRITTEN
    assert format_module("Q4_0") is q4_0 and gemv_workspace_numel(4096, 4096) > 0
    w = (np.random.default_rng(6).standard_normal((6, 320)) * 0.02).astype(np.float32)
    raw = quantize("Q4_0", w)
    assert raw.shape == (6, 10 * BLOCK_BYTES) and raw.dtype == np.uint8
    q = QWeight.from_raw("Q4_0", torch.from_numpy(raw), 6, 320)
    back = q.dequantize()
    assert torch.equal(back.view(torch.int32), gguf_bits(raw))
    assert (back - torch.from_numpy(w)).norm() / np.linalg.norm(w) < 0.15  # 4 bits a value
    blocks = random_blocks("Q4_0", 32, 512, torch.Generator().manual_seed(0), "cpu")
    values = gguf.quants.dequantize(blocks.numpy(), QT40)
    assert np.isfinite(values).all() and 0.005 < values.std() < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dequantize_into_buffer(dtype):
    """dequant.py's kernel: `dequantize` rounded to the buffer's dtype bit for bit at K = 512, 768 and
    160 (32-value K tiles), a ragged row tile, only the first N·K elements written; then a QWeight read
    of `dequant_read_rows` rows goes through it."""
    from strata.kernels import choices
    from strata.kernels.quant import QWeight
    from strata.kernels.quant.dequant import DequantConfig, block_k_for, dequantize_into_triton

    n = 40
    assert block_k_for("Q4_0", 160, 256) == 32 and block_k_for("Q4_0", 320, 256) == 64
    for k, config in ((512, None), (768, DequantConfig(16, 256, num_warps=4)), (160, None)):
        _, planes = make_weight(n, k, seed_of("deq-into", k))
        out = torch.full((n * k + 9,), 7.0, dtype=dtype, device=DEV)
        got = dequantize_into_triton("Q4_0", planes, n, k, out, config=config)
        assert got.data_ptr() == out.data_ptr() and torch.equal(got, dequantize(planes, n, k).to(dtype)), k
        assert torch.all(out[n * k:] == 7.0)
    raw = torch.from_numpy(random_raw(n, 256, 4)).to(DEV)
    w = QWeight.from_raw("Q4_0", raw, n, 256)
    w.dequant_buf = torch.zeros(n * 256, dtype=dtype, device=DEV)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    with choices.using(dequant_read_rows=8):
        got = w.matmul(x)
    want_w = w.dequantize().to(dtype)
    assert torch.equal(w.dequant_buf.view(n, 256), want_w) and torch.equal(got, x @ want_w.t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_moe_grouped_kernel_on_q4_0_stacks(dtype):
    """moe_q's grouped kernel takes Q4_0 stacks: decode (swap AB) and 64-row tiles, empty experts,
    uneven groups, 32-value K steps, against the reference."""
    from strata.kernels.quant.moe_q import GroupedConfig, QExpertStack, grouped_matmul_ref, grouped_matmul_triton

    e, n, k = 4, 48, 256
    raw = torch.from_numpy(random_raw(e * n, k, seed_of("moe"))).view(e, n, -1)
    stack = QExpertStack.from_raw("Q4_0", raw)
    assert torch.equal(stack.dequantize().view(e * n, k).view(torch.int32), gguf_bits(raw.view(e * n, -1).numpy()))
    offs = torch.tensor([0, 5, 5, 21], dtype=torch.int32)  # each expert's end row: experts 0 and 2 empty
    xs = torch.randn(21, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = grouped_matmul_ref(xs, stack, offs)
    if dtype == torch.float32:  # the FMA dot's tiles (`grouped_config`)
        configs = (GroupedConfig(16, 32, 32), GroupedConfig(32, 32, 128, num_warps=8))
    else:
        configs = (GroupedConfig(16, 64, 128, swap_ab=True), GroupedConfig(64, 32, 32, num_warps=8))
    for cfg in configs:
        got = grouped_matmul_triton(xs, stack, offs, config=cfg)
        assert rel_frobenius(got, ref) <= TOL_FP32_REF[dtype], cfg


def test_moe_decode_kernels_on_q4_0_stacks():
    """moe_decode_q's two launches on Q4_0 stacks against their reference (its tolerances: the largest
    error within 2e-2 of the largest |reference|, Frobenius 5e-3 in bf16), 64-row blocks, I = 96 (32-value
    K steps in the down kernel); a token alone gives its bits in the batch."""
    import dataclasses

    from strata.kernels.quant import moe_decode_q as mdq
    from strata.kernels.quant.moe_q import QExpertStack

    e, h, inter, t, top_k = 6, 256, 96, 2, 3
    raw13 = torch.from_numpy(random_raw(e * 2 * inter, h, 21)).view(e, 2 * inter, -1)
    raw2 = torch.from_numpy(random_raw(e * h, inter, 22)).view(e, h, -1)
    w13, w2 = QExpertStack.from_raw("Q4_0", raw13), QExpertStack.from_raw("Q4_0", raw2)
    assert mdq.supported(t, top_k, "Q4_0", h, inter, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)])
    w = torch.rand(t, top_k, generator=gen) + 0.1
    w = (w / w.sum(-1, keepdim=True)).float()
    cfg = dataclasses.replace(mdq.decode_config("Q4_0", h, inter), gate_up_block_i=64, down_block_h=64)
    assert cfg.down_block_k == 32
    got = mdq.moe_decode_q_triton(x, ids, w, w13, w2, config=cfg)
    ref = mdq.reference(x, ids, w, w13, w2, cfg)
    err = (got.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err <= 2e-2 and rel_frobenius(got, ref) <= 5e-3
    alone = mdq.moe_decode_q_triton(x[1:].clone(), ids[1:].clone(), w[1:].clone(), w13, w2, config=cfg)
    assert torch.equal(alone, got[1:])


# ----------------------------------------------------------------------------------------------
# GPU (pytest -m gpu)

GPU_SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288), (4096, 2880)]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 512])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_real_shapes(n, k, m):
    planes, ws = check_real_shape(Q40, n, k, m)
    x = torch.randn(m, k, device="cuda") * 0.5
    check_product(matmul(x, planes, n, k, workspace=ws), x, planes, n, k)  # fp32 x through the IEEE dot


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 512], ids=["gemv", "gemm"])
def test_gpu_kernels_dequantize_exactly(m):
    check_one_hot_gives_dequantized(Q40, m)


@needs_cuda
@pytest.mark.gpu
def test_gpu_batch_invariant_and_graph():
    check_batch_invariant_and_graph(Q40)


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
    assert torch.equal(dequantize_into("Q4_0", planes, n, k, out), dequantize(planes, n, k).to(torch.bfloat16))
    e, h, inter = 128, 2048, 768
    w13 = QExpertStack.from_raw("Q4_0", torch.from_numpy(random_raw(e * 2 * inter, h, 1)).cuda().view(e, 2 * inter, -1))
    w2 = QExpertStack.from_raw("Q4_0", torch.from_numpy(random_raw(e * h, inter, 2)).cuda().view(e, h, -1))
    x = torch.randn(4, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device="cuda")[:8] for _ in range(4)])
    w = torch.softmax(torch.randn(4, 8, device="cuda"), -1)
    got, ref = mdq.moe_decode_q_triton(x, ids, w, w13, w2), mdq.reference(x, ids, w, w13, w2)
    assert rel_frobenius(got, ref) <= 5e-3
