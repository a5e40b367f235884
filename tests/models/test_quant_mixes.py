"""Per-tensor format mixes (`strata.kernels.quant.mixes`): Q4_K_M's choice of Q6_K tensors, and a
random Q4_K_M model whose mixed q|k|v stacks stay quantized and decode through the engine."""

from __future__ import annotations

import time

import torch

from strata.bench.random_model import random_model
from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.kernels.quant import QWeight, QWeightStack
from strata.kernels.quant.mixes import more_bits, tensor_type
from strata.models.quantize import qweights_of
from strata.params import SamplingParams


def test_q4_k_m_gives_more_bits_to_the_ends_and_every_third_layer():
    assert [i for i in range(36) if more_bits(i, 36)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35]
    assert tensor_type("Q4_K_M", "model.layers.0.self_attn.v_proj.weight", 36) == "Q6_K"
    assert tensor_type("Q4_K_M", "model.layers.4.self_attn.v_proj.weight", 36) == "Q4_K"
    assert tensor_type("Q4_K_M", "model.layers.6.mlp.down_proj.weight", 36) == "Q6_K"
    assert tensor_type("Q4_K_M", "model.layers.0.self_attn.q_proj.weight", 36) == "Q4_K"
    assert tensor_type("Q4_K_M", "model.layers.0.mlp.experts.5.down_proj.weight", 36) == "Q6_K"
    assert tensor_type("Q4_K_M", "lm_head.weight", 36) == "Q6_K"
    assert tensor_type("Q8_0", "lm_head.weight", 36) == "Q8_0"  # a single format: every weight


def test_a_q4_k_m_random_model_keeps_its_mixed_stacks_quantized_and_decodes():
    loaded = random_model("tiny-256", "cpu", torch.float32, quant="Q4_K_M")
    layers = loaded.model.model.layers
    assert isinstance(layers[0].self_attn.qkv_q, QWeight) and layers[0].self_attn.qkv_q.ggml_type == "Q4_K"
    stack = layers[1].self_attn.qkv_q  # the last layer gets more bits: its attn_v is Q6_K
    assert isinstance(stack, QWeightStack) and stack.ggml_type == "Q4_K+Q4_K+Q6_K"
    assert layers[1].mlp.down_q.ggml_type == "Q6_K" and layers[0].mlp.down_q.ggml_type == "Q4_K"
    assert loaded.model.lm_head_q.ggml_type == "Q6_K"
    e = LLMEngine(EngineConfig(device="cpu", dtype="float32", ctx=64, parallel=1), progress=False, loaded=loaded)
    e.add_request(EngineRequest("a", tuple(range(1, 9)), SamplingParams(max_tokens=3, ignore_eos=True), time.monotonic()))
    tokens = [t for ev in e.run_to_completion()["a"] for t in ev.token_ids]
    assert len(tokens) == 3 and all(0 <= t < loaded.config.vocab_size for t in tokens)


def test_the_dequant_buffer_fits_the_largest_projection_not_the_lm_head():
    """`CausalLM._share_dequant_buffer` (CUDA's pack calls it): one buffer, the size of the largest
    weight a read multiplies, shared by every projection; the LM head (sampling rows only) and the
    embedding table kept quantized (looked up) get none."""
    model = random_model("tiny-256", "cpu", torch.float32, quant="Q8_0").model
    model._share_dequant_buffer(torch.bfloat16)
    table = model.model.embed_tokens.q
    projections = [q for q in qweights_of(model) if q is not model.lm_head_q and q is not table]
    buf = projections[0].dequant_buf
    assert buf is not None and buf.dtype == torch.bfloat16
    assert all(q.dequant_buf is buf for q in projections) and model.lm_head_q.dequant_buf is None
    assert table.dequant_buf is None and table.workspace is None
    assert buf.numel() == max(q.n * q.k for q in projections)
