"""MoE routing and token sort kernels (moe_routing.py, moe_sort.py) against torch references and the MoE module.

CPU: the kernels run in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at small shapes:
softmax and sigmoid scoring, group limit and correction bias on and off, fused-router configurations
forced to loop (several H steps, expert blocks and token blocks), sorts over several histogram blocks
with experts that get no pair. The wiring is checked by running a MoE module with the kernels switched
on against its reference paths. GPU (`pytest -m gpu`): Qwen3-30B-A3B and 160-expert group-limited
shapes, batch invariance and CUDA-graph replay (timings: benchmarks/kernels/moe_routing.py).

Every case draws fresh inputs from its own seed. Ids must equal torch's exactly (random inputs have no
near ties); weights agree to fp32 rounding (the softmax denominator and the k-sum are summed in
another order); the fused router's logits agree to fp32 rounding of a different H order, so its ids
and weights are checked against the reference routing of its own logits.
"""

from __future__ import annotations

import copy
import zlib

import pytest
import torch

from strata.kernels import moe_routing as mr
from strata.kernels import moe_sort as ms
from strata.models import moe as moe_module
from test_moe_packed import BASE, random_moe

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
# Forces every loop of the fused router at small shapes: H steps of 16, one expert per program.
LOOPING = mr.RouterDecodeConfig(block_e=1, block_h=16, num_warps=1, num_stages=2)
SMALL_SORT = ms.SortConfig(hist_block=32, rank_block=8, scan_rows=2)


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def settings(scoring, k, e, group=None, bias=True, norm=True, scale=2.5, device=DEV, seed=0):
    """Router settings as `Router` holds them; `group`: (n_group, topk_group) or None."""
    n_group, topk_group = group or (1, 1)
    out = dict(scoring=scoring, top_k=k, norm_topk_prob=norm, n_group=n_group, topk_group=topk_group, bias=None,
               scale=scale if scoring == "sigmoid" else 1.0)
    if scoring == "sigmoid" and bias:
        out["bias"] = (torch.randn(e, generator=torch.Generator().manual_seed(seed)) * 0.3).to(device)
    return out


def assert_routing_equal(got, ref, atol=1e-6):
    (w, ids), (w_ref, ids_ref) = got[:2], ref[:2]
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == ids_ref.shape
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=atol)


ROUTE_CASES = [  # (scoring, E, k, group, bias, norm, T)
    ("softmax", 8, 1, None, False, False, 37),  # the only long one
    ("softmax", 16, 2, None, False, True, 3),
    ("softmax", 128, 8, None, False, True, 16),
    ("sigmoid", 8, 2, None, True, True, 1),
    ("sigmoid", 16, 8, None, False, False, 16),
    ("sigmoid", 16, 2, (4, 2), True, True, 9),
    ("sigmoid", 128, 8, (8, 4), True, True, 3),
    ("sigmoid", 40, 1, (5, 1), False, True, 16),  # groups of 8 in a 64-wide block with 24 padding columns
]


@pytest.mark.parametrize("case", ROUTE_CASES,
                         ids=lambda c: f"{c[0]}-e{c[1]}-k{c[2]}-g{c[3]}-b{int(c[4])}-n{int(c[5])}-t{c[6]}")
def test_route_matches_reference(case):
    scoring, e, k, group, bias, norm, t = case
    s = settings(scoring, k, e, group, bias, norm, seed=seed_of("bias", case))
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(seed_of("route", case))).to(DEV) * 2
    assert_routing_equal(mr.route_triton(logits, **s), mr.route_ref(logits, **s))


def test_route_ties_take_the_lower_id_and_strided_logits():
    logits = torch.zeros(2, 16, device=DEV)
    logits[1, 5] = logits[1, 9] = 1.0
    w, ids = mr.route_triton(logits, **settings("softmax", 3, 16, norm=False))
    assert ids.tolist() == [[0, 1, 2], [5, 9, 0]]
    wide = torch.randn(3, 32, device=DEV)
    s = settings("sigmoid", 2, 16, (4, 2), seed=1)
    assert_routing_equal(mr.route_triton(wide[:, ::2].contiguous(), **s), mr.route_ref(wide[:, ::2], **s))
    view = wide[:, :16]  # rows 32 apart
    assert_routing_equal(mr.route_triton(view, **s), mr.route_ref(view, **s))


