"""Where the engine puts a model before loading it: which MoE layers keep their routed experts in host
RAM (`--cpu-moe`, `--n-cpu-moe N`, or the memory plan on CUDA), and how many tokens the KV pool holds.

The sizes come from the checkpoint's index (each tensor's stored type and bytes) and the model config,
before any weight is read; `strata.memory_plan` does the arithmetic.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import torch

from strata.config import EngineConfig, ModelConfig
from strata.env import torch_allocator_configured
from strata.kernels.quant import FORMATS as KEPT_FORMATS
from strata.kvcache.pool import kv_bytes_per_token
from strata.kvcache.tier import tier_tokens
from strata.loaders.base import Checkpoint
from strata.memory_plan import GiB, MiB, ModelSizes, Plan, PlanError, PlanRequest, plan_memory

log = logging.getLogger("strata")

_ROUTED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.")
_SHARED = re.compile(r"^model\.layers\.(\d+)\.mlp\.shared_experts?\.")
_LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$|^lm_head\.weight$")
# The CUDA context, cuBLAS and Triton workspaces and the graphs' pools, beside the activations.
CONTEXT_BYTES = 768 * MiB


def moe_layers(mc: ModelConfig) -> list[int]:
    return [i for i in range(mc.num_hidden_layers) if mc.layer_is_moe(i)]


def flagged_host_layers(cfg: EngineConfig, mc: ModelConfig) -> list[int] | None:
    """The layers `--cpu-moe` / `--n-cpu-moe N` put in RAM, or None when neither is given."""
    if cfg.cpu_moe:
        return moe_layers(mc)
    if cfg.n_cpu_moe is not None:
        return moe_layers(mc)[: cfg.n_cpu_moe]
    return None


def tensor_bytes(ckpt: Checkpoint, name: str, dtype: torch.dtype, keep_quantized: bool) -> int:
    """What one tensor takes once loaded: its file bytes where it stays quantized, else the model dtype
    (the routing bias stays fp32)."""
    stored = ckpt.types.get(name)
    if keep_quantized and stored in KEPT_FORMATS and _LINEAR.search(name) and name in ckpt.nbytes:
        return ckpt.nbytes[name]
    numel = 1
    for d in ckpt.shapes.get(name, ()):
        numel *= d
    size = 4 if name.endswith("e_score_correction_bias") else torch.empty(0, dtype=dtype).element_size()
    return numel * size


def model_sizes(ckpt: Checkpoint, mc: ModelConfig, cfg: EngineConfig, dtype: torch.dtype, num_kv_layers: int,
                state_bytes: int = 0) -> ModelSizes:
    keep = bool(cfg.keep_quantized)
    layers = moe_layers(mc)
    routed = {i: 0 for i in layers}
    embed = dense = shared = 0
    for name in ckpt.names:
        b = tensor_bytes(ckpt, name, dtype, keep)
        m = _ROUTED.match(name)
        if m and int(m[1]) in routed:
            routed[int(m[1])] += b
        elif _SHARED.match(name):
            shared += b
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            embed += b
        else:
            dense += b
    per_token = kv_bytes_per_token(num_kv_layers, mc.num_key_value_heads, mc.head_dim, cfg.kv, dtype)
    int8 = kv_bytes_per_token(num_kv_layers, mc.num_key_value_heads, mc.head_dim, "int8", dtype)
    return ModelSizes(fixed=(("embeddings + LM head", embed), ("attention, dense layers, routers, norms", dense)),
                      shared_experts=shared, routed_experts=tuple(routed[i] for i in layers), moe_layers=tuple(layers),
                      kv_bytes_per_token=per_token, kv_bytes_per_token_int8=None if cfg.kv == "int8" else int8,
                      state_bytes=state_bytes)


def scratch_bytes(cfg: EngineConfig, mc: ModelConfig) -> int:
    """Activations of the largest step (fp32 upper bound on its widest tensors) and the logits of its
    sampling rows; under --gpu-memory also CONTEXT_BYTES, which a budget taken from the card's free
    memory has already lost."""
    tokens = cfg.max_num_batched_tokens or 2048
    width = max(mc.intermediate_size, 2 * mc.moe_intermediate_size * max(mc.num_experts_per_tok, 1), mc.hidden_size)
    rows = cfg.parallel * (1 + cfg.spec)
    context = CONTEXT_BYTES if cfg.gpu_memory is not None else 0
    return context + tokens * (6 * mc.hidden_size + 2 * width) * 4 + rows * mc.vocab_size * 4 * 3


def plan_placement(cfg: EngineConfig, mc: ModelConfig, ckpt: Checkpoint, dtype: torch.dtype, budget: int,
                   num_kv_layers: int, kv_tokens_max: int | None = None, state_bytes: int = 0) -> Plan:
    """The memory plan of this run on a GPU budget of `budget` bytes (raises `PlanError`)."""
    demand = cfg.kv_size or cfg.ctx * cfg.parallel
    scratch = scratch_bytes(cfg, mc)
    tiered = cfg.kv_resident is not None and not cfg.kv_size
    if tiered:
        # Older blocks live in the host tier: the device holds each slot's window and what one step adds,
        # and two buffers of one layer's K/V at the full context stream a host prefix to prompt chunks.
        demand = min(demand, cfg.parallel * tier_tokens(cfg.kv_resident, cfg.chunk_size or cfg.max_num_batched_tokens
                                                        or 2048, cfg.spec, cfg.block_size))
        scratch += 2 * cfg.ctx * kv_bytes_per_token(1, mc.num_key_value_heads, mc.head_dim, cfg.kv, dtype)
    req = PlanRequest(model_sizes(ckpt, mc, cfg, dtype, num_kv_layers, state_bytes), gpu_budget=budget,
                      scratch_bytes=scratch, kv_tokens=demand,
                      kv_tokens_max=None if cfg.kv_size else kv_tokens_max, context=cfg.ctx, parallel=cfg.parallel,
                      cpu_moe=cfg.cpu_moe, n_cpu_moe=cfg.n_cpu_moe, stream_experts=cfg.expert_stream_tokens != 0)
    try:
        return plan_memory(req)
    except PlanError:
        if cfg.kv_size or tiered or demand <= cfg.ctx:
            raise
    # Not every slot's full context: one, with what is left for more (requests beyond it are preempted).
    plan = plan_memory(dataclasses.replace(req, kv_tokens=cfg.ctx, kv_tokens_max=demand))
    return dataclasses.replace(plan, notes=plan.notes + (
        f"the KV pool holds {plan.kv_tokens} tokens, less than --ctx x --parallel ({demand}): a long request may "
        "be preempted while others run",))


def gpu_budget(cfg: EngineConfig, device: torch.device) -> int:
    """--gpu-memory GiB, else the card's free memory x gpu_memory_utilization."""
    if cfg.gpu_memory is not None:
        return int(cfg.gpu_memory * GiB)
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * cfg.gpu_memory_utilization)


def cap_allocator(cfg: EngineConfig, device: torch.device) -> None:
    """With --gpu-memory, torch's caching allocator may hold at most the budget less CONTEXT_BYTES: a
    step that would go past it fails with an out-of-memory error instead of taking more of the card."""
    if cfg.gpu_memory is None:
        return
    if not torch_allocator_configured():
        # Under a cap a free block between live ones still counts against it, and the load's repacking
        # temporaries leave such holes (1.8 GiB of 16 in the 80B-A3B IQ3_S load). Segments that grow page
        # by page instead of being cut anew let the next tensor reuse those pages.
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, max(cfg.gpu_memory * GiB - CONTEXT_BYTES, 0) / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device.index if device.index is not None else torch.cuda.current_device())
    log.info("GPU memory capped at %.2f GiB (torch's allocator: %.2f GiB of %.2f)", cfg.gpu_memory,
             fraction * total / GiB, total / GiB)
