"""Writes a random-weight GGUF at a `strata bench` shape (dense qwen3, or qwen3_moe such as
qwen3-30b-a3b) with every linear weight (and the embedding table) in one quantized format, for timing
llama.cpp on the same formats `strata bench quant` and `strata bench offload` time. The blocks are random valid ones made on the device by the same
`random_blocks` the bench uses; norms are ones. The tokenizer fields come from a vocab-only GGUF
(llama.cpp ships `models/ggml-vocab-qwen2.gguf`).

    python3 scripts/quant_gguf.py OUT.gguf Q4_K --vocab /tmp/llama/models/ggml-vocab-qwen2.gguf
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np
import torch

from strata.bench.random_model import shape_config
from strata.kernels.quant import FORMATS, random_blocks

FILE_TYPES = {"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_S,
              "IQ3_S": gguf.LlamaFileType.MOSTLY_IQ3_S}


def copy_tokenizer(writer: gguf.GGUFWriter, vocab_path: str) -> None:
    reader = gguf.GGUFReader(vocab_path)
    for f in reader.fields.values():
        if not f.name.startswith("tokenizer."):
            continue
        kind = f.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            parts = [f.parts[i] for i in f.data]
            if f.types[1] == gguf.GGUFValueType.STRING:
                writer.add_array(f.name, [bytes(p).decode("utf-8", errors="replace") for p in parts])
            else:
                writer.add_array(f.name, [p.tolist()[0] for p in parts])
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(f.name, bytes(f.parts[f.data[0]]).decode())
        else:
            writer.add_key_value(f.name, f.parts[f.data[0]].tolist()[0], kind)


def _writer(args, mc, layers: int, arch: str) -> gguf.GGUFWriter:
    """A writer with the tokenizer and the keys a qwen3 / qwen3moe file shares."""
    w = gguf.GGUFWriter(args.out, arch)
    copy_tokenizer(w, args.vocab)
    w.add_context_length(mc.max_position_embeddings)
    w.add_embedding_length(mc.hidden_size)
    w.add_block_count(layers)
    w.add_feed_forward_length(mc.intermediate_size)
    w.add_head_count(mc.num_attention_heads)
    w.add_head_count_kv(mc.num_key_value_heads)
    w.add_key_length(mc.head_dim)
    w.add_value_length(mc.head_dim)
    w.add_rope_freq_base(mc.rope.theta)
    w.add_layer_norm_rms_eps(mc.rms_norm_eps)
    w.add_file_type(FILE_TYPES[args.format])
    return w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("format", choices=FORMATS)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--vocab", required=True, help="a vocab-only GGUF whose tokenizer.* fields are copied")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (quick checks)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    mc = shape_config(args.shape)
    layers = args.layers or mc.num_hidden_layers
    if mc.model_type == "qwen3_moe":
        return write_moe(args, mc, layers)
    if mc.is_moe or mc.model_type != "qwen3":
        raise SystemExit(f"{args.shape}: only qwen3 and qwen3_moe shapes are written")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    qtype = getattr(gguf.GGMLQuantizationType, args.format)
    w = _writer(args, mc, layers, "qwen3")
    hd, nh, nkv = mc.head_dim, mc.num_attention_heads, mc.num_key_value_heads

    def linear(name: str, n: int, k: int) -> None:
        raw = random_blocks(args.format, n, k, gen, device).cpu().numpy()
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    h, ff = mc.hidden_size, mc.intermediate_size
    linear("token_embd.weight", mc.vocab_size, h)
    norm("output_norm.weight", h)
    linear("output.weight", mc.vocab_size, h)
    for i in range(layers):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight", h)
        norm(b + "ffn_norm.weight", h)
        norm(b + "attn_q_norm.weight", hd)
        norm(b + "attn_k_norm.weight", hd)
        linear(b + "attn_q.weight", nh * hd, h)
        linear(b + "attn_k.weight", nkv * hd, h)
        linear(b + "attn_v.weight", nkv * hd, h)
        linear(b + "attn_output.weight", h, nh * hd)
        linear(b + "ffn_gate.weight", ff, h)
        linear(b + "ffn_up.weight", ff, h)
        linear(b + "ffn_down.weight", h, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", args.out, args.format)


def write_moe(args, mc, layers: int) -> None:
    """qwen3moe: each layer's experts as llama.cpp stores them, one [E, I, H] stack per projection.
    Tensors are made and written one at a time (a 30B-A3B file is ~32 GB in Q8_0)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    qtype = getattr(gguf.GGMLQuantizationType, args.format)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    h, hd, nh, nkv = mc.hidden_size, mc.head_dim, mc.num_attention_heads, mc.num_key_value_heads
    e, mi = mc.num_experts, mc.moe_intermediate_size
    plan = [("token_embd.weight", (mc.vocab_size, h), True), ("output_norm.weight", (h,), False),
            ("output.weight", (mc.vocab_size, h), True)]
    for i in range(layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (h,), False), (b + "ffn_norm.weight", (h,), False),
                 (b + "attn_q_norm.weight", (hd,), False), (b + "attn_k_norm.weight", (hd,), False),
                 (b + "attn_q.weight", (nh * hd, h), True), (b + "attn_k.weight", (nkv * hd, h), True),
                 (b + "attn_v.weight", (nkv * hd, h), True), (b + "attn_output.weight", (h, nh * hd), True),
                 (b + "ffn_gate_inp.weight", (e, h), False), (b + "ffn_gate_exps.weight", (e, mi, h), True),
                 (b + "ffn_up_exps.weight", (e, mi, h), True), (b + "ffn_down_exps.weight", (e, h, mi), True)]
    w = _writer(args, mc, layers, "qwen3moe")
    w.add_expert_count(e)
    w.add_expert_used_count(mc.num_experts_per_tok)
    w.add_expert_feed_forward_length(mi)
    for name, shape, quantized in plan:
        if quantized:
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, quantized in plan:
        if quantized:
            rows = int(np.prod(shape[:-1]))
            w.write_tensor_data(random_blocks(args.format, rows, shape[-1], gen, device).cpu().numpy()
                                .reshape(*shape[:-1], -1))
        elif name.endswith("ffn_gate_inp.weight"):
            w.write_tensor_data(torch.randn(shape, generator=torch.Generator().manual_seed(len(name))).mul_(0.02)
                                .numpy())
        else:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
    w.close()
    print("wrote", args.out, args.format, f"({layers} layers)")


if __name__ == "__main__":
    main()
