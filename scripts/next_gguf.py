"""Writes a random-weight Qwen3-Next GGUF in llama.cpp's `qwen3next` layout at a `strata bench` shape, so
llama-bench times the shape `strata bench read|decode --shape` times. Every matrix is bf16 or
random Q8_0 or IQ3_S blocks; what llama.cpp's converter and quantizer keep in F32 is F32 here too (norms, the
router, the shared expert's gate, the conv kernel, ssm_a, ssm_dt.bias). Tensors are made (on the GPU
when there is one) and written one at a time, so the host holds at most one tensor (1 GiB at the 80B
expert stacks in bf16). The tokenizer fields come from a vocab-only GGUF (llama.cpp ships
`models/ggml-vocab-qwen2.gguf`), without which llama.cpp refuses the file.

The MTP layer is left out unless `--mtp`: llama-bench never runs it, and llama.cpp's qwen3next loader
creates no tensor for it and refuses a file holding tensors it did not create ("wrong number of
tensors"). With `--mtp` the file is for Strata (`--spec`): the layer as llama.cpp writes DeepSeek's and
GLM-4.5's, counted in block_count and `nextn_predict_layers`, block L = num_hidden_layers a full-attention
MoE block under qwen3next's names plus the head's nextn.eh_proj / enorm / hnorm / shared_head_norm.

    python3 scripts/next_gguf.py /tmp/peer_next.gguf --shape qwen3-next-80b-a3b-12l --type bf16 \
        --vocab /tmp/llama/models/ggml-vocab-qwen2.gguf
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
import time
from typing import Any, Callable

import gguf
import numpy as np
import torch

from strata.bench.random_model import INIT_STD, SHAPES, shape_config
from strata.config import ModelConfig
from strata.kernels.quant import random_blocks
from strata.loaders.gguf import open_reader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quant_gguf import copy_tokenizer  # noqa: E402

ARCH = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3NEXT]
QT = gguf.GGMLQuantizationType
TYPES = {"bf16": (QT.BF16, gguf.LlamaFileType.MOSTLY_BF16), "Q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
         "IQ3_S": (QT.IQ3_S, gguf.LlamaFileType.MOSTLY_IQ3_S)}
# What a tensor holds: `matrix` in the file's type; the rest F32 (`random`, `ones`, `ssm_a`).
MATRIX, RANDOM, ONES, SSM_A = "matrix", "random", "ones", "ssm_a"


def _config(cfg: ModelConfig | dict[str, Any]) -> ModelConfig:
    cfg = cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_hf(dict(cfg))
    if cfg.model_type != "qwen3_next":
        raise ValueError(f"a qwen3_next config is needed, not {cfg.model_type}")
    if not cfg.is_hybrid or not all(cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers)):
        raise ValueError("llama.cpp's qwen3next has MoE blocks only, with linear-attention layers")
    if cfg.linear_key_head_dim != cfg.linear_value_head_dim:
        raise ValueError("llama.cpp's qwen3next takes ssm.state_size as both the key and the value head size")
    if cfg.rope.kind != "default":
        raise ValueError(f"rope scaling {cfg.rope.kind!r} is not written")
    return cfg


def mtp_layers(cfg: ModelConfig, mtp: bool) -> int:
    """The MTP layers written: the config's (one if it names none) with `mtp`, else none."""
    return (cfg.num_nextn_predict_layers or 1) if mtp else 0


def metadata(cfg: ModelConfig, mtp: bool = False) -> dict[str, int | float | list[bool]]:
    """`qwen3next.*` keys → values, as llama.cpp's loader reads them (llama-model.cpp `load_hparams`,
    models/qwen3next.cpp `load_arch_hparams`); with `mtp`, the MTP layers counted in block_count."""
    nextn = mtp_layers(cfg, mtp)
    every = cfg.layer_types.index("full_attention") + 1 if "full_attention" in cfg.layer_types else 0
    periodic = every > 0 and all(cfg.layer_is_linear(i) == ((i + 1) % every != 0) for i in range(cfg.num_hidden_layers))
    meta: dict[str, int | float | list[bool]] = {
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers + nextn,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": cfg.head_dim,
        "attention.value_length": cfg.head_dim,
        "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        "rope.freq_base": cfg.rope.theta,
        "rope.dimension_count": cfg.rotary_dim,
        "expert_count": cfg.num_experts,
        "expert_used_count": cfg.num_experts_per_tok,
        "expert_feed_forward_length": cfg.moe_intermediate_size,
        # Without it llama.cpp sizes the shared expert by feed_forward_length.
        "expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size,
        "ssm.conv_kernel": cfg.linear_conv_kernel_dim,
        "ssm.state_size": cfg.linear_key_head_dim,
        "ssm.group_count": cfg.linear_num_key_heads,
        "ssm.time_step_rank": cfg.linear_num_value_heads,
        "ssm.inner_size": cfg.linear_num_value_heads * cfg.linear_value_head_dim,
    }
    if periodic:
        meta["full_attention_interval"] = every
    else:
        recurrent = [cfg.layer_is_linear(i) for i in range(cfg.num_hidden_layers)]
        meta["attention.recurrent_layers"] = recurrent + [False] * nextn  # MTP layers: full attention
    if nextn:
        meta["nextn_predict_layers"] = nextn
    return meta


