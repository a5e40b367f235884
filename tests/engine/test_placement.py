"""Routed experts in host RAM through the engine (`--cpu-moe`, `--n-cpu-moe N`, strata/engine/placement.py)
on the embedded MoE model, on the CPU: the same greedy tokens with the experts in RAM in float form, close
ones in int8, and the memory plan of the real checkpoint on made-up GPU budgets."""

import dataclasses

import pytest
import torch

from strata.config import EngineConfig, ModelConfig
from strata.engine import placement
from strata.engine.engine import LLMEngine
from strata.kvcache.pool import kv_bytes_per_token
from strata.kvcache.tier import tier_tokens
from strata.engine.types import EngineRequest
from strata.loaders import default_model_path, host_format, read_checkpoint
from strata.kernels.host_moe import has_cpp_compiler
from strata.models.host_experts import has_fbgemm
from strata.memory_plan import MiB, PlanError
from strata.models.moe import MoE
from strata.params import SamplingParams

PROMPTS = ["It is a truth universally acknowledged, that", "To be, or not to be:"]


def _greedy(**kw):
    e = LLMEngine(EngineConfig(device="cpu", parallel=2, **kw), progress=False)
    for i, p in enumerate(PROMPTS):
        e.add_request(EngineRequest(f"r{i}", tuple(e.tokenizer.encode(p)), SamplingParams(max_tokens=24, ignore_eos=True),
                                    0.0))
    out = {rid: [t for ev in evs for t in ev.token_ids] for rid, evs in e.run_to_completion().items()}
    return out, e


@pytest.fixture(scope="module")
def plain():
    return _greedy()[0]


def _host_layers(e):
    return [i for i, layer in enumerate(e.model.model.layers) for m in layer.modules()
            if isinstance(m, MoE) and m.host is not None]


def test_cpu_moe_float_gives_the_same_tokens(plain):
    out, e = _greedy(cpu_moe=True, host_experts="float")
    moe_layers = placement.moe_layers(e.model_config)
    assert moe_layers and _host_layers(e) == moe_layers
    assert all(m.path == "host" and m.host.fmt == "float" for m in e.model.modules() if isinstance(m, MoE)
               and m.host is not None)
    assert out == plain


def test_n_cpu_moe_places_the_first_layers(plain):
    out, e = _greedy(n_cpu_moe=1, host_experts="float")
    assert _host_layers(e) == placement.moe_layers(e.model_config)[:1]
    assert out == plain


@pytest.mark.parametrize("fmt", ["int8", "w8a8", "fbgemm", "compiled", "compiled-int4"])
def test_quantized_experts_stay_close(plain, fmt):
    if fmt == "fbgemm" and not has_fbgemm():
        pytest.skip("torch has no FBGEMM here")
    out, e = _greedy(cpu_moe=True, host_experts=fmt)
    assert {m.host.fmt for m in e.model.modules() if isinstance(m, MoE) and m.host is not None} == {fmt}
    same = sum(a == b for k in plain for a, b in zip(plain[k], out[k]))
    assert same >= 0.5 * sum(map(len, plain.values()))  # an 8- or 4-bit copy of a 9M model: most tokens agree


def test_auto_format_follows_the_stored_type_and_the_room():
    assert host_format("BF16", [(64, 32)]) == "float"
    int8 = "compiled" if has_cpp_compiler() else "fbgemm" if has_fbgemm() else "w8a8"
    assert host_format("Q8_0", [(64, 32)]) == int8 and host_format("IQ3_S", [(64, 64), (64, 32)]) == int8
    assert host_format("IQ3_S", [(64, 64), (64, 32)], int8_fits=False) == "int4"
    assert host_format("Q4_K", [(24, 64)], int8_fits=False) == int8  # rows not in tiles of 16: no int4
    assert host_format("BF16", [(64, 32)], int8_fits=False) == "float"
    assert host_format({"Q4_K", "BF16"}, [(64, 32)]) == "float"
    # Rows of multiples of 128 take the generated kernels' 4-bit groups where there is a compiler.
    four = "compiled-int4" if has_cpp_compiler() else "int4"
    shapes = [(256, 128), (128, 128)]
    assert host_format("IQ3_S", shapes, int8_fits=False) == four
    # Types whose groups are 16 levels of their own take them with room for int8 too (exact, fewer bytes);
    # a layer with one other type (a Q4_K_M file's Q6_K down projection) keeps int8 rows.
    assert host_format({"IQ3_S"}, shapes) == host_format({"Q4_K", "Q4_0"}, shapes) == ("compiled-int4" if has_cpp_compiler() else int8)
    assert host_format({"Q4_K", "Q6_K"}, shapes) == host_format("Q8_0", shapes) == int8


