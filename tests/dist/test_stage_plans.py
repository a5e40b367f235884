"""Each pipeline stage's memory plan (`strata.engine.placement.plan_stages`), on made-up tensor sizes: a stage
counts its own layers' weights, K/V, experts and scratch, the embedding where it applies it, the MTP head
and the drafter's prompt hidden states on the last stage; the planner keeps a stage's experts in RAM as
its own budget needs; --cpu-moe / --n-cpu-moe reach each stage as the layers it holds."""

from __future__ import annotations

import json

import pytest
import torch

from strata.config import EngineConfig, ModelConfig
from strata.dist.link import StagePlacement
from strata.dist.plan import layer_ranges
from strata.engine import placement
from strata.kvcache.pool import kv_bytes_per_token
from strata.loaders import default_model_path
from strata.loaders.base import Checkpoint
from strata.memory_plan import MiB

# Made-up numbers of values (bf16: 2 bytes each) per tensor.
EMBED, DENSE, EXPERTS, MTP = 1000, 300, 5000, 700
MTP_LAYER = 6  # glm4_moe keeps its MTP layer as block num_hidden_layers


@pytest.fixture(scope="module")
def ckpt() -> Checkpoint:
    """The embedded model's config (6 layers: a dense one, then five MoE; an MTP layer), one tensor per part."""
    config = json.load(open(f"{default_model_path()}/config.json"))
    shapes = {"model.embed_tokens.weight": (EMBED,), "model.norm.weight": (1,)}
    for i in range(config["num_hidden_layers"]):
        shapes[f"model.layers.{i}.self_attn.q_proj.weight"] = (DENSE,)
        if i >= config["first_k_dense_replace"]:
            shapes[f"model.layers.{i}.mlp.experts.0.down_proj.weight"] = (EXPERTS,)
    shapes[f"model.layers.{MTP_LAYER}.eh_proj.weight"] = (MTP,)
    return Checkpoint("made-up", config, list(shapes), get=lambda name: None, shapes=shapes)


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(device="cuda", ctx=1024, parallel=2, spec=3, expert_stream_tokens=0, **kw).resolved()


def _fixed(plan, name: str) -> int:
    return sum(r.nbytes for r in plan.rows if r.component == name)


def test_each_stage_counts_what_it_holds(ckpt):
    mc = ModelConfig.from_hf(ckpt.config)
    cfg = _cfg()
    ranges = tuple(layer_ranges(mc.num_hidden_layers, [1, 1, 1]))  # layers 0-1, 2-3, 4-5
    plans = placement.plan_stages(cfg, mc, ckpt, torch.bfloat16, ranges, [8 << 30] * 3, split_drafts=False)
    first, middle, last = plans
    # The embedding on rank 0 (it embeds the tokens and applies the tied head) and on the last stage (the
    # MTP head embeds the tokens it drafts from); none in the middle.
    assert _fixed(first, "embeddings + LM head") == _fixed(last, "embeddings + LM head") == 2 * EMBED
    assert _fixed(middle, "embeddings + LM head") == 0
    # Each stage its own layers' dense weights (and the final norm, which every stage's model has), the
    # last the MTP layer's.
    dense = "attention, dense layers, routers, norms"
    assert _fixed(first, dense) == _fixed(middle, dense) == 2 * (2 * DENSE + 1)
    assert _fixed(last, dense) == 2 * (2 * DENSE + MTP + 1)
    # Routed experts: the MoE layers in each range (layer 0 is dense).
    assert [_fixed(p, f"routed experts, layers {a}-{b - 1}" if a else "routed experts, layers 1")
            for p, (a, b) in zip(plans, ranges)] == [2 * EXPERTS, 2 * 2 * EXPERTS, 2 * 2 * EXPERTS]
    # K/V: two full-attention layers each, the MTP layer's on the last stage.
    one = kv_bytes_per_token(1, mc.num_key_value_heads, mc.head_dim, cfg.kv, torch.bfloat16)
    kv = [next(r.nbytes for r in p.rows if r.component.startswith("KV pool")) for p in plans]
    assert kv == [p.kv_tokens * one * layers for p, layers in zip(plans, (2, 2, 3))]
    # The drafter's prompt hidden states where it runs; the logits of the sampling rows where the head is.
    hidden = cfg.parallel * cfg.ctx * mc.hidden_size * 2
    assert [_fixed(p, "MTP prompt hidden states") for p in plans] == [0, 0, hidden]
    logits = cfg.parallel * (1 + cfg.spec) * mc.vocab_size * 4 * 3
    assert first.scratch_bytes == last.scratch_bytes == middle.scratch_bytes + logits
    # Written chunk by chunk (STRATA_SPLIT_MTP_BATCH) the prompt's MTP K/V need no stored hidden states.
    split = placement.plan_stages(cfg, mc, ckpt, torch.bfloat16, ranges, [8 << 30] * 3, split_drafts=True)
    assert _fixed(split[2], "MTP prompt hidden states") == 0
    # The printed plan shows each stage's rows.
    assert "MTP prompt hidden states" in last.table() and "embeddings" not in middle.table()


