"""Q6_K (strata/kernels/quant/q6_k.py) beyond the checks every format passes
(tests/kernels/test_quant_formats.py): the GGUF loader keeping a Q6_K projection quantized, and the
Q6_K writer (`writers.quantize`), whose blocks gguf reads back within 6-bit precision.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_quant_formats import Q6K, dequantizing_decode  # noqa: F401  (an autouse fixture)

from strata.kernels.quant.q6_k import random_raw

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


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
    _write_with_raw(path, c, tensors, {"blk.0.ffn_down.weight": (blob, Q6K.qtype)}, intermediate=256)
    floats = load_model(path)
    kept = load_model(path, keep_quantized=True)
    mlp = kept.model.model.layers[0].mlp
    assert isinstance(mlp.down_q, QWeight) and mlp.down_q.ggml_type == "Q6_K" and mlp.down_proj.weight.is_meta
    assert torch.equal(mlp.down_q.dequantize().view(torch.int32), Q6K.gguf_bits(blob))
    for t in (20, 3):  # a prompt-sized GEMM and decode-sized GEMVs
        ids = torch.randint(0, c["vocab_size"], (1, t), generator=torch.Generator().manual_seed(t))
        got, want = _logits(kept, ids), _logits(floats, ids)
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4, t


def test_the_writer_makes_blocks_gguf_reads_back():
    """writers.quantize_q6_k: gguf's own dequantization of the written blocks is within 6-bit precision
    of the input (RMS error < 3%, every value within half a step of its sub-block's scale), and each
    sub-block's largest value comes back to within its scale's rounding."""
    from gguf.quants import dequantize as gguf_dequantize

    from strata.kernels.quant.writers import quantize

    rng = np.random.default_rng(6)
    w = (rng.standard_normal((6, 512)) * 0.02).astype(np.float32)
    w[0, :16] = 0.0  # an all-zero sub-block
    raw = quantize("Q6_K", w)
    assert raw.shape == (6, 2 * 210) and raw.dtype == np.uint8
    back = gguf_dequantize(raw, Q6K.qtype).reshape(w.shape)
    assert np.linalg.norm(back - w) / np.linalg.norm(w) < 0.03
    assert not back[0, :16].any()
    sub = np.abs(w).reshape(-1, 16).max(-1)
    worst = (np.abs(back - w).reshape(-1, 16).max(-1) / np.where(sub > 0, sub, 1)).max()
    assert worst < 0.05  # half a step (1/64 of the peak) plus the int8 scale's and fp16 d's rounding
