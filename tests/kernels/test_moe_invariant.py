"""Batch-invariant MoE experts (strata/kernels/moe_invariant.py, `MoE._grouped_invariant`).

CPU: the kernels run in Triton's interpreter at small shapes (E 4-8, N 48-96, K 64-200 with a tail),
fp32 and bf16. Against the references with the interpreter's own dot (bf16 operands widened exactly,
`_bf16_dot` of test_kernel_matmul); row invariance under `kstep_dot`, test_kernel_matmul's model of the
hardware (the interpreter's BLAS dot depends on a row's place in the tile, the device's must not):
the same tokens alone and among others (other group sizes, other offsets in their tiles, empty
experts) give bitwise the same rows. Even rows cancel (their exact products are 0), so any fp32
difference in order shows. The layer path is `_grouped_invariant` called on CPU tensors (on CUDA
`MoE.forward` takes it; on the CPU the invariant mode runs `_loop`).
GPU (`pytest -m gpu`): Qwen3-30B-A3B shapes in bf16, the grouped GEMMs' rows and one token's layer
output alone and inside batches of 7, 64 and 2048 tokens, bitwise; no host sync; CUDA-graph replay;
the tiny MoE models' engine matrix (needs the engine's refusal of MoE on CUDA lifted: it skips while
the engine refuses). Timings: benchmarks/kernels/moe_invariant.py.

Tolerances (max error / max |reference|): fp32 1e-5 (summation order only), bf16 1e-2 (one final
rounding); the layer against `_loop`: fp32 1e-5, bf16 3e-2 (h13 rounded to bf16 before the down GEMM).
"""

from __future__ import annotations

import copy

import pytest
import torch

from strata.kernels.matmul import MatmulConfig
from strata.kernels.moe_invariant import (
    grouped_matmul_invariant,
    grouped_matmul_invariant_ref,
    grouped_matmul_invariant_triton,
    moe_combine_invariant,
    moe_combine_invariant_ref,
    moe_combine_invariant_triton,
    router_logits_workspace_parts,
    router_workspace,
)
from strata.kernels.moe_sort import sort_tokens_ref
from test_matmul import _bf16_dot, kstep_dot  # noqa: F401 (fixtures)
from test_matmul import CUDA, DEV, needs_cuda, needs_interpreter, rel_err, seed_of
from test_moe_packed import BASE, random_moe

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def expert_stack(seed, e, n, k, dtype, device=DEV):
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(e, n, k, generator=gen, device=device) * k ** -0.5).to(dtype)


def tokens(seed, t, e, top_k, k, dtype, *, skip=(), device=DEV):
    """x [t, k] (exponents spread over 2^±6, so partial sums round), ids [t, top_k] (distinct experts per
    token, none of `skip`), routing weights [t, top_k] fp32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(t, k, generator=gen, device=device)
    x = x * torch.exp2(torch.randint(-6, 7, (t, k), generator=gen, device=device).float())
    allowed = torch.tensor([i for i in range(e) if i not in skip], device=device)
    ids = allowed[torch.rand(t, len(allowed), generator=gen, device=device).argsort(-1)[:, :top_k]]
    return x.to(dtype), ids, torch.rand(t, top_k, generator=gen, device=device)


def cancel(x, w):
    """In place: each expert's second half of K repeats its first and even tokens negate theirs there,
    so those rows' exact products are 0 and the outputs are the residue of the fp32 roundings."""
    half = x.shape[1] // 2
    w[:, :, half:2 * half] = w[:, :, :half]
    x[0::2, half:2 * half] = -x[0::2, :half]