def test_each_stage_places_its_experts_within_its_own_budget(ckpt):
    mc = ModelConfig.from_hf(ckpt.config)
    cfg = _cfg(gpu_memory=1.0)
    ranges = tuple(layer_ranges(mc.num_hidden_layers, [1, 1]))  # layers 0-2 (MoE 1, 2), 3-5 (MoE 3, 4, 5)
    roomy = placement.plan_stages(cfg, mc, ckpt, torch.bfloat16, ranges, [8 << 30] * 2, split_drafts=False)
    assert [p.cpu_moe_layers for p in roomy] == [(), ()]
    # The last stage's budget holds everything but one MoE layer's experts: its first (layer 3) stays in
    # RAM; rank 0's budget is its own, and holds all of its experts.
    last = roomy[1]
    kv = next(r.nbytes for r in last.rows if r.component.startswith("KV pool"))
    demand = cfg.ctx * cfg.parallel * kv // last.kv_tokens  # the K/V of every slot's context, no more
    budget = last.gpu_bytes - kv + demand - 2 * EXPERTS
    plans = placement.plan_stages(cfg, mc, ckpt, torch.bfloat16, ranges, [8 << 30, budget], split_drafts=False)
    assert plans[0].cpu_moe_layers == () and plans[1].cpu_moe_layers == (3,)
    assert plans[1].gpu_bytes == budget and plans[1].kv_tokens == cfg.ctx * cfg.parallel
    assert "1 of 3 MoE layers keep their routed experts in host RAM" in plans[1].table()
    # What the stage loads by: its experts in RAM, its plan's K/V tokens, budget, scratch, allocator cap.
    places = placement.stage_placements(cfg, mc, ranges, plans)
    assert places[1] == StagePlacement((3,), plans[1].kv_tokens, budget, plans[1].scratch_bytes,
                                       (1 << 30) - placement.CONTEXT_BYTES)
    assert StagePlacement.of(places[1].words(mc.num_hidden_layers)) == places[1]


def test_the_flags_name_each_stage_its_layers(ckpt):
    mc = ModelConfig.from_hf(ckpt.config)
    ranges = tuple(layer_ranges(mc.num_hidden_layers, [1, 1]))
    # --n-cpu-moe 3: the model's first three MoE layers (1, 2, 3): two on rank 0, one on the last stage.
    plans = placement.plan_stages(_cfg(n_cpu_moe=3), mc, ckpt, torch.bfloat16, ranges, [8 << 30] * 2, False)
    assert [p.cpu_moe_layers for p in plans] == [(1, 2), (3,)] and not any(p.auto for p in plans)
    plans = placement.plan_stages(_cfg(cpu_moe=True), mc, ckpt, torch.bfloat16, ranges, [8 << 30] * 2, False)
    assert [p.cpu_moe_layers for p in plans] == [(1, 2), (3, 4, 5)]
    # Off CUDA there is no plan: the flags' layers, by stage.
    cpu = EngineConfig(device="cpu", n_cpu_moe=3)
    assert [p.host_layers for p in placement.stage_placements(cpu, mc, ranges, None)] == [(1, 2), (3,)]
    assert placement.stage_placements(cpu, mc, ranges, None)[0].kv_tokens == -1


def test_a_stage_too_small_for_its_layers_says_so(ckpt):
    mc = ModelConfig.from_hf(ckpt.config)
    ranges = tuple(layer_ranges(mc.num_hidden_layers, [1, 1]))
    with pytest.raises(placement.PlanError, match="does not fit the GPU budget"):
        placement.plan_stages(_cfg(), mc, ckpt, torch.bfloat16, ranges, [8 << 30, 1 * MiB], False)
