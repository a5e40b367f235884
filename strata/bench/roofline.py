"""What a step must move and compute, and what this device can move and compute: the benchmarks'
yardsticks for "how far from the hardware".

Counts come from `ModelConfig` alone, so they can be checked by hand. Decode is memory-bound: a step
at batch b reads every dense weight once, the K/V of every sequence, and for MoE only the experts its
b·k routings land on (E·(1 - (1 - k/E)^b) per layer in expectation when routing is uniform). A
prompt read is compute-bound: 2 flops per active parameter per token plus causal attention.
The ceilings are measured in the same process: a device-to-device copy (bandwidth) and a square GEMM
(compute), each timed with CUDA events, the median of several runs after a warm-up.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from strata.config import ModelConfig
from strata.kvcache.pool import kv_bytes_per_token


def attention_params(cfg: ModelConfig, layer: int = 0) -> int:
    """The token mixer of `layer`: q, k, v, o projections (+ biases) and the per-head q/k norms (a hybrid
    model's full attention also projects a per-head output gate), or a linear-attention layer's."""
    if cfg.layer_is_linear(layer):
        return linear_attention_params(cfg)
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    gate = q if cfg.is_hybrid else 0
    n = h * (q + gate) + 2 * h * kv + q * h
    if cfg.attention_bias:
        n += q + gate + 2 * kv + (h if cfg.is_hybrid else 0)
    if cfg.use_qk_norm:
        n += 2 * d
    return n


def linear_attention_params(cfg: ModelConfig) -> int:
    """A Gated DeltaNet layer: q|k|v|z and b|a projections, the depthwise conv, per-head decay
    parameters, the gated norm and the output projection."""
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    kd, vd = cfg.linear_num_key_heads * cfg.linear_key_head_dim, hv * cfg.linear_value_head_dim
    conv = (2 * kd + vd) * cfg.linear_conv_kernel_dim
    return h * (2 * kd + 2 * vd) + h * 2 * hv + conv + 2 * hv + cfg.linear_value_head_dim + vd * h


def linear_attention_flops(cfg: ModelConfig) -> float:
    """Per token and linear layer, the delta rule's state work: decay, S^T k, the rank-1 update and
    S^T q over the [Dk, Dv] state of each value head (~8 flops per state element)."""
    return 8.0 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim


def expert_params(cfg: ModelConfig) -> int:
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts that `batch` tokens, each routed to `top_k` of `num_experts` uniformly, touch
    in expectation: each expert is missed by one token with probability 1 - k/E."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def _mlp_params(cfg: ModelConfig, layer: int, experts: float) -> float:
    """The feed-forward weights of `layer` that are touched when `experts` routed experts are."""
    h = cfg.hidden_size
    if not cfg.layer_is_moe(layer):
        return 3 * h * cfg.intermediate_size
    router = cfg.num_experts * h
    shared = 3 * h * cfg.moe_intermediate_size * cfg.n_shared_experts
    if cfg.shared_expert_intermediate_size:  # qwen3_next: one shared expert and its sigmoid gate
        shared += 3 * h * cfg.shared_expert_intermediate_size + h
    return router + shared + experts * expert_params(cfg)


def total_params(cfg: ModelConfig) -> int:
    """Every parameter of the model (no MTP layers); a tied head counts once."""
    h, v = cfg.hidden_size, cfg.vocab_size
    n = v * h + h + (0 if cfg.tie_word_embeddings else v * h)
    for i in range(cfg.num_hidden_layers):
        n += attention_params(cfg, i) + 2 * h + int(_mlp_params(cfg, i, cfg.num_experts))
    return n


def weight_bytes_per_step(cfg: ModelConfig, batch: int, itemsize: int) -> float:
    """Parameter bytes one decode step at `batch` sequences reads: all dense weights (attention, norms,
    dense MLPs, routers, shared experts, final norm, lm_head), the routed experts its tokens activate
    in expectation, and `batch` embedding rows (none apart when the head is tied: it reads them all)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    experts = expected_experts(cfg.num_experts, cfg.num_experts_per_tok, batch)
    params = h + v * h + (0 if cfg.tie_word_embeddings else batch * h)
    for i in range(cfg.num_hidden_layers):
        params += attention_params(cfg, i) + 2 * h + _mlp_params(cfg, i, experts)
    fp32_bias = 4 * cfg.num_experts * sum(cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers)) \
        if cfg.scoring == "sigmoid" else 0  # the routing correction bias stays fp32
    return params * itemsize + fp32_bias


