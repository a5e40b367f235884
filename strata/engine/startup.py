"""How an engine is built, step by step (`LLMEngine.__init__` calls them in order): the model placed and
loaded (`load_placed`: the memory plan on CUDA), what the host KV tier and hybrid models run without
(`tier_limits`, `hybrid_limits`), the KV pool's tokens (`kv_capacity_tokens`), the grammar compiler,
and the phases' seconds (`StartupClock`)."""

from __future__ import annotations

import dataclasses
import gc
import logging
import time

import torch

from strata.config import EngineConfig, ModelConfig
from strata.dist.link import Link
from strata.engine import placement
from strata.grammar import GrammarCompiler
from strata.kvcache.state_pool import StatePool
from strata.loaders import LoadedModel, default_model_path, load_model, move_experts_to_ram, read_model
from strata.memory_plan import ModelSizes, Plan, PlanError, beyond_estimate
from strata.models.moe import MoE
from strata.speculative.drafter import MTPDrafter

log = logging.getLogger("strata")


class StartupClock:
    """Start-up's phases, each ended by `mark(name)`; `log()` gives their seconds in one line."""

    def __init__(self) -> None:
        self.marks = [("", time.perf_counter())]

    def mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))

    def log(self) -> None:
        log.info("start-up in %.1f s: %s", self.marks[-1][1] - self.marks[0][1],
                 ", ".join(f"{name} {t - before:.1f} s" for (_, before), (name, t) in zip(self.marks, self.marks[1:])))


def load_placed(cfg: EngineConfig, device: torch.device, dtype: torch.dtype, progress: bool, stages: Link | None
                ) -> tuple[LoadedModel, Plan | None]:
    """Start-up's first steps: read the checkpoint's index, decide where its parts go (on CUDA the
    memory plan, printed; elsewhere --cpu-moe / --n-cpu-moe), then load them there. Returns the model
    and the plan (rank 0's, with pipeline stages; None off CUDA)."""
    path = cfg.model or default_model_path()
    ckpt, mc = read_model(path)
    host = placement.flagged_host_layers(cfg, mc)
    stage_budgets = stages.budgets() if stages is not None else []
    plans, memory_plan, sizes = None, None, None
    if device.type == "cuda":
        placement.cap_allocator(cfg, device)
        placement.pin_exact_sizes()  # before the load pins experts' and the KV tier's host memory
        budget = placement.gpu_budget(cfg, device, stages.plan.sharing if stages else 1)
        if stages is not None:  # every stage's own layers within its own budget
            ranges = stages.plan.ranges
            plans = placement.plan_stages(cfg, mc, ckpt, dtype, ranges, [budget] + stage_budgets,
                                          MTPDrafter.split_mode())
            for r, ((a, b), plan) in enumerate(zip(ranges, plans)):
                log.info("pipeline stage %d, layers %d-%d: %s", r, a, b - 1, plan.table())
            memory_plan = plans[0]
        else:
            memory_plan, sizes = plan_one_device(cfg, mc, ckpt, dtype, budget)
            log.info("%s", memory_plan.table())
        host = list(memory_plan.cpu_moe_layers)
    if stages is not None:
        stages.place(placement.stage_placements(cfg, mc, stages.plan.ranges, plans), mc.num_hidden_layers)
        host = [i for i in host or () if i < stages.plan.layers[1]]
    held = torch.cuda.memory_reserved(device) if sizes is not None else 0
    loaded = load_model(path, device=device, dtype=dtype, progress=progress, keep_quantized=cfg.keep_quantized,
                        quantize=cfg.quantize, host_moe_layers=host or (), host_experts=cfg.host_experts,
                        checkpoint=ckpt, layers=stages.plan.layers if stages is not None else None)
    if sizes is not None:
        memory_plan = refit_after_load(cfg, mc, ckpt, loaded, dtype, sizes, memory_plan, held, device)
    return loaded, memory_plan


