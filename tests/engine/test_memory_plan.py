"""The memory planner's arithmetic (strata/memory_plan.py) on made-up sizes: the order of placement,
the automatic expert split, the flags that fix it, the KV pool's growth, and the one-line refusals."""

import pytest

import math

from strata.memory_plan import BEYOND, GiB, MiB, ModelSizes, PlanError, PlanRequest, beyond_estimate, plan_memory

# A 48-layer MoE shaped like an 80B-A3B model in a 3-bit format: ~0.63 GiB of routed experts a layer.
SIZES = ModelSizes(
    fixed=(("embeddings + LM head", 600 * MiB), ("attention, dense, routers, norms", 1400 * MiB), ("MTP head", 200 * MiB)),
    shared_experts=300 * MiB,
    routed_experts=(640 * MiB,) * 48,
    moe_layers=tuple(range(48)),
    kv_bytes_per_token=24 * 1024,  # 12 attention layers x 2 x 2 heads x 256 x 2 bytes
    kv_bytes_per_token_int8=12 * 1024 + 256,
)


def _req(**kw):
    base = dict(sizes=SIZES, gpu_budget=16 * GiB, scratch_bytes=1 * GiB, kv_tokens=2 * 32768, context=32768, parallel=2)
    return PlanRequest(**{**base, **kw})


def test_experts_fill_what_is_left_from_the_last_layers():
    plan = plan_memory(_req())
    fixed = (600 + 1400 + 200 + 300) * MiB + 1 * GiB + 2 * 32768 * 24 * 1024
    room = 16 * GiB - fixed
    on_gpu = room // (640 * MiB)
    assert plan.cpu_moe_layers == tuple(range(48 - on_gpu))
    assert plan.gpu_bytes <= 16 * GiB and plan.gpu_bytes + 640 * MiB > 16 * GiB  # one more layer would not fit
    assert plan.host_bytes == (48 - on_gpu) * 640 * MiB
    assert plan.auto and f"as --n-cpu-moe {48 - on_gpu}" in plan.table()
    # The order: fixed weights, shared experts, scratch, the KV pool, then the experts.
    names = [r.component for r in plan.rows]
    assert names[:5] == ["embeddings + LM head", "attention, dense, routers, norms", "MTP head", "shared experts",
                         "scratch, workspaces, graphs"]
    assert names[5].startswith("KV pool (65536 tokens)")
    assert names[6] == f"routed experts, layers {48 - on_gpu}-47" and names[7] == f"routed experts, layers 0-{47 - on_gpu}"


def test_everything_fits_and_the_rest_grows_the_kv_pool():
    plan = plan_memory(_req(gpu_budget=80 * GiB, kv_tokens_max=10**9))
    assert plan.cpu_moe_layers == () and plan.host_bytes == 0
    assert plan.kv_tokens > 2 * 32768
    assert 80 * GiB - 24 * 1024 < plan.gpu_bytes <= 80 * GiB
    capped = plan_memory(_req(gpu_budget=80 * GiB, kv_tokens_max=100_000))
    assert capped.kv_tokens == 100_000


def test_the_pool_does_not_grow_while_experts_sit_in_ram():
    assert plan_memory(_req(kv_tokens_max=10**9)).kv_tokens == 2 * 32768


def test_cpu_moe_and_n_cpu_moe_fix_the_split():
    all_cpu = plan_memory(_req(cpu_moe=True))
    assert all_cpu.cpu_moe_layers == tuple(range(48)) and not all_cpu.auto
    assert "experts placed by flag" in all_cpu.table()
    some = plan_memory(_req(n_cpu_moe=40))
    assert some.cpu_moe_layers == tuple(range(40))
    assert plan_memory(_req(n_cpu_moe=99)).cpu_moe_layers == tuple(range(48))
    with pytest.raises(PlanError, match=r"use --n-cpu-moe \d+ or more"):
        plan_memory(_req(n_cpu_moe=2))


def test_moe_layers_name_the_model_layers():
    sizes = ModelSizes(fixed=(("weights", GiB),), routed_experts=(GiB, GiB, GiB), moe_layers=(1, 3, 5),
                       kv_bytes_per_token=1024)
    plan = plan_memory(PlanRequest(sizes, gpu_budget=4 * GiB, scratch_bytes=0, kv_tokens=1024))
    assert plan.cpu_moe_layers == (1,)
    assert [r.component for r in plan.rows][-2:] == ["routed experts, layers 3,5", "routed experts, layers 1"]


