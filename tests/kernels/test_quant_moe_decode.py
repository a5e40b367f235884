"""The quantized MoE decode kernels (strata.kernels.quant.moe_decode_q) against their reference, a token's
result alone and in a batch, and the MoE layer serving decode steps through them.

CPU: the kernels in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at E = 6, H and I of
256 (96 for a Q8_0 and an FP8 case whose rows do not fill the tiles), T = 1-3, top-2/3, bf16 (two cases in fp16), with the
default configuration's K steps and one forced to loop (several K steps in both kernels), in 64-row blocks
(the shipped row blocks in one case). GPU (`pytest -m gpu`):
Qwen3-30B-A3B sizes (E = 128, top-8, H = 2048, I = 768) in every format and FP8 and graph capture
(timings: benchmarks/kernels/quant_moe.py --decode).

Inputs are fresh per case (their own seeds); outputs start as NaN and are compared whole. Tolerances
(against `moe_decode_q_ref`, the exact dequantized weights and the rounding points of `MoE._grouped`):
the largest error over the largest |reference| ≤ 2e-2 in bf16 and 3e-3 in fp16, as the bf16 decode
kernels' tests (the fp32 summation order can flip one rounding of h13 or y by an ulp, which the later
steps carry), and the relative Frobenius error ≤ 5e-3 in bf16.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from strata.kernels import choices
from strata.kernels.quant import format_module, fp8
from strata.kernels.quant import moe_decode_q as mdq
from strata.kernels.quant.moe_q import QExpertStack
from test_quant_moe import interpreter_tiles, quantized_moe  # noqa: F401 (a fixture)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
MAX_TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
FRO_TOL = 5e-3
# Q8_0's dp4a tiles against their definition: a one-ulp flip of a rounded h13 value can move its group's
# amax, and so the int8 codes of all 32 activations of the down projection's input (~2⁻⁸ each).
DP4A_FRO_TOL = 1e-2


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def max_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def fro_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def stacks(fmt: str, e: int, h: int, inter: int, seed: int):
    if fmt == "FP8":  # `--quantize fp8`'s experts: e4m3 with a scale per row
        gen = torch.Generator().manual_seed(seed)
        return tuple(mdq.Fp8Experts(*fp8.quantize_experts(torch.randn(e, n, k, generator=gen) * 0.02))
                     for n, k in ((2 * inter, h), (h, inter)))
    mod = format_module(fmt)
    raw13 = torch.from_numpy(mod.random_raw(e * 2 * inter, h, seed)).view(e, 2 * inter, -1)
    raw2 = torch.from_numpy(mod.random_raw(e * h, inter, seed + 1)).view(e, h, -1)
    return QExpertStack.from_raw(fmt, raw13), QExpertStack.from_raw(fmt, raw2)


def routing(seed: int, t: int, k: int, e: int, h: int, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen) + 0.1
    return x, ids, (w / w.sum(-1, keepdim=True)).float()


def looping(fmt: str) -> mdq.QMoeDecodeConfig:
    """The format's least K step in both kernels (several steps at K = 256), 64-row blocks."""
    least = mdq.MIN_BLOCK_K[fmt]
    return mdq.QMoeDecodeConfig(gate_up_block_i=64, gate_up_block_k=least, gate_up_warps=2, gate_up_stages=2,
                                down_block_h=64, down_block_k=least, down_warps=2, down_stages=2)


def wide(cfg: mdq.QMoeDecodeConfig) -> mdq.QMoeDecodeConfig:
    """A configuration's K steps and tiles with 64-row blocks: the interpreter's cost is per program, 3-4x
    less this way; the shipped row blocks run in one CPU case and in every GPU case."""
    return dataclasses.replace(cfg, gate_up_block_i=64, down_block_h=64)


@pytest.fixture
def wide_decode_rows(monkeypatch):
    """`decode_config` with `wide` row blocks, for the tests that take the kernels' default configuration."""
    shipped = mdq.decode_config
    monkeypatch.setattr(mdq, "decode_config", lambda *a: wide(shipped(*a)))


CASES = [  # (format, T, k, H, I, config): None the shipped one, "wide" its K steps with 64-row blocks
    ("Q8_0", 1, 2, 256, 256, None), ("Q8_0", 3, 3, 256, 96, "loop"), ("Q4_K", 2, 2, 256, 256, "wide"),
    ("Q4_K", 1, 3, 256, 256, "loop"), ("IQ3_S", 2, 3, 256, 256, "wide"), ("IQ3_S", 1, 2, 256, 256, "loop"),
    ("Q6_K", 2, 2, 256, 256, "wide"), ("Q6_K", 1, 2, 256, 256, "loop"), ("FP8", 2, 3, 256, 96, "wide"),
    ("FP8", 1, 2, 128, 64, "loop"),
]


