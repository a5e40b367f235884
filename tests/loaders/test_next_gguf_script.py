"""scripts/next_gguf.py, the random-weight `qwen3next` GGUF written for llama-bench, at a tiny
config: Strata's loader reads it back to the same model config and runs it, and the file carries what
llama.cpp's qwen3next loader reads (lists below, taken from the llama.cpp that llama-cpp-python 0.3.36
vendors, which `scripts/gpu_round.sh peer-build` builds)."""

from __future__ import annotations

import os
import shutil
import sys
from types import SimpleNamespace

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from strata.bench.random_model import SHAPES, shape_config
from strata.config import ModelConfig
from strata.loaders import load_model
from strata.loaders.gguf import read_gguf
from strata.attention import CausalBatch
from test_gguf import write_vocab_gguf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from next_gguf import tensor_plan, write_next_gguf  # noqa: E402

A = "qwen3next."
# Read with get_key(..., required): llama.cpp refuses a file without them. src/llama-model.cpp
# `load_hparams` (context_length, embedding_length, block_count) and src/models/qwen3next.cpp
# `load_arch_hparams` (the rest); src/llama-vocab.cpp reads tokenizer.ggml.model.
LLAMA_REQUIRED = [
    "general.architecture", A + "context_length", A + "embedding_length", A + "block_count",
    A + "attention.layer_norm_rms_epsilon", A + "ssm.conv_kernel", A + "ssm.inner_size", A + "ssm.state_size",
    A + "ssm.time_step_rank", A + "ssm.group_count",
]
# Optional to llama.cpp, but its default would change the model: head counts (n_head 0 = no attention),
# head sizes (default n_embd / n_head), rope.dimension_count (default the whole head), rope.freq_base
# (default 1e4), the expert counts and sizes (the shared expert defaults to feed_forward_length), and
# the layer pattern (default every 4th layer full attention).
LLAMA_SHAPE_KEYS = [
    A + "attention.head_count", A + "attention.head_count_kv", A + "attention.key_length",
    A + "attention.value_length", A + "rope.dimension_count", A + "rope.freq_base", A + "expert_count",
    A + "expert_used_count", A + "expert_feed_forward_length", A + "expert_shared_feed_forward_length",
    A + "full_attention_interval",
]
# src/models/qwen3next.cpp `load_arch_tensors` (current converter layout: attn_qkv + attn_gate, separate
# expert gate/up stacks). llama.cpp fails on any tensor of the file it did not create.
LLAMA_GLOBAL = {"token_embd.weight", "output_norm.weight", "output.weight"}
LLAMA_EVERY_BLOCK = [
    "attn_norm.weight", "post_attention_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight",
    "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight",
    "ffn_up_shexp.weight", "ffn_down_shexp.weight",
]
LLAMA_LINEAR_BLOCK = ["attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a",
                      "ssm_ba.weight", "ssm_norm.weight", "ssm_out.weight"]
LLAMA_FULL_BLOCK = ["attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                    "attn_q_norm.weight", "attn_k_norm.weight"]
# Kept F32 by llama.cpp's converter and quantizer (1-D tensors, the router, the conv kernel).
F32_SUFFIXES = ("norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight",
                "ssm_dt.bias", "ssm_a")


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> tuple[str, int]:
    """A vocab-only GGUF (as llama.cpp's ggml-vocab-*.gguf) and its token count."""
    path = write_vocab_gguf(tmp_path_factory.mktemp("tok"))
    return path, len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data)


def _tiny(vocab_size: int) -> dict:
    return {**SHAPES["tiny-next"], "vocab_size": vocab_size}


