"""Qwen3-Next GGUF files: the tiny HF checkpoint written the way llama.cpp's converter writes a
`qwen3next` file (convert_hf_to_gguf.py, Qwen3NextModel over Qwen2MoeModel), loaded by Strata and
compared with the HF model.

The writer below is this test's own: GGUF names come from the gguf package's tensor map for
QWEN3NEXT, and it applies the converter's transforms (norms + 1 but linear_attn.norm, A_log →
-exp(A_log), dt_bias → ssm_dt.bias, conv1d squeezed, in_proj_qkvz regrouped into attn_qkv + attn_gate,
experts stacked). `legacy=True` writes what older converters wrote: in_proj_qkvz as `ssm_in` and every
tensor squeezed (so the shared expert's gate [1, H] is stored as [H]).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import load_file

from strata.config import ModelConfig
from strata.loaders import LoadError, load_model
from strata.loaders.gguf import read_gguf
from strata.attention import CausalBatch
from test_gguf import gguf_tokenizer_fields

REL_TOL = 1e-4
ARCH = gguf.MODEL_ARCH.QWEN3NEXT


def _qkv_and_gate(w: torch.Tensor, c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The converter's split of in_proj_qkvz ([q, k, v, z] per key head) into q|k|v (every key head's
    q, then every k, then every v) and z."""
    hk, dk = c["linear_num_key_heads"], c["linear_key_head_dim"]
    vz = c["linear_num_value_heads"] // hk * c["linear_value_head_dim"]
    q, k, v, z = w.view(hk, 2 * dk + 2 * vz, -1).split([dk, dk, vz, vz], dim=1)
    h = w.shape[1]
    return torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)]), z.reshape(-1, h)


