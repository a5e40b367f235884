"""MoE experts kept quantized (strata.kernels.quant.moe_q): the stacked planes, the grouped kernel, the MoE
layer on them, and a GGUF MoE model loaded with its experts kept quantized.

CPU: the kernel in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at E = 4..8, K = 256,
N ≤ 64, T up to 40 rows with empty experts and uneven groups, Q8_0 / IQ3_S / Q4_K, bf16 and fp32 x,
every tile shape (decode "swap AB" tiles, 64- and 128-row tiles) against `grouped_matmul_ref`. GPU
(`pytest -m gpu`): Qwen3-30B-A3B sizes (E = 128, top-8, H = 2048, I = 768), graph capture, a MoE
layer under CUDA's sync debug mode (timings: benchmarks/kernels/quant_moe.py).

Tolerances (relative Frobenius error of the product against the reference, fp32 weights): fp32 x 1e-5
(summation order only); bf16 x 1e-2 (each weight rounded to bf16, ~2⁻⁹, and the output's one rounding;
against the reference with its weights rounded to bf16 as the kernel does, 4e-3: the output rounding,
which the fp32 summation order may flip). MoE layers and models in fp32: 1e-5 / 1e-4.
"""

from __future__ import annotations

import copy
import logging
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from strata.config import ModelConfig
from strata.kernels import moe_sort
from strata.kernels.quant import format_module
from strata.kernels.quant import moe_q
from strata.kernels.quant.moe_q import GroupedConfig, QExpertStack, grouped_matmul, grouped_matmul_ref
from strata.models.moe import MoE

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
TOL_ROUNDED = 4e-3


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def raw_stack(fmt: str, e: int, n: int, k: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(format_module(fmt).random_raw(e * n, k, seed)).view(e, n, -1)


def offs_of(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def rounded_ref(xs: torch.Tensor, stack: QExpertStack, offs: torch.Tensor) -> torch.Tensor:
    """The kernel's definition: weights rounded to x's dtype, fp32 products and sums (not rounded)."""
    y = torch.zeros(xs.shape[0], stack.n)
    bounds = [0, *offs.tolist()]
    for e in range(stack.num_experts):
        a, b = bounds[e], bounds[e + 1]
        y[a:b] = F.linear(xs[a:b].float(), stack.dequantize_expert(e).to(xs.dtype).float())
    return y


# ---------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("fmt", ["Q8_0", "IQ3_S", "Q4_K"])
def test_stack_planes_are_the_formats(fmt):
    """from_raw: the format's planes with a leading expert dim, the file's size (IQ3_S's GEMV workspace
    dropped), dequantizing bit for bit like gguf, expert e = rows e·N.. of the stack."""
    e, n, k = 3, 16, 512
    raw = raw_stack(fmt, e, n, k, seed=5)
    stack = QExpertStack.from_raw(fmt, raw)
    assert (stack.num_experts, stack.n, stack.k) == (e, n, k) and "workspace" not in stack.planes
    assert all(p.shape[:2] == (e, n) and p.is_contiguous() for p in stack.planes.values())
    assert raw.numel() <= stack.nbytes <= 1.1 * raw.numel()
    want = gguf_dequantize(raw.reshape(e * n, -1).numpy(), QT[fmt]).reshape(e, n, k)
    assert np.array_equal(stack.dequantize().numpy(), want)
    assert np.array_equal(stack.dequantize_expert(1).numpy(), want[1])
    with pytest.raises(ValueError):
        QExpertStack.from_raw(fmt, raw.reshape(e * n, -1))
    with pytest.raises(ValueError):
        QExpertStack.from_raw("Q6_K", raw)


# (experts, rows per expert, forced config or None). Empty experts everywhere, uneven groups; the
# configurations cover the decode tiles (swap AB), 64-row and 128-row tiles, ragged column tiles.
CASES = {
    "decode": (8, [0, 3, 0, 0, 1, 0, 2, 0], None),
    "mid": (4, [0, 17, 23, 0], None),
    "swap": (6, [5, 0, 19, 1, 0, 15], GroupedConfig(16, 32, 256, swap_ab=True)),
    "rows128": (5, [0, 30, 0, 1, 9], GroupedConfig(128, 64, 128, num_warps=8)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fmt,case", [("Q8_0", "decode"), ("Q8_0", "mid"), ("Q8_0", "rows128"), ("IQ3_S", "decode"),
                                      ("IQ3_S", "mid"), ("IQ3_S", "swap"), ("Q4_K", "mid"), ("Q4_K", "swap")])
def test_kernel_matches_reference(fmt, case, dtype):
    e, counts, config = CASES[case]
    n, k = (48 if case == "rows128" else 64), 256
    stack = QExpertStack.from_raw(fmt, raw_stack(fmt, e, n, k, seed=zlib.crc32(f"{fmt}/{case}".encode()) % 1000))
    offs = offs_of(counts)
    gen = torch.Generator().manual_seed(7)
    xs = torch.randn(sum(counts), k, generator=gen).to(dtype)
    out = torch.full((xs.shape[0], n), float("nan"), dtype=dtype)
    if config is not None and dtype == torch.float32:
        config = GroupedConfig(config.block_m, 32, 64 if fmt == "IQ3_S" else 128 if fmt == "Q4_K" else 32,
                               swap_ab=config.swap_ab)
    got = moe_q.grouped_matmul_triton(xs, stack, offs, out, config=config)
    assert got is out and got.dtype == dtype and not got.isnan().any()
    ref = grouped_matmul_ref(xs, stack, offs)
    err = rel_err(got, ref)
    assert err <= TOL[dtype], err
    if dtype == torch.bfloat16:
        assert rel_err(got, rounded_ref(xs, stack, offs)) <= TOL_ROUNDED
    if config is None:  # the dispatch runs the kernel here, with the same configuration
        assert torch.equal(grouped_matmul(xs, stack, offs), got)


def test_kernel_edge_cases():
    """No rows; every row in the last expert; offs of the wrong dtype refused."""
    stack = QExpertStack.from_raw("Q8_0", raw_stack("Q8_0", 4, 32, 64, seed=1))
    xs = torch.randn(0, 64)
    assert grouped_matmul(xs, stack, offs_of([0, 0, 0, 0])).shape == (0, 32)
    xs = torch.randn(5, 64)
    offs = offs_of([0, 0, 0, 5])
    assert rel_err(grouped_matmul(xs, stack, offs), grouped_matmul_ref(xs, stack, offs)) <= TOL[torch.float32]
    with pytest.raises(ValueError):
        moe_q.grouped_matmul_triton(xs, stack, offs.long())


@pytest.fixture
def interpreter_tiles(monkeypatch):
    """Large tiles for the layer and model tests: the interpreter's cost is per program and step, and
    the configurations themselves are `test_kernel_matches_reference`'s business."""
    monkeypatch.setattr(moe_q, "grouped_config",
                        lambda fmt, t, e, n, k, dtype, spec=None: GroupedConfig(64, 128, moe_q._block_k(fmt, k, 256)))


MOE_CONFIG = dict(model_type="qwen3_moe", vocab_size=320, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  norm_topk_prob=True)


def quantized_moe(fmt: str, seed: int, hidden: int = 256, inter: int = 256, down_fmt: str | None = None):
    """(MoE whose experts carry `quant_raw` as the loader parks them, its float twin with the dequantized
    weights). `down_fmt`: the down projections' format (None: float, not kept quantized)."""
    torch.manual_seed(seed)
    moe = MoE(ModelConfig(**MOE_CONFIG, hidden_size=hidden, moe_intermediate_size=inter)).requires_grad_(False).eval()
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.1)
    floats = copy.deepcopy(moe)
    for e, (m, f) in enumerate(zip(moe.experts, floats.experts)):
        for j, name in enumerate(("gate_proj", "up_proj", "down_proj")):
            lin, twin = getattr(m, name), getattr(f, name)
            kind = fmt if name != "down_proj" else down_fmt if down_fmt != "same" else fmt
            if kind is None:
                twin.weight = nn.Parameter(lin.weight.detach().clone(), requires_grad=False)
                continue
            mod = format_module(kind)
            raw = torch.from_numpy(mod.random_raw(lin.out_features, lin.in_features, seed=seed * 100 + 3 * e + j))
            lin.quant_raw = (kind, raw)
            twin.weight = nn.Parameter(mod.dequantize(mod.repack(raw), lin.out_features, lin.in_features),
                                       requires_grad=False)
    return moe, floats


@pytest.mark.parametrize("fmt", ["Q8_0", "IQ3_S"])
def test_moe_layer_quantized_matches_dequantized(fmt, monkeypatch, interpreter_tiles):
    """pack_experts stacks the kept experts (gate|up rows per expert) and the layer's grouped path on
    them equals the same MoE with the dequantized float weights: through the kernel (interpreter) and
    through the reference the CPU engine runs."""
    moe, floats = quantized_moe(fmt, seed=3, down_fmt="same")
    assert moe.pack_experts() == "grouped" and moe.quant is not None and moe.w13 is None
    w13, w2 = moe.quant
    assert (w13.ggml_type, w13.num_experts, w13.n, w13.k) == (fmt, 8, 512, 256) and (w2.n, w2.k) == (256, 256)
    floats.pack_experts()
    assert torch.equal(w13.dequantize(), floats.w13) and torch.equal(w2.dequantize(), floats.w2)
    empty_seen = False
    for t in (1, 19):
        x = torch.randn(t, 256)
        ids = floats.gate(x)[1]
        empty_seen |= bool((torch.bincount(ids.flatten(), minlength=8) == 0).any())
        with torch.no_grad():
            ref, got = floats(x), moe(x)
        assert rel_err(got, ref) <= 1e-5, t
    assert empty_seen
    monkeypatch.setattr(moe_q, "kernels_run", lambda *a: False)  # the CPU engine's path: the reference
    x = torch.randn(5, 256)
    with torch.no_grad():
        assert rel_err(moe(x), floats(x)) <= 1e-5


def test_moe_pack_falls_back_to_floats_when_a_stack_is_not_kept():
    """Down projections not kept quantized (a format without kernels, as Q4_K_M's Q6_K): the kept gate
    and up weights are expanded to floats and the experts pack as before."""
    moe, floats = quantized_moe("Q8_0", seed=4, hidden=64, inter=32, down_fmt=None)
    moe.pack_experts()
    floats.pack_experts()
    assert moe.quant is None and torch.equal(moe.w13, floats.w13) and torch.equal(moe.w2, floats.w2)
    assert all("quant_raw" not in vars(m.gate_proj) for m in moe.experts)


@pytest.mark.parametrize("kept", ["all", "gate_up_only"])
def test_gguf_moe_keeps_experts_quantized(kept, tmp_path, caplog, interpreter_tiles):
    """A qwen3_moe GGUF with Q8_0 expert stacks: with keep_quantized each MoE layer holds two Q8_0
    QExpertStacks (float experts never made) and the logits equal the dequantized load's (fp32). With
    the down stacks in F32 the experts fall back to floats, as before."""
    from safetensors.torch import load_file
    from test_gguf import _hf_config, _logits, write_gguf
    from tiny_models import save_tiny_model

    from strata.loaders import load_model

    src = str(tmp_path / "hf")
    save_tiny_model("qwen3_moe", src)
    c = _hf_config(src)
    kinds = ("gate", "up", "down") if kept == "all" else ("gate", "up")
    qtypes = {f"blk.{i}.ffn_{kind}_exps.weight": QT.Q8_0 for i in range(c["num_hidden_layers"]) for kind in kinds}
    path = write_gguf(tmp_path / "moe.gguf", c, load_file(f"{src}/model.safetensors"), qtypes=qtypes)
    floats = load_model(path)
    with caplog.at_level(logging.INFO, logger="strata"):
        lm = load_model(path, keep_quantized=True)
    moes = [m for m in lm.model.modules() if isinstance(m, MoE)]
    assert len(moes) == 2
    for m in moes:
        if kept == "all":
            assert [s.ggml_type for s in m.quant] == ["Q8_0", "Q8_0"] and m.w13 is None
            assert m.experts[0].gate_proj.weight.is_meta and m.experts[0].down_proj.weight.is_meta
        else:
            assert m.quant is None and m.w13 is not None
    if kept == "all":
        assert "kept 4 MoE expert stacks quantized (Q8_0)" in caplog.text
    for t in (12, 3):
        ids = torch.randint(0, c["vocab_size"], (1, t), generator=torch.Generator().manual_seed(t))
        err = rel_err(_logits(lm, ids), _logits(floats, ids))
        assert err <= 1e-4, (t, err)


# ---------------------------------------------------------------------------------------------- GPU

E30, TOP_K30, H30, I30 = 128, 8, 2048, 768  # Qwen3-30B-A3B


def stack_30b(fmt: str, n: int, k: int, seed: int) -> QExpertStack:
    from strata.kernels.quant import random_blocks

    gen = torch.Generator(device="cuda").manual_seed(seed)
    return QExpertStack.from_raw(fmt, random_blocks(fmt, E30 * n, k, gen, "cuda").view(E30, n, -1))


def routed_rows(tokens: int, k: int, seed: int, dtype=torch.bfloat16):
    """(xs [tokens·top-k, k] sorted rows, offs) of a random top-8 routing over the 128 experts."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(tokens, E30, device="cuda", generator=gen).topk(TOP_K30, dim=-1).indices
    xs = torch.randn(tokens * TOP_K30, k, device="cuda", generator=gen).to(dtype)
    return xs, moe_sort.sort_tokens(ids, E30)[1]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["Q8_0", "IQ3_S", "Q4_K"])
def test_gpu_30b_matches_reference(fmt):
    for proj, (n, k) in {"gate_up": (2 * I30, H30), "down": (H30, I30)}.items():
        stack = stack_30b(fmt, n, k, seed=n + k)
        for tokens in (1, 16, 512, 4096):
            xs, offs = routed_rows(tokens, k, seed=tokens)
            got, ref = grouped_matmul(xs, stack, offs), grouped_matmul_ref(xs, stack, offs)
            err = rel_err(got, ref)
            print(f"{fmt} {proj} tokens {tokens}: rel err {err:.2e}")
            assert err <= TOL[torch.bfloat16], (proj, tokens, err)
            assert torch.equal(grouped_matmul(xs, stack, offs), got), "not deterministic run to run"
        xs, offs = routed_rows(16, k, seed=99, dtype=torch.float32)
        assert rel_err(grouped_matmul(xs, stack, offs), grouped_matmul_ref(xs, stack, offs)) <= TOL[torch.float32]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["Q8_0", "IQ3_S"])
def test_gpu_graph_capture(fmt):
    """Captured once, replayed with new rows and a new routing written into the same buffers; no host
    sync in the launch."""
    stack = stack_30b(fmt, 2 * I30, H30, seed=11)
    xs, offs = routed_rows(16, H30, seed=1)
    out = torch.empty(xs.shape[0], stack.n, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grouped_matmul(xs, stack, offs, out)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_matmul(xs, stack, offs, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_matmul(xs, stack, offs, out)
    for step in range(3):
        new_xs, new_offs = routed_rows(16, H30, seed=100 + step)
        xs.copy_(new_xs)
        offs.copy_(new_offs)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, grouped_matmul(xs, stack, offs))
        assert rel_err(out, grouped_matmul_ref(xs, stack, offs)) <= TOL[torch.bfloat16]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["Q8_0", "IQ3_S"])
def test_gpu_moe_layer_30b(fmt):
    """A 30B-A3B MoE layer packed from kept blocks: the forward reads nothing on the host and matches the
    decode reference (`moe_experts_decode_ref`, the rounding points of `MoE._grouped`) on the
    dequantized weights rounded to bf16, as the grouped kernel rounds them; decode-sized steps take the
    fused kernels (`moe_decode_q`, probed at pack) and match their own definition (Q8_0: activations
    quantized per 32 values, hence the looser bound)."""
    from strata.kernels.quant import moe_decode_q
    from strata.bench.random_model import shape_config
    from strata.kernels.moe_decode import moe_experts_decode_ref
    from strata.kernels.quant import random_blocks

    cfg = shape_config("qwen3-30b-a3b")
    with torch.device("meta"):
        moe = MoE(cfg)
    gen = torch.Generator(device="cuda").manual_seed(5)
    moe.gate.weight = nn.Parameter((torch.randn(E30, H30, device="cuda", generator=gen) * 0.02).to(torch.bfloat16),
                                   requires_grad=False)
    for m in moe.experts:
        for lin in (m.gate_proj, m.up_proj, m.down_proj):
            lin.quant_raw = (fmt, random_blocks(fmt, lin.out_features, lin.in_features, gen, "cuda"))
    assert moe.pack_experts() == "grouped" and moe.quant[0].ggml_type == fmt and moe.qdecode is not None
    w13, w2 = (s.dequantize().to(torch.bfloat16) for s in moe.quant)
    for tokens in (1, 16, 300):
        x = torch.randn(tokens, H30, device="cuda", generator=gen).to(torch.bfloat16)
        w, ids, _ = moe.gate(x)
        with torch.no_grad():
            moe(x)  # compiles outside the sync check
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.no_grad():
                got = moe(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        fused = moe_decode_q.serves(x, ids.shape[1], *moe.qdecode)
        ref = moe_decode_q.reference(x, ids, w, *moe.quant) if fused else moe_experts_decode_ref(x, ids, w, w13, w2)
        err = rel_err(got, ref)
        print(f"{fmt} MoE layer, {tokens} tokens ({'fused' if fused else 'grouped'}): rel err vs reference {err:.2e}")
        assert fused == (tokens <= 16), tokens
        assert err <= TOL[torch.bfloat16], (tokens, err)