# Every case in bf16, two in fp16 (the interpreter's cost is per program and step).
DTYPED = [(c, torch.bfloat16) for c in CASES] + [(CASES[0], torch.float16), (CASES[2], torch.float16)]


@pytest.mark.parametrize("case,dtype", DTYPED,
                         ids=[f"{c[0]}-t{c[1]}k{c[2]}-i{c[4]}-{c[5] or 'default'}-{str(d)[6:]}" for c, d in DTYPED])
def test_matches_reference(case, dtype):
    fmt, t, k, h, inter, cfg = case
    if cfg == "loop":
        cfg = looping(fmt)
    elif inter % 64:  # rows of I = 96 fill the default 16-row blocks: take 64-row blocks, left part empty
        cfg = mdq.QMoeDecodeConfig(64, 32, 4, 2, 64, 32, 4, 2)
    elif cfg == "wide":
        cfg = wide(mdq.decode_config(fmt, h, inter))
    w13, w2 = stacks(fmt, 6, h, inter, seed_of("stacks", case) % 10_000)
    x, ids, w = routing(seed_of("route", case, dtype), t, k, 6, h, dtype)
    out = torch.full((t, h), float("nan"), dtype=dtype)
    got = mdq.moe_decode_q_triton(x, ids, w, w13, w2, out, config=cfg)
    assert got is out and torch.isfinite(out).all()
    dp4a = (cfg or mdq.decode_config(fmt, h, inter)).dp4a
    ref = mdq.reference(x, ids, w, w13, w2, cfg)
    assert max_err(got, ref) <= MAX_TOL[dtype], max_err(got, ref)
    if dtype == torch.bfloat16:
        assert fro_err(got, ref) <= (DP4A_FRO_TOL if dp4a else FRO_TOL)


@pytest.mark.parametrize("fmt,t,cfg", [("Q8_0", 1, None), ("Q8_0", 3, "loop"), ("IQ3_S", 2, None), ("IQ3_S", 1, "loop")],
                         ids=["Q8_0-t1", "Q8_0-t3-loop", "IQ3_S-t2", "IQ3_S-t1-loop"])
def test_dp4a_tiles(fmt, t, cfg):
    """Q8_0 and IQ3_S with `dp4a`: x quantized per 32 values, against the definition with that
    quantization (and within 2e-2 of the exact-weight reference), bit for bit a token alone and in a batch."""
    cfg = dataclasses.replace(looping(fmt) if cfg else wide(mdq.decode_config(fmt, 256, 256)), dp4a=True)
    if cfg.gate_up_block_k < 64:
        cfg = dataclasses.replace(cfg, gate_up_block_k=64, down_block_k=64)
    w13, w2 = stacks(fmt, 6, 256, 256, seed=11)
    x, ids, w = routing(seed_of("dp4a", fmt, t), t, 2, 6, 256, torch.bfloat16)
    got = mdq.moe_decode_q_triton(x, ids, w, w13, w2, config=cfg)
    ref = mdq.moe_decode_dp4a_ref(x, ids, w, w13, w2)
    assert max_err(got, ref) <= MAX_TOL[torch.bfloat16] and fro_err(got, ref) <= DP4A_FRO_TOL
    assert fro_err(got, mdq.moe_decode_q_ref(x, ids, w, w13, w2)) <= 2e-2
    assert torch.equal(mdq.moe_decode_q_triton(x[-1:].clone(), ids[-1:].clone(), w[-1:].clone(), w13, w2, config=cfg),
                       got[-1:])
    with pytest.raises(ValueError):
        mdq.moe_decode_q_triton(x, ids, w, *stacks("Q4_K", 6, 256, 256, seed=1), config=cfg)


