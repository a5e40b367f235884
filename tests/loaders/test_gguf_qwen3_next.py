"""Qwen3-Next GGUF files: the tiny HF checkpoint written the way llama.cpp's converter writes a
`qwen3next` file (convert_hf_to_gguf.py, Qwen3NextModel over Qwen2MoeModel), loaded by Strata and
compared with the HF model.

The writer below is this test's own: GGUF names come from the gguf package's tensor map for
QWEN3NEXT, and it applies the converter's transforms (norms + 1 but linear_attn.norm, A_log →
-exp(A_log), dt_bias → ssm_dt.bias, conv1d squeezed, in_proj_qkvz regrouped into attn_qkv + attn_gate,
experts stacked). `legacy=True` writes what older converters wrote: in_proj_qkvz as `ssm_in` and every
tensor squeezed (so the shared expert's gate [1, H] is stored as [H]).

The MTP head (`mtp.*`, which llama.cpp's converter drops) is written as llama.cpp writes DeepSeek's and
GLM-4.5's: `nextn_predict_layers`, counted in `block_count`, its block `blk.{L}` (L = num_hidden_layers)
under the arch's block names and transforms, and mtp.fc / pre_fc_norm_embedding / pre_fc_norm_hidden /
norm as that block's nextn.eh_proj / enorm / hnorm / shared_head_norm (norms + 1 as every other).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import load_file

from strata.config import EngineConfig, ModelConfig
from strata.loaders import LoadError, load_model
from strata.loaders.gguf import read_gguf
from strata.loaders.names import gguf_to_hf, hf_to_gguf
from strata.attention import CausalBatch
from test_gguf import gguf_tokenizer_fields

REL_TOL = 1e-4
ARCH = gguf.MODEL_ARCH.QWEN3NEXT
# The MTP head's own tensors → (the layer-indexed name llama.cpp's Qwen3.5 converter gives them before
# its transforms, which add 1 to each of these norms as to every other; their NEXTN tensor).
MTP_HEAD = {
    "mtp.fc.weight": ("eh_proj.weight", gguf.MODEL_TENSOR.NEXTN_EH_PROJ),
    "mtp.pre_fc_norm_embedding.weight": ("enorm.weight", gguf.MODEL_TENSOR.NEXTN_ENORM),
    "mtp.pre_fc_norm_hidden.weight": ("hnorm.weight", gguf.MODEL_TENSOR.NEXTN_HNORM),
    "mtp.norm.weight": ("shared_head.norm.weight", gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM),
}


def _qkv_and_gate(w: torch.Tensor, c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The converter's split of in_proj_qkvz ([q, k, v, z] per key head) into q|k|v (every key head's
    q, then every k, then every v) and z."""
    hk, dk = c["linear_num_key_heads"], c["linear_key_head_dim"]
    vz = c["linear_num_value_heads"] // hk * c["linear_value_head_dim"]
    q, k, v, z = w.view(hk, 2 * dk + 2 * vz, -1).split([dk, dk, vz, vz], dim=1)
    h = w.shape[1]
    return torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)]), z.reshape(-1, h)