def kv_bytes_per_step(cfg: ModelConfig, batch: int, context: float, kv: str, dtype: torch.dtype) -> float:
    """K/V bytes one decode step reads: `batch` sequences of `context` tokens each."""
    per_token = kv_bytes_per_token(cfg.num_full_attention_layers, cfg.num_key_value_heads, cfg.head_dim, kv, dtype)
    return batch * context * per_token


def active_params_per_token(cfg: ModelConfig) -> int:
    """Matmul parameters one token goes through in the decoder layers (the embedding is a lookup and
    the head runs only at sampled rows): attention, dense MLPs, router + top-k + shared experts."""
    n = 0
    for i in range(cfg.num_hidden_layers):
        norms = 2 * cfg.head_dim if cfg.use_qk_norm and not cfg.layer_is_linear(i) else 0
        n += attention_params(cfg, i) - norms
        n += int(_mlp_params(cfg, i, cfg.num_experts_per_tok))
    return n


def causal_attention_flops(cfg: ModelConfig, length: int) -> float:
    """QK^T and PV over a causal prompt of `length`: 4·L²·Hq·D per full-attention layer, halved by the
    mask; a linear-attention layer's state work is linear in L."""
    linear = cfg.num_hidden_layers - cfg.num_full_attention_layers
    return (cfg.num_full_attention_layers * 4 * length * length / 2 * cfg.num_attention_heads * cfg.head_dim
            + linear * length * linear_attention_flops(cfg))


def read_flops(cfg: ModelConfig, tokens: int, logit_rows: int = 1) -> float:
    """Flops of reading a `tokens`-long prompt and computing logits at `logit_rows` rows."""
    return (2 * active_params_per_token(cfg) * tokens + causal_attention_flops(cfg, tokens)
            + 2 * cfg.hidden_size * cfg.vocab_size * logit_rows)


def fraction(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _median_seconds(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_ceilings(device: torch.device, dtype: torch.dtype, copy_bytes: int | None = None,
                     gemm_n: int | None = None, iters: int = 10) -> dict:
    """{copy_gbs, gemm_tflops, ...}. CUDA: a 4 GiB device-to-device copy (bytes read + written) and
    a bf16 8192³ GEMM. CPU: the same at small sizes (64 MiB, 512³ in the engine's dtype), so that the
    fractions computed from them are numbers, but only rough ones."""
    cuda = device.type == "cuda"
    copy_bytes = copy_bytes or (4 * 2**30 if cuda else 64 * 2**20)
    gemm_n = gemm_n or (8192 if cuda else 512)
    gemm_dtype = torch.bfloat16 if cuda else dtype
    src = torch.ones(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = _median_seconds(lambda: dst.copy_(src), device, iters)
    del src, dst
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(gemm_n, gemm_n, device=device, dtype=gemm_dtype, generator=gen)
    b = torch.randn(gemm_n, gemm_n, device=device, dtype=gemm_dtype, generator=gen)
    c = torch.empty_like(a)
    gemm_s = _median_seconds(lambda: torch.mm(a, b, out=c), device, iters)
    del a, b, c
    if cuda:
        torch.cuda.empty_cache()
    return {"copy_gbs": 2 * copy_bytes / copy_s / 1e9, "gemm_tflops": 2 * gemm_n**3 / gemm_s / 1e12,
            "copy_bytes": copy_bytes, "gemm_n": gemm_n, "gemm_dtype": str(gemm_dtype).removeprefix("torch."),
            "timing": f"{'CUDA events' if cuda else 'perf_counter'}, median of {iters} after 2 warm-ups"}