DECODE_CASES = [  # (scoring, E, k, group, H, x dtype, config, T)
    ("softmax", 8, 2, None, 64, torch.float32, None, 16),
    ("softmax", 16, 8, None, 80, torch.bfloat16, LOOPING, 3),
    ("sigmoid", 16, 2, (4, 2), 48, torch.float16, LOOPING, 6),
    ("sigmoid", 8, 1, None, 64, torch.bfloat16, None, 1),
    ("softmax", 16, 4, None, 32, torch.bfloat16, None, 1),
    ("sigmoid", 128, 8, (8, 4), 32, torch.float32, mr.RouterDecodeConfig(block_e=32, block_h=16, num_warps=2), 5),
]


@pytest.mark.parametrize("case", DECODE_CASES,
                         ids=lambda c: f"{c[0]}-e{c[1]}-k{c[2]}-g{c[3]}-h{c[4]}-{c[5]}-t{c[7]}".replace("torch.", ""))
def test_router_decode_matches_reference(case):
    scoring, e, k, group, h, dtype, cfg, t = case
    gen = torch.Generator().manual_seed(seed_of("decode", case))
    x = torch.randn(t, h, generator=gen).to(dtype).to(DEV)
    weight = (torch.randn(e, h, generator=gen) * h ** -0.5).to(DEV)
    s = settings(scoring, k, e, group, seed=seed_of("bias", case))
    ws = mr.router_decode_workspace(DEV)
    for _ in range(2):  # the counters come back to zero, so the workspace serves the next call
        w, ids, logits = mr.router_decode_triton(x, weight, workspace=ws, config=cfg, **s)
        assert not ws.any()
    w_ref, ids_ref, logits_ref = mr.router_decode_ref(x, weight, **s)
    assert logits.shape == (t, e) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)
    assert_routing_equal((w, ids), mr.route_ref(logits, **s))
    assert_routing_equal((w, ids), (w_ref, ids_ref), atol=1e-5)


def test_router_decode_batch_invariant_and_out_logits():
    gen = torch.Generator().manual_seed(seed_of("invariant"))
    x = torch.randn(7, 80, generator=gen).to(torch.bfloat16).to(DEV)
    weight = torch.randn(16, 80, generator=gen).to(DEV)
    s = settings("sigmoid", 4, 16, (4, 2), seed=3)
    logits = torch.full((7, 16), float("nan"), device=DEV)
    full = mr.router_decode_triton(x, weight, logits=logits, config=LOOPING, **s)
    assert full[2] is logits and torch.isfinite(logits).all()
    for rows in ([5], [6, 2, 0]):
        part = mr.router_decode_triton(x[rows], weight, config=LOOPING, **s)
        for a, b in zip(part, full):
            assert torch.equal(a, b[rows])


SORT_CASES = [(1, 1, 8), (3, 2, 16), (16, 8, 128), (37, 8, 16), (37, 2, 8), (5, 1, 512)]