def tensor_plan(cfg: ModelConfig, mtp: bool = False) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape, what it holds) for every tensor llama.cpp's qwen3next creates for the
    trunk (models/qwen3next.cpp `load_arch_tensors`: separate q/k/v in attention layers, attn_qkv +
    attn_gate in linear ones, separate gate/up expert stacks); with `mtp`, the MTP layers after it
    (full attention, MoE; the head's own tensors in the first)."""
    h, v, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    kd, vd = cfg.linear_num_key_heads * cfg.linear_key_head_dim, hv * dv
    e, mi, si = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    plan = [("token_embd.weight", (v, h), MATRIX), ("output_norm.weight", (h,), ONES), ("output.weight", (v, h), MATRIX)]
    for i in range(cfg.num_hidden_layers + mtp_layers(cfg, mtp)):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (h,), ONES), (b + "post_attention_norm.weight", (h,), ONES)]
        if i == cfg.num_hidden_layers:  # the MTP head: eh_proj takes [embedding; hidden state]
            plan += [
                (b + "nextn.eh_proj.weight", (h, 2 * h), MATRIX),
                (b + "nextn.enorm.weight", (h,), ONES),
                (b + "nextn.hnorm.weight", (h,), ONES),
                (b + "nextn.shared_head_norm.weight", (h,), ONES),
            ]
        if i < cfg.num_hidden_layers and cfg.layer_is_linear(i):
            plan += [
                (b + "attn_qkv.weight", (2 * kd + vd, h), MATRIX),
                (b + "attn_gate.weight", (vd, h), MATRIX),
                (b + "ssm_ba.weight", (2 * hv, h), MATRIX),
                (b + "ssm_conv1d.weight", (2 * kd + vd, cfg.linear_conv_kernel_dim), RANDOM),
                (b + "ssm_a", (hv,), SSM_A),
                (b + "ssm_dt.bias", (hv,), RANDOM),
                (b + "ssm_norm.weight", (dv,), ONES),
                (b + "ssm_out.weight", (h, vd), MATRIX),
            ]
        else:
            plan += [
                (b + "attn_q.weight", (2 * q, h), MATRIX),  # the query and its output gate
                (b + "attn_k.weight", (kv, h), MATRIX),
                (b + "attn_v.weight", (kv, h), MATRIX),
                (b + "attn_output.weight", (h, q), MATRIX),
                (b + "attn_q_norm.weight", (hd,), ONES),
                (b + "attn_k_norm.weight", (hd,), ONES),
            ]
        plan += [
            (b + "ffn_gate_inp.weight", (e, h), RANDOM),
            (b + "ffn_gate_exps.weight", (e, mi, h), MATRIX),
            (b + "ffn_up_exps.weight", (e, mi, h), MATRIX),
            (b + "ffn_down_exps.weight", (e, h, mi), MATRIX),
            (b + "ffn_gate_inp_shexp.weight", (1, h), RANDOM),
            (b + "ffn_gate_shexp.weight", (si, h), MATRIX),
            (b + "ffn_up_shexp.weight", (si, h), MATRIX),
            (b + "ffn_down_shexp.weight", (h, si), MATRIX),
        ]
    return plan


def _stored(shape: tuple[int, ...], kind: str, qtype: QT) -> tuple[QT, tuple[int, ...]]:
    """(GGML type, shape in bytes) of a tensor as written."""
    t = qtype if kind == MATRIX else QT.F32
    block, size = gguf.GGML_QUANT_SIZES[t]
    if shape[-1] % block:
        raise ValueError(f"rows of {shape[-1]} values are not whole {t.name} blocks of {block}")
    return t, (*shape[:-1], shape[-1] // block * size)


def _make(shape: tuple[int, ...], kind: str, qtype: QT, gen: torch.Generator, device: torch.device) -> np.ndarray:
    """A tensor's bytes. Values as `strata.bench.random_model` makes them: matrices ~ N(0, 0.02), norms 1,
    A_log ~ N(0, 0.02) stored as llama.cpp's converter stores it, -exp(A_log)."""
    if kind == ONES:
        return np.ones(shape, dtype=np.float32).view(np.uint8)
    if kind == MATRIX and qtype != QT.BF16:
        rows = math.prod(shape[:-1])
        raw = random_blocks(qtype.name, rows, shape[-1], gen, device)
        return raw.cpu().numpy().reshape(*shape[:-1], -1)
    dtype = torch.bfloat16 if kind == MATRIX else torch.float32
    x = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, INIT_STD, generator=gen)
    if kind == SSM_A:
        x = -torch.exp(x)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    return x.view(bits).cpu().numpy().view(np.uint8)