def pair_rows(x, ids, w_stack, config=None):
    """Every (token, slot) pair's row of x @ w[expert]ᵀ in pair order, through the kernel on sorted rows."""
    order, offs = sort_tokens_ref(ids, w_stack.shape[0])
    xs = x[order // ids.shape[1]]
    y = grouped_matmul_invariant_triton(xs, w_stack, offs, config=config)
    out = torch.empty_like(y)
    out[order] = y
    return out


# (E, tokens, top_k, N, K, experts no token picks)
CASES = [
    (4, 5, 2, 48, 64, ()),
    (8, 13, 2, 96, 200, (0, 3, 7)),  # K tail: 200 = 3 x 64 + 8; first and last experts empty
    (8, 3, 4, 72, 136, (1,)),  # fewer tokens than experts
    (6, 9, 1, 48, 64, (0, 1, 2, 3, 4)),  # every row in the last expert
]


@DTYPES
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"e{c[0]}-t{c[1]}-k{c[2]}-n{c[3]}-K{c[4]}")
def test_matches_reference(case, dtype):
    e, t, top_k, n, k, skip = case
    seed = seed_of(case, dtype)
    x, ids, _ = tokens(seed, t, e, top_k, k, dtype, skip=skip)
    w = expert_stack(seed, e, n, k, dtype)
    order, offs = sort_tokens_ref(ids, e)
    xs = x[order // top_k]
    wide = torch.full((t * top_k, n + 3), 7.0, dtype=dtype, device=DEV)  # extra columns: a sentinel
    out = wide[:, :n]
    out.fill_(float("nan"))
    got = grouped_matmul_invariant(xs, w, offs, out)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(out).all(), "a row left unwritten"
    assert (wide[:, n:] == 7.0).all(), "write outside out"
    ref = grouped_matmul_invariant_ref(xs, w, offs)
    assert rel_err(out, ref) <= TOL[dtype]
    assert torch.equal(grouped_matmul_invariant(xs[:0], w, torch.zeros_like(offs)), ref[:0])


def test_validation():
    x, ids, _ = tokens(1, 4, 4, 2, 64, torch.float32)
    w = expert_stack(1, 4, 48, 64, torch.float32)
    order, offs = sort_tokens_ref(ids, 4)
    xs = x[order // 2]
    for bad in (dict(xs=xs[:, :32]), dict(xs=xs.to(torch.bfloat16)), dict(offs=offs.long()), dict(offs=offs[:3]),
                dict(w=w.transpose(1, 2)), dict(out=torch.empty(8, 47))):
        args = dict(xs=xs, w=w, offs=offs, out=None) | bad
        with pytest.raises(ValueError):
            grouped_matmul_invariant(args["xs"], args["w"], args["offs"], args["out"])


@needs_interpreter
@DTYPES
def test_rows_invariant_alone_and_among_others(kstep_dot, dtype):
    """Probe tokens alone, one alone, and among 37 others (put before, between and after them, so their
    rows sit elsewhere in other-sized groups and tiles; experts 2 and 5 empty): bitwise the same pair rows,
    cancelling ones included. Under the hardware model other tile shapes give the same bits too (what
    tiles following T would need); split ranges do change them (the order is the ranges' too)."""
    e, top_k, n, k = 8, 2, 48, 200
    x, ids, _ = tokens(seed_of("probe", dtype), 40, e, top_k, k, dtype, skip=(2, 5))
    w = expert_stack(seed_of("probe-w", dtype), e, n, k, dtype)
    cancel(x, w)
    probe = [0, 1, 2]  # even rows cancel
    alone = pair_rows(x[probe], ids[probe], w).view(3, top_k, n)
    assert alone[0].abs().max() > 0, "no residue: the cancelling rows would test nothing"
    busy_order = [*range(3, 20), 0, 1, *range(20, 40), 2]
    where = [busy_order.index(i) for i in probe]
    for config in (None, MatmulConfig(128, 64, num_warps=8), MatmulConfig(64, 32, num_stages=2, group_m=1)):
        if config is not None and dtype == torch.float32:
            config = MatmulConfig(config.block_m, config.block_n, block_k=32, num_warps=4, num_stages=2)
        busy = pair_rows(x[busy_order], ids[busy_order], w, config).view(40, top_k, n)
        for i, j in zip(probe, where):
            assert torch.equal(busy[j], alone[i]), f"{config}: token {i}"
    one = pair_rows(x[1:2], ids[1:2], w).view(1, top_k, n)
    assert torch.equal(one[0], alone[1])
    split = pair_rows(x[probe], ids[probe], w, MatmulConfig(64, 128, num_warps=4, split_k=2)).view(3, top_k, n)
    assert not torch.equal(split[0], alone[0]) or not torch.equal(split[2], alone[2]), "ranges changed nothing"
    ref = (x[1:2].float() @ w[ids[1, 0]].float().T).to(dtype)  # token 1 does not cancel
    assert rel_err(alone[1, 0], ref[0]) <= TOL[dtype]


@DTYPES
def test_combine_matches_reference_bitwise(dtype):
    """Each pair's row weighted and rounded, the slots added in order in fp32 and rounded once: the
    kernel's operations are the reference's, so the bits match (and no token reads another's rows)."""
    t, top_k, n = 11, 4, 72
    _, ids, weights = tokens(seed_of("combine", dtype), t, 8, top_k, 8, dtype)
    order, _ = sort_tokens_ref(ids, 8)
    gen = torch.Generator(device=DEV).manual_seed(3)
    y = torch.randn(t * top_k, n, generator=gen, device=DEV).to(dtype)
    got = moe_combine_invariant(y, order, weights)
    assert got.dtype == dtype and got.shape == (t, n)
    assert torch.equal(got, moe_combine_invariant_ref(y, order, weights))
    assert moe_combine_invariant_triton(y[:0], order[:0], weights[:0]).shape == (0, n)


@needs_interpreter
@DTYPES
@pytest.mark.parametrize("router", ["softmax_k4", "sigmoid"])
def test_layer_rows_alone_and_in_a_batch(kstep_dot, router, dtype):
    """`_grouped_invariant` and the router's invariant path (`Router._route_invariant`) as CUDA runs them:
    a token alone and among 20 others gives bitwise the same logits, routing and output row, close to
    the per-expert loop."""
    moe = random_moe(router, seed=seed_of(router)).to(dtype)
    moe.pack_experts()
    gen = torch.Generator().manual_seed(seed_of("layer", router, dtype))
    x = torch.randn(21, BASE["hidden_size"], generator=gen).to(dtype)
    weight = moe.gate.weight_f32 if moe.gate.weight_f32 is not None else moe.gate.weight
    with torch.no_grad():
        routed = moe.gate._route_invariant(x, weight)
        alone_routed = moe.gate._route_invariant(x[13:14], weight)
        for got, want in zip(alone_routed, routed):
            assert torch.equal(got[0], want[13])
        w, ids, _ = routed
        out = moe._grouped_invariant(x, w, ids)
        alone = moe._grouped_invariant(x[13:14], w[13:14], ids[13:14])
        assert torch.equal(alone[0], out[13])
        loop = moe._loop(x, w, ids)
    assert out.dtype == dtype
    assert rel_err(out, loop) <= (1e-5 if dtype == torch.float32 else 3e-2)


def test_router_workspace_serves_both_router_paths(monkeypatch):
    from strata.kernels import matmul as k_matmul
    from strata.kernels.moe_routing import WORKSPACE_NUMEL

    assert router_logits_workspace_parts(128, 2048) == (0, 0)  # one K range (`matmul.SPLIT_RANGES`)
    monkeypatch.setattr(k_matmul, "SPLIT_RANGES", True)
    counters, partials = router_logits_workspace_parts(128, 2048)
    assert (counters, partials) == (32, 2 * 4 * 64 * 64)  # FP32_CONFIG tiles, 4 ranges of the 30B router
    ws = router_workspace(128, 2048, "cpu")
    assert ws.numel() >= max(counters, WORKSPACE_NUMEL) + partials and not ws.any()


# ---------------------------------------------------------------------------------------------- GPU

E30, TOPK30, H30, I30 = 128, 8, 2048, 768
GPU_TOKENS = (1, 7, 64)


@pytest.fixture(scope="module")
def stacks_30b():
    return {"gate_up": expert_stack(1, E30, 2 * I30, H30, torch.bfloat16),
            "down": expert_stack(2, E30, H30, I30, torch.bfloat16)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("proj", ["gate_up", "down"])
def test_gpu_grouped_rows_invariant_30b(stacks_30b, proj):
    """Pairs of 1, 7 and 64 tokens bitwise equal to the same tokens' pairs inside a 2048-token batch
    (other group sizes, other places in their tiles), cancelling rows included; near the reference."""
    w = stacks_30b[proj].clone()
    x, ids, _ = tokens(3, 2048, E30, TOPK30, w.shape[2], torch.bfloat16)
    order, offs = sort_tokens_ref(ids, E30)
    xs = x[order // TOPK30]
    assert rel_err(grouped_matmul_invariant(xs, w, offs), grouped_matmul_invariant_ref(xs, w, offs)) <= 1e-2
    cancel(x, w)
    full = pair_rows(x, ids, w).view(2048, TOPK30, -1)
    assert full[0].abs().max() > 0
    for t in GPU_TOKENS:
        for first in (0, 1000, 2048 - t):
            got = pair_rows(x[first:first + t], ids[first:first + t], w).view(t, TOPK30, -1)
            assert torch.equal(got, full[first:first + t]), (proj, t, first)
    assert torch.equal(pair_rows(x, ids, w).view(2048, TOPK30, -1), full), "not deterministic run to run"


def moe_30b(seed: int = 0):
    from torch import nn

    from strata.bench.random_model import shape_config
    from strata.models.moe import MoE

    with torch.device("meta"):
        moe = MoE(shape_config("qwen3-30b-a3b"))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s: nn.Parameter((torch.randn(*s, device="cuda", generator=gen) * s[1] ** -0.5)  # noqa: E731
                                   .to(torch.bfloat16), requires_grad=False)
    moe.gate.weight = rand(E30, H30)
    for m in moe.experts:
        m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight = rand(I30, H30), rand(I30, H30), rand(H30, I30)
    moe.pack_experts()
    moe.batch_invariant = moe.gate.batch_invariant = True
    return moe.eval()


@pytest.mark.gpu
@needs_cuda
def test_gpu_layer_30b_one_token_alone_and_in_batches():
    """The 30B-A3B layer, bf16: token rows alone bitwise equal inside batches of 7, 64 and 2048 (at
    several places, among other tokens), router logits and routing included, with no host sync; near
    the non-invariant grouped path."""
    moe = moe_30b()
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(2048, H30, device="cuda", generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        moe(x)  # compiles outside the sync check
        torch.cuda.set_sync_debug_mode("error")
        try:
            full = moe(x)
            routed = moe.gate(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for i in (0, 5, 1000, 2047):
            assert torch.equal(moe(x[i:i + 1])[0], full[i]), f"token {i} alone"
            for got, want in zip(moe.gate(x[i:i + 1]), routed):
                assert torch.equal(got[0], want[i]), f"token {i}'s routing alone"
        for t in (7, 64):
            batch = torch.cat([x[1500:1500 + t // 2], x[5:6], x[1700:1700 + t - 1 - t // 2]])
            got = moe(batch)
            assert torch.equal(got[t // 2], full[5]), f"token 5 inside {t}"
            assert torch.equal(got[:t // 2], full[1500:1500 + t // 2])
        w, ids, _ = routed
        plain = moe._grouped(x, w, ids)
    assert rel_err(full, plain) <= 3e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_layer_cuda_graph_replay():
    moe = moe_30b(seed=1)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(8, H30, device="cuda", generator=gen).to(torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        moe(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = moe(x)
    for step in range(3):
        x.copy_(torch.randn(8, H30, device="cuda", generator=gen).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            assert torch.equal(out, moe(x)), step


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", ["glm4_moe", "qwen3_moe"])
def test_gpu_engine_moe_bf16_matrix(tiny_model_dirs, arch):
    """The tiny MoE models in bf16 on CUDA with batch_invariant: alone against chunked, busy, cache-hit
    runs with give-ways and against preemption (test_batch_invariance's matrix), graphs on, and graphs off."""
    from strata.loaders import load_model
    from test_batch_invariance import _busy, _engine, _matrix, _same

    model = load_model(tiny_model_dirs[arch][0], device="cuda", dtype=torch.bfloat16, progress=False)
    cuda = dict(device="cuda", dtype="bfloat16")
    want = _matrix(model, **cuda)
    _same(_busy(_engine(model, cuda_graph=False, **cuda)), want)


def test_packed_layer_keeps_loop_on_cpu():
    """The CPU's invariant mode stays on `_loop` (the torch path the CPU engine runs)."""
    moe = random_moe("softmax", seed=9)
    moe.pack_experts()
    moe.batch_invariant = moe.gate.batch_invariant = True
    x = torch.randn(5, BASE["hidden_size"])
    twin = copy.deepcopy(moe)
    with torch.no_grad():
        w, ids, _ = twin.gate(x)
        assert torch.equal(moe(x), twin._loop(x, w, ids))
