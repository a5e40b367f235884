"""Where the engine puts a model before loading it: which MoE layers keep their routed experts in host
RAM (`--cpu-moe`, `--n-cpu-moe N`, or the memory plan on CUDA), and how many tokens the KV pool holds.

The sizes come from the checkpoint's index (each tensor's stored type and bytes) and the model config,
before any weight is read; `strata.memory_plan` does the arithmetic.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import re

import torch

from strata.config import EngineConfig, ModelConfig
from strata.dist.link import StagePlacement
from strata.dist.stage import free_share
from strata.engine.concurrent import ConcurrentReadSetup
from strata.env import torch_allocator_configured
from strata.kernels.quant import FORMATS as KEPT_FORMATS
from strata.kvcache.pool import kv_bytes_per_token
from strata.kvcache.tier import device_context_buffers, tier_tokens, tiered_backends
from strata.loaders.base import Checkpoint
from strata.loaders import host as host_ram
from strata.loaders.host import layer_format, ram_format
from strata.memory_plan import GiB, MiB, ModelSizes, Plan, PlanError, PlanRequest, PlanRow, plan_memory, size_text
from strata.models.host_experts import projection_bytes

log = logging.getLogger("strata")

_ROUTED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.")
_SHARED = re.compile(r"^model\.layers\.(\d+)\.mlp\.shared_experts?\.")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.weight$")
# The weights a load keeps quantized (`strata.loaders._quantizable_linears`: Gated DeltaNet's projections
# and the embedding table too).
_KEPT = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$|\.(in_proj_qkvz|in_proj_ba|out_proj)\.weight$"
                   r"|^lm_head\.weight$|^model\.embed_tokens\.weight$")
# The CUDA context and what the libraries hold outside torch's allocator (the allocator's cap leaves it out).
CONTEXT_BYTES = 768 * MiB
# Beside a step's activations, whatever the model's width: the runner's static buffers (inputs, tables,
# sampling state), the decode graphs' private pool, and cuBLAS's workspace on each stream that runs a
# GEMM (32 MiB on Hopper; the decode stream, the graphs' capture stream, the read stage's).
BUFFER_BYTES = 256 * MiB


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
    if keep_quantized and stored in KEPT_FORMATS and _KEPT.search(name) and name in ckpt.nbytes:
        return ckpt.nbytes[name]
    numel = 1
    for d in ckpt.shapes.get(name, ()):
        numel *= d
    size = 4 if name.endswith("e_score_correction_bias") else torch.empty(0, dtype=dtype).element_size()
    return numel * size


def model_sizes(ckpt: Checkpoint, mc: ModelConfig, cfg: EngineConfig, dtype: torch.dtype, num_kv_layers: int,
                state_bytes: int = 0, layers: tuple[int, int] | None = None,
                elsewhere: tuple[str, ...] = ()) -> ModelSizes:
    """`layers` (a, b), `elsewhere`: a pipeline stage's decoder layers and the name prefixes of the tensors
    it does not hold (`strata.models.held.elsewhere_prefixes`)."""
    keep = bool(cfg.keep_quantized)
    first, last = layers or (0, mc.num_hidden_layers)
    layers = [i for i in moe_layers(mc) if first <= i < last]
    routed = {i: 0 for i in layers}
    embed = dense = shared = 0
    for name in ckpt.names:
        if name.startswith(elsewhere):
            continue
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
            if _ROUTER.match(name) and dtype != torch.float32:
                dense += b // torch.empty(0, dtype=dtype).element_size() * 4  # the router's fp32 copy (`MoE.gate`)
    per_token = kv_bytes_per_token(num_kv_layers, mc.num_key_value_heads, mc.head_dim, cfg.kv, dtype)
    int8 = kv_bytes_per_token(num_kv_layers, mc.num_key_value_heads, mc.head_dim, "int8", dtype)
    return ModelSizes(fixed=(("embeddings + LM head", embed), ("attention, dense layers, routers, norms", dense)),
                      shared_experts=shared, routed_experts=tuple(routed[i] for i in layers), moe_layers=tuple(layers),
                      kv_bytes_per_token=per_token, kv_bytes_per_token_int8=None if cfg.kv == "int8" else int8,
                      state_bytes=state_bytes)


def scratch_bytes(cfg: EngineConfig, mc: ModelConfig, logits: bool = True) -> int:
    """Activations of the largest step (fp32 upper bound on its widest tensors), the logits of its
    sampling rows (`logits`: a pipeline stage that applies the LM head), and BUFFER_BYTES of the
    runner's static buffers and graph pools; under --gpu-memory also CONTEXT_BYTES, which a budget taken
    from the card's free memory has already lost."""
    tokens = cfg.max_num_batched_tokens or 2048
    width = 2 * max(mc.intermediate_size, mc.hidden_size)
    k = mc.num_experts_per_tok
    if k:
        # A MoE layer's rows, one per (token, expert): gathered in, gate|up, the activation and down out.
        width = max(width, k * (2 * mc.hidden_size + 3 * mc.moe_intermediate_size))
    rows = cfg.parallel * (1 + cfg.spec)
    context = CONTEXT_BYTES if cfg.gpu_memory is not None else 0
    # An int8 pool's prompt steps attend over a dense copy of their context's K and V in the model's
    # dtype (the Triton backend's, two contexts long; the batch-invariant kernels read int8).
    dense_copy = (2 * 2 * cfg.ctx * mc.num_key_value_heads * mc.head_dim * cfg.torch_dtype.itemsize
                  if cfg.kv == "int8" and not cfg.batch_invariant and cfg.resolved_device.startswith("cuda") else 0)
    return (context + BUFFER_BYTES + dense_copy + tokens * (6 * mc.hidden_size + width) * 4
            + logits * rows * mc.vocab_size * 4 * 3)