def test_flags_must_agree():
    with pytest.raises(ValueError, match="n_cpu_moe"):
        EngineConfig(cpu_moe=True, n_cpu_moe=2)
    with pytest.raises(ValueError, match="host_experts"):
        EngineConfig(host_experts="int2")
    for way in ("cpu", "both"):  # no CPU copy to compute from
        with pytest.raises(ValueError, match="no CPU copy"):
            EngineConfig(host_experts="file", host_expert_decode=way)
    assert EngineConfig(host_experts="file").host_expert_decode == "auto"
    with pytest.raises(ValueError, match="needs CUDA"):
        EngineConfig(host_experts="file", device="cpu")
    with pytest.raises(ValueError, match="gpu_memory"):
        EngineConfig(gpu_memory=0)


def test_the_plan_of_the_embedded_checkpoint():
    ckpt = read_checkpoint(default_model_path())
    mc = ModelConfig.from_hf(ckpt.config)
    cfg = EngineConfig(device="cuda", ctx=4096, parallel=2, gpu_memory=2.0).resolved()
    kv_layers = mc.num_full_attention_layers
    sizes = placement.model_sizes(ckpt, mc, cfg, torch.bfloat16, kv_layers)
    assert len(sizes.routed_experts) == len(placement.moe_layers(mc)) and all(sizes.routed_experts)
    # Everything the file holds is counted once, at 2 bytes a value (bf16 file, bf16 model), and each
    # router's fp32 copy beside it.
    total = sum(b for _, b in sizes.fixed) + sizes.shared_experts + sum(sizes.routed_experts)
    routers = [n for n in ckpt.names if n.endswith(".mlp.gate.weight")]
    assert routers and total == sum(ckpt.nbytes.values()) + 2 * sum(ckpt.nbytes[n] for n in routers)
    big = placement.plan_placement(cfg, mc, ckpt, torch.bfloat16, 2 << 30, kv_layers)
    assert big.cpu_moe_layers == () and "memory plan (GPU budget 2.00 GiB)" in big.table()
    # A budget that holds everything but the routed experts of the first MoE layer (no streaming buffers:
    # test_memory_plan covers them).
    fixed = (sum(b for _, b in sizes.fixed) + sizes.shared_experts + placement.scratch_bytes(cfg, mc)
             + cfg.ctx * cfg.parallel * sizes.kv_bytes_per_token)
    tight = placement.plan_placement(dataclasses.replace(cfg, expert_stream_tokens=0), mc, ckpt, torch.bfloat16,
                                     fixed + sum(sizes.routed_experts[1:]), kv_layers)
    assert tight.cpu_moe_layers == tuple(placement.moe_layers(mc)[:1])
    with pytest.raises(PlanError, match="does not fit the GPU budget"):
        placement.plan_placement(cfg, mc, ckpt, torch.bfloat16, 64 * MiB, kv_layers)


def test_batch_invariance_refuses_experts_in_ram():
    with pytest.raises(ValueError, match=r"MoE experts in host RAM \(--cpu-moe"):
        LLMEngine(EngineConfig(device="cpu", cpu_moe=True, batch_invariant=True), progress=False)


def test_with_a_resident_window_the_plan_counts_the_window_not_the_context():
    ckpt = read_checkpoint(default_model_path())
    mc = ModelConfig.from_hf(ckpt.config)
    kv_layers = mc.num_full_attention_layers
    whole = EngineConfig(device="cuda", ctx=262144, parallel=2, gpu_memory=2.0, kv="int8",
                         expert_stream_tokens=0).resolved()
    tiered = dataclasses.replace(whole, kv_resident=4096)
    sizes = placement.model_sizes(ckpt, mc, tiered, torch.bfloat16, kv_layers)
    window = 2 * tier_tokens(4096, tiered.chunk_size, 0, tiered.block_size)
    # The two streaming buffers of one layer's K/V at the full context are part of the scratch, and the
    # output and LSE of a step's rows over the streamed prefix.
    one_layer = kv_bytes_per_token(1, mc.num_key_value_heads, mc.head_dim, "int8", torch.bfloat16)
    rows_out = tiered.max_num_batched_tokens * mc.num_attention_heads * (mc.head_dim * 2 + 4)
    scratch = placement.scratch_bytes(tiered, mc) + 2 * 262144 * one_layer + rows_out
    budget = (sum(b for _, b in sizes.fixed) + sizes.shared_experts + sum(sizes.routed_experts) + scratch
              + 2 * window * sizes.kv_bytes_per_token)
    with pytest.raises(PlanError):  # one slot's 262K context does not fit beside the weights
        placement.plan_placement(whole, mc, ckpt, torch.bfloat16, budget, kv_layers)
    plan = placement.plan_placement(tiered, mc, ckpt, torch.bfloat16, budget, kv_layers)
    assert plan.cpu_moe_layers == () and plan.kv_tokens == window and plan.scratch_bytes == scratch