def _converted(c: dict, tensors: dict[str, torch.Tensor], legacy: bool) -> dict[str, torch.Tensor]:
    """HF tensors → GGUF-named, transformed tensors, as the converter yields them."""
    n = c["num_hidden_layers"]
    names = gguf.get_tensor_name_map(ARCH, n)
    # llama.cpp has no dense Qwen3-Next blocks; Strata reads HF's `mlp_only_layers` under the dense
    # names of dense Qwen3 (as in Qwen3-MoE files).
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, n)
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        t = t.float()
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if "in_proj_qkvz" in name and not legacy:
            bid = int(name.split(".")[2])
            qkv, z = _qkv_and_gate(t, c)
            out[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_QKV].format(bid=bid) + ".weight"] = qkv
            out[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_GATE].format(bid=bid) + ".weight"] = z
            continue
        if ".mlp.experts." in name:
            parts = name.split(".")
            merged = ".".join(parts[:5] + parts[6:])  # model.layers.N.mlp.experts.gate_proj.weight
            stacks.setdefault(names.get_name(merged, try_suffixes=(".weight",)), {})[int(parts[5])] = t
            continue
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            gname = dense_names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        out[gname] = t.squeeze() if legacy else t
    for g, experts in stacks.items():
        out[g] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def write_next_gguf(path, c: dict, tensors: dict[str, torch.Tensor], *, legacy: bool = False,
                    layer_flags: bool = False, tok_dir: str | None = None, drop_tensors: tuple[str, ...] = (),
                    drop_keys: tuple[str, ...] = ()) -> str:
    """`layer_flags`: state the layer kinds as `attention.recurrent_layers` instead of the interval."""
    path = str(path)
    w = GGUFWriter(path, gguf.MODEL_ARCH_NAMES[ARCH])
    arch = w.arch
    meta = {
        "block_count": c["num_hidden_layers"],
        "context_length": c["max_position_embeddings"],
        "embedding_length": c["hidden_size"],
        "feed_forward_length": c["intermediate_size"],
        "attention.head_count": c["num_attention_heads"],
        "attention.head_count_kv": c["num_key_value_heads"],
        "attention.key_length": c["head_dim"],
        "attention.value_length": c["head_dim"],
        "expert_count": c["num_experts"],
        "expert_used_count": c["num_experts_per_tok"],
        "expert_feed_forward_length": c["moe_intermediate_size"],
        "expert_shared_feed_forward_length": c["shared_expert_intermediate_size"],
        "ssm.conv_kernel": c["linear_conv_kernel_dim"],
        "ssm.state_size": c["linear_key_head_dim"],
        "ssm.group_count": c["linear_num_key_heads"],
        "ssm.time_step_rank": c["linear_num_value_heads"],
        "ssm.inner_size": c["linear_value_head_dim"] * c["linear_num_value_heads"],
        "rope.dimension_count": int(c["head_dim"] * c["partial_rotary_factor"]),
    }
    for key, value in meta.items():
        if key not in drop_keys:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    if layer_flags:
        w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in c["layer_types"]])
    else:
        every = c["layer_types"].index("full_attention") + 1
        assert all((t == "full_attention") == ((i + 1) % every == 0) for i, t in enumerate(c["layer_types"]))
        w.add_full_attention_interval(every)
    if tok_dir:
        gguf_tokenizer_fields(w, tok_dir)
    for g, t in _converted(c, tensors, legacy).items():
        if g not in drop_tensors:
            w.add_tensor(g, t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(lm, ids: torch.Tensor) -> torch.Tensor:
    b, t = ids.shape
    with torch.no_grad():
        hidden = lm.model(ids.flatten(), torch.arange(t).repeat(b), CausalBatch(b, t))
        return lm.model.compute_logits(hidden).view(b, t, -1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def next_parts(tiny_model_dirs):
    src, hf = tiny_model_dirs["qwen3_next"]
    c = json.loads(Path(src, "config.json").read_text())
    return src, hf, c, load_file(os.path.join(src, "model.safetensors"))


@pytest.mark.parametrize("legacy,layer_flags", [(False, False), (True, True)], ids=["current", "legacy"])
def test_qwen3next_gguf_matches_hf(legacy, layer_flags, next_parts, tmp_path):
    src, hf, c, tensors = next_parts
    path = write_next_gguf(tmp_path / "n.gguf", c, tensors, legacy=legacy, layer_flags=layer_flags, tok_dir=src)
    stored = {t.name: tuple(t.shape.tolist()) for t in gguf.GGUFReader(path).tensors}
    assert {"blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.ssm_conv1d.weight", "blk.3.attn_q.weight",
            "blk.3.post_attention_norm.weight", "blk.2.ffn_gate.weight"} <= stored.keys()
    if legacy:
        assert "blk.0.ssm_in.weight" in stored and stored["blk.0.ffn_gate_inp_shexp.weight"] == (c["hidden_size"],)
    else:
        assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight"} <= stored.keys()
        assert "blk.0.ssm_in.weight" not in stored and stored["blk.0.ffn_gate_inp_shexp.weight"] == (c["hidden_size"], 1)

    ckpt = read_gguf(path)
    ours_cfg, hf_cfg = ModelConfig.from_hf(ckpt.config), ModelConfig.from_hf(c)
    assert ours_cfg.replace(bos_token_id=None, eos_token_ids=()) == hf_cfg
    assert sorted(ckpt.names) == sorted(tensors)
    assert all(ckpt.shapes[n] == tuple(t.shape) for n, t in tensors.items())
    for n, t in tensors.items():
        got = ckpt.get(n)
        assert got.shape == t.shape, n
        if n.endswith("A_log"):  # log(-(-exp(x))) is x to rounding
            torch.testing.assert_close(got, t, rtol=1e-6, atol=1e-7)
        elif n.endswith("norm.weight") and "linear_attn" not in n:
            # Zero-centred: the file holds fl(1 + w), and the model's 1 + w gives back exactly that.
            assert torch.equal(1 + got, 1 + t), n
        else:
            assert torch.equal(got.float(), t), n

    lm = load_model(path)
    assert not lm.has_mtp and lm.tokenizer is not None
    torch.manual_seed(1)
    ids = torch.randint(0, c["vocab_size"], (2, 40))
    with torch.no_grad():
        ref = hf(ids).logits
    err = rel_err(_logits(lm, ids), ref)
    print(f"qwen3next ({'legacy' if legacy else 'current'} layout): GGUF vs HF max relative logit error {err:.2e}")
    assert err < REL_TOL


@pytest.mark.parametrize(
    "drop_tensors,drop_keys,legacy,expect",
    [
        (("blk.1.ssm_a",), (), False, "missing tensors: blk.1.ssm_a"),
        (("blk.0.attn_gate.weight",), (), False, "missing tensors: blk.0.attn_gate.weight"),
        (("blk.0.attn_qkv.weight", "blk.0.attn_gate.weight"), (), False,
         "missing tensors: blk.0.attn_gate.weight, blk.0.attn_qkv.weight"),
        (("blk.2.ssm_in.weight",), (), True, "missing tensors: blk.2.attn_gate.weight, blk.2.attn_qkv.weight"),
        (("blk.3.attn_q_norm.weight",), (), False, "missing tensors: blk.3.attn_q_norm.weight"),
        (("blk.0.ffn_gate_inp_shexp.weight",), (), False, "missing tensors: blk.0.ffn_gate_inp_shexp.weight"),
        ((), ("ssm.inner_size",), False, "bad GGUF metadata: metadata key qwen3next.ssm.inner_size is missing"),
    ],
)
def test_bad_qwen3next_files_give_one_line_errors(drop_tensors, drop_keys, legacy, expect, next_parts, tmp_path):
    _, _, c, tensors = next_parts
    path = write_next_gguf(tmp_path / "bad.gguf", c, tensors, legacy=legacy, drop_tensors=drop_tensors,
                           drop_keys=drop_keys)
    with pytest.raises(LoadError) as ei:
        load_model(path)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(path), msg
    assert expect in msg, msg