def test_pcie_tiles_read_two_super_blocks_a_step_and_match_the_reference():
    """`pcie_configs`: the default configuration, then IQ3_S's K steps of two super-blocks (where the
    shapes take them; none for formats without such tiles), whose sums match the reference as the
    default's do, and whose tokens match the default's within the summation order's rounding."""
    base, longer = mdq.pcie_configs("IQ3_S", 2048, 512)
    assert base == mdq.decode_config("IQ3_S", 2048, 512) and (longer.gate_up_block_k, longer.down_block_k) == (512, 512)
    assert mdq.pcie_configs("IQ3_S", 256, 256) == [mdq.decode_config("IQ3_S", 256, 256)]  # one super-block a row
    assert mdq.pcie_configs("Q8_0", 2048, 512) == [mdq.decode_config("Q8_0", 2048, 512)]
    w13, w2 = stacks("IQ3_S", 6, 512, 512, seed=21)
    x, ids, w = routing(seed_of("pcie", "IQ3_S"), 2, 3, 6, 512, torch.bfloat16)
    base, longer = (wide(c) for c in mdq.pcie_configs("IQ3_S", 512, 512))
    assert longer.gate_up_block_k == 512
    got = mdq.moe_decode_q_triton(x, ids, w, w13, w2, config=longer)
    ref = mdq.reference(x, ids, w, w13, w2, longer)
    assert max_err(got, ref) <= MAX_TOL[torch.bfloat16] and fro_err(got, ref) <= FRO_TOL
    assert fro_err(got, mdq.moe_decode_q_triton(x, ids, w, w13, w2, config=base)) <= FRO_TOL


@pytest.mark.parametrize("fmt", ["Q8_0", "FP8"])
def test_a_token_alone_equals_it_in_a_batch(fmt, wide_decode_rows):
    """Each program serves one pair or one token: token 1's row, bit for bit, alone and beside others."""
    w13, w2 = stacks(fmt, 6, 256, 256, seed=7)
    x, ids, w = routing(seed_of("batch", fmt), 3, 2, 6, 256, torch.bfloat16)
    both = mdq.moe_decode_q_triton(x, ids, w, w13, w2)
    alone = mdq.moe_decode_q_triton(x[1:2].clone(), ids[1:2].clone(), w[1:2].clone(), w13, w2)
    assert torch.equal(both[1:2], alone)


def test_moe_decode_choice():
    assert mdq.fused_chosen()
    with choices.using(moe_decode="grouped"):
        assert not mdq.fused_chosen()
    assert mdq.fused_chosen()
    with pytest.raises(ValueError, match="moe_decode"), choices.using(moe_decode="fast"):
        pass


def test_checks_and_support():
    w13, w2 = stacks("Q8_0", 4, 64, 32, seed=3)
    x, ids, w = routing(1, 2, 2, 4, 64, torch.bfloat16)
    assert mdq.supported(2, 2, "Q8_0", 64, 32, torch.bfloat16)
    assert not mdq.supported(17, 2, "Q8_0", 64, 32, torch.bfloat16)  # more tokens than a decode step
    assert not mdq.supported(2, 2, "Q8_0", 64, 32, torch.float32)  # fp32 runs the grouped path
    assert not mdq.supported(2, 2, "Q4_K", 64, 32, torch.bfloat16)  # K not a multiple of Q4_K's step
    assert not mdq.supported(2, 2, "Q2_K", 64, 32, torch.bfloat16)
    assert mdq.supported(8, 2, "Q4_K", 256, 256, torch.bfloat16) and not mdq.supported(9, 2, "Q4_K", 256, 256,
                                                                                       torch.bfloat16)
    for fmt, cfg in (("Q8_0", mdq.QMoeDecodeConfig(16, 256, 4, 2, 8, 256, 4, 2)),  # measured wrong on the H200
                     ("Q4_K", mdq.QMoeDecodeConfig(8, 256, 4, 2, 4, 256, 2, 2))):
        with pytest.raises(ValueError):
            mdq.moe_decode_q_triton(torch.randn(1, 256).to(torch.bfloat16), ids[:1], w[:1],
                                    *stacks(fmt, 4, 256, 256, seed=2), config=cfg)
    with pytest.raises(ValueError):
        mdq.moe_decode_q_triton(x[:, :32], ids, w, w13, w2)  # H does not fit the stacks
    with pytest.raises(ValueError):
        mdq.moe_decode_q_triton(x, ids, w, w13, w2, config=mdq.QMoeDecodeConfig(16, 48, 4, 2, 8, 32, 4, 2))
    with pytest.raises(ValueError):
        mdq.moe_decode_q_triton(x, ids, w, w2, w2)  # not a gate|up stack of this down stack


