"""GGUF weights kept quantized (`keep_quantized`, the default on CUDA): each format's projections,
stacks of mixed formats, the embedding table, a type without kernels named with its cost, and a file
served kept quantized, each against the same file expanded to floats. The GGUF writer and helpers are
tests/loaders/test_gguf.py's."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from strata.loaders import load_model
from test_gguf import _hf_config, _logits, _write_with_raw, rel_err, write_gguf, write_q8_0_q4_k_gguf
from tiny_models import save_tiny_model


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # Triton's interpreter
def test_quantized_weights_kept_quantized(tmp_path):
    """`keep_quantized`: the Q8_0 / Q4_K projections become QWeights from the file's own blocks (q|k|v
    and gate|up stacked by rows), their float parameters are never made, and the logits match the
    dequantized model's (fp32 activations: the kernels against dequantize-then-matmul)."""
    from strata.kernels.quant import QWeight

    path, _, c, _, _ = write_q8_0_q4_k_gguf(tmp_path, QT.Q8_0)

    floats = load_model(path)
    kept = load_model(path, keep_quantized=True)
    attn, mlp = kept.model.model.layers[0].self_attn, kept.model.model.layers[0].mlp
    assert isinstance(attn.qkv_q, QWeight) and attn.qkv_q.ggml_type == "Q8_0" and attn.qkv_weight is None
    assert attn.qkv_q.n == attn.q_proj.out_features + 2 * attn.k_proj.out_features
    assert isinstance(mlp.down_q, QWeight) and mlp.down_q.ggml_type == "Q4_K"
    assert isinstance(mlp.gate_up_q, QWeight) and isinstance(kept.model.lm_head_q, QWeight)
    assert attn.q_proj.weight.is_meta and mlp.down_proj.weight.is_meta  # never materialised
    ref_qkv = floats.model.model.layers[0].self_attn.qkv_weight
    assert torch.equal(attn.qkv_q.dequantize(), ref_qkv.float())
    for t in (24, 5):  # a prompt-sized GEMM and decode-sized GEMVs
        ids = torch.randint(0, c["vocab_size"], (1, t))
        err = rel_err(_logits(kept, ids), _logits(floats, ids))
        assert err < 1e-4, (t, err)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_embedding_table_kept_quantized(tied, tmp_path):
    """A Q8_0 token_embd stays in its blocks (`QuantizedEmbedding`): a step's rows are dequantized from
    them, a tied LM head reads the same blocks, and the logits are the file's expanded to floats."""
    from strata.models.layers import QuantizedEmbedding
    from strata.models.quantize import matmul_qweights_of

    src = str(tmp_path / "hf")
    save_tiny_model("qwen3", src, tie_word_embeddings=tied)
    c = _hf_config(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    if tied:
        tensors.pop("lm_head.weight", None)
    qtypes = {"token_embd.weight": QT.Q8_0} if tied else {"token_embd.weight": QT.Q8_0, "output.weight": QT.Q8_0}
    path = write_gguf(tmp_path / "e.gguf", c, tensors, qtypes=qtypes)

    floats, kept = load_model(path), load_model(path, keep_quantized=True)
    emb = kept.model.model.embed_tokens
    assert isinstance(emb, QuantizedEmbedding) and emb.q.ggml_type == "Q8_0" and emb.weight.numel() == 0
    assert kept.model.lm_head_q is not None and (kept.model.lm_head_q is emb.q) == tied
    # Looked up, never multiplied by unless it is the head too: no kernel scratch, no --batch-invariant check.
    assert any(q is emb.q for q in matmul_qweights_of(kept.model)) == tied
    ids = torch.randint(0, c["vocab_size"], (2, 7))
    assert torch.equal(emb(ids), floats.model.model.embed_tokens(ids))
    for t in (24, 5):  # a prompt-sized step and a decode-sized one
        ids = torch.randint(0, c["vocab_size"], (1, t))
        err = rel_err(_logits(kept, ids), _logits(floats, ids))
        assert err < 1e-4, (t, err)


def test_iq4_xs_and_q3_k_weights_kept_quantized(tmp_path):
    """`keep_quantized` on a file with IQ4_XS q, k and v projections and a Q3_K ffn_down and output head
    (random valid blocks: gguf writes neither type): QWeights of the file's own blocks, their float
    parameters never made, and the logits of the file expanded to floats (fp32 activations: the kernels
    against dequantize-then-matmul)."""
    from strata.kernels.quant import QWeight
    from strata.kernels.quant.iq4_xs import random_raw as iq4_xs_blocks
    from strata.kernels.quant.q3_k import random_raw as q3_k_blocks

    src = str(tmp_path / "hf")
    save_tiny_model("qwen3", src, hidden_size=256, intermediate_size=256)
    c = _hf_config(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"):
        tensors.pop(f"model.layers.0.{name}.weight")
    tensors.pop("lm_head.weight")
    q_rows, kv_rows = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    raw = {"blk.0.attn_q.weight": (iq4_xs_blocks(q_rows, 256, 1), QT.IQ4_XS),
           "blk.0.attn_k.weight": (iq4_xs_blocks(kv_rows, 256, 2), QT.IQ4_XS),
           "blk.0.attn_v.weight": (iq4_xs_blocks(kv_rows, 256, 3), QT.IQ4_XS),
           "blk.0.ffn_down.weight": (q3_k_blocks(c["hidden_size"], 256, 4), QT.Q3_K),
           "output.weight": (q3_k_blocks(c["vocab_size"], 256, 5), QT.Q3_K)}
    path = str(tmp_path / "iq4_xs_q3_k.gguf")
    _write_with_raw(path, c, tensors, raw, intermediate=256)

    floats = load_model(path)
    kept = load_model(path, keep_quantized=True)
    attn, mlp = kept.model.model.layers[0].self_attn, kept.model.model.layers[0].mlp
    assert isinstance(attn.qkv_q, QWeight) and attn.qkv_q.ggml_type == "IQ4_XS" and attn.qkv_weight is None
    assert isinstance(mlp.down_q, QWeight) and mlp.down_q.ggml_type == "Q3_K"
    assert isinstance(kept.model.lm_head_q, QWeight) and kept.model.lm_head_q.ggml_type == "Q3_K"
    assert attn.q_proj.weight.is_meta and mlp.down_proj.weight.is_meta  # never materialised
    want_qkv = np.concatenate([dequantize(raw[f"blk.0.attn_{p}.weight"][0], QT.IQ4_XS) for p in "qkv"])
    assert np.array_equal(attn.qkv_q.dequantize().numpy().view(np.uint32), want_qkv.view(np.uint32))
    want_down = dequantize(raw["blk.0.ffn_down.weight"][0], QT.Q3_K)
    assert np.array_equal(mlp.down_q.dequantize().numpy().view(np.uint32), want_down.view(np.uint32))
    for t in (24, 5):  # a prompt-sized GEMM and decode-sized GEMVs
        ids = torch.randint(0, c["vocab_size"], (1, t), generator=torch.Generator().manual_seed(t))
        err = rel_err(_logits(kept, ids), _logits(floats, ids))
        assert err < 1e-4, (t, err)


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # Triton's interpreter
def test_q5_k_and_q4_0_weights_kept_quantized(tmp_path):
    """`keep_quantized` on a file with Q4_0 attention projections and output head (gguf's own Q4_0
    quantization of the model's weights; K = 96 and 64: rows that 256 does not divide) and a Q5_K
    ffn_down (random valid blocks: gguf does not write Q5_K): QWeights of the file's own blocks, their
    float parameters never made, and the logits of the file expanded to floats (fp32 activations: the
    kernels against dequantize-then-matmul)."""
    from strata.kernels.quant import QWeight
    from strata.kernels.quant.q5_k import random_raw as q5_k_blocks

    src = str(tmp_path / "hf")
    save_tiny_model("qwen3", src, hidden_size=96, intermediate_size=256)
    c = _hf_config(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    raw = {}
    for hf_name, g in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                       ("self_attn.o_proj", "attn_output")):
        w = tensors.pop(f"model.layers.0.{hf_name}.weight").numpy()
        raw[f"blk.0.{g}.weight"] = (quantize(w, QT.Q4_0), QT.Q4_0)
    raw["output.weight"] = (quantize(tensors.pop("lm_head.weight").numpy(), QT.Q4_0), QT.Q4_0)
    tensors.pop("model.layers.0.mlp.down_proj.weight")
    raw["blk.0.ffn_down.weight"] = (q5_k_blocks(c["hidden_size"], 256, 4), QT.Q5_K)
    path = str(tmp_path / "q5_k_q4_0.gguf")
    _write_with_raw(path, c, tensors, raw, intermediate=256)

    floats = load_model(path)
    kept = load_model(path, keep_quantized=True)
    attn, mlp = kept.model.model.layers[0].self_attn, kept.model.model.layers[0].mlp
    assert isinstance(attn.qkv_q, QWeight) and attn.qkv_q.ggml_type == "Q4_0" and attn.qkv_weight is None
    assert isinstance(attn.o_q, QWeight) and attn.o_q.ggml_type == "Q4_0"
    assert isinstance(mlp.down_q, QWeight) and mlp.down_q.ggml_type == "Q5_K"
    assert isinstance(kept.model.lm_head_q, QWeight) and kept.model.lm_head_q.ggml_type == "Q4_0"
    assert attn.q_proj.weight.is_meta and attn.o_proj.weight.is_meta and mlp.down_proj.weight.is_meta
    want_qkv = np.concatenate([dequantize(raw[f"blk.0.attn_{p}.weight"][0], QT.Q4_0) for p in "qkv"])
    assert np.array_equal(attn.qkv_q.dequantize().numpy().view(np.uint32), want_qkv.view(np.uint32))
    want_down = dequantize(raw["blk.0.ffn_down.weight"][0], QT.Q5_K)
    assert np.array_equal(mlp.down_q.dequantize().numpy().view(np.uint32), want_down.view(np.uint32))
    for t in (24, 5):  # a prompt-sized GEMM and decode-sized GEMVs
        ids = torch.randint(0, c["vocab_size"], (1, t), generator=torch.Generator().manual_seed(t))
        err = rel_err(_logits(kept, ids), _logits(floats, ids))
        assert err < 1e-4, (t, err)


def test_a_type_without_kernels_is_named_with_its_cost(tmp_path, caplog):
    """A projection in a GGUF type Strata has no kernels for is expanded, and one warning line names the
    type, its tensors and the bytes it costs; the rest stays quantized."""
    src = str(tmp_path / "hf")
    save_tiny_model("qwen3", src, intermediate_size=256)
    c = _hf_config(src)
    qtypes = {f"blk.{i}.{t}.weight": QT.Q8_0 for i in range(c["num_hidden_layers"])
              for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")}
    qtypes.update({f"blk.{i}.ffn_down.weight": QT.Q5_0 for i in range(c["num_hidden_layers"])})
    path = write_gguf(tmp_path / "q.gguf", c, load_file(os.path.join(src, "model.safetensors")), qtypes=qtypes)
    with caplog.at_level(logging.WARNING, logger="strata"):
        kept = load_model(path, keep_quantized=True)
    lines = [r.getMessage() for r in caplog.records if "not kept quantized" in r.getMessage()]
    mib = c["num_hidden_layers"] * c["hidden_size"] * 256 * 4 / 2**20
    assert lines == [f"not kept quantized (no kernels for the type), expanded to float32: Q5_0 "
                     f"({c['num_hidden_layers']} tensors, {mib:.1f} MiB)"]
    mlp = kept.model.model.layers[0].mlp
    assert mlp.down_q is None and mlp.gate_up_q is not None


def test_gguf_stays_quantized_by_default_on_cuda():
    from strata.config import EngineConfig

    assert EngineConfig(device="cuda").resolved().keep_quantized is True
    assert EngineConfig(device="cpu").resolved().keep_quantized is False
    assert EngineConfig(device="cuda", keep_quantized=False).resolved().keep_quantized is False
    assert EngineConfig(device="cuda", batch_invariant=True).resolved().keep_quantized is False
    assert EngineConfig(device="cuda", quantize="fp8").resolved().keep_quantized is False


def test_mixed_format_qkv_stays_quantized(tmp_path):
    """A Q4_K_M-style file keeps attn_v in another format than attn_q and attn_k: with `keep_quantized`
    q|k|v become a `QWeightStack` of their own blocks (no float weights), and the logits match the
    dequantized model's."""
    from strata.kernels.quant import QWeightStack

    src = str(tmp_path / "hf")
    save_tiny_model("qwen3", src, hidden_size=256, intermediate_size=256)
    c = _hf_config(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    qtypes = {"token_embd.weight": QT.F16}
    for i in range(c["num_hidden_layers"]):
        qtypes |= {f"blk.{i}.attn_q.weight": QT.Q8_0, f"blk.{i}.attn_k.weight": QT.Q8_0,
                   f"blk.{i}.attn_v.weight": QT.Q4_K}
    path = write_gguf(tmp_path / "m.gguf", c, tensors, qtypes=qtypes)
    floats = load_model(path)
    kept = load_model(path, keep_quantized=True)
    attn = kept.model.model.layers[0].self_attn
    assert isinstance(attn.qkv_q, QWeightStack) and attn.qkv_q.ggml_type == "Q8_0+Q8_0+Q4_K"
    assert attn.qkv_weight is None and attn.v_proj.weight.is_meta
    assert torch.equal(attn.qkv_q.dequantize(), floats.model.model.layers[0].self_attn.qkv_weight.float())
    for t in (24, 5):
        ids = torch.randint(0, c["vocab_size"], (1, t))
        err = rel_err(_logits(kept, ids), _logits(floats, ids))
        assert err < 1e-4, (t, err)


def test_quantized_gguf_serves_kept_quantized(tmp_path, monkeypatch):
    """`strata serve model.gguf --keep-quantized`: a Q4_K / Q8_0 file answers a completion through the
    OpenAI API with the same greedy text as the same file expanded to floats. (CPU: the QWeights use
    their reference path; the kernels are the format tests' business.)"""
    from serving import running_server

    import httpx

    src = str(tmp_path / "hf")
    save_tiny_model("qwen3", src, intermediate_size=256)
    c = _hf_config(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    qtypes = {"output.weight": QT.Q8_0}
    for i in range(c["num_hidden_layers"]):
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"):
            qtypes[f"blk.{i}.{t}.weight"] = QT.Q8_0  # rows of 64: too short for Q4_K's 256-value blocks
        qtypes[f"blk.{i}.ffn_down.weight"] = QT.Q4_K
    path = write_gguf(tmp_path / "q4k.gguf", c, tensors, qtypes=qtypes, tok_dir=src)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the server's CPU path, not interpreted kernels
    config = {"model": path, "device": "cpu", "ctx": 256, "log_level": "info", "keep_quantized": True}
    with running_server(tmp_path, config) as base:
        r = httpx.post(base + "/v1/completions", json={"model": path, "prompt": "the earth", "max_tokens": 12,
                                                      "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        served = r.json()["choices"][0]["text"]
    log = (tmp_path / "server.log").read_text()
    assert "kept 9 linear weights quantized (Q4_K, Q8_0)" in log, log[-2000:]
    # The same file expanded to floats, in process: the same greedy text.
    from strata.llm import LLM
    from strata.params import SamplingParams

    expanded = LLM(path, device="cpu", ctx=256).generate(["the earth"], SamplingParams(max_tokens=12, temperature=0))
    assert served and served == expanded[0].outputs[0].text