@pytest.mark.parametrize("wtype,with_vocab", [("bf16", True), ("Q8_0", False)])
def test_tiny_file_loads_and_runs_in_strata(wtype, with_vocab, vocab, tmp_path):
    vocab_path, n_tokens = vocab
    c = _tiny(n_tokens)
    path = str(tmp_path / "next.gguf")
    size, count = write_next_gguf(path, c, wtype, vocab_path if with_vocab else None, seed=3)
    assert size == os.path.getsize(path) and count == len(gguf.GGUFReader(path).tensors)

    want = ModelConfig.from_hf(c)
    got = ModelConfig.from_hf(read_gguf(path).config)
    assert got.replace(bos_token_id=None, eos_token_ids=()) == want
    assert got.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (got.num_experts, got.num_experts_per_tok, got.moe_intermediate_size) == (8, 2, 32)
    assert (got.linear_num_key_heads, got.linear_num_value_heads, got.linear_key_head_dim) == (2, 4, 16)

    lm = load_model(path)
    assert (lm.tokenizer is not None) == with_vocab
    ids = torch.randint(0, n_tokens, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = lm.model(ids.flatten(), torch.arange(12).repeat(2), CausalBatch(2, 12))
        logits = lm.model.compute_logits(hidden)
    assert logits.shape == (24, n_tokens) and torch.isfinite(logits).all()


def test_file_has_what_llama_cpp_reads(vocab, tmp_path):
    vocab_path, n_tokens = vocab
    c = _tiny(n_tokens)
    path = str(tmp_path / "next.gguf")
    write_next_gguf(path, c, "Q8_0", vocab_path)
    reader = gguf.GGUFReader(path)
    fields = reader.fields
    assert set(LLAMA_REQUIRED + LLAMA_SHAPE_KEYS) <= fields.keys()
    assert fields["general.architecture"].contents() == "qwen3next"
    # llama.cpp takes the vocabulary size from the token list: it must match token_embd's rows.
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert len(fields["tokenizer.ggml.tokens"].data) == n_tokens
    value = {k: fields[A + k].contents() for k in (
        "block_count", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size",
        "ssm.conv_kernel", "rope.dimension_count", "expert_shared_feed_forward_length", "full_attention_interval",
        "attention.key_length")}
    assert value == {"block_count": 4, "ssm.state_size": 16, "ssm.group_count": 2, "ssm.time_step_rank": 4,
                     "ssm.inner_size": 64, "ssm.conv_kernel": 4, "rope.dimension_count": 4,
                     "expert_shared_feed_forward_length": 32, "full_attention_interval": 4,
                     "attention.key_length": 16}
    assert A + "nextn_predict_layers" not in fields  # no MTP block

    want = set(LLAMA_GLOBAL)
    for i in range(4):
        kind = LLAMA_FULL_BLOCK if i == 3 else LLAMA_LINEAR_BLOCK
        want |= {f"blk.{i}.{s}" for s in LLAMA_EVERY_BLOCK + kind}
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == want
    # GGUF dims (innermost first), as llama.cpp's create_tensor checks them.
    h, e, mi = 64, 8, 32
    assert tuple(tensors["blk.0.ffn_down_exps.weight"].shape) == (mi, h, e)
    assert tuple(tensors["blk.0.ssm_conv1d.weight"].shape) == (4, 2 * 32 + 64)
    assert tuple(tensors["blk.0.attn_qkv.weight"].shape) == (h, 2 * 32 + 64)
    assert tuple(tensors["blk.3.attn_q.weight"].shape) == (h, 2 * 4 * 16)
    assert tuple(tensors["blk.0.ffn_gate_inp_shexp.weight"].shape) == (h, 1)
    for name, t in tensors.items():
        assert t.tensor_type == (QT.F32 if name.endswith(F32_SUFFIXES) else QT.Q8_0), name
    assert (reader.get_tensor(list(tensors).index("blk.0.ssm_a")).data < 0).all()  # -exp(A_log)


@pytest.mark.parametrize("layer_flags", [False, True], ids=["interval", "flags"])
def test_mtp_file_loads_with_its_head(layer_flags, vocab, tmp_path):
    """With `mtp`, the MTP layer as block 4 (full attention, MoE) plus the head's nextn.* tensors,
    counted in block_count and nextn_predict_layers: Strata loads the head and runs it."""
    vocab_path, n_tokens = vocab
    c = _tiny(n_tokens)
    if layer_flags:  # not every 4th layer: written as attention.recurrent_layers
        c["layer_types"] = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    path = str(tmp_path / "mtp.gguf")
    _, count = write_next_gguf(path, c, "Q8_0", vocab_path, seed=3, mtp=True)
    reader = gguf.GGUFReader(path)
    assert reader.fields[A + "block_count"].contents() == 5 and reader.fields[A + "nextn_predict_layers"].contents() == 1
    if layer_flags:
        assert reader.fields[A + "attention.recurrent_layers"].contents() == [True, False, True, True, False]
    plain = {n for n, _, _ in tensor_plan(ModelConfig.from_hf(c))}
    extra = {t.name for t in reader.tensors} - plain
    assert extra == {f"blk.4.{t}" for t in LLAMA_EVERY_BLOCK + LLAMA_FULL_BLOCK} | {
        "blk.4.nextn.eh_proj.weight", "blk.4.nextn.enorm.weight", "blk.4.nextn.hnorm.weight",
        "blk.4.nextn.shared_head_norm.weight"}
    assert count == len(reader.tensors) == len(plain) + len(extra)
    assert tuple(next(t for t in reader.tensors if t.name == "blk.4.nextn.eh_proj.weight").shape) == (128, 64)

    cfg = ModelConfig.from_hf(read_gguf(path).config)
    assert cfg.replace(bos_token_id=None, eos_token_ids=()) == ModelConfig.from_hf(c).replace(num_nextn_predict_layers=1)
    lm = load_model(path)
    assert lm.has_mtp and len(lm.model.mtp_layers) == 1
    ids = torch.randint(0, n_tokens, (13,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = lm.model(ids[:12], torch.arange(12), CausalBatch(1, 12))
        _, logits = lm.model.mtp_forward(hidden, ids[1:], torch.arange(12), CausalBatch(1, 12))
    assert logits.shape == (12, n_tokens) and torch.isfinite(logits).all()


def test_refusals(vocab, tmp_path, monkeypatch):
    vocab_path, n_tokens = vocab
    with pytest.raises(ValueError, match="tokens"):
        write_next_gguf(tmp_path / "a.gguf", _tiny(n_tokens + 1), "bf16", vocab_path)
    with pytest.raises(ValueError, match="qwen3_next"):
        write_next_gguf(tmp_path / "b.gguf", SHAPES["tiny-moe"])
    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(free=1 << 20))
    with pytest.raises(OSError, match="GiB free"):
        write_next_gguf(tmp_path / "c.gguf", _tiny(n_tokens), "bf16")
    assert not (tmp_path / "c.gguf").exists()


def test_12_layer_shape_is_9_linear_3_full_and_fits_the_disk():
    cfg = shape_config("qwen3-next-80b-a3b-12l")
    assert cfg.num_hidden_layers == 12 and cfg.num_full_attention_layers == 3
    assert [i for i in range(12) if not cfg.layer_is_linear(i)] == [3, 7, 11]
    plan = tensor_plan(cfg)
    bf16_bytes = sum(4 * torch.Size(s).numel() // (2 if k == "matrix" else 1) for _, s, k in plan)
    assert len(plan) == 3 + 9 * 18 + 3 * 16
    assert 37 * 2**30 < bf16_bytes < 39 * 2**30  # of the device's 64 GiB disk
