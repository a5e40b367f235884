"""GGUF loading: tiny random HF checkpoints written to GGUF the way llama.cpp lays them out, loaded by
Strata, and compared with the HF model and with Strata's own load of the HF directory.

The GGUF files are written here with the gguf package's `GGUFWriter` and its `add_*` metadata calls
(the canonical key names), with tensor names from `strata.loaders.names.hf_to_gguf` and experts stacked
per layer as llama.cpp stores them.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import ExpertGatingFuncType, GGUFWriter, RopeScalingType
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from strata.config import ModelConfig
from strata.kernels.quant.writers import quantize_q4_k
from strata.loaders import LoadError, load_model
from strata.loaders.gguf import read_gguf
from strata.loaders.names import MODEL_TYPE_TO_ARCH, hf_to_gguf
from strata.attention import CausalBatch
from strata.models.registry import build_model
from strata.tokenizer import Tokenizer
from tiny_models import TOKENIZER_TEXT, save_tiny_model

REL_TOL = 1e-4
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _encode(arr: np.ndarray, qtype: QT | None) -> tuple[np.ndarray, QT | None]:
    if qtype is None:
        return arr.astype(np.float32), None
    if qtype == QT.F16:
        return arr.astype(np.float16), None
    if qtype == QT.Q4_K:
        return quantize_q4_k(arr.reshape(-1, arr.shape[-1]).astype(np.float32)).reshape(*arr.shape[:-1], -1), qtype
    return quantize(arr.astype(np.float32), qtype), qtype


def gguf_tokenizer_fields(w: GGUFWriter, tok_dir: str) -> None:
    """Write an HF byte-level BPE tokenizer.json as a GGUF `gpt2` vocabulary."""
    tj = json.loads(Path(tok_dir, "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    special = {}
    for t in tj["added_tokens"]:
        vocab[t["content"]] = t["id"]
        special[t["id"]] = t["special"]
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if special.get(i) else (4 if i in special else 1) for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab["<|endoftext|>"])
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def write_vocab_gguf(directory) -> str:
    """A vocab-only GGUF of the tiny tokenizer in `directory` (as llama.cpp's ggml-vocab-*.gguf); its path."""
    from tiny_models import save_tiny_tokenizer

    save_tiny_tokenizer(str(directory), 320)
    path = str(Path(directory) / "vocab.gguf")
    w = GGUFWriter(path, "qwen2")
    gguf_tokenizer_fields(w, str(directory))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gguf(
    path, c: dict, tensors: dict[str, torch.Tensor], *, qtypes: dict[str, QT] | None = None, arch: str | None = None,
    nextn: int = 0, tok_dir: str | None = None, rope_yarn: dict | None = None, split_max_tensors: int = 0,
) -> str:
    """HF config `c` + HF-named `tensors` → a llama.cpp-layout GGUF file at `path` (with
    `split_max_tensors`, parts `PATH-0000k-of-0000N.gguf` of at most that many tensors)."""
    path = str(path)
    mt = c["model_type"]
    arch = arch or MODEL_TYPE_TO_ARCH[mt]
    names_arch = MODEL_TYPE_TO_ARCH[mt]
    w = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_block_count(c["num_hidden_layers"] + nextn)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    rope = c.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(int(c["head_dim"] * partial))
    if rope_yarn:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope_yarn["factor"])
        w.add_rope_scaling_orig_ctx_len(rope_yarn["original_max_position_embeddings"])
    if mt in ("qwen3_moe", "glm4_moe"):
        w.add_expert_count(_n_experts(c))
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if mt == "glm4_moe":
        w.add_expert_shared_count(c["n_shared_experts"])
        w.add_leading_dense_block_count(c["first_k_dense_replace"])
        w.add_expert_weights_scale(c["routed_scaling_factor"])
        w.add_expert_weights_norm(c["norm_topk_prob"])
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(c["n_group"])
        w.add_expert_group_used_count(c["topk_group"])
        w.add_nextn_predict_layers(nextn)
    if tok_dir:
        gguf_tokenizer_fields(w, tok_dir)

    plain: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        ref = hf_to_gguf(names_arch, name)
        if ref is None:  # a test adds GGUF-named tensors directly
            plain[name] = t
        elif ref.expert is None:
            plain[ref.gguf_name] = t
        else:
            stacks.setdefault(ref.gguf_name, {})[ref.expert] = t
    for g, experts in stacks.items():
        plain[g] = torch.stack([experts[e] for e in range(len(experts))])
    for g, t in plain.items():
        arr, raw = _encode(t.float().numpy(), (qtypes or {}).get(g))
        w.add_tensor(g, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _n_experts(c: dict) -> int:
    return c.get("num_experts") or c.get("num_local_experts") or c["n_routed_experts"]


def _hf_config(path: str) -> dict:
    return json.loads(Path(path, "config.json").read_text())


def _logits(lm, ids: torch.Tensor) -> torch.Tensor:
    b, t = ids.shape
    with torch.no_grad():
        hidden = lm.model(ids.flatten(), torch.arange(t).repeat(b), CausalBatch(b, t))
        return lm.model.compute_logits(hidden).view(b, t, -1)


def _mtp_tensors(cfg: ModelConfig, seed: int = 3) -> dict[str, torch.Tensor]:
    """Random MTP-layer weights (HF drops them on save), incl. the layer's own embedding and head."""
    torch.manual_seed(seed)
    donor = build_model(cfg, with_mtp=True)
    n = cfg.num_hidden_layers
    sd = {k: v.clone() for k, v in donor.state_dict().items() if k.startswith(f"model.layers.{n}.")}
    sd[f"model.layers.{n}.embed_tokens.weight"] = torch.empty(cfg.vocab_size, cfg.hidden_size)
    sd[f"model.layers.{n}.shared_head.head.weight"] = torch.empty(cfg.vocab_size, cfg.hidden_size)
    for k, v in sd.items():
        if k.endswith("norm.weight"):
            v.copy_(1 + 0.1 * torch.randn_like(v))
        else:
            v.normal_(0, 0.05)
    return sd


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "glm4_moe"])
def test_gguf_matches_hf_and_hf_dir(arch, tiny_model_dirs, tmp_path):
    src, hf = tiny_model_dirs[arch]
    c = _hf_config(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    nextn = 0
    if arch == "glm4_moe":
        mtp = _mtp_tensors(ModelConfig.from_hf(c))
        tensors.update(mtp)
        nextn = c["num_nextn_predict_layers"]
        # The HF-directory twin gets the same MTP tensors, so both loads hold the same model.
        twin = tmp_path / "hfdir"
        twin.mkdir()
        save_file(tensors, str(twin / "model.safetensors"))
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            (twin / f).write_bytes(Path(src, f).read_bytes())
        src = str(twin)
    gguf_path = write_gguf(tmp_path / "m.gguf", c, tensors, nextn=nextn, tok_dir=src)

    ckpt = read_gguf(gguf_path)
    ours_cfg, hf_cfg = ModelConfig.from_hf(ckpt.config), ModelConfig.from_hf(c)
    # Metadata → config: everything equal but the token ids, which HF's tiny config leaves unset.
    assert ours_cfg.replace(bos_token_id=None, eos_token_ids=()) == hf_cfg
    assert sorted(ckpt.names) == sorted(tensors)

    lm_gguf, lm_dir = load_model(gguf_path), load_model(src)
    torch.manual_seed(1)
    ids = torch.randint(0, c["vocab_size"], (2, 40))
    with torch.no_grad():
        ref = hf(ids).logits
    ours, twin_logits = _logits(lm_gguf, ids), _logits(lm_dir, ids)
    err = rel_err(ours, ref)
    print(f"{arch}: GGUF vs HF max relative logit error {err:.2e}; vs HF dir {rel_err(ours, twin_logits):.2e}")
    assert err < REL_TOL
    assert torch.allclose(ours, twin_logits, rtol=0, atol=1e-6)

    sd_gguf, sd_dir = lm_gguf.model.state_dict(), lm_dir.model.state_dict()
    assert sd_gguf.keys() == sd_dir.keys() and all(torch.equal(sd_gguf[k], sd_dir[k]) for k in sd_gguf)
    if arch == "glm4_moe":
        assert lm_gguf.has_mtp and lm_dir.has_mtp
        n = c["num_hidden_layers"]
        layer = lm_gguf.model.mtp_layers[0]
        assert torch.equal(layer.eh_proj.weight, mtp[f"model.layers.{n}.eh_proj.weight"])
        assert layer.embed_tokens is not None and layer.shared_head.head is not None
        h = torch.randn(20, c["hidden_size"])
        with torch.no_grad():
            _, a = lm_gguf.model.mtp_forward(h, ids[0, 1:21], torch.arange(20), CausalBatch(1, 20))
            _, b = lm_dir.model.mtp_forward(h, ids[0, 1:21], torch.arange(20), CausalBatch(1, 20))
        print(f"glm4_moe MTP: GGUF vs HF dir max relative error {rel_err(a, b):.2e}")
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_glm_file_without_mtp_tensors(tiny_model_dirs, tmp_path):
    """A GLM file whose metadata counts an MTP block (in block_count) but whose MTP tensors were
    stripped loads as the plain decoder."""
    src, hf = tiny_model_dirs["glm4_moe"]
    c = _hf_config(src)
    path = write_gguf(tmp_path / "g.gguf", c, load_file(os.path.join(src, "model.safetensors")), nextn=1)
    lm = load_model(path)
    assert not lm.has_mtp and lm.config.num_hidden_layers == c["num_hidden_layers"]
    ids = torch.randint(0, c["vocab_size"], (1, 16))
    with torch.no_grad():
        assert rel_err(_logits(lm, ids), hf(ids).logits) < REL_TOL


def test_gguf_tokenizer_matches_hf_dir(tiny_model_dirs, tmp_path):
    src, _ = tiny_model_dirs["qwen3"]
    c = _hf_config(src)
    path = write_gguf(tmp_path / "t.gguf", c, load_file(os.path.join(src, "model.safetensors")), tok_dir=src)
    ours, ref = load_model(path).tokenizer, Tokenizer.from_hf_dir(src)
    assert isinstance(ours, Tokenizer)
    texts = [TOKENIZER_TEXT, "  leading spaces, digits 12345 and unicode: café ☕\n\ttabs", ""]
    for text in texts:
        assert ours.encode(text) == ref.encode(text)
        assert ours.decode(ours.encode(text)) == text
    chat = ours.apply_chat_template([{"role": "user", "content": "the earth"}])
    assert ours.encode(chat) == ref.encode(chat)
    assert ours.encode(chat)[0] == ref.token_to_id("<|im_start|>")
    assert ours.eos_ids == (ref.token_to_id("<|endoftext|>"),)
    assert ref.token_to_id("<|im_end|>") in ours.stop_ids and not ours.add_bos


def test_quantized_weights(tmp_path):
    """Q8_0 and Q4_K weights dequantize to exactly what gguf.quants gives for the stored bytes; F16
    and BF16 keep their dtype; the model's logits stay close to the fp32 model's but differ."""
    src = str(tmp_path / "hf")
    hf = save_tiny_model("qwen3", src, intermediate_size=256)  # Q4_K needs rows of 256
    c = _hf_config(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    qtypes = {"token_embd.weight": QT.F16, "output.weight": QT.BF16}
    for i in range(c["num_hidden_layers"]):
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"):
            qtypes[f"blk.{i}.{t}.weight"] = QT.Q8_0
        qtypes[f"blk.{i}.ffn_down.weight"] = QT.Q4_K
    path = write_gguf(tmp_path / "q.gguf", c, tensors, qtypes=qtypes)

    from gguf import GGUFReader

    raw = {t.name: t for t in GGUFReader(path).tensors}
    ckpt = read_gguf(path)
    for g, q in qtypes.items():
        hf_name = next(n for n in tensors if hf_to_gguf("qwen3", n).gguf_name == g)
        got = ckpt.get(hf_name)
        assert raw[g].tensor_type == q
        if q == QT.F16:
            assert got.dtype == torch.float16 and torch.equal(got, tensors[hf_name].half())
        elif q == QT.BF16:
            assert got.dtype == torch.bfloat16 and torch.equal(got, tensors[hf_name].bfloat16())
        else:
            want = dequantize(np.array(raw[g].data), q)
            assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want), g
            assert got.shape == tensors[hf_name].shape
            # A real quantization of the source, not noise: close to it, not equal.
            err = rel_err(got, tensors[hf_name])
            assert 0 < err < (0.02 if q == QT.Q8_0 else 0.15), (g, err)

    lm = load_model(path)
    ids = torch.randint(0, c["vocab_size"], (1, 32))
    with torch.no_grad():
        ref = hf(ids).logits
    err = rel_err(_logits(lm, ids), ref)
    print(f"qwen3 Q8_0/Q4_K/F16/BF16: max relative logit error vs fp32 HF {err:.2e}")
    assert 1e-6 < err < 0.1


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # Triton's interpreter
def test_quantized_weights_kept_quantized(tmp_path):
    """`keep_quantized`: the Q8_0 / Q4_K projections become QWeights from the file's own blocks (q|k|v
    and gate|up stacked by rows), their float parameters are never made, and the logits match the
    dequantized model's (fp32 activations: the kernels against dequantize-then-matmul)."""
    from strata.kernels.quant import QWeight

    src = str(tmp_path / "hf")
    save_tiny_model("qwen3", src, intermediate_size=256)
    c = _hf_config(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    qtypes = {"token_embd.weight": QT.F16, "output.weight": QT.Q8_0}
    for i in range(c["num_hidden_layers"]):
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"):
            qtypes[f"blk.{i}.{t}.weight"] = QT.Q8_0
        qtypes[f"blk.{i}.ffn_down.weight"] = QT.Q4_K
    path = write_gguf(tmp_path / "q.gguf", c, tensors, qtypes=qtypes)

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


def test_quantized_expert_stacks(tiny_model_dirs, tmp_path):
    """Quantized stacked experts split per expert: expert e is row e of the dequantized stack."""
    src, _ = tiny_model_dirs["qwen3_moe"]
    c = _hf_config(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    qtypes = {f"blk.0.ffn_{k}_exps.weight": QT.Q8_0 for k in ("gate", "up", "down")}
    path = write_gguf(tmp_path / "e.gguf", c, tensors, qtypes=qtypes)
    from gguf import GGUFReader

    raw = {t.name: t for t in GGUFReader(path).tensors}
    ckpt = read_gguf(path)
    for kind in ("gate", "up", "down"):
        stack = dequantize(np.array(raw[f"blk.0.ffn_{kind}_exps.weight"].data), QT.Q8_0)
        for e in range(_n_experts(c)):
            name = f"model.layers.0.mlp.experts.{e}.{kind}_proj.weight"
            assert np.array_equal(ckpt.get(name).numpy(), stack[e])
            assert ckpt.shapes[name] == tuple(tensors[name].shape)
    lm = load_model(path)
    assert lm.config.num_experts == _n_experts(c)


@pytest.mark.parametrize("qtype", [QT.IQ3_S, QT.Q4_K, QT.Q6_K, QT.Q5_0, QT.IQ4_XS, QT.Q2_K])
def test_any_quant_type_dequantizes_like_gguf(qtype, tiny_model_dirs, tmp_path):
    """Types Strata cannot produce (IQ3_S ...) still load: arbitrary block bytes → gguf's dequantization."""
    src, _ = tiny_model_dirs["qwen3"]
    c = _hf_config(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = c["hidden_size"], 256 * (block // 256 if block > 256 else 1)
    # A block's fp16 scales are random bits too; NaNs then compare equal in assert_array_equal.
    blob = np.random.default_rng(0).integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    name = "model.layers.0.mlp.down_proj.weight"
    tensors.pop(name)
    path = str(tmp_path / "x.gguf")
    _write_with_raw(path, c, tensors, {"blk.0.ffn_down.weight": (blob, qtype)}, intermediate=cols)
    ckpt = read_gguf(path)
    with np.errstate(invalid="ignore", over="ignore"):
        np.testing.assert_array_equal(ckpt.get(name).numpy(), dequantize(blob, qtype))
        assert ckpt.get(name).shape == (rows, cols)


def _write_with_raw(path, c, tensors, raw: dict, intermediate: int) -> None:
    """A qwen3 GGUF whose layer-0 MLP is `intermediate` wide: random fp32 gate/up, raw-typed down."""
    c = {**c, "intermediate_size": intermediate, "num_hidden_layers": 1}
    keep = {k: v for k, v in tensors.items() if not k.startswith("model.layers.1.")}
    keep["model.layers.0.mlp.gate_proj.weight"] = torch.randn(intermediate, c["hidden_size"])
    keep["model.layers.0.mlp.up_proj.weight"] = torch.randn(intermediate, c["hidden_size"])
    w = GGUFWriter(path, "qwen3")
    w.add_block_count(1)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(intermediate)
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    for name, t in keep.items():
        w.add_tensor(hf_to_gguf("qwen3", name).gguf_name, t.float().numpy())
    for g, (blob, qtype) in raw.items():
        w.add_tensor(g, blob, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_yarn_metadata_gives_hf_rope(tiny_model_dirs, tmp_path):
    src, _ = tiny_model_dirs["qwen3"]
    c = _hf_config(src)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    path = write_gguf(tmp_path / "y.gguf", {**c, "max_position_embeddings": 1024},
                      load_file(os.path.join(src, "model.safetensors")), rope_yarn=yarn)
    ours = ModelConfig.from_hf(read_gguf(path).config)
    rope = {**c["rope_parameters"], **yarn}
    want = ModelConfig.from_hf({**c, "max_position_embeddings": 1024, "rope_parameters": rope})
    assert ours.rope == want.rope and ours.rope.kind == "yarn" and ours.max_position_embeddings == 1024


def test_split_gguf_loads_from_any_part(tiny_model_dirs, tmp_path):
    """llama.cpp's split files (NAME-0000k-of-0000N.gguf): the parts load as one file, from any part; a
    missing part is a one-line error naming it."""
    src, _ = tiny_model_dirs["qwen3"]
    c = _hf_config(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    whole = load_model(write_gguf(tmp_path / "whole.gguf", c, tensors, tok_dir=src))
    write_gguf(tmp_path / "m.gguf", c, tensors, tok_dir=src, split_max_tensors=5)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) >= 3 and parts[0].name == f"m-00001-of-{len(parts):05d}.gguf"
    ids = torch.randint(0, c["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(4))
    want = _logits(whole, ids)
    for part in (parts[0], parts[-1]):
        lm = load_model(str(part))
        assert lm.tokenizer is not None
        assert torch.equal(_logits(lm, ids), want)
    parts[1].unlink()
    with pytest.raises(LoadError, match=f"missing part {parts[1].name}"):
        load_model(str(parts[0]))


@pytest.fixture(scope="module")
def qwen3_parts(tiny_model_dirs):
    src, _ = tiny_model_dirs["qwen3"]
    return _hf_config(src), load_file(os.path.join(src, "model.safetensors"))


@pytest.mark.parametrize(
    "case,expect",
    [
        ("unknown_arch", "unknown GGUF architecture 'llama'"),
        ("missing", "missing tensors: blk.1.attn_k.weight"),
        ("extra", "unexpected tensors: blk.0.attn_bogus.weight"),
        ("extra_layer", "unexpected tensors: blk.2."),
        ("shape", "shape mismatch for output_norm.weight: file has (7,), config implies (64,)"),
        ("truncated_data", "truncated GGUF file"),
        ("truncated_header", "truncated GGUF file"),
        ("bad_magic", "not a valid GGUF file"),
        ("empty", "not a valid GGUF file"),
    ],
)
def test_bad_gguf_files_give_one_line_errors(case, expect, qwen3_parts, tmp_path):
    c, tensors = qwen3_parts
    tensors = dict(tensors)
    path = tmp_path / "bad.gguf"
    arch = None
    if case == "unknown_arch":
        arch = "llama"
    elif case == "missing":
        tensors.pop("model.layers.1.self_attn.k_proj.weight")
    elif case == "extra":
        tensors["blk.0.attn_bogus.weight"] = torch.zeros(4)
    elif case == "extra_layer":
        tensors["model.layers.2.input_layernorm.weight"] = torch.ones(c["hidden_size"])
    elif case == "shape":
        tensors["model.norm.weight"] = torch.zeros(7)
    write_gguf(path, c, tensors, arch=arch)
    data = path.read_bytes()
    if case == "truncated_data":
        path.write_bytes(data[: len(data) - 1000])
    elif case == "truncated_header":
        path.write_bytes(data[:200])
    elif case == "bad_magic":
        path.write_bytes(b"GGML" + data[4:])
    elif case == "empty":
        path.write_bytes(b"")
    with pytest.raises(LoadError) as ei:
        load_model(str(path))
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(str(path)), msg
    assert expect in msg, msg