def plan_placement(cfg: EngineConfig, mc: ModelConfig, ckpt: Checkpoint, dtype: torch.dtype, budget: int,
                   num_kv_layers: int, kv_tokens_max: int | None = None, state_bytes: int = 0,
                   sizes: ModelSizes | None = None, scratch: int | None = None, host_check: bool = True) -> Plan:
    """The memory plan of this run on a GPU budget of `budget` bytes (raises `PlanError`). `sizes`,
    `scratch`: a pipeline stage's (`plan_stages`), instead of the whole model's. `host_check`: refuse a plan
    whose experts in RAM the host's memory cannot hold (off for a plan made after the load, whose experts
    already hold some of it)."""
    demand = cfg.kv_size or cfg.ctx * cfg.parallel
    scratch = scratch_bytes(cfg, mc) if scratch is None else scratch
    tiered = cfg.kv_resident is not None and not cfg.kv_size
    if tiered:
        # Older blocks live in the host tier: the device holds each slot's window and what one step adds.
        demand = min(demand, cfg.parallel * tier_tokens(cfg.kv_resident, cfg.chunk_size or cfg.max_num_batched_tokens
                                                        or 2048, cfg.spec, cfg.block_size))
    if cfg.kv_resident is not None or cfg.kv_host_memory is not None:
        # Buffers of one layer's K/V at the full context: a host prefix streamed to prompt chunks.
        concurrent = ConcurrentReadSetup.from_env()
        who = dict(drafter=bool(cfg.spec), concurrent_read=concurrent.enabled,
                   read_drafts=bool(cfg.spec) and (concurrent.split_mtp_batch_reserved or (
                       concurrent.piped_concurrent and cfg.kv_resident is not None)))
        buffers = device_context_buffers(**who, batch_invariant=cfg.batch_invariant)
        scratch += buffers * cfg.ctx * kv_bytes_per_token(1, mc.num_key_value_heads, mc.head_dim, cfg.kv, dtype)
        # Each backend's output and LSE of a step's rows over a streamed host prefix.
        scratch += (tiered_backends(**who) * (cfg.max_num_batched_tokens or 2048) * mc.num_attention_heads
                    * (mc.head_dim * dtype.itemsize + 4))
    req = PlanRequest(sizes or model_sizes(ckpt, mc, cfg, dtype, num_kv_layers, state_bytes), gpu_budget=budget,
                      scratch_bytes=scratch, kv_tokens=demand,
                      kv_tokens_max=None if cfg.kv_size else kv_tokens_max, context=cfg.ctx, parallel=cfg.parallel,
                      cpu_moe=cfg.cpu_moe, n_cpu_moe=cfg.n_cpu_moe, stream_experts=cfg.expert_stream_tokens != 0)
    try:
        return with_host_copy(plan_memory(req), cfg, mc, ckpt, host_check)
    except PlanError:
        if cfg.kv_size or tiered or demand <= cfg.ctx:
            raise
    # Not every slot's full context: one, with what is left for more (requests beyond it are preempted).
    plan = with_host_copy(plan_memory(dataclasses.replace(req, kv_tokens=cfg.ctx, kv_tokens_max=demand)), cfg, mc, ckpt,
                          host_check)
    return dataclasses.replace(plan, notes=plan.notes + (
        f"the KV pool holds {plan.kv_tokens} tokens, less than --ctx x --parallel ({demand}): a long request may "
        "be preempted while others run",))


