"""Models with random weights at named shapes, built straight on the target device (no checkpoint).

Throughput does not depend on the weights' values, only on their shapes, dtype and (for MoE) on the
routing spreading tokens over the experts, which a random router does. So the benchmarks skip writing
and reading a checkpoint: `random_model` builds Strata's model on the meta device, gives every tensor
real storage on the device (matrices ~ N(0, 0.02), norm weights 1, biases and the routing correction
bias 0) and runs the loader's post-load steps, returning the `LoadedModel` an `LLMEngine` takes.
`random_hf_model` builds HF transformers' model from the same config with its own random init.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from strata import loaders
from strata.config import ModelConfig
from strata.kernels.quant import format_module
from strata.kernels.quant.mixes import tensor_type
from strata.loaders import LoadedModel
from strata.models.layers import rope_inv_freq
from strata.models.registry import build_model
from strata.tokenizer import Tokenizer

INIT_STD = 0.02

_QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                 num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False)

_QWEN3_NEXT_80B = dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
                       num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                       linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_num_key_heads=16, linear_num_value_heads=32, full_attention_interval=4,
                       num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                       shared_expert_intermediate_size=512, norm_topk_prob=True, partial_rotary_factor=0.25,
                       max_position_embeddings=262144, rope_theta=10000000.0, tie_word_embeddings=False)

# HF config.json spellings (what `ModelConfig.from_hf` and `AutoConfig.for_model` both read).
SHAPES: dict[str, dict] = {
    "qwen3-8b": _QWEN3_8B,
    # Qwen3's published recipe for 128K context: YaRN, factor 4 over the native 32K.
    "qwen3-8b-128k": {**{k: v for k, v in _QWEN3_8B.items() if k != "rope_theta"},
                      "max_position_embeddings": 131072,
                      "rope_parameters": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768,
                                              rope_theta=1000000.0)},
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False),
    # Qwen3-Next-80B-A3B's published config; 48 layers need ~160 GB in bf16, so the `-36l` shape keeps
    # as many as fit one H200 (the layers repeat: per-layer speed is the same).
    "qwen3-next-80b-a3b": _QWEN3_NEXT_80B,
    "qwen3-next-80b-a3b-36l": {**_QWEN3_NEXT_80B, "num_hidden_layers": 36},
    # 9 linear-attention + 3 full-attention layers: the size of a bf16 GGUF (scripts/next_gguf.py) that
    # fits the device's disk beside llama.cpp, so both engines time the same model.
    "qwen3-next-80b-a3b-12l": {**_QWEN3_NEXT_80B, "num_hidden_layers": 12},
    "tiny-next": dict(model_type="qwen3_next", vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                      linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=32, norm_topk_prob=True,
                      partial_rotary_factor=0.25, max_position_embeddings=4096),
    "tiny": dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
    # Every K a multiple of 256, as the 256-value super-blocks of Q4_K / IQ3_S need.
    "tiny-256": dict(model_type="qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                     tie_word_embeddings=False),
    "tiny-moe": dict(model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                     max_position_embeddings=4096),
}


def shape_config(shape: str) -> ModelConfig:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (known: {', '.join(sorted(SHAPES))})")
    return ModelConfig.from_hf(dict(SHAPES[shape]))


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer whose token i is the word `t{i}`: every id in the shape's vocabulary is
    valid and decodes to text of its own, so the server streams one text chunk per token."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    tk = tokenizers.Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(tk=tk)


def _fill(t: torch.Tensor, name: str, gen: torch.Generator) -> torch.Tensor:
    attr = name.rpartition(".")[2]
    if attr == "bias" or attr == "e_score_correction_bias":
        return t.zero_()
    if attr == "weight" and t.dim() == 1:  # RMSNorm weights: the only 1-D weights
        return t.fill_(1.0)
    return t.normal_(0.0, INIT_STD, generator=gen)


@torch.no_grad()
def random_model(shape: str, device: str | torch.device, dtype: torch.dtype, seed: int = 0,
                 tokenizer: Tokenizer | None = None, quant: str | None = None) -> LoadedModel:
    """Strata's model for `shape` with random weights on `device` in `dtype`, ready for
    `LLMEngine(cfg, loaded=...)`: packed and in eval mode, as `load_model` leaves it. `quant` (a GGUF
    type of `strata.kernels.quant`, or a mix of them such as "Q4_K_M": `strata.kernels.quant.mixes`): the linear weights a GGUF load would keep quantized (MoE experts
    included) are random blocks of that format instead, as `load_model(keep_quantized=True)` leaves
    them; weights whose rows are not whole blocks of the format stay float. `quant="FP8"`: the float
    weights made e4m3 after packing, as `--quantize fp8` does at load."""
    if quant == "FP8":
        from strata.models.quantize import quantize_fp8

        loaded = random_model(shape, device, dtype, seed, tokenizer)
        quantize_fp8(loaded.model)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # the float weights quantize_fp8 dropped
        return loaded
    device = torch.device(device)
    cfg = shape_config(shape)
    with torch.device("meta"):
        model = build_model(cfg, with_mtp=False)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    quantized = loaders._quantizable_linears(model) if quant else set()
    # One tensor at a time, straight into its parameter, as the loader assigns weights: the peak is
    # the model itself, never a second copy of it.
    for name, p in list(model.named_parameters()):
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        fmt = tensor_type(quant, name, cfg.num_hidden_layers) if quant else None
        if name in quantized and p.shape[1] % format_module(fmt).BLOCK_VALUES == 0:
            from strata.kernels.quant import random_blocks

            module = model.get_submodule(name.rpartition(".")[0])
            module.quant_raw = (fmt, random_blocks(fmt, p.shape[0], p.shape[1], gen, device))
            continue
        value = _fill(torch.empty(p.shape, device=device, dtype=dtype), name, gen)
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, nn.Parameter(value, requires_grad=False))
    persistent = set(model.state_dict())
    for name, b in list(model.named_buffers()):
        module_name, _, attr = name.rpartition(".")
        if name == "rotary.inv_freq":
            value = rope_inv_freq(cfg.rope, cfg.rotary_dim)[0].to(device)  # computed, as the loader does
        elif attr == "e_score_correction_bias":
            value = torch.zeros(b.shape, device=device, dtype=torch.float32)  # the loader keeps it fp32
        else:
            # A buffer this function does not know how to make: fail here rather than benchmark garbage.
            raise ValueError(f"random_model: no rule for buffer {name!r} of {cfg.model_type}")
        model.get_submodule(module_name).register_buffer(attr, value, persistent=name in persistent)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    _post_load(model, device, dtype)
    model.eval()
    return LoadedModel(model=model, config=cfg, tokenizer=tokenizer, path=f"random:{shape}", has_mtp=False)


def _post_load(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    loaders._pack(model, device, dtype)  # what `load_model` does after assigning weights


def with_tokenizer(loaded: LoadedModel, tokenizer: Tokenizer | None) -> LoadedModel:
    """The same model (shared, not copied) with another tokenizer."""
    return dataclasses.replace(loaded, tokenizer=tokenizer)


def random_hf_model(shape: str, device: str | torch.device, dtype: torch.dtype, seed: int = 0):
    """HF transformers' model for `shape`, random-initialised by HF on `device` (its own weights:
    the comparison is of speed only)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(SHAPES[shape])
    model_type = d.pop("model_type")
    torch.manual_seed(seed)
    with torch.device(torch.device(device)):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **d), dtype=dtype)
    return model.eval()


def timed(fn, device: torch.device):
    """(fn(), seconds), with the device's queue drained before the clock stops."""
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0
