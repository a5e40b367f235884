"""GGUF loading: tiny random HF checkpoints written to GGUF the way llama.cpp lays them out, loaded by
Strata, and compared with the HF model and with Strata's own load of the HF directory.

The GGUF files are written here with the gguf package's `GGUFWriter` and its `add_*` metadata calls
(the canonical key names), with tensor names from `strata.loaders.names.hf_to_gguf` and experts stacked
per layer as llama.cpp stores them.
"""

from __future__ import annotations

import json
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


def write_q8_0_q4_k_gguf(tmp_path, output: QT):
    """A tiny qwen3 written as a GGUF of Q8_0 projections, Q4_K ffn_down (rows of 256), an F16 embedding and
    an `output` head: (path, HF model, its config, its tensors, each GGUF tensor's type)."""
    src = str(tmp_path / "hf")
    hf = save_tiny_model("qwen3", src, intermediate_size=256)
    c = _hf_config(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    qtypes = {"token_embd.weight": QT.F16, "output.weight": output}
    for i in range(c["num_hidden_layers"]):
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"):
            qtypes[f"blk.{i}.{t}.weight"] = QT.Q8_0
        qtypes[f"blk.{i}.ffn_down.weight"] = QT.Q4_K
    return write_gguf(tmp_path / "q.gguf", c, tensors, qtypes=qtypes), hf, c, tensors, qtypes


def test_quantized_weights(tmp_path):
    """Q8_0 and Q4_K weights dequantize to exactly what gguf.quants gives for the stored bytes; F16
    and BF16 keep their dtype; the model's logits stay close to the fp32 model's but differ."""
    path, hf, c, tensors, qtypes = write_q8_0_q4_k_gguf(tmp_path, QT.BF16)

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