def with_host_copy(plan: Plan, cfg: EngineConfig, mc: ModelConfig, ckpt: Checkpoint, check: bool = True) -> Plan:
    """`plan` with the host RAM that the CPU copy of its experts in RAM takes beside the file's (the row
    after theirs), in the format the load will give each layer (`loaders.host.ram_format`, `layer_format`);
    none for float experts, which the CPU reads where they lie, or `file`. With `check`, a plan whose host
    rows exceed the host memory available is refused (`PlanError`), before any weight is read."""
    if not plan.cpu_moe_layers:
        return plan
    plan = _with_copy_row(plan, cfg, mc, ckpt)
    if check:
        check_host_room([plan])
    return plan


def check_host_room(plans: list[Plan]) -> None:
    """Refuses (`PlanError`) plans of one machine whose experts in RAM, together, the host's memory cannot
    hold."""
    held = sum(p.host_bytes for p in plans)
    available = host_ram.host_memory_available()
    if available is not None and held > 0.95 * available:
        copy = any(r.component.startswith("their CPU copy") for p in plans for r in p.rows)
        raise PlanError(f"the routed experts kept in host RAM take {size_text(held)} but {size_text(available)} of "
                        f"host memory is available: a larger --gpu-memory (fewer layers' experts in RAM)"
                        f"{' or --host-experts file (no CPU copy)' if copy else ''}")


def _with_copy_row(plan: Plan, cfg: EngineConfig, mc: ModelConfig, ckpt: Checkpoint) -> Plan:
    ram = ram_format(ckpt, plan.cpu_moe_layers, cfg.host_experts, cfg.resolved_device.startswith("cuda"), quiet=True)
    inter, hidden, experts = mc.moe_intermediate_size, mc.hidden_size, mc.num_experts
    copies: dict[str, int] = {}
    for i in plan.cpu_moe_layers:
        names = [n for n in ckpt.names if n.startswith(f"model.layers.{i}.mlp.experts.")]
        fmt = layer_format(ram, {ckpt.types.get(n) for n in names} if names else None, inter, hidden)
        if fmt != "float":
            nbytes = projection_bytes(fmt, experts, 2 * inter, hidden) + projection_bytes(fmt, experts, hidden, inter)
            copies[fmt] = copies.get(fmt, 0) + nbytes
    if not sum(copies.values()):
        return plan
    rows = list(plan.rows)
    at = max(j for j, r in enumerate(rows) if r.where == "cpu") + 1
    rows.insert(at, PlanRow(f"their CPU copy ({', '.join(sorted(copies))})", "cpu", sum(copies.values())))
    return dataclasses.replace(plan, rows=tuple(rows))