def plan_one_device(cfg: EngineConfig, mc: ModelConfig, ckpt, dtype: torch.dtype, budget: int) -> tuple[Plan, ModelSizes]:
    """The memory plan of this run on one GPU budget of `budget` bytes, from the checkpoint's index alone,
    and the sizes it weighed (raises `PlanError` when even the minimum does not fit)."""
    # Hybrids: the slots' recurrent states (+1, a graph's padding rows), each with its copies after
    # every verification row under speculation, as the engine allocates them after the load.
    states = ((cfg.parallel + 1) * (1 + (1 + cfg.spec if cfg.spec else 0)) * StatePool.bytes_per_state(mc, dtype)
              if mc.is_hybrid else 0)
    sizes = placement.model_sizes(ckpt, mc, cfg, dtype, kv_layers(mc), states)
    return placement.plan_placement(cfg, mc, ckpt, dtype, budget, kv_layers(mc), kv_tokens_max=1 << 40,
                                    state_bytes=states, sizes=sizes), sizes


def kv_layers(mc: ModelConfig) -> int:
    """The layers with K/V in the pool: the full-attention ones and the MTP head's."""
    return mc.num_full_attention_layers + mc.num_nextn_predict_layers


def refit_after_load(cfg: EngineConfig, mc: ModelConfig, ckpt, loaded: LoadedModel, dtype: torch.dtype,
                     sizes: ModelSizes, plan: Plan, held: int, device: torch.device) -> Plan:
    """The plan checked against what the load holds on the GPU (beyond the `held` bytes before it): where
    that is more than the plan estimated, the plan made again with the difference
    (`strata.memory_plan.beyond_estimate`) and the layers it now keeps in RAM moved there."""
    gc.collect()
    torch.cuda.empty_cache()
    measured = torch.cuda.memory_reserved(device) - held
    log.info("the load holds %.2f GiB on the GPU; the plan estimated %.2f GiB of weights", measured / 2**30,
             plan.weight_bytes / 2**30)
    again = beyond_estimate(sizes, plan, measured)
    if again is None:
        return plan
    refit = placement.plan_placement(cfg, mc, ckpt, dtype, plan.gpu_budget, kv_layers(mc), kv_tokens_max=1 << 40,
                                     state_bytes=again.state_bytes, sizes=again, host_check=False)
    moved = [i for i in refit.cpu_moe_layers if i not in plan.cpu_moe_layers]
    if moved:
        t0 = time.perf_counter()
        move_experts_to_ram(loaded.model, ckpt, moved, cfg.host_experts, dtype)
        gc.collect()
        torch.cuda.empty_cache()
        log.info("the routed experts of %d more MoE layers moved to RAM in %.1f s", len(moved), time.perf_counter() - t0)
    log.info("%s", refit.table())
    return refit


def host_limits(cfg: EngineConfig, model: torch.nn.Module, device: torch.device, staged: bool) -> EngineConfig:
    """What a CUDA run of a model with MoE layers whose experts are in RAM (set up) runs without. Where the
    CPU computes a decode step's experts, the host waits for each such layer's router, so no step is
    queued ahead (async scheduling off) and a step's graph is captured in pieces around them
    (`strata.runner.graph_pieces`, --host-expert-graphs) or not at all. Where the GPU reads them over
    PCIe (`--host-expert-decode`), decode steps never wait for the host: async scheduling stays (a step
    of more rows than those kernels take still waits, in its turn)."""
    moes = [m for m in model.modules() if isinstance(m, MoE) and m.host is not None]
    if not moes or device.type != "cuda" or not (cfg.cuda_graph or cfg.async_scheduling):
        return cfg
    graphs = cfg.cuda_graph and cfg.host_expert_graphs and not staged
    pcie = all(m.pcie_stacks is not None and not m.cpu_slots for m in moes)
    async_ = bool(cfg.async_scheduling) and pcie
    log.info("%d MoE layers with their routed experts in RAM: %s, %s", len(moes),
             "async scheduling on (decode steps read them over PCIe)" if async_ else "async scheduling off",
             "CUDA graphs in pieces around the CPU's part" if graphs else "CUDA graphs off")
    return dataclasses.replace(cfg, cuda_graph=graphs, async_scheduling=async_)