def write_next_gguf(path: str | os.PathLike, cfg: ModelConfig | dict[str, Any], wtype: str = "bf16",
                    vocab: str | None = None, seed: int = 0, device: str | torch.device | None = None,
                    model_name: str = "random qwen3next", log: Callable[[str], None] | None = None,
                    mtp: bool = False) -> tuple[int, int]:
    """Writes the GGUF for `cfg` (a qwen3_next `ModelConfig`, or its HF config dict) at `path`, the
    matrices in `wtype` ("bf16", "Q8_0" or "IQ3_S"), the tokenizer copied from the vocab-only GGUF `vocab`
    (whose token count must be the config's vocab_size); with `mtp`, the MTP layer too (a file
    llama.cpp refuses; see the module docstring). Refuses before writing when the disk lacks the
    room. The file appears at `path` only once whole (written as `path`.part, then renamed).
    Returns (file bytes, tensor count)."""
    cfg = _config(cfg)
    path = os.fspath(path)
    part = path + ".part"
    if os.path.exists(part):
        os.remove(part)  # a write cut short, whose room the check below may count on
    qtype, file_type = TYPES[wtype]
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator(device=device).manual_seed(seed)
    plan = tensor_plan(cfg, mtp)
    blocks = cfg.num_hidden_layers + mtp_layers(cfg, mtp)
    stored = [_stored(shape, kind, qtype) for _, shape, kind in plan]
    planned = sum(gguf.GGUFWriter.ggml_pad(math.prod(s), gguf.GGUF_DEFAULT_ALIGNMENT) for _, s in stored)
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    if planned + (1 << 30) > free:
        raise OSError(f"{path}: needs {planned / 2**30:.1f} GiB (+1 GiB spare), the disk has {free / 2**30:.1f} GiB free")

    w = gguf.GGUFWriter(part, ARCH)
    w.add_name(model_name)
    w.add_file_type(file_type)
    for key, value in metadata(cfg, mtp).items():
        full = f"{ARCH}.{key}"
        if isinstance(value, list):
            w.add_array(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, int(value))
    if vocab:
        # llama.cpp sizes the embedding by the token list.
        n_tokens = len(open_reader(vocab).fields["tokenizer.ggml.tokens"].data)
        if n_tokens != cfg.vocab_size:
            raise ValueError(f"{vocab} has {n_tokens} tokens, the shape's vocab_size is {cfg.vocab_size}")
        copy_tokenizer(w, vocab)
    for (tensor, _, _), (t, byte_shape) in zip(plan, stored):
        w.add_tensor_info(tensor, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0, layer = time.perf_counter(), -1
    for tensor, shape, kind in plan:
        if log and tensor.startswith("blk.") and int(tensor.split(".")[1]) != layer:
            layer = int(tensor.split(".")[1])
            log(f"layer {layer + 1}/{blocks} ({time.perf_counter() - t0:.0f} s)")
        w.write_tensor_data(_make(shape, kind, qtype, gen, device))
    w.close()
    os.replace(part, path)
    return os.path.getsize(path), len(plan)


def main() -> None:
    next_shapes = sorted(s for s, d in SHAPES.items() if d["model_type"] == "qwen3_next")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--shape", default="qwen3-next-80b-a3b-12l", choices=next_shapes)
    p.add_argument("--type", default="bf16", choices=sorted(TYPES))
    p.add_argument("--vocab", default=None, help="a vocab-only GGUF whose tokenizer.* fields are copied "
                   "(llama.cpp needs them; Strata reads the file without)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="the first N of the shape's layers (quick checks)")
    p.add_argument("--mtp", action="store_true", help="also write the MTP layer (blk.L + nextn.*, "
                   "nextn_predict_layers), for Strata's --spec; off by default because llama.cpp refuses "
                   "a qwen3next file with tensors it does not create, so llama-bench cannot read it")
    args = p.parse_args()
    cfg = shape_config(args.shape)
    if args.layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers, layer_types=cfg.layer_types[: args.layers])
    if not args.vocab:
        print("no --vocab: llama.cpp will refuse a file without tokenizer fields", file=sys.stderr)
    t0 = time.perf_counter()
    size, count = write_next_gguf(args.out, cfg, args.type, args.vocab, args.seed, model_name=f"random {args.shape}",
                                  log=lambda s: print(s, file=sys.stderr, flush=True), mtp=args.mtp)
    linear = sum(cfg.layer_is_linear(i) for i in range(cfg.num_hidden_layers))
    print(f"wrote {args.out}: {args.shape} {args.type}, {size / 2**30:.2f} GiB ({size} bytes), {count} tensors, "
          f"{cfg.num_hidden_layers} layers ({linear} linear-attention + {cfg.num_hidden_layers - linear} full-attention, "
          f"{'+ MTP layer, not for llama.cpp' if args.mtp else 'no MTP layer'}) in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