def plan_stages(cfg: EngineConfig, mc: ModelConfig, ckpt: Checkpoint, dtype: torch.dtype,
                ranges: tuple[tuple[int, int], ...], budgets: list[int], split_drafts: bool) -> list[Plan]:
    """Each pipeline stage's memory plan (`--split-mode layer`): rank r's decoder layers `ranges[r]` on its
    own GPU budget `budgets[r]`, placed as `plan_placement` places one device's. A stage counts what it
    holds (`strata.models.held.elsewhere_prefixes`: its layers' weights as they load, kept quantized or not;
    the embedding and LM head on the first stage, and on the last with the MTP head, which needs them),
    its own layers' K/V (full-attention layers, the MTP layer on the last), its linear layers' states,
    its routed experts (the planner keeps those of the stage's first MoE layers in RAM as far as its
    budget needs; --n-cpu-moe N counts the model's first N MoE layers, each stage those it holds), the
    logits of the sampling rows where it applies the head, and on the last stage the drafter's prompt
    hidden states (`split_drafts` false)."""
    from strata.kvcache.state_pool import StatePool
    from strata.loaders import mtp_prefix as checkpoint_mtp_prefix
    from strata.models.held import elsewhere_prefixes, holds_ends

    mtp_prefix = checkpoint_mtp_prefix(mc, ckpt.names)

    linear = sum(mc.layer_is_linear(i) for i in range(mc.num_hidden_layers))
    # The slots' recurrent states (+1, a graph's padding rows), each with its copies after every
    # verification row under speculation, per linear layer.
    per_layer = (StatePool.bytes_per_state(mc, dtype) // linear * (cfg.parallel + 1)
                 * (1 + (1 + cfg.spec if cfg.spec else 0)) if linear else 0)
    moe = moe_layers(mc)
    plans = []
    for (a, b), budget in zip(ranges, budgets):
        mtp = mtp_prefix is not None and b == mc.num_hidden_layers
        kv_layers = sum(not mc.layer_is_linear(i) for i in range(a, b)) + (mc.num_nextn_predict_layers if mtp else 0)
        states = per_layer * sum(mc.layer_is_linear(i) for i in range(a, b))
        sizes = model_sizes(ckpt, mc, cfg, dtype, kv_layers, states, (a, b), elsewhere_prefixes(mc, a, b, mtp_prefix))
        if mtp and cfg.spec and not split_drafts:
            hidden = cfg.parallel * min(cfg.ctx, mc.max_position_embeddings) * mc.hidden_size * dtype.itemsize
            sizes = dataclasses.replace(sizes, fixed=sizes.fixed + (("MTP prompt hidden states", hidden),))
        local = cfg
        if cfg.n_cpu_moe is not None:
            local = dataclasses.replace(cfg, n_cpu_moe=sum(a <= i < b for i in moe[: cfg.n_cpu_moe]))
        scratch = scratch_bytes(cfg, mc, logits=holds_ends(mc, a, b, mtp_prefix is not None))
        plans.append(plan_placement(local, mc, ckpt, dtype, budget, kv_layers, kv_tokens_max=1 << 40,
                                    state_bytes=states, sizes=sizes, scratch=scratch, host_check=cfg.nnodes > 1))
    if cfg.nnodes == 1:  # every stage's experts in this machine's RAM
        check_host_room(plans)
    return plans


def stage_placements(cfg: EngineConfig, mc: ModelConfig, ranges: tuple[tuple[int, int], ...],
                     plans: list[Plan] | None) -> list[StagePlacement]:
    """What each pipeline stage loads by: its plan's experts in RAM, K/V tokens (under --gpu-memory),
    budget, scratch and allocator cap (`plans` None, off CUDA: the layers --cpu-moe / --n-cpu-moe name)."""
    if plans is None:
        flagged = flagged_host_layers(cfg, mc) or []
        return [StagePlacement(tuple(i for i in flagged if a <= i < b)) for a, b in ranges]
    capped = cfg.gpu_memory is not None
    cap = max(int(cfg.gpu_memory * GiB) - CONTEXT_BYTES, 0) if capped else -1
    return [StagePlacement(p.cpu_moe_layers, p.kv_tokens if capped else -1, p.gpu_budget, p.scratch_bytes, cap)
            for p in plans]


def gpu_budget(cfg: EngineConfig, device: torch.device, sharing: int = 1) -> int:
    """--gpu-memory GiB, else the card's free memory x gpu_memory_utilization (its share, where `sharing`
    pipeline stages share the card)."""
    if cfg.gpu_memory is not None:
        return int(cfg.gpu_memory * GiB)
    return free_share(device, cfg.gpu_memory_utilization, sharing)


PINNED_ROUND_MB = 64  # pinned allocations larger than this take their exact size (`pin_exact_sizes`)


def pin_exact_sizes() -> None:
    """torch's pinned (page-locked) host allocator rounds each allocation up to a power of two: a 20 GiB
    host KV pool would pin 32, an 80B-A3B layer's 0.69 GiB of experts 1. Allocations above
    PINNED_ROUND_MB take their exact size instead, unless the allocator settings name the threshold
    already (PYTORCH_ALLOC_CONF); a torch without the setting ignores it."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    put = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if get is None or put is None:
        return
    current = get()
    if "pinned_max_round_threshold_mb" in current:
        return
    setting = f"pinned_max_round_threshold_mb:{PINNED_ROUND_MB}"
    put(f"{current},{setting}" if current else setting)


def cap_allocator(cfg: EngineConfig, device: torch.device) -> None:
    """With --gpu-memory, torch's caching allocator may hold at most the budget less CONTEXT_BYTES: a
    step that would go past it fails with an out-of-memory error instead of taking more of the card."""
    if cfg.gpu_memory is None:
        # An engine capped before this one in the same process (a benchmark's arms, tests) left its cap.
        torch.cuda.set_per_process_memory_fraction(1.0, device.index if device.index is not None
                                                   else torch.cuda.current_device())
        return
    # Blocks an earlier engine of this process left in torch's cache would count against the cap.
    gc.collect()
    torch.cuda.empty_cache()
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