def _converted(c: dict, tensors: dict[str, torch.Tensor], legacy: bool) -> dict[str, torch.Tensor]:
    """HF tensors → GGUF-named, transformed tensors, as the converter yields them; `mtp.layers.{d}` as
    block n + d, the MTP head's own tensors as block n's nextn.*."""
    n = c["num_hidden_layers"]
    depths = {k.split(".")[2] for k in tensors if k.startswith("mtp.layers.")}
    names = gguf.get_tensor_name_map(ARCH, n + len(depths))
    # llama.cpp has no dense Qwen3-Next blocks; Strata reads HF's `mlp_only_layers` under the dense
    # names of dense Qwen3 (as in Qwen3-MoE files).
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, n)
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        t = t.float()
        head = None
        if name.startswith("mtp.layers."):
            d, rest = name.removeprefix("mtp.layers.").split(".", 1)
            name = f"model.layers.{n + int(d)}.{rest}"
        elif name in MTP_HEAD:
            head = MTP_HEAD[name][1]
            name = f"model.layers.{n}.{MTP_HEAD[name][0]}"
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if head is not None:
            out[gguf.TENSOR_NAMES[head].format(bid=n) + ".weight"] = t
            continue
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
                    drop_keys: tuple[str, ...] = (), nextn: int = 0,
                    extra_tensors: dict[str, torch.Tensor] | None = None, q8_0: tuple[str, ...] = ()) -> str:
    """`layer_flags`: state the layer kinds as `attention.recurrent_layers` instead of the interval.
    `nextn`: the MTP layers the metadata counts (their `mtp.*` tensors, if in `tensors`, are written).
    `extra_tensors`: GGUF-named tensors written as they are. `q8_0`: suffixes of the GGUF names of 2-D
    weights stored as Q8_0 blocks (those with rows of whole blocks)."""
    path = str(path)
    w = GGUFWriter(path, gguf.MODEL_ARCH_NAMES[ARCH])
    arch = w.arch
    meta = {
        "block_count": c["num_hidden_layers"] + nextn,
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
    if nextn:
        meta["nextn_predict_layers"] = nextn
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
    for g, t in {**_converted(c, tensors, legacy), **(extra_tensors or {})}.items():
        if g in drop_tensors:
            continue
        if t.dim() == 2 and g.endswith(q8_0) and t.shape[1] % 32 == 0:
            q = gguf.quants.quantize(t.numpy().astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(g, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(g, t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(lm, ids: torch.Tensor) -> torch.Tensor:
    b, t = ids.shape
    with torch.no_grad():
        hidden = lm.model(ids.flatten(), torch.arange(t, device=ids.device).repeat(b), CausalBatch(b, t))
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


# Every projection of the Gated DeltaNet and gated attention layers and of the shared experts.
PROJECTIONS = ("attn_qkv.weight", "attn_gate.weight", "ssm_in.weight", "ssm_ba.weight", "ssm_out.weight",
               "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "_shexp.weight")


@pytest.mark.parametrize("legacy", [False, True], ids=["current", "legacy"])
def test_qwen3next_projections_stay_quantized(legacy, next_parts, tmp_path):
    """A Q8_0 file's Gated DeltaNet projections (q|k|v + z regrouped as the float path regroups them,
    b|a below) and gated attention projections (gates first) stay quantized: the same logits as the
    file's blocks expanded to floats."""
    src, _, c, tensors = next_parts
    path = write_next_gguf(tmp_path / "q.gguf", c, tensors, legacy=legacy, layer_flags=legacy, q8_0=PROJECTIONS)
    kept, expanded = load_model(path, keep_quantized=True), load_model(path)
    layers = kept.model.model.layers
    linear = [m for m in kept.model.modules() if hasattr(m, "in_proj_q")]
    gated = [m for m in kept.model.modules() if hasattr(m, "gqkv_q")]
    assert linear and gated
    assert all(m.in_proj_q is not None and m.out_q is not None and m.in_proj_weight is None for m in linear)
    assert all(m.gqkv_q is not None and m.o_q is not None and m.gqkv_weight is None for m in gated)
    assert len(layers) == c["num_hidden_layers"]
    torch.manual_seed(2)
    ids = torch.randint(0, c["vocab_size"], (2, 24))
    err = rel_err(_logits(kept, ids), _logits(expanded, ids))
    assert err < REL_TOL, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qwen3next_kept_quantized_on_cuda(next_parts, tmp_path):
    """On CUDA, where the kept projections run their Triton kernels and the gated attention's stack
    feeds the fused q/k norm + RoPE: fp32 logits of the Q8_0 file kept quantized (its embedding table
    too) against the same file expanded; and an engine on the kept file captures its decode graphs
    (the table's lookup included) and decodes."""
    import time

    from strata.engine.engine import LLMEngine
    from strata.engine.types import EngineRequest
    from strata.models.layers import QuantizedEmbedding
    from strata.params import SamplingParams

    _, _, c, tensors = next_parts
    path = write_next_gguf(tmp_path / "q.gguf", c, tensors, q8_0=PROJECTIONS + ("token_embd.weight",))
    kept = load_model(path, device="cuda", keep_quantized=True)
    expanded = load_model(path, device="cuda", keep_quantized=False)
    assert isinstance(kept.model.model.embed_tokens, QuantizedEmbedding)
    ids = torch.randint(0, c["vocab_size"], (2, 24), device="cuda")
    err = rel_err(_logits(kept, ids), _logits(expanded, ids))
    assert err < 1e-3, err
    e = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32", parallel=2), progress=False)
    assert e.runner.graphs and isinstance(e.model.model.embed_tokens, QuantizedEmbedding)
    e.add_request(EngineRequest("r", tuple(range(5, 30)), SamplingParams(max_tokens=12, ignore_eos=True),
                                time.monotonic()))
    assert len([t for ev in e.run_to_completion()["r"] for t in ev.token_ids]) == 12


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


# ---- the MTP head ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def next_mtp_parts(next_parts, tmp_path_factory):
    """The tiny checkpoint plus random `mtp.*` tensors (HF's class drops them on save) and
    `num_nextn_predict_layers: 1`, as an HF directory: the GGUF's twin."""
    from safetensors.torch import save_file

    from strata.models.registry import build_model

    src, hf, c, tensors = next_parts
    c = {**c, "num_nextn_predict_layers": 1}
    torch.manual_seed(4)
    donor = build_model(ModelConfig.from_hf(c), with_mtp=True)
    mtp = {k: v.clone() for k, v in donor.state_dict().items() if k.startswith("mtp.")}
    for k, v in mtp.items():
        v.copy_(0.1 * torch.randn_like(v) if k.endswith("norm.weight") else 0.05 * torch.randn_like(v))
    twin = tmp_path_factory.mktemp("next_mtp_dir")
    (twin / "config.json").write_text(json.dumps(c))
    save_file({**tensors, **mtp}, str(twin / "model.safetensors"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (twin / f).write_bytes(Path(src, f).read_bytes())
    return str(twin), c, {**tensors, **mtp}, mtp


@pytest.fixture(scope="module")
def mtp_gguf(next_mtp_parts, tmp_path_factory):
    twin, c, tensors, _ = next_mtp_parts
    return write_next_gguf(tmp_path_factory.mktemp("next_mtp_gguf") / "m.gguf", c, tensors, nextn=1, tok_dir=twin)


def test_mtp_block_names():
    """mtp.layers.0 is block L under the arch's block names; the head's own tensors are block L's nextn.*
    (norms stored plus one); copies of the embedding and LM head there are accepted and not read."""
    n = 4
    pairs = {
        "blk.4.nextn.eh_proj.weight": "mtp.fc.weight",
        "blk.4.nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
        "blk.4.nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
        "blk.4.nextn.shared_head_norm.weight": "mtp.norm.weight",
        "blk.4.attn_q.weight": "mtp.layers.0.self_attn.q_proj.weight",
        "blk.4.attn_norm.weight": "mtp.layers.0.input_layernorm.weight",
        "blk.4.post_attention_norm.weight": "mtp.layers.0.post_attention_layernorm.weight",
        "blk.4.attn_k_norm.weight": "mtp.layers.0.self_attn.k_norm.weight",
        "blk.4.ffn_gate_inp_shexp.weight": "mtp.layers.0.mlp.shared_expert_gate.weight",
        "blk.3.attn_q.weight": "model.layers.3.self_attn.q_proj.weight",
    }
    for g, h in pairs.items():
        [(got, ref)] = gguf_to_hf("qwen3next", g, 0, n)
        assert got == h and hf_to_gguf("qwen3next", h, n) == ref, g
        assert (ref.undo == "minus_one") == g.endswith("norm.weight"), g
    stack = gguf_to_hf("qwen3next", "blk.4.ffn_up_exps.weight", 8, n)
    assert [h for h, _ in stack] == [f"mtp.layers.0.mlp.experts.{e}.up_proj.weight" for e in range(8)]
    assert hf_to_gguf("qwen3next", "mtp.layers.0.mlp.experts.5.up_proj.weight", n).expert == 5
    assert gguf_to_hf("qwen3next", "blk.4.nextn.embed_tokens.weight", 0, n) == []
    assert gguf_to_hf("qwen3next", "blk.4.nextn.shared_head_head.weight", 0, n) == []
    # GLM keeps its MTP layer among the decoder's.
    assert gguf_to_hf("glm4moe", "blk.4.nextn.eh_proj.weight", 0, n)[0][0] == "model.layers.4.eh_proj.weight"


def test_qwen3next_gguf_with_mtp_matches_hf_dir(next_mtp_parts, mtp_gguf):
    twin, c, tensors, mtp = next_mtp_parts
    n, h = c["num_hidden_layers"], c["hidden_size"]
    reader = gguf.GGUFReader(mtp_gguf)
    assert reader.fields["qwen3next.block_count"].contents() == n + 1
    assert reader.fields["qwen3next.nextn_predict_layers"].contents() == 1
    stored = {t.name: tuple(t.shape.tolist()) for t in reader.tensors}
    assert stored["blk.4.nextn.eh_proj.weight"] == (2 * h, h)  # GGUF dims: [in, out]
    assert {"blk.4.nextn.enorm.weight", "blk.4.nextn.hnorm.weight", "blk.4.nextn.shared_head_norm.weight",
            "blk.4.attn_q.weight", "blk.4.attn_q_norm.weight", "blk.4.ffn_gate_exps.weight",
            "blk.4.ffn_gate_inp_shexp.weight"} <= stored.keys()
    assert not any(k.startswith("blk.4.ssm") or k.startswith("blk.4.attn_qkv") for k in stored)

    ckpt = read_gguf(mtp_gguf)
    ours_cfg, hf_cfg = ModelConfig.from_hf(ckpt.config), ModelConfig.from_hf(c)
    assert ours_cfg.replace(bos_token_id=None, eos_token_ids=()) == hf_cfg
    assert ours_cfg.num_hidden_layers == n and ours_cfg.num_nextn_predict_layers == 1
    assert sorted(ckpt.names) == sorted(tensors)
    for k, t in mtp.items():
        got = ckpt.get(k)
        assert ckpt.shapes[k] == tuple(t.shape) == tuple(got.shape), k
        if "norm" in k.split(".")[-2]:  # stored as fl(1 + w); the model's 1 + w gives back exactly that
            assert torch.equal(1 + got, 1 + t), k
        else:
            assert torch.equal(got, t), k

    lm_g, lm_d = load_model(mtp_gguf), load_model(twin)
    assert lm_g.has_mtp and lm_d.has_mtp and len(lm_g.model.mtp_layers) == 1
    torch.manual_seed(2)
    t = 20
    ids = torch.randint(0, c["vocab_size"], (t + 1,))
    with torch.no_grad():
        hidden = lm_d.model(ids[:t], torch.arange(t), CausalBatch(1, t))
        outs = []
        for lm in (lm_g, lm_d):
            hm = lm.model.mtp_hidden(hidden, ids[1:], torch.arange(t), CausalBatch(1, t))
            outs.append((hm, lm.model.mtp_logits(hm)))
    (h_g, l_g), (h_d, l_d) = outs
    err_h, err_l = rel_err(h_g, h_d), rel_err(l_g, l_d)
    print(f"qwen3next MTP head: GGUF vs HF dir max relative error hidden {err_h:.2e}, logits {err_l:.2e}")
    assert err_h < REL_TOL and err_l < REL_TOL


def test_qwen3next_gguf_with_mtp_speculates(mtp_gguf):
    """An engine on the GGUF with --spec 2 (fp32, CPU) drafts with the head and emits the plain greedy
    tokens."""
    from strata.engine.engine import LLMEngine
    from strata.engine.types import EngineRequest
    from strata.params import SamplingParams

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (7, 30, 13)]

    def run(**kw):
        e = LLMEngine(EngineConfig(model=mtp_gguf, device="cpu", dtype="float32", ctx=256, parallel=3,
                                   chunk_size=256, max_num_batched_tokens=512, **kw), progress=False)
        for i, p in enumerate(prompts):
            e.add_request(EngineRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=12, ignore_eos=True),
                                        time.monotonic()))
        got = e.run_to_completion()
        return [[tok for ev in got[f"r{i}"] for tok in ev.token_ids] for i in range(len(prompts))], e

    plain, _ = run()
    spec, e = run(spec=2)
    assert spec == plain and all(len(o) == 12 for o in plain)
    assert e.stats().spec["drafts_proposed"] > 0


@pytest.mark.parametrize("nextn", [0, 1], ids=["not-counted", "counted-but-stripped"])
def test_qwen3next_gguf_without_mtp_block_loads_without_head(nextn, next_mtp_parts, tmp_path):
    twin, c, tensors, mtp = next_mtp_parts
    plain = {k: v for k, v in tensors.items() if k not in mtp}
    path = write_next_gguf(tmp_path / "p.gguf", c, plain, nextn=nextn)
    lm = load_model(path)
    assert not lm.has_mtp and lm.model.mtp is None
    assert lm.config.num_hidden_layers == c["num_hidden_layers"] and lm.config.num_nextn_predict_layers == nextn
    from strata.engine.engine import LLMEngine

    with pytest.raises(ValueError, match="MTP head"):
        LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", ctx=128, spec=2), progress=False)


def test_qwen3next_mtp_block_copies_of_shared_tensors(next_mtp_parts, tmp_path):
    """nextn.embed_tokens / nextn.shared_head_head (copies of the model's own, shared) may be in the file."""
    _, c, tensors, _ = next_mtp_parts
    copies = {"blk.4.nextn.embed_tokens.weight": tensors["model.embed_tokens.weight"],
              "blk.4.nextn.shared_head_head.weight": tensors["lm_head.weight"]}
    path = write_next_gguf(tmp_path / "s.gguf", c, {**tensors}, nextn=1, extra_tensors=copies)
    assert copies.keys() <= {t.name for t in gguf.GGUFReader(path).tensors}
    ckpt = read_gguf(path)
    assert sorted(ckpt.names) == sorted(tensors)
    assert load_model(path).has_mtp


@pytest.mark.parametrize("drop,expect", [
    ("blk.4.nextn.hnorm.weight", "missing tensors: blk.4.nextn.hnorm.weight"),
    ("blk.4.attn_q_norm.weight", "missing tensors: blk.4.attn_q_norm.weight"),
    ("blk.4.ffn_gate_inp_shexp.weight", "missing tensors: blk.4.ffn_gate_inp_shexp.weight"),
])
def test_incomplete_mtp_block_gives_one_line_error(drop, expect, next_mtp_parts, tmp_path):
    _, c, tensors, _ = next_mtp_parts
    path = write_next_gguf(tmp_path / "bad.gguf", c, tensors, nextn=1, drop_tensors=(drop,))
    with pytest.raises(LoadError) as ei:
        load_model(path)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(path) and expect in msg, msg