def test_a_capped_pool_short_of_one_context_is_a_start_up_error(monkeypatch):
    """Under --gpu-memory the plan promises one full context of K/V at least: when what the load and the
    buffers hold leaves less, start-up says so in one line instead of serving a context of a few tokens."""
    from strata.engine.startup import kv_capacity_tokens
    from strata.memory_plan import Plan

    mc = ModelConfig.from_hf(read_checkpoint(default_model_path()).config)
    cfg = EngineConfig(device="cpu", ctx=4096, parallel=1, gpu_memory=2.0)
    per_token = 1024
    plan = Plan(rows=(), cpu_moe_layers=(3, 4), kv_tokens=4096, gpu_budget=2 << 30, scratch_bytes=256 * MiB)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    held = {"bytes": (2 << 30) - 256 * MiB - 4096 * per_token}  # the weights as planned: the pool fits exactly
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: held["bytes"])
    cuda = torch.device("cuda")
    assert kv_capacity_tokens(cfg, mc, per_token, cuda, 0, plan) == 4096
    held["bytes"] += 4000 * per_token  # 4 MiB more than planned: 96 tokens left
    with pytest.raises(PlanError, match=r"leaves K/V for 96 tokens where the plan counted 4096.*--n-cpu-moe 3 or more"):
        kv_capacity_tokens(cfg, mc, per_token, cuda, 0, plan)


def test_a_capped_pool_beside_a_model_built_before_the_engine_stays_within_the_allocators_cap(monkeypatch):
    """No plan (a benchmark's random weights): the pool gets what the allocator's cap (--gpu-memory less
    the CUDA context) leaves beside the weights already held, one step's activations and the runner's
    buffers and graphs."""
    from strata.engine.startup import kv_capacity_tokens

    mc = ModelConfig.from_hf(read_checkpoint(default_model_path()).config)
    cfg = EngineConfig(device="cpu", ctx=4096, parallel=2, gpu_memory=1.5)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * MiB)
    per_token = 4096
    tokens = kv_capacity_tokens(cfg, mc, per_token, torch.device("cuda"), 0)
    cap = (3 << 29) - placement.CONTEXT_BYTES
    beside = placement.scratch_bytes(cfg, mc) - placement.CONTEXT_BYTES
    assert beside >= placement.BUFFER_BYTES
    assert 0 < tokens * per_token <= cap - 10 * MiB - beside


def test_strata_plan_prints_the_plan_start_up_would_make(capsys):
    from strata.cli import main
    from strata.engine.startup import plan_one_device

    assert main(["plan", "--gpu-memory", "1.5", "--ctx", "4096", "--parallel", "2"]) == 0
    ckpt = read_checkpoint(default_model_path())
    cfg = EngineConfig(device="cuda", ctx=4096, parallel=2, gpu_memory=1.5).resolved()
    plan, _ = plan_one_device(cfg, ModelConfig.from_hf(ckpt.config), ckpt, torch.bfloat16, 3 << 29)
    assert capsys.readouterr().out.strip() == plan.table() and "KV pool" in plan.table()
    # Each pipeline stage's plan on its own budget.
    assert main(["plan", "--gpu-memory", "1.5", "--split-mode", "layer", "--tensor-split", "1,1"]) == 0
    out = capsys.readouterr().out
    assert out.count("pipeline stage") == 2 and out.count("memory plan (GPU budget 1.50 GiB)") == 2
    # A budget the minimum does not fit: the one line that says so, status 2.
    assert main(["plan", "--gpu-memory", "0.5", "--ctx", "4096"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not fit the GPU budget of 512.0 MiB" in err
    assert main(["plan", "--device", "cpu", "--gpu-memory", "1"]) == 2


def test_scratch_counts_the_dense_copy_an_int8_pool_reads_prompts_through():
    """On CUDA an int8 pool's prompt steps attend over a bf16 copy two contexts long (K and V): part of
    the plan's scratch, as it is of the card."""
    mc = ModelConfig.from_hf(read_checkpoint(default_model_path()).config)
    base = EngineConfig(device="cuda", dtype="bfloat16", ctx=65536, parallel=2)
    copy = 2 * 2 * 65536 * mc.num_key_value_heads * mc.head_dim * 2
    assert placement.scratch_bytes(dataclasses.replace(base, kv="int8"), mc) - placement.scratch_bytes(base, mc) == copy
    invariant = dataclasses.replace(base, kv="int8", batch_invariant=True)  # its kernels read the int8 blocks
    assert placement.scratch_bytes(invariant, mc) == placement.scratch_bytes(dataclasses.replace(base, batch_invariant=True), mc)


def test_pinned_allocations_above_the_threshold_take_their_exact_size(monkeypatch):
    """`pin_exact_sizes` adds the pinned allocator's rounding threshold to torch's allocator settings,
    keeping what is there, and leaves a threshold the user set alone."""
    from strata.engine import placement

    settings = {"now": "expandable_segments:True"}
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: settings["now"], raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda s: settings.update(now=s), raising=False)
    placement.pin_exact_sizes()
    assert settings["now"] == f"expandable_segments:True,pinned_max_round_threshold_mb:{placement.PINNED_ROUND_MB}"
    settings["now"] = "pinned_max_round_threshold_mb:4096"
    placement.pin_exact_sizes()
    assert settings["now"] == "pinned_max_round_threshold_mb:4096"
