"""Tiny random HF models built offline from configs, shared by the tests (and the GPU test)."""

from __future__ import annotations

import os

import torch

ARCH_CONFIGS: dict[str, dict] = {
    "qwen3": dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    "glm4_moe": dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        num_nextn_predict_layers=1, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
    ),
    "qwen3_next": dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[2],
    ),
}


def build_hf_model(arch: str, seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(arch, **{**ARCH_CONFIGS[arch], **overrides})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # Random init leaves routing biases and norms at trivial values; perturb them so the test sees them.
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("norm.weight"):
                t.add_(0.1 * torch.randn_like(t))
            if name.endswith("bias"):
                t.normal_(0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model


def save_hf_model(model, path: str) -> str:
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


TOKENIZER_TEXT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep. It is a truth universally acknowledged, that a single "
    "man in possession of a good fortune, must be in want of a wife. To be, or not to be, that is the "
    "question. Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune. "
) * 4


def save_tiny_tokenizer(path: str, vocab_size: int = 320) -> None:
    """A byte-level BPE with ChatML specials, trained in milliseconds on a fixed text."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tk.train_from_iterator([TOKENIZER_TEXT], trainer)
    tk.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "bos_token": None, "add_bos_token": False}, f)


def save_tiny_model(arch: str, path: str, seed: int = 0, **overrides):
    """HF model + tokenizer in `path`; returns the HF model (fp32, eval)."""
    model = build_hf_model(arch, seed=seed, **overrides)
    save_hf_model(model, path)
    save_tiny_tokenizer(path, model.config.vocab_size)
    return model
