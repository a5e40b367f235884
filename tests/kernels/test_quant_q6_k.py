"""Q6_K quantized weights (strata/kernels/quant/q6_k.py): repack, dequantize, the GEMV and GEMM kernels,
the grouped MoE kernel on Q6_K stacks, the registry and the GGUF loader keeping Q6_K quantized.

CPU: `dequantize` equals gguf's numpy dequantizer bit for bit; the kernels run in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1) at K = 256/512, N ≤ 96, M in {1, 3, 16, 40}, fp32, fp16
and bf16 x. GPU (`pytest -m gpu`): the 8B shapes at M = 1, 8, 512, CUDA-graph replay, and a speed
report (`-s` to see it; printed, never asserted).

Tolerances, relative Frobenius error of the product:
- against `matmul_ref` (the stated semantics: weights rounded to x's dtype, fp32 sums, one final
  rounding): fp32 1e-5 (summation order only); fp16/bf16 one output rounding, ≤ 2^-9 per value:
  fp16 2e-3, bf16 4e-3;
- against the fp32 dequantize-then-matmul reference: fp32 1e-5, fp16 2e-3, bf16 1e-2 (the weights'
  rounding to bf16 adds ~2^-9 relative per weight).

The tests imported from tests/kernels/test_quant_q4_k.py are Q4_K's and Q6_K's alike: collected here,
they take Q6_K from this module's `kquant` fixture.
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

from strata.kernels.quant import q6_k
from strata.kernels.quant.q6_k import (
    BLOCK_BYTES,
    BLOCK_VALUES,
    GemvConfig,
    dequantize,
    gemm_q6k,
    gemv_q6k,
    gemv_workspace_numel,
    matmul,
    random_raw,
    repack,
)

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

QT6 = gguf.GGMLQuantizationType.Q6_K
Q6K = KQuantFormat(q6_k, gemv_q6k, gemm_q6k, QT6, gemm_block_k=256)
make_weight = Q6K.weight
gguf_bits = Q6K.gguf_bits
check_product = Q6K.check_product


@pytest.fixture
def kquant() -> KQuantFormat:
    return Q6K


def test_constants():
    assert (q6_k.GGML_TYPE, BLOCK_VALUES, BLOCK_BYTES) == ("Q6_K", 256, 210)
    assert gguf.GGML_QUANT_SIZES[QT6] == (BLOCK_VALUES, BLOCK_BYTES)


def test_dequantize_extreme_fields():
    """Every quant bit set or clear, scales ±127 / −128 / 0, and huge, tiny (subnormal), negative and
    signed-zero fp16 d: still gguf's bits, signs of zeros included."""
    n, k = 6, 512
    raw = random_raw(n, k, 5).reshape(n, -1, BLOCK_BYTES)
    raw[0, :, :192] = 0xFF
    raw[1, :, :192] = 0x00
    raw[2, :, 192:208] = np.array([0x80, 0x7F, 0x00, 0x81] * 4, dtype=np.uint8)
    for row, d in zip(range(3, 6), ([60000.0, -0.5], [6e-8, -6e-8], [0.0, -0.0])):
        raw[row, :, 208:210] = np.array(d, dtype=np.float16).view(np.uint8).reshape(2, 2)
    raw = raw.reshape(n, -1)
    got = dequantize(repack(torch.from_numpy(raw)), n, k)
    assert torch.equal(got.view(torch.int32), gguf_bits(raw))