def test_moe_layer_decodes_through_the_kernels(monkeypatch, interpreter_tiles, wide_decode_rows):
    """A packed MoE with kept Q8_0 experts: with the probe's flag set, a decode-sized step runs the fused
    kernels (counted) and agrees with the layer's grouped path on the same stacks; a step of more
    tokens than a decode step takes the grouped path."""
    moe, _ = quantized_moe("Q8_0", seed=5, down_fmt="same")
    moe = moe.to(torch.bfloat16)
    assert moe.pack_experts() == "grouped" and moe.qdecode is None  # the probe runs on CUDA only
    calls = []
    real = mdq.moe_decode_q_triton
    monkeypatch.setattr(mdq, "moe_decode_q_triton", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    x = torch.randn(2, 256).to(torch.bfloat16)
    with torch.no_grad():
        grouped = moe(x)
        moe.qdecode = moe.quant
        fused = moe(x)
        moe(torch.randn(mdq.MAX_TOKENS + 1, 256).to(torch.bfloat16))
    assert calls == [2]
    w, ids, _ = moe.gate(x)
    assert fro_err(fused, mdq.reference(x, ids, w, *moe.quant)) <= DP4A_FRO_TOL  # Q8_0: dp4a tiles
    assert fro_err(fused, grouped) <= 2e-2  # and the grouped kernels round each weight to bf16 instead


# ---------------------------------------------------------------------------------------------- GPU

E30, K30, H30, I30 = 128, 8, 2048, 768  # Qwen3-30B-A3B


def stacks_30b(fmt: str, seed: int):
    from strata.kernels.quant import random_blocks

    gen = torch.Generator(device="cuda").manual_seed(seed)
    if fmt == "FP8":
        return tuple(mdq.Fp8Experts(*fp8.quantize_experts(torch.randn(E30, n, k, device="cuda", generator=gen) * 0.02))
                     for n, k in ((2 * I30, H30), (H30, I30)))
    return (QExpertStack.from_raw(fmt, random_blocks(fmt, E30 * 2 * I30, H30, gen, "cuda").view(E30, 2 * I30, -1)),
            QExpertStack.from_raw(fmt, random_blocks(fmt, E30 * H30, I30, gen, "cuda").view(E30, H30, -1)))


def routing_30b(seed: int, t: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, H30, device="cuda", generator=gen).to(torch.bfloat16)
    w, ids = torch.rand(t, E30, device="cuda", generator=gen).softmax(-1).topk(K30, dim=-1)
    return x, ids, (w / w.sum(-1, keepdim=True)).float()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "IQ3_S", "Q6_K", "FP8"])
def test_gpu_30b_matches_reference_and_replays(fmt):
    w13, w2 = stacks_30b(fmt, seed=len(fmt))
    for t in (1, 4, 8):
        x, ids, w = routing_30b(t, t)
        got = mdq.moe_decode_q_triton(x, ids, w, w13, w2)
        ref = mdq.reference(x, ids, w, w13, w2)
        print(f"{fmt} T={t}: max err {max_err(got, ref):.2e}, rel err {fro_err(got, ref):.2e}")
        tol = DP4A_FRO_TOL if mdq.decode_config(fmt, H30, I30).dp4a else FRO_TOL
        assert max_err(got, ref) <= MAX_TOL[torch.bfloat16] and fro_err(got, ref) <= tol
        assert torch.equal(mdq.moe_decode_q_triton(x, ids, w, w13, w2), got), "not deterministic run to run"
        assert torch.equal(mdq.moe_decode_q_triton(x[:1].clone(), ids[:1].clone(), w[:1].clone(), w13, w2), got[:1])
    x, ids, w = routing_30b(0, 4)
    out = torch.empty_like(x)
    mdq.moe_decode_q_triton(x, ids, w, w13, w2, out)
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            mdq.moe_decode_q_triton(x, ids, w, w13, w2, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    new_x, new_ids, new_w = routing_30b(1, 4)
    x.copy_(new_x)
    ids.copy_(new_ids)
    w.copy_(new_w)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, mdq.moe_decode_q_triton(x, ids, w, w13, w2))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["Q8_0", "IQ3_S"])
def test_gpu_30b_dp4a_tiles(fmt):
    w13, w2 = stacks_30b(fmt, seed=3)
    cfg = dataclasses.replace(mdq.decode_config(fmt, H30, I30), dp4a=True)
    for t in (1, 8):
        x, ids, w = routing_30b(10 + t, t)
        got = mdq.moe_decode_q_triton(x, ids, w, w13, w2, config=cfg)
        ref = mdq.moe_decode_dp4a_ref(x, ids, w, w13, w2)
        print(f"{fmt} dp4a T={t}: max err {max_err(got, ref):.2e}, rel err {fro_err(got, ref):.2e}")
        assert max_err(got, ref) <= MAX_TOL[torch.bfloat16] and fro_err(got, ref) <= DP4A_FRO_TOL