def test_a_dense_model_has_no_expert_rows():
    sizes = ModelSizes(fixed=(("weights", 15 * GiB),), kv_bytes_per_token=128 * 1024)
    plan = plan_memory(PlanRequest(sizes, gpu_budget=80 * GiB, scratch_bytes=GiB, kv_tokens=8192))
    assert [r.where for r in plan.rows] == ["gpu"] * 3 and plan.cpu_moe_layers == ()


def test_refusals_say_what_would_fit():
    with pytest.raises(PlanError) as e:
        plan_memory(_req(gpu_budget=12 * GiB, kv_tokens=2 * 262144, context=262144))
    msg = str(e.value)
    assert "\n" not in msg and "does not fit the GPU budget of 12.00 GiB" in msg
    room = 12 * GiB - (2500 * MiB + 1 * GiB)
    assert f"--ctx {room // (24 * 1024 * 2)} (with --parallel 2)" in msg and "--kv int8" in msg
    with pytest.raises(PlanError, match="even without a KV cache"):
        plan_memory(_req(gpu_budget=2 * GiB))
    with pytest.raises(PlanError, match="--n-cpu-moe must be >= 0"):
        plan_memory(_req(n_cpu_moe=-1))


def test_streaming_buffers_come_out_of_the_experts_room():
    """With prompt chunks streaming the RAM layers' experts up, two buffers of the largest such layer
    stay on the GPU: the split leaves two more layers in RAM than without them, and none at all when
    every layer fits."""
    plain = plan_memory(_req())
    streamed = plan_memory(_req(stream_experts=True))
    assert len(streamed.cpu_moe_layers) == len(plain.cpu_moe_layers) + 2
    assert streamed.gpu_bytes <= 16 * GiB
    row = next(r for r in streamed.rows if r.component.startswith("expert streaming buffers"))
    assert row.where == "gpu" and row.nbytes == 2 * 640 * MiB
    everything = plan_memory(_req(gpu_budget=80 * GiB, stream_experts=True))
    assert everything.cpu_moe_layers == () and not any("streaming" in r.component for r in everything.rows)


def test_streaming_buffers_that_cannot_fit_say_how_to_do_without():
    fixed = (600 + 1400 + 200 + 300) * MiB + 1 * GiB + 2 * 32768 * 24 * 1024
    with pytest.raises(PlanError, match="--expert-stream-tokens 0"):
        plan_memory(_req(gpu_budget=fixed + 100 * MiB, cpu_moe=True, stream_experts=True))
    assert plan_memory(_req(gpu_budget=fixed + 100 * MiB, cpu_moe=True)).cpu_moe_layers == tuple(range(48))


def test_a_load_beyond_the_estimate_moves_more_layers_experts_to_ram():
    plan = plan_memory(_req())
    n = len(plan.cpu_moe_layers)
    assert plan.weight_bytes == (600 + 1400 + 200 + 300) * MiB + (48 - n) * 640 * MiB
    assert beyond_estimate(SIZES, plan, plan.weight_bytes) is None  # the estimate held
    slack = 16 * GiB - plan.gpu_bytes
    over = slack + 700 * MiB
    again = beyond_estimate(SIZES, plan, plan.weight_bytes + over)
    assert dict(again.fixed)[BEYOND] == over
    refit = plan_memory(_req(sizes=again))
    assert refit.cpu_moe_layers == tuple(range(n + math.ceil(700 / 640)))  # the slack took the rest
    assert refit.gpu_bytes <= 16 * GiB and BEYOND in refit.table()
    # Measured again after the refit: the row grows by what is still beyond it.
    twice = beyond_estimate(again, refit, refit.weight_bytes + 100 * MiB)
    assert dict(twice.fixed)[BEYOND] == over + 100 * MiB and len(twice.fixed) == len(again.fixed)
    # Within the slack the split stays.
    small = beyond_estimate(SIZES, plan, plan.weight_bytes + slack // 2)
    assert plan_memory(_req(sizes=small)).cpu_moe_layers == plan.cpu_moe_layers


def test_a_split_given_by_flag_that_the_load_overran_says_which_would_fit():
    plan = plan_memory(_req(n_cpu_moe=32))
    again = beyond_estimate(SIZES, plan, plan.weight_bytes + 16 * GiB - plan.gpu_bytes + 1300 * MiB)
    with pytest.raises(PlanError, match=r"use --n-cpu-moe 35 or more"):
        plan_memory(_req(sizes=again, n_cpu_moe=32))
