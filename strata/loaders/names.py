"""GGUF ↔ HF names, in one place: tensor names per architecture and metadata keys → HF config keys.

GGUF names follow llama.cpp (`gguf.constants.TENSOR_NAMES`); HF names are the `transformers` state-dict
names, which are also Strata's parameter names. llama.cpp stores the routed experts of a layer stacked
in one tensor (`blk.N.ffn_gate_exps.weight`, numpy shape [E, I, H]); HF names each expert's matrix
(`model.layers.N.mlp.experts.{e}.gate_proj.weight`, [I, H]), which is index e of the stack.

A few tensors are stored transformed by llama.cpp's converter (Qwen3-Next: norms offset by one, A_log
as -exp(A_log), the conv kernel squeezed, in_proj_qkvz regrouped into q|k|v and z); their `TensorRef`
names the inverse (`undo`), which `strata.loaders.gguf` applies when the tensor is read.

Multi-token-prediction (MTP) layers are stored as llama.cpp stores DeepSeek's and GLM-4.5's: counted in
`block_count`, `{arch}.nextn_predict_layers` of them after the decoder's, as blocks `blk.{L + d}` (L =
num_hidden_layers) holding the block's own tensors under the arch's block names plus `nextn.*`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Collection

# GGUF `general.architecture` → HF `model_type`.
ARCH_TO_MODEL_TYPE = {"qwen3": "qwen3", "qwen3moe": "qwen3_moe", "glm4moe": "glm4_moe", "qwen3next": "qwen3_next"}
MODEL_TYPE_TO_ARCH = {v: k for k, v in ARCH_TO_MODEL_TYPE.items()}

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_ATTENTION = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_DENSE_MLP = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_ROUTER = {"ffn_gate_inp.weight": "mlp.gate.weight"}
_SHARED_EXPERTS = {
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
# llama.cpp's converter renames `e_score_correction_bias` to `e_score_correction.bias`, hence `.bias`.
_SCORE_BIAS = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
# DeepSeek-V3 / GLM-4.5 multi-token-prediction layer, stored as block index num_hidden_layers.
_NEXTN = {
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.shared_head_norm.weight": "shared_head.norm.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight",
    "nextn.embed_tokens.weight": "embed_tokens.weight",
}
# Qwen3-Next keeps its MTP head apart from the decoder, as `mtp.*` (`Qwen3NextMTP`): block L + d is
# `mtp.layers.{d}` (a full-attention block, MoE when the model is) and the head's own tensors are read
# from block L's `nextn.*` (what later MTP blocks repeat of them is not read). fc's input is
# [embedding; hidden state], the order of eh_proj's [enorm(embedding); hnorm(hidden)]. The embedding and
# the LM head are the main model's: a file's nextn.embed_tokens / nextn.shared_head_head are accepted
# and not read.
MTP_BLOCK_PREFIX = {"qwen3next": "mtp.layers."}
MTP_HEAD_TENSORS: dict[str, dict[str, str]] = {
    "qwen3next": {
        "nextn.eh_proj.weight": "mtp.fc.weight",
        "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
        "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
        "nextn.shared_head_norm.weight": "mtp.norm.weight",
    },
}
MTP_SHARED_TENSORS = {"nextn.embed_tokens.weight", "nextn.shared_head_head.weight"}
STACKED_EXPERTS = {
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}
# Qwen3-Next's one sigmoid-gated shared expert (HF: singular `shared_expert`, and its gate [1, H]).
_GATED_SHARED_EXPERT = {
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# Qwen3-Next's Gated DeltaNet layers. llama.cpp renames `dt_bias` to `dt_proj.bias` (hence `ssm_dt.bias`)
# and names `A_log` `ssm_a`, without a suffix. `ssm_in` is HF's in_proj_qkvz as is, in files from
# converters before the q|k|v / z split (JOINED_TENSORS).
_GATED_DELTA_NET = {
    "ssm_in.weight": "linear_attn.in_proj_qkvz.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
# One HF tensor read from several GGUF tensors: arch → {first GGUF suffix: (HF suffix, the other GGUF
# suffixes, undo)}. Current converters split Qwen3-Next's in_proj_qkvz (rows grouped per key head: q,
# k, v, z) into the conv input q|k|v (every head's q, then every k, then every v) and z.
JOINED_TENSORS: dict[str, dict[str, tuple[str, tuple[str, ...], str]]] = {
    "qwen3next": {"attn_qkv.weight": ("linear_attn.in_proj_qkvz.weight", ("attn_gate.weight",), "qkvz")},
}
# HF name (a global name, or the suffix after `model.layers.N.`) → the inverse of llama.cpp's transform
# (implemented in strata.loaders.gguf). The Qwen3-Next converter adds 1 to every zero-centred norm (all
# but linear_attn.norm; the MTP head's and its block's too), stores -exp(A_log) and squeezes the conv
# kernel [C, 1, K] to [C, K].
UNDO: dict[str, dict[str, str]] = {
    "qwen3next": {
        "model.norm.weight": "minus_one",
        "mtp.pre_fc_norm_embedding.weight": "minus_one",
        "mtp.pre_fc_norm_hidden.weight": "minus_one",
        "mtp.norm.weight": "minus_one",
        "input_layernorm.weight": "minus_one",
        "post_attention_layernorm.weight": "minus_one",
        "self_attn.q_norm.weight": "minus_one",
        "self_attn.k_norm.weight": "minus_one",
        "linear_attn.A_log": "log_neg",
        "linear_attn.conv1d.weight": "unsqueeze_1",
    },
}

# Per architecture: block tensor suffix → HF suffix (without the `model.layers.N.` prefix).
BLOCK_TENSORS: dict[str, dict[str, str]] = {
    "qwen3": {**_ATTENTION, "ffn_norm.weight": "post_attention_layernorm.weight", **_DENSE_MLP},
    # Dense blocks in a Qwen3-MoE file stand for HF's `mlp_only_layers` (llama.cpp itself never writes them).
    "qwen3moe": {**_ATTENTION, "ffn_norm.weight": "post_attention_layernorm.weight", **_ROUTER, **_DENSE_MLP},
    # GLM-4.5 names its post-attention norm `post_attention_norm` in GGUF, not `ffn_norm`.
    "glm4moe": {
        **_ATTENTION,
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        **_DENSE_MLP,
        **_ROUTER,
        **_SHARED_EXPERTS,
        **_SCORE_BIAS,
        **_NEXTN,
    },
    # Dense blocks stand for HF's `mlp_only_layers`, as in Qwen3-MoE files.
    "qwen3next": {
        **_ATTENTION,
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        **_GATED_DELTA_NET,
        **_DENSE_MLP,
        **_ROUTER,
        **_GATED_SHARED_EXPERT,
    },
}
ARCH_HAS_EXPERTS = {"qwen3": False, "qwen3moe": True, "glm4moe": True, "qwen3next": True}
# Computed from the config, never loaded.
IGNORED_TENSORS = {"rope_freqs.weight"}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_HF_BLOCK_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class TensorRef:
    """Where an HF tensor lives in a GGUF file: a tensor, or index `expert` of a stacked tensor; with
    `more`, further GGUF tensors it is joined from, and with `undo`, the inverse transform to apply."""

    gguf_name: str
    expert: int | None = None
    more: tuple[str, ...] = ()
    undo: str | None = None


def gguf_to_hf(arch: str, name: str, n_experts: int,
               n_layers: int | None = None) -> list[tuple[str, TensorRef]] | None:
    """HF names held by GGUF tensor `name` (several for a stack of experts, none for the second part
    of a joined tensor or a copy of a shared tensor); None if unknown. `n_layers`: the decoder's layer
    count, past which blocks are MTP layers (needed where the arch keeps those apart, `MTP_BLOCK_PREFIX`)."""
    undo = UNDO.get(arch, {})
    if name in GLOBAL_TENSORS:
        hf = GLOBAL_TENSORS[name]
        return [(hf, TensorRef(name, undo=undo.get(hf)))]
    m = _BLOCK_RE.match(name)
    if m is None:
        return None
    layer, suffix = m.group(1), m.group(2)
    prefix = f"model.layers.{layer}."
    if arch in MTP_BLOCK_PREFIX and n_layers is not None and int(layer) >= n_layers:
        depth = int(layer) - n_layers
        if suffix in MTP_SHARED_TENSORS:
            return []
        if suffix in MTP_HEAD_TENSORS[arch]:
            if depth:  # a repeat of block n_layers' (`expected_tensors`)
                return []
            hf = MTP_HEAD_TENSORS[arch][suffix]
            return [(hf, TensorRef(name, undo=undo.get(hf)))]
        prefix = f"{MTP_BLOCK_PREFIX[arch]}{depth}."
    joined = JOINED_TENSORS.get(arch, {})
    if suffix in joined:
        hf, rest, how = joined[suffix]
        return [(prefix + hf, TensorRef(name, more=tuple(f"blk.{layer}.{r}" for r in rest), undo=how))]
    if any(suffix in rest for _, rest, _ in joined.values()):
        return []
    hf = BLOCK_TENSORS[arch].get(suffix)
    if hf is not None:
        return [(prefix + hf, TensorRef(name, undo=undo.get(hf)))]
    if ARCH_HAS_EXPERTS[arch] and suffix in STACKED_EXPERTS:
        template = STACKED_EXPERTS[suffix]
        return [(prefix + template.format(e=e), TensorRef(name, e)) for e in range(n_experts)]
    return None


def hf_to_gguf(arch: str, name: str, n_layers: int | None = None) -> TensorRef | None:
    """The GGUF tensor (and expert index) that holds HF tensor `name`, as current llama.cpp converters
    write it; None if it has no GGUF name. `n_layers`: as for `gguf_to_hf` (MTP names need it)."""
    undo = UNDO.get(arch, {})
    for g, h in GLOBAL_TENSORS.items():
        if h == name:
            return TensorRef(g, undo=undo.get(h))
    m = _HF_BLOCK_RE.match(name)
    if arch in MTP_BLOCK_PREFIX and n_layers is not None:
        for g, h in MTP_HEAD_TENSORS[arch].items():
            if h == name:
                return TensorRef(f"blk.{n_layers}.{g}", undo=undo.get(h))
        mtp = re.match(re.escape(MTP_BLOCK_PREFIX[arch]) + r"(\d+)\.(.+)$", name)
        if mtp is not None:
            m = _HF_BLOCK_RE.match(f"model.layers.{n_layers + int(mtp.group(1))}.{mtp.group(2)}")
    if m is None:
        return None
    layer, suffix = m.group(1), m.group(2)
    for g, (h, rest, how) in JOINED_TENSORS.get(arch, {}).items():
        if h == suffix:
            return TensorRef(f"blk.{layer}.{g}", more=tuple(f"blk.{layer}.{r}" for r in rest), undo=how)
    for g, h in BLOCK_TENSORS[arch].items():
        if h == suffix:
            return TensorRef(f"blk.{layer}.{g}", undo=undo.get(h))
    e = _HF_EXPERT_RE.match(suffix)
    if e is not None and ARCH_HAS_EXPERTS[arch]:
        kind = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}[e.group(2)]
        return TensorRef(f"blk.{layer}.{kind}.weight", int(e.group(1)))
    return None


# `{arch}.<key>` → HF config key, for values copied as they are.
CONFIG_KEYS: dict[str, str] = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_count": "n_shared_experts",
    "leading_dense_block_count": "first_k_dense_replace",
    "expert_weights_scale": "routed_scaling_factor",
    "expert_weights_norm": "norm_topk_prob",
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
    "nextn_predict_layers": "num_nextn_predict_layers",
}
# HF spells the routed expert count differently per family.
EXPERT_COUNT_KEY = {"qwen3moe": "num_experts", "glm4moe": "n_routed_experts", "qwen3next": "num_experts"}
# llama.cpp always renormalises Qwen3-MoE's and Qwen3-Next's top-k weights; GLM reads `expert_weights_norm`
# (default off).
DEFAULT_NORM_TOPK = {"qwen3moe": True, "glm4moe": False, "qwen3next": True}


class MetadataError(ValueError):
    pass


def _uniform(key: str, v: Any) -> Any:
    # Some converters write per-layer arrays (e.g. head_count_kv); Strata runs uniform layers only.
    if isinstance(v, list):
        if not v or any(x != v[0] for x in v):
            raise MetadataError(f"{key} varies per layer ({v[:8]}...), which is not supported")
        return v[0]
    return v


def config_from_metadata(arch: str, meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """An HF-style config dict from GGUF metadata (`meta`: key → Python value; the vocabulary arrays
    need not be there) and the file's tensors (GGUF name → numpy shape)."""

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        return _uniform(full, meta[full]) if full in meta else default

    for required in ("block_count", "embedding_length", "attention.head_count"):
        if get(required) is None:
            raise MetadataError(f"metadata key {arch}.{required} is missing")
    cfg: dict[str, Any] = {"model_type": ARCH_TO_MODEL_TYPE[arch]}
    for key, hf in CONFIG_KEYS.items():
        v = get(key)
        if v is not None:
            cfg[hf] = v
    nextn = int(get("nextn_predict_layers", 0))
    # llama.cpp counts the MTP layers as blocks.
    cfg["num_hidden_layers"] = int(get("block_count")) - nextn
    cfg["num_nextn_predict_layers"] = nextn
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg["head_dim"] = head_dim
    value_length = get("attention.value_length")
    if value_length is not None and int(value_length) != head_dim:
        raise MetadataError(f"value head size {value_length} differs from key head size {head_dim}")
    rot = get("rope.dimension_count")
    cfg["partial_rotary_factor"] = 1.0 if rot is None else int(rot) / head_dim
    cfg["rope_theta"] = float(get("rope.freq_base", 10000.0))
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        rs: dict[str, Any] = {"rope_type": scaling, "factor": float(get("rope.scaling.factor", 1.0))}
        orig = get("rope.scaling.original_context_length")
        if orig is not None:
            rs["original_max_position_embeddings"] = int(orig)
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("attn_factor", "attention_factor")):
            v = get(f"rope.scaling.{key}")
            if v is not None:
                rs[hf] = float(v)
        log_mul = get("rope.scaling.yarn_log_multiplier")
        if log_mul:  # llama.cpp stores 0.1 * mscale_all_dim
            rs["mscale_all_dim"] = float(log_mul) / 0.1
        cfg["rope_scaling"] = rs
    if arch in EXPERT_COUNT_KEY:
        cfg[EXPERT_COUNT_KEY[arch]] = int(get("expert_count", 0))
        cfg.setdefault("norm_topk_prob", DEFAULT_NORM_TOPK[arch])
        if arch in ("qwen3moe", "qwen3next"):
            dense = [i for i in range(cfg["num_hidden_layers"]) if f"blk.{i}.ffn_gate.weight" in tensor_shapes]
            cfg.update(decoder_sparse_step=1, mlp_only_layers=dense)
    if arch == "qwen3next":
        cfg.update(_hybrid_config(get, meta.get(f"{arch}.attention.recurrent_layers"), cfg["num_hidden_layers"],
                                  tensor_shapes))
    if "vocab_size" not in cfg:
        if "token_embd.weight" not in tensor_shapes:
            raise MetadataError("missing tensor token_embd.weight (and no vocab_size in the metadata)")
        cfg["vocab_size"] = int(tensor_shapes["token_embd.weight"][0])
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_shapes
    cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    if arch == "glm4moe":
        cfg["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensor_shapes
    for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if key in meta:
            cfg[hf] = int(meta[key])
    return cfg


def _hybrid_config(get: Any, recurrent: Any, n_layers: int, tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Qwen3-Next's Gated DeltaNet sizes and layer kinds, as llama.cpp reads them: ssm.state_size is the
    key head size, ssm.group_count the key heads, ssm.time_step_rank the value heads, ssm.inner_size
    all value heads' width; `attention.recurrent_layers` (one flag per layer) or else every
    `full_attention_interval`-th layer (default 4) is full attention."""
    keys = ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size")
    kernel, dk, hk, hv, inner = (get(k) for k in keys)
    for k, v in zip(keys, (kernel, dk, hk, hv, inner)):
        if v is None:
            raise MetadataError(f"metadata key qwen3next.{k} is missing")
    hk, hv, inner = int(hk), int(hv), int(inner)
    if not hk or hv % hk or inner % hv:
        raise MetadataError(f"{hv} value heads of total width {inner} do not split over {hk} key heads")
    if recurrent is None:
        every = int(get("full_attention_interval", 4))
        recurrent = [(i + 1) % every != 0 for i in range(n_layers)]
    elif not isinstance(recurrent, list):
        recurrent = [recurrent] * n_layers
    if len(recurrent) < n_layers:
        raise MetadataError(f"attention.recurrent_layers has {len(recurrent)} entries for {n_layers} layers")
    out = {
        "linear_conv_kernel_dim": int(kernel),
        "linear_key_head_dim": int(dk),
        "linear_num_key_heads": hk,
        "linear_num_value_heads": hv,
        "linear_value_head_dim": inner // hv,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:n_layers]],
    }
    shared = get("expert_shared_feed_forward_length")
    if shared is None:  # llama.cpp falls back to the shared expert's tensor
        moe = next((i for i in range(n_layers) if f"blk.{i}.ffn_gate_shexp.weight" in tensor_shapes), None)
        shared = 0 if moe is None else tensor_shapes[f"blk.{moe}.ffn_gate_shexp.weight"][0]
    out["shared_expert_intermediate_size"] = int(shared)
    return out


def _hybrid_mixer(b: str, i: int, cfg: Any, present: Collection[str]) -> dict[str, tuple[int, ...]]:
    """Qwen3-Next block i's token mixer: gated full attention (q_proj yields q and its gate; always in
    an MTP block) or Gated DeltaNet, whose in_proj_qkvz is `ssm_in` in older files and q|k|v + z in
    current ones."""
    h, hd = cfg.hidden_size, cfg.head_dim
    if i >= cfg.num_hidden_layers or not cfg.layer_is_linear(i):
        q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        return {
            b + "attn_q.weight": (2 * q, h),
            b + "attn_k.weight": (kv, h),
            b + "attn_v.weight": (kv, h),
            b + "attn_output.weight": (h, q),
            b + "attn_q_norm.weight": (hd,),
            b + "attn_k_norm.weight": (hd,),
        }
    hv = cfg.linear_num_value_heads
    kd, vd = cfg.linear_num_key_heads * cfg.linear_key_head_dim, hv * cfg.linear_value_head_dim
    out = {
        b + "ssm_ba.weight": (2 * hv, h),
        b + "ssm_conv1d.weight": (2 * kd + vd, cfg.linear_conv_kernel_dim),
        b + "ssm_a": (hv,),
        b + "ssm_dt.bias": (hv,),
        b + "ssm_norm.weight": (cfg.linear_value_head_dim,),
        b + "ssm_out.weight": (h, vd),
    }
    if b + "ssm_in.weight" in present:
        out[b + "ssm_in.weight"] = (2 * kd + 2 * vd, h)
    else:
        out.update({b + "attn_qkv.weight": (2 * kd + vd, h), b + "attn_gate.weight": (vd, h)})
    return out


def expected_tensors(arch: str, cfg: Any, with_mtp: bool,
                     present: Collection[str] = ()) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(GGUF name → numpy shape for every tensor the model needs, names that may be absent).

    `cfg` is a `strata.config.ModelConfig`; `present`, the file's tensor names, picks between a
    layer's alternative layouts. Numpy shapes are GGUF dims reversed (torch order). `with_mtp`: the
    MTP blocks too (`cfg.num_nextn_predict_layers` of them after the decoder's).
    """
    h, v, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (v, h),
        "output_norm.weight": (h,),
        "output.weight": (v, h),
    }
    optional = {"output.weight"}
    n_layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if with_mtp else 0)
    for i in range(n_layers):
        b = f"blk.{i}."
        post_norm = "post_attention_norm.weight" if arch in ("glm4moe", "qwen3next") else "ffn_norm.weight"
        out.update({b + "attn_norm.weight": (h,), b + post_norm: (h,)})
        if arch == "qwen3next":
            out.update(_hybrid_mixer(b, i, cfg, present))
        else:
            out.update({
                b + "attn_q.weight": (q, h),
                b + "attn_k.weight": (kv, h),
                b + "attn_v.weight": (kv, h),
                b + "attn_output.weight": (h, q),
            })
            if cfg.attention_bias:
                out.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
            if cfg.use_qk_norm:
                out.update({b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)})
        mtp = i >= cfg.num_hidden_layers
        # A Qwen3-Next MTP layer is MoE whenever the model is (`HybridDecoderLayer`).
        moe = cfg.is_moe if mtp and arch == "qwen3next" else cfg.layer_is_moe(i)
        if moe:
            e, mi = cfg.num_experts, cfg.moe_intermediate_size
            out.update({
                b + "ffn_gate_inp.weight": (e, h),
                b + "ffn_gate_exps.weight": (e, mi, h),
                b + "ffn_up_exps.weight": (e, mi, h),
                b + "ffn_down_exps.weight": (e, h, mi),
            })
            if cfg.n_shared_experts:
                si = mi * cfg.n_shared_experts
                out.update({
                    b + "ffn_gate_shexp.weight": (si, h),
                    b + "ffn_up_shexp.weight": (si, h),
                    b + "ffn_down_shexp.weight": (h, si),
                })
            if arch == "qwen3next":
                si = cfg.shared_expert_intermediate_size
                out.update({
                    b + "ffn_gate_shexp.weight": (si, h),
                    b + "ffn_up_shexp.weight": (si, h),
                    b + "ffn_down_shexp.weight": (h, si),
                    b + "ffn_gate_inp_shexp.weight": (1, h),
                })
            if cfg.scoring == "sigmoid":
                out[b + "exp_probs_b.bias"] = (e,)
        else:
            it = cfg.intermediate_size
            out.update({b + "ffn_gate.weight": (it, h), b + "ffn_up.weight": (it, h), b + "ffn_down.weight": (h, it)})
        if mtp:
            own = {
                b + "nextn.eh_proj.weight": (h, 2 * h),
                b + "nextn.enorm.weight": (h,),
                b + "nextn.hnorm.weight": (h,),
                b + "nextn.shared_head_norm.weight": (h,),
                b + "nextn.shared_head_head.weight": (v, h),
                b + "nextn.embed_tokens.weight": (v, h),
            }
            out.update(own)
            optional |= {b + "nextn.shared_head_head.weight", b + "nextn.embed_tokens.weight"}
            if arch in MTP_HEAD_TENSORS and i > cfg.num_hidden_layers:
                # One head, read from the first MTP block; later ones may repeat it (llama.cpp's Qwen3.5
                # converter writes it in each).
                optional |= own.keys()
    return out, optional