@pytest.mark.parametrize("t,k,e", SORT_CASES)
@pytest.mark.parametrize("cfg", [None, SMALL_SORT], ids=["default", "small-blocks"])
def test_sort_tokens_matches_argsort(t, k, e, cfg):
    gen = torch.Generator().manual_seed(seed_of("sort", t, k, e))
    # Experts drawn from half the range (some get nothing) with repeats across tokens, as top-k gives.
    ids = torch.stack([torch.randperm(max(k, e // 2), generator=gen)[:k] for _ in range(t)]).to(DEV)
    ws = ms.sort_tokens_workspace(DEV)
    order, offs = ms.sort_tokens_triton(ids, e, workspace=ws, config=cfg)
    order_ref, offs_ref = ms.sort_tokens_ref(ids, e)
    assert order.dtype == torch.int64 and offs.dtype == torch.int32 and offs.shape == (e,)
    assert torch.equal(order, order_ref) and torch.equal(offs, offs_ref)
    assert not ws.any()


def test_sort_tokens_skewed_int32_and_empty():
    ids = torch.full((40, 2), 3, dtype=torch.int32, device=DEV)  # every pair on one expert: stability is all
    ids[7, 1] = ids[30, 0] = 0
    for cfg in (None, SMALL_SORT):
        order, offs = ms.sort_tokens_triton(ids, 5, config=cfg)
        order_ref, offs_ref = ms.sort_tokens_ref(ids, 5)
        assert torch.equal(order, order_ref) and torch.equal(offs, offs_ref)
    order, offs = ms.sort_tokens_triton(ids[:0], 5)
    assert order.shape == (0,) and offs.tolist() == [0] * 5


def test_dispatch_and_support():
    x = torch.randn(3, 32)
    weight = torch.randn(8, 32)
    s = settings("sigmoid", 2, 8, (4, 2), device="cpu")
    for got, ref in ((mr.router_decode(x, weight, **s), mr.router_decode_ref(x, weight, **s)),
                     (mr.route(x @ weight.T, **s), mr.route_ref(x @ weight.T, **s))):
        for a, b in zip(got, ref):
            assert torch.equal(a, b)  # off CUDA the dispatch runs the references
    ids = torch.randint(0, 8, (5, 2))
    assert all(torch.equal(a, b) for a, b in zip(ms.sort_tokens(ids, 8), ms.sort_tokens_ref(ids, 8)))
    assert mr.router_decode_supported(16, 128, 2048, torch.bfloat16, top_k=8)
    assert mr.router_decode_supported(1, 160, 5120, torch.float32, top_k=8, scoring="sigmoid", n_group=8, topk_group=4)
    assert not mr.router_decode_supported(17, 128, 2048, torch.bfloat16, top_k=8)
    assert not mr.router_decode_supported(1, 1024, 2048, torch.bfloat16, top_k=8)
    assert not mr.router_decode_supported(1, 128, 2048, torch.int8, top_k=8)
    assert mr.route_supported(512, 8, scoring="softmax", n_group=3)  # softmax ignores groups, as the reference
    assert not mr.route_supported(160, 8, scoring="sigmoid", n_group=3, topk_group=1)  # 160 % 3
    assert not mr.route_supported(16, 8, scoring="sigmoid", n_group=8, topk_group=2)  # 2 groups of 2 < k
    assert not mr.route_supported(16, 17, scoring="softmax")
    with pytest.raises(ValueError):
        mr.route_triton(torch.randn(2, 8), **settings("softmax", 9, 8))
    with pytest.raises(ValueError):
        mr.router_decode_triton(torch.randn(17, 32), weight, **s)


@pytest.mark.parametrize("router", ["softmax", "softmax_k4", "sigmoid"])
def test_moe_module_with_kernels_switched_on(router, monkeypatch):
    """Router.forward and MoE._grouped through the kernels (use_triton forced on for CPU tensors)
    against the same module's reference paths: same ids, same logits up to fp32 order, same output."""
    ref = random_moe(router, seed=seed_of("module", router) % 1000)
    assert ref.pack_experts() == "grouped"
    ours = copy.deepcopy(ref)
    # pack_experts makes the kernels' counters only on CUDA: give the CPU module its own.
    ours.gate.route_ws, ours.sort_ws = mr.router_decode_workspace("cpu"), ms.sort_tokens_workspace("cpu")
    calls = []
    monkeypatch.setattr(mr, "router_decode_triton", _counting(mr.router_decode_triton, calls, "decode"))
    monkeypatch.setattr(mr, "route_triton", _counting(mr.route_triton, calls, "route"))
    monkeypatch.setattr(ms, "sort_tokens_triton", _counting(ms.sort_tokens_triton, calls, "sort"))
    for t in (3, 17):
        x = torch.randn(t, BASE["hidden_size"], generator=torch.Generator().manual_seed(seed_of(router, t)))
        with torch.no_grad():
            w_ref, ids_ref, logits_ref = ref.gate(x)
            out_ref = ref._grouped(x, w_ref, ids_ref)
            with monkeypatch.context() as m:
                for module in (moe_module, mr, ms):
                    m.setattr(module, "use_triton", lambda _t: True)
                w, ids, logits = ours.gate(x)
                out = ours._grouped(x, w, ids)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    assert calls == ["decode", "sort", "route", "sort"]
    assert not ours.gate.route_ws.any()


def _counting(fn, calls, name):
    def wrapped(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return wrapped


# ---------------------------------------------------------------------------------------------- GPU

SHAPES_GPU = {  # name: (E, H, settings)
    "30b": (128, 2048, dict(scoring="softmax", top_k=8, norm_topk_prob=True)),
    "e160-groups": (160, 4096, dict(scoring="sigmoid", top_k=8, norm_topk_prob=True, n_group=8, topk_group=4,
                                    scale=2.5)),
}


def gpu_router(name, seed):
    e, h, s = SHAPES_GPU[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weight = torch.randn(e, h, device="cuda", generator=gen) * h ** -0.5
    if s["scoring"] == "sigmoid":
        s = dict(s, bias=torch.randn(e, device="cuda", generator=gen) * 0.1)
    x = torch.randn(16, h, device="cuda", generator=gen).to(torch.bfloat16)
    return x, weight, s


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(SHAPES_GPU))
def test_gpu_router_decode_real_sizes(name):
    x, weight, s = gpu_router(name, seed_of("gpu", name))
    ws = mr.router_decode_workspace("cuda")
    full = mr.router_decode_triton(x, weight, workspace=ws, **s)
    assert not ws.any()
    for t in (1, 4, 16):
        got = mr.router_decode(x[:t], weight, workspace=ws, **s)
        ref = mr.router_decode_ref(x[:t], weight, **s)
        err = ((got[2] - ref[2]).abs().max() / ref[2].abs().max()).item()
        print(f"{name} T={t}: logits rel err {err:.1e}, ids equal {torch.equal(got[1], ref[1])}, "
              f"max |dw| {(got[0] - ref[0]).abs().max().item():.1e}")
        assert err <= 1e-5
        assert_routing_equal(got, mr.route_ref(got[2], **s))
        assert_routing_equal(got, ref, atol=1e-5)
        for a, b in zip(got, full):
            assert torch.equal(a, b[:t]), f"T={t} differs from the same rows in T=16"
    alone = mr.router_decode_triton(x[11:12], weight, workspace=ws, **s)
    assert all(torch.equal(a[0], b[11]) for a, b in zip(alone, full))
    again = mr.router_decode_triton(x, weight, workspace=ws, **s)
    assert all(torch.equal(a, b) for a, b in zip(again, full)), "not deterministic run to run"
    assert not ws.any()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(SHAPES_GPU))
def test_gpu_route_many_tokens(name):
    e, _, s = SHAPES_GPU[name]
    gen = torch.Generator(device="cuda").manual_seed(5)
    if s["scoring"] == "sigmoid":
        s = dict(s, bias=torch.randn(e, device="cuda", generator=gen) * 0.1)
    logits = torch.randn(4096, e, device="cuda", generator=gen) * 2
    w, ids = mr.route(logits, **s)
    w_ref, ids_ref = mr.route_ref(logits, **s)
    differ = (ids != ids_ref).any(-1)
    print(f"{name}: rows with other ids {differ.float().mean().item():.3%}, max |dw| "
          f"{(w - w_ref).abs().max().item():.1e}")
    # The kernel's sigmoid may differ from torch's by an ulp, so a row whose reference choice is a
    # near-tie (two groups' or two experts' scores within 1e-5 at the selection boundary) may pick the
    # other side; every other row must match exactly.
    assert not (differ & ~_near_ties(logits, s)).any()
    keep = ~differ
    assert_routing_equal((w[keep], ids[keep]), (w_ref[keep], ids_ref[keep]))


def _near_ties(logits, s, tol=1e-5):
    """Rows whose reference routing has a gap below tol at a selection boundary (groups or experts)."""
    choice = logits.sigmoid() + s["bias"] if s["scoring"] == "sigmoid" else logits.softmax(-1)
    n, e = choice.shape
    near = torch.zeros(n, dtype=torch.bool, device=logits.device)
    if s.get("n_group", 1) > 1:
        g, kg = s["n_group"], s["topk_group"]
        group_score = choice.view(n, g, e // g).topk(2, dim=-1)[0].sum(-1)
        ranked = group_score.sort(-1, descending=True)[0]
        near |= (ranked[:, kg - 1] - ranked[:, kg]).abs() < tol
        kept = torch.zeros_like(group_score).scatter_(1, group_score.topk(kg, dim=-1)[1], 1.0)
        choice = choice.masked_fill(kept.repeat_interleave(e // g, dim=1) == 0, float("-inf"))
    top = choice.sort(-1, descending=True)[0]
    return near | ((top[:, s["top_k"] - 1] - top[:, s["top_k"]]).abs() < tol)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t,k,e", [(512, 8, 128), (4096, 8, 128), (8192, 8, 160), (8192, 8, 512), (3, 8, 128)])
def test_gpu_sort_tokens(t, k, e):
    gen = torch.Generator(device="cuda").manual_seed(seed_of("gpu sort", t, k, e))
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=-1)[1]
    skewed = torch.randint(0, 3, (t, k), device="cuda", generator=gen)
    ws = ms.sort_tokens_workspace("cuda")
    for case in (ids, skewed, ids.to(torch.int32)):
        order, offs = ms.sort_tokens(case, e, workspace=ws)
        order_ref, offs_ref = ms.sort_tokens_ref(case, e)
        assert torch.equal(order, order_ref) and torch.equal(offs, offs_ref)
    assert not ws.any()


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replay():
    """Capture the fused router and the sort once; replay with new inputs written into the same tensors."""
    x, weight, s = gpu_router("e160-groups", 9)
    x = x[:4].clone()
    ids_in = torch.rand(512, 160, device="cuda").topk(8, dim=-1)[1]
    route_ws, sort_ws = mr.router_decode_workspace("cuda"), ms.sort_tokens_workspace("cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles outside the capture
        mr.router_decode(x, weight, workspace=route_ws, **s)
        ms.sort_tokens(ids_in, 160, workspace=sort_ws)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        routed = mr.router_decode(x, weight, workspace=route_ws, **s)
        sorted_ = ms.sort_tokens(ids_in, 160, workspace=sort_ws)
    for step in range(3):
        x.copy_(torch.randn_like(x))
        ids_in.copy_(torch.rand(512, 160, device="cuda").topk(8, dim=-1)[1])
        graph.replay()
        torch.cuda.synchronize()
        want = mr.router_decode_triton(x, weight, **s)
        assert all(torch.equal(a, b) for a, b in zip(routed, want)), f"replay {step}"
        assert all(torch.equal(a, b) for a, b in zip(sorted_, ms.sort_tokens_ref(ids_in, 160))), f"replay {step}"
    assert not route_ws.any() and not sort_ws.any()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_gpu_moe_module(router, monkeypatch):
    """A packed bf16 MoE module on CUDA: its router (fused up to 16 tokens) against the torch router on
    the same weights, and `_grouped` with the kernel sort bitwise equal to `_grouped` with argsort."""
    moe = random_moe(router, seed=4).to("cuda", torch.bfloat16)
    assert moe.pack_experts() == "grouped"
    gate = moe.gate
    s = dict(scoring=gate.scoring, top_k=gate.top_k, norm_topk_prob=gate.norm, n_group=gate.n_group,
             topk_group=gate.topk_group, bias=gate.e_score_correction_bias, scale=gate.scale)
    for t in (1, 16, 40):
        x = torch.randn(t, BASE["hidden_size"], device="cuda").to(torch.bfloat16)
        with torch.no_grad():
            w, ids, logits = gate(x)
            w_ref, ids_ref, logits_ref = mr.router_decode_ref(x, gate.weight_f32, **s)
            out = moe._grouped(x, w, ids)
            with monkeypatch.context() as m:
                m.setattr(mr, "use_triton", lambda _t: False)
                out_ref = moe._grouped(x, w, ids)
            full = moe(x)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(out, out_ref)
        assert torch.isfinite(full).all()


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_nan_logits_still_give_valid_expert_ids(scoring):
    """Overflowed activations give NaN logits: the ids must stay within range (the expert kernels index
    weights with them), ranking NaN first as torch.topk does."""
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
    logits[1] = float("nan")
    logits[3, 4] = float("nan")
    settings = dict(scoring=scoring, top_k=4, norm_topk_prob=True)
    _, ids = mr.route_triton(logits, **settings)
    _, ref_ids = mr.route_ref(logits, **settings)
    assert bool(((ids >= 0) & (ids < 16)).all())
    if scoring == "sigmoid":  # per-expert scores: only column 4 is NaN, and it ranks first
        assert ids[3, 0] == 4 == ref_ids[3, 0]
    assert torch.equal(ids[[0, 2, 4]], ref_ids[[0, 2, 4]])