def test_repack_planes():
    n, k = 10, 768
    raw, planes = repacked(Q6K, n, k)
    want = {"ql": ((n, k // 2), torch.uint8), "qh": ((n, k // 4), torch.uint8),
            "scales": ((n, k // 16), torch.int8), "d": ((n, k // 256), torch.float32)}
    assert {name: (tuple(t.shape), t.dtype) for name, t in planes.items()} == want
    blocks = raw.reshape(n, -1, BLOCK_BYTES)
    assert np.array_equal(planes["qh"].cpu().numpy(), blocks[:, :, 128:192].reshape(n, -1))
    assert np.array_equal(planes["d"].cpu().numpy(), blocks[:, :, 208:].copy().view(np.float16)[..., 0])


# (m, n, k, config): split-K even and uneven, wider tiles, 256-value steps
GEMV_CASES = [
    (3, 80, 512, GemvConfig(32, 128, split_k=4)),
    (5, 40, 768, GemvConfig(16, 256, split_k=3)),
    (2, 70, 512, GemvConfig(64, 128, split_k=3)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", GEMV_CASES, ids=gemv_case_id)
def test_gemv_split_k(case, dtype):
    check_gemv_split_k(Q6K, case, dtype)


@pytest.mark.parametrize("config,ms", [(None, range(1, 16)), (GemvConfig(16, 128, split_k=2), (1, 6, 15))],
                         ids=["auto", "split2"])
def test_gemv_batch_invariant(config, ms):
    """Each of the m rows of a batch of m ≤ 16 has the bits it has in the batch of 16 (every m with
    the default configuration; a few with split-K)."""
    n, k = 32, 256
    _, planes = make_weight(n, k, seed_of("inv"))
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(7)).to(DEV, torch.bfloat16)
    ws = torch.zeros(max(1, gemv_workspace_numel(n, k, config)), dtype=torch.int32, device=DEV)
    full = gemv_q6k(x, planes, n, k, workspace=ws, config=config)
    for m in ms:
        assert torch.equal(gemv_q6k(x[:m], planes, n, k, workspace=ws, config=config), full[:m]), m


def test_registered_format():
    """Q6_K is kept quantized: in FORMATS, a QWeight with its split-K workspace, `random_blocks` valid."""
    from strata.kernels.quant import FORMATS, QWeight, format_module, random_blocks

    assert "Q6_K" in FORMATS and format_module("Q6_K") is q6_k
    n, k = 4096, 4096
    assert gemv_workspace_numel(n, k) > 0  # the default 8B configuration splits K
    raw = torch.from_numpy(random_raw(8, 256, 3))
    w = QWeight.from_raw("Q6_K", raw, 8, 256)
    assert torch.equal(w.dequantize().view(torch.int32), gguf_bits(raw.numpy()))
    blocks = random_blocks("Q6_K", 32, 512, torch.Generator().manual_seed(0), "cpu")
    values = gguf.quants.dequantize(blocks.numpy(), QT6)
    assert np.isfinite(values).all() and 0.005 < values.std() < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_moe_grouped_kernel_on_q6_k_stacks(dtype):
    """moe_q's grouped kernel takes Q6_K stacks: decode (swap AB) and 64-row tiles, empty experts,
    uneven groups, against the reference."""
    from strata.kernels.quant.moe_q import GroupedConfig, QExpertStack, grouped_matmul_ref, grouped_matmul_triton

    e, n, k = 4, 48, 256
    raw = torch.from_numpy(random_raw(e * n, k, seed_of("moe"))).view(e, n, -1)
    stack = QExpertStack.from_raw("Q6_K", raw)
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


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_gguf_loader_keeps_q6_k_quantized(tmp_path):
    """A qwen3 GGUF whose ffn_down is Q6_K: with keep_quantized the MLP's down projection is a Q6_K
    QWeight from the file's own blocks (its float weight never made), and the logits match the
    dequantized load's (fp32: the kernels against dequantize-then-matmul)."""
    from safetensors.torch import load_file
    from test_gguf import _hf_config, _logits, _write_with_raw
    from tiny_models import save_tiny_model

    from strata.kernels.quant import QWeight
    from strata.loaders import load_model

    src = str(tmp_path / "hf")
    save_tiny_model("qwen3", src)
    c = _hf_config(src)
    tensors = load_file(f"{src}/model.safetensors")
    tensors.pop("model.layers.0.mlp.down_proj.weight")
    blob = random_raw(c["hidden_size"], 256, 9)
    path = str(tmp_path / "q6.gguf")
    _write_with_raw(path, c, tensors, {"blk.0.ffn_down.weight": (blob, QT6)}, intermediate=256)
    floats = load_model(path)
    kept = load_model(path, keep_quantized=True)
    mlp = kept.model.model.layers[0].mlp
    assert isinstance(mlp.down_q, QWeight) and mlp.down_q.ggml_type == "Q6_K" and mlp.down_proj.weight.is_meta
    assert torch.equal(mlp.down_q.dequantize().view(torch.int32), gguf_bits(blob))
    for t in (20, 3):  # a prompt-sized GEMM and decode-sized GEMVs
        ids = torch.randint(0, c["vocab_size"], (1, t), generator=torch.Generator().manual_seed(t))
        got, want = _logits(kept, ids), _logits(floats, ids)
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4, t


# ----------------------------------------------------------------------------------------------
# GPU (pytest -m gpu)

GPU_SHAPES = [(4096, 4096), (4096, 12288), (12288, 4096)]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 512])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_real_shapes(n, k, m):
    planes, ws = check_real_shape(Q6K, n, k, m)
    x = torch.randn(m, k, device="cuda") * 0.5
    check_product(matmul(x, planes, n, k, workspace=ws), x, planes, n, k)  # fp32 x through the IEEE dot


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 512], ids=["gemv", "gemm"])
def test_gpu_kernels_dequantize_exactly(m):
    check_one_hot_gives_dequantized(Q6K, m)


@needs_cuda
@pytest.mark.gpu
def test_gpu_batch_invariant_and_graph():
    check_batch_invariant_and_graph(Q6K)


def test_the_writer_makes_blocks_gguf_reads_back():
    """writers.quantize_q6_k: gguf's own dequantization of the written blocks is within 6-bit precision
    of the input (RMS error < 3%, every value within half a step of its sub-block's scale), and each
    sub-block's largest value comes back to within its scale's rounding."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from strata.kernels.quant.writers import quantize

    rng = np.random.default_rng(6)
    w = (rng.standard_normal((6, 512)) * 0.02).astype(np.float32)
    w[0, :16] = 0.0  # an all-zero sub-block
    raw = quantize("Q6_K", w)
    assert raw.shape == (6, 2 * 210) and raw.dtype == np.uint8
    back = gguf_dequantize(raw, GGMLQuantizationType.Q6_K).reshape(w.shape)
    assert np.linalg.norm(back - w) / np.linalg.norm(w) < 0.03
    assert not back[0, :16].any()
    sub = np.abs(w).reshape(-1, 16).max(-1)
    worst = (np.abs(back - w).reshape(-1, 16).max(-1) / np.where(sub > 0, sub, 1)).max()
    assert worst < 0.05  # half a step (1/64 of the peak) plus the int8 scale's and fp16 d's rounding