def tier_limits(cfg: EngineConfig) -> EngineConfig:
    """With the host KV tier, a request's blocks move to the host between its steps, which a step
    queued ahead of its inputs would never leave room for. (CUDA graphs stay: a step with a host part,
    whose attention reads it through the CPU, runs eagerly.)"""
    changes = {}
    if cfg.async_scheduling:
        changes["async_scheduling"] = False
    if changes:
        log.info("host KV tier: %s off", " and ".join(k.replace("_", " ") for k in changes))
    return dataclasses.replace(cfg, **changes) if changes else cfg


def hybrid_limits(cfg: EngineConfig, mc: ModelConfig) -> EngineConfig:
    """What a hybrid (linear-attention) model runs without yet, each with the reason logged: a cached
    prefix has K/V but no saved linear state to resume from; verification steps keep every row's state
    token by token, which the decode graphs (one row per sequence) do not."""
    changes = {}
    if cfg.prefix_cache:
        log.info("prefix cache off: %s keeps linear-attention state per sequence, not per block", mc.model_type)
        changes["prefix_cache"] = False
    if cfg.spec and cfg.cuda_graph and torch.device(cfg.resolved_device).type == "cuda":
        log.info("CUDA graphs off with --spec: verification rows of %s keep their states eagerly", mc.model_type)
        changes["cuda_graph"] = False
    return dataclasses.replace(cfg, **changes) if changes else cfg


def kv_capacity_tokens(cfg: EngineConfig, mc: ModelConfig, per_token: int, device: torch.device, reserved: int,
                       plan: Plan | None = None, sharing: int = 1) -> int:
    """The KV pool's tokens: --kv-size; on CUDA what the cap (or the card's free share) leaves beside the
    weights, `reserved` bytes still to come; on the CPU every slot's context."""
    if cfg.kv_size:
        return cfg.kv_size
    if device.type == "cuda":
        # An engine built before this one (a benchmark's previous arm) may linger in a reference cycle
        # with its pool, or as blocks in PyTorch's cache: neither counts as free unless released.
        gc.collect()
        torch.cuda.empty_cache()
        if cfg.gpu_memory is not None:
            # Within the cap: what the plan left for K/V, less what loading took beyond its estimate. A model
            # built before the engine (a benchmark's random weights) has no plan: the cap less one step's scratch.
            budget, scratch, most = ((plan.gpu_budget, plan.scratch_bytes, plan.kv_tokens) if plan is not None else
                                     (placement.gpu_budget(cfg, device), placement.scratch_bytes(cfg, mc), 1 << 62))
            left = budget - scratch - torch.cuda.memory_reserved(device) - reserved
            tokens = max(min(most, int(left) // per_token), 0)
            if plan is not None and tokens < min(most, cfg.ctx):
                # The plan promised one full context at least: a pool short of it means the estimate failed.
                short = (min(most, cfg.ctx) - tokens) * per_token
                raise PlanError(f"after loading, --gpu-memory {cfg.gpu_memory:g} leaves K/V for {tokens} tokens where the "
                                f"plan counted {most}: the model and its buffers took {short / 2**20:.0f} MiB more than "
                                f"estimated; keep more layers' experts in RAM (--n-cpu-moe "
                                f"{len(plan.cpu_moe_layers) + 1} or more) or give a shorter --ctx")
            return tokens
        # Weights are already resident; still to come are `reserved` bytes (the drafter's buffers) and the
        # scratch (a step's activations, the runner's buffers and graphs, an int8 pool's dense copy, and
        # in the plan's, the tier's streaming buffers).
        scratch = plan.scratch_bytes if plan is not None else placement.scratch_bytes(cfg, mc)
        return max(placement.free_share(device, cfg.gpu_memory_utilization, sharing) - reserved - scratch, 0) // per_token
    return cfg.ctx * cfg.parallel


def grammar_compiler(tokenizer, vocab_size: int) -> GrammarCompiler | None:
    """The compiler of this model's grammars (structured output), or None without a tokenizer."""
    if tokenizer is None:
        return None
    try:
        t0 = time.perf_counter()
        compiler = GrammarCompiler(tokenizer, vocab_size)
    except Exception as e:  # a tokenizer the grammar engine cannot read: serve without structured output
        log.warning("structured output is off: the grammar engine cannot use this tokenizer (%s)", e)
        return None
    log.info("grammar compiler ready (%d tokens) in %.1fs", compiler.vocab_size, time.perf_counter() - t0)
    return compiler
