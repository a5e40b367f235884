"""`QWeight`, the stacking of weights the loader kept quantized and the embedding table kept quantized
(the per-format kernels have their own tests in tests/kernels/test_quant_*.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from strata.kernels import choices
from strata.kernels.quant import FORMATS, QWeight, QWeightStack, format_module, random_blocks
from strata.models.quantize import qweights_of
from strata.models.layers import take_quantized

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def _raw(fmt: str, n: int, k: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(format_module(fmt).random_raw(n, k, seed))


@pytest.mark.parametrize("fmt", FORMATS)
def test_qweight_dequantizes_like_gguf_and_multiplies(fmt):
    n, k = 48, 512
    raw = _raw(fmt, n, k, 1)
    w = QWeight.from_raw(fmt, raw, n, k)
    want = gguf_dequantize(raw.numpy(), QT[fmt])
    assert np.array_equal(w.dequantize().numpy(), want)
    raw_bytes = raw.numel()
    assert raw_bytes * 0.9 <= sum(t.numel() * t.element_size() for t in w.planes.values()) <= raw_bytes * 1.1
    x = torch.randn(3, k)
    ref = x @ torch.from_numpy(want).T
    got = w.matmul(x)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    with pytest.raises(ValueError, match="expected raw blocks"):
        QWeight.from_raw(fmt, raw[:, :-1], n, k)


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_blocks_are_valid(fmt):
    gen = torch.Generator().manual_seed(0)
    raw = random_blocks(fmt, 32, 256, gen, "cpu")
    w = gguf_dequantize(raw.numpy(), QT[fmt])
    assert np.isfinite(w).all() and 0.001 < w.std() < 0.2


def _linear(fmt: str | None, n: int, k: int, seed: int) -> nn.Linear:
    with torch.device("meta"):
        m = nn.Linear(k, n, bias=False)
    if fmt:
        m.quant_raw = (fmt, _raw(fmt, n, k, seed))
    return m


def test_take_quantized_stacks_rows_of_blocks():
    mods = [_linear("Q8_0", n, 256, i) for i, n in enumerate((64, 32, 32))]
    raws = [m.quant_raw[1] for m in mods]
    w = take_quantized(mods, torch.float32)
    assert w is not None and (w.n, w.k, w.ggml_type) == (128, 256, "Q8_0")
    parts = [gguf_dequantize(r.numpy(), QT.Q8_0) for r in raws]
    assert np.array_equal(w.dequantize().numpy(), np.concatenate(parts))
    assert not any(hasattr(m, "quant_raw") for m in mods)  # consumed
    assert take_quantized([_linear(None, 8, 256, 0)], torch.float32) is None


def test_take_quantized_mixed_formats_stack_and_a_float_member_falls_back():
    """Members kept in different formats (a Q4_K_M file's Q6_K attn_v beside Q4_K q and k) stay
    quantized as a `QWeightStack`: each part's columns side by side. A stack with a float member packs
    as floats: the quantized members are expanded to the model dtype, exactly."""
    q, k, v = _linear("Q4_K", 32, 256, 1), _linear("Q4_K", 16, 256, 2), _linear("Q6_K", 16, 256, 3)
    raws = [m.quant_raw for m in (q, k, v)]
    w = take_quantized([q, k, v], torch.float32)
    assert isinstance(w, QWeightStack) and (w.n, w.k, w.ggml_type) == (64, 256, "Q4_K+Q4_K+Q6_K")
    want_w = np.concatenate([gguf_dequantize(r.numpy(), QT[fmt]) for fmt, r in raws])
    assert np.array_equal(w.dequantize().numpy(), want_w)
    x = torch.randn(5, 256)
    torch.testing.assert_close(w.matmul(x), x @ torch.from_numpy(want_w).t(), rtol=1e-4, atol=1e-4)
    out = torch.full((5, 64), 7.0)
    assert w.matmul(x, out) is out and torch.equal(out, w.matmul(x))
    assert {id(p) for p in qweights_of(_holding(w))} == {id(p) for p in w.parts}

    a, b = _linear("Q8_0", 16, 256, 4), _linear(None, 16, 256, 5)
    fmt, raw = a.quant_raw
    assert take_quantized([a, b], torch.float32) is None
    assert not a.weight.is_meta and a.weight.dtype == torch.float32
    assert np.array_equal(a.weight.detach().numpy(), gguf_dequantize(raw.numpy(), QT[fmt]))


def _holding(value) -> nn.Module:
    """A module holding `value` as an attribute, as Attention holds `qkv_q`."""
    m = nn.Module()
    m.qkv_q = value
    return m


def test_q8_0_reads_in_the_stream_k_range_use_the_context(monkeypatch):
    """With a context, a Q8_0 read of STREAMK_ROWS rows runs the stream-K GEMM through it (fix-ups in
    its pool); shorter and longer reads, fp32 x and the other formats keep their kernels."""
    from strata.kernels.quant import STREAMK_ROWS, q8_0, streamk

    n, k = 40, 256
    w = QWeight.from_raw("Q8_0", _raw("Q8_0", n, k, 3), n, k)
    ctx = streamk.QMatmulContext("cpu")
    w.context = ctx
    calls = []
    real = streamk.q8_0_matmul_streamk
    monkeypatch.setattr(streamk, "q8_0_matmul_streamk", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    lo, hi = STREAMK_ROWS
    for m, dtype, expect in [(lo, torch.bfloat16, True), (lo - 1, torch.bfloat16, False), (hi + 1, torch.bfloat16, False),
                             (lo, torch.float32, False)]:
        x = torch.randn(m, k).to(dtype)
        got = w.matmul(x)
        assert (calls[-1:] == [m]) == expect, (m, dtype)
        calls.clear()
        if expect:  # the same product as the tiled GEMM up to the fp32 summation order
            tiled = q8_0.matmul(x, w.planes, n, k)
            assert ((got.float() - tiled.float()).norm() / tiled.float().norm()).item() < 1e-2
    assert ctx.grows <= 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_long_reads_dequantize_into_the_shared_buffer(monkeypatch, fmt):
    """With a buffer, a read of `dequant_read_rows` rows or more (a kernel choice) dequantizes the weight
    into it and multiplies once; fewer rows, a mismatched dtype or the choice at 0 keep the format's kernels."""
    from strata.kernels.quant import dequant

    n, k = 24, 256
    w = QWeight.from_raw(fmt, _raw(fmt, n, k, 5), n, k)
    w.dequant_buf = torch.full((n * k + 7,), 7.0, dtype=torch.bfloat16)
    calls = []
    real = dequant.dequantize_into
    monkeypatch.setattr(dequant, "dequantize_into", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    want_w = w.dequantize().to(torch.bfloat16)
    for m, dtype, rows, expect in [(8, torch.bfloat16, 8, True), (7, torch.bfloat16, 8, False),
                                   (8, torch.float32, 8, False), (8, torch.bfloat16, 0, False)]:
        x = torch.randn(m, k).to(dtype)
        with choices.using(dequant_read_rows=rows):
            got = w.matmul(x)
        assert bool(calls) == expect, (m, dtype, rows)
        calls.clear()
        if expect:
            assert torch.equal(got, x @ want_w.t())  # the dequantized weight, then one product
            assert torch.equal(w.dequant_buf[n * k :], torch.full((7,), 7.0, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantized_embedding_rows_of_every_format(dtype):
    """`QuantizedEmbedding`: a batch of ids (repeats included) gives the rows of the table dequantized
    whole, in the model's dtype, for every format a table can be kept in."""
    from strata.models.layers import QuantizedEmbedding

    gen = torch.Generator().manual_seed(0)
    for fmt in FORMATS:
        n, k = 100, 512
        emb = QuantizedEmbedding(QWeight.from_raw(fmt, random_blocks(fmt, n, k, gen, "cpu"), n, k), dtype)
        ids = torch.randint(0, n, (2, 12), generator=gen)
        ids[1, 3] = ids[0, 0]
        got = emb(ids)
        assert got.dtype == dtype and got.shape == (2, 12, k)
        assert torch.equal(got, emb.q.dequantize().to(dtype)[ids]), fmt
