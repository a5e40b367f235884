"""Paged attention kernel against its torch reference.

CPU: the Triton kernel runs in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at small
shapes, in fp32 and fp16 (the interpreter's bf16 dot is not usable). GPU (`pytest -m gpu`): real
shapes in bf16 and int8, split-KV, and a CUDA-graph replay with new lengths and tables.

Every case builds fresh inputs from its own seed. The pool is filled with NaN (int8: NaN scales)
except at the slots of real key positions, block 0 included, so a read of anything a sequence does
not own shows up as NaN; `out` starts as NaN so unwritten sequence rows and stray writes show too.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from strata.kernels import attention
from strata.kernels.attention import (
    MIN_SPLIT_KEYS,
    SplitWorkspace,
    attention_flops,
    choose_num_splits,
    paged_attention,
    paged_attention_ref,
    paged_attention_triton,
)
from strata.kvcache.pool import quantize_int8

# The interpreter converts 1-element arrays to ints through a path numpy deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

PAD = (0, 5)  # a padding sequence: q_len 0 (its ctx and table must be ignored)
# (q_len, ctx_len): prefill chunk over a cached prefix, decode, verify (k=2), padding, fresh prefill, first token.
MIXED = [(40, 150), (1, 97), (3, 64), PAD, (17, 17), (1, 1)]
DECODES = [(1, 150), (1, 33), (2, 70), PAD, (4, 129)]


def make_case(seed, seqs, *, hkv, group, head_dim, block_size, dtype, int8=False, device="cpu", extra_rows=3,
              max_q_len=None):
    gen = torch.Generator().manual_seed(seed)
    hq = hkv * group
    blocks = [math.ceil(ctx / block_size) if n else 0 for n, ctx in seqs]
    num_blocks = 1 + sum(blocks) + 2
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # shuffled, never block 0
    tables = torch.zeros(len(seqs), max(blocks) + 1, dtype=torch.int32)
    num_slots = num_blocks * block_size
    k = torch.full((num_slots, hkv, head_dim), float("nan"))
    v = torch.full_like(k, float("nan"))
    q_start, row = [], 0
    for r, ((n, ctx), nb) in enumerate(zip(seqs, blocks)):
        tables[r, :nb] = torch.tensor(ids[:nb], dtype=torch.int32)
        ids = ids[nb:]
        if n:
            t = torch.arange(ctx)
            slots = tables[r].long()[t // block_size] * block_size + t % block_size
            k[slots] = torch.randn(ctx, hkv, head_dim, generator=gen) * 1.5
            v[slots] = torch.randn(ctx, hkv, head_dim, generator=gen)
        q_start.append(row if n else 0)  # a padding entry points at live rows: it must not write them
        row += n
    n_rows = row + extra_rows
    q = torch.randn(n_rows, hq, head_dim, generator=gen)
    case = dict(q=q.to(device, dtype), block_tables=tables.to(device),
                q_start=torch.tensor(q_start, dtype=torch.int32, device=device),
                q_len=torch.tensor([n for n, _ in seqs], dtype=torch.int32, device=device),
                ctx_len=torch.tensor([c for _, c in seqs], dtype=torch.int32, device=device),
                block_size=block_size, max_q_len=max_q_len or max(n for n, _ in seqs), scale=head_dim ** -0.5)
    if int8:
        valid = ~k.isnan().any(-1)
        kq, ks = quantize_int8(k.nan_to_num())
        vq, vs = quantize_int8(v.nan_to_num())
        ks[~valid], vs[~valid] = float("nan"), float("nan")
        case.update(k_cache=kq.to(device), v_cache=vq.to(device), k_scale=ks.to(device), v_scale=vs.to(device))
    else:
        case.update(k_cache=k.to(device, dtype), v_cache=v.to(device, dtype))
    return case, seqs, q_start


def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode())


def run(fn, case, num_splits=1, workspace=None):
    out = torch.full_like(case["q"], float("nan"))
    args = {k: v for k, v in case.items() if k not in ("q", "k_cache", "v_cache", "block_tables", "q_start",
                                                     "q_len", "ctx_len")}
    return fn(case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["q_start"], case["q_len"],
              case["ctx_len"], out, num_splits=num_splits, workspace=workspace, **args)


def workspace_for(case, num_splits):
    n, hq, d = case["q"].shape
    return SplitWorkspace(n, hq, d, num_splits, case["q"].device)


def check(out, ref, seqs, q_start, tol):
    """Every sequence row written and close to the reference (per sequence); every other row untouched."""
    owned = torch.zeros(out.shape[0], dtype=torch.bool)
    for (n, _), row in zip(seqs, q_start):
        if not n:
            continue
        o, r = out[row:row + n].float().cpu(), ref[row:row + n].float().cpu()
        assert torch.isfinite(o).all(), f"rows {row}..{row + n - 1} not written or NaN"
        err = ((o - r).norm() / r.norm()).item()
        assert err <= tol, f"sequence at row {row} (q_len {n}): relative error {err:.2e} > {tol}"
        owned[row:row + n] = True
    assert out[~owned.to(out.device)].isnan().all(), "a row outside every sequence was written"


@pytest.fixture
def short_splits(monkeypatch):
    """Splits as short as one key tile, so the CPU-sized contexts below really split (and merge)."""
    monkeypatch.setattr(attention, "MIN_SPLIT_KEYS", 16)


CPU_CASES = [  # (dtype, int8, hkv, group, head_dim, block_size, num_splits, tol)
    (torch.float32, False, 2, 2, 16, 4, 1, 1e-5),
    (torch.float32, False, 1, 4, 32, 16, 1, 1e-5),
    (torch.float32, False, 2, 1, 16, 16, 3, 1e-5),
    (torch.float16, False, 1, 2, 32, 4, 1, 5e-3),
    (torch.float32, True, 2, 2, 16, 16, 2, 1e-5),
    (torch.float16, True, 1, 4, 16, 4, 1, 5e-3),
    (torch.float16, False, 1, 8, 256, 16, 2, 5e-3),  # Qwen3-Next's heads: their own decode tiles
    (torch.float32, True, 1, 8, 256, 16, 1, 1e-5),
]


@pytest.mark.parametrize("seqs", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("dtype,int8,hkv,group,head_dim,block_size,num_splits,tol", CPU_CASES)
def test_matches_reference(seqs, dtype, int8, hkv, group, head_dim, block_size, num_splits, tol, short_splits):
    seed = seed_of(len(seqs), dtype, int8, hkv, group, head_dim, block_size, num_splits)
    case, seqs, q_start = make_case(seed, seqs, hkv=hkv, group=group, head_dim=head_dim,
                                    block_size=block_size, dtype=dtype, int8=int8)
    ws = workspace_for(case, num_splits) if num_splits > 1 else None
    out = run(paged_attention_triton, case, num_splits, ws)
    check(out, run(paged_attention_ref, case), seqs, q_start, tol)


@pytest.mark.parametrize("seqs", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_splits_match_single_pass(seqs, short_splits):
    case, seqs, q_start = make_case(11 + len(seqs), seqs, hkv=2, group=2, head_dim=16, block_size=16,
                                    dtype=torch.float32)
    one = run(paged_attention_triton, case)
    for num_splits in (2, 5):  # 5 splits of one 64-key tile: shorter sequences use fewer
        split = run(paged_attention_triton, case, num_splits, workspace_for(case, 8))
        check(split, one, seqs, q_start, 1e-5)


def assert_batch_invariant(case, seqs, q_start, num_splits, check_seqs):
    """A sequence alone equals itself inside the batch, bitwise, under the same launch configuration
    (`max_q_len` picks the tile shape; on the GPU a different tile height may reorder a row's fp32
    reductions, which the batch-invariant mode has to pin down)."""
    ws = workspace_for(case, num_splits) if num_splits > 1 else None
    batched = run(paged_attention_triton, case, num_splits, ws)
    device = case["q"].device
    for r in check_seqs:
        n, row = seqs[r][0], q_start[r]
        alone = dict(case, q=case["q"][row:row + n].clone(), block_tables=case["block_tables"][r:r + 1].clone(),
                     q_start=torch.zeros(1, dtype=torch.int32, device=device), q_len=case["q_len"][r:r + 1].clone(),
                     ctx_len=case["ctx_len"][r:r + 1].clone(), max_q_len=case["max_q_len"])
        ws_alone = workspace_for(alone, num_splits) if num_splits > 1 else None
        out = run(paged_attention_triton, alone, num_splits, ws_alone)
        assert torch.equal(out, batched[row:row + n]), f"sequence {r} differs alone vs batched"


@pytest.mark.parametrize("num_splits", [1, 3])
def test_row_results_do_not_depend_on_the_batch(num_splits, short_splits):
    """fp32: a sequence alone and inside a mixed batch (other rows, another place in the batch) gives
    bitwise the same rows under the same launch configuration."""
    case, seqs, q_start = make_case(23 + num_splits, MIXED, hkv=1, group=4, head_dim=16, block_size=4,
                                    dtype=torch.float32)
    assert_batch_invariant(case, seqs, q_start, num_splits, check_seqs=(1, 2, 5))  # decode, verify, first token


def test_dispatch_runs_reference_on_cpu():
    case, _, _ = make_case(5, DECODES, hkv=1, group=2, head_dim=16, block_size=4, dtype=torch.float32)
    assert torch.equal(run(paged_attention, case).nan_to_num(7.0), run(paged_attention_ref, case).nan_to_num(7.0))


def test_split_needs_a_large_enough_workspace():
    case, _, _ = make_case(6, DECODES, hkv=1, group=2, head_dim=16, block_size=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="SplitWorkspace"):
        run(paged_attention_triton, case, 2)
    with pytest.raises(ValueError, match="too small"):
        run(paged_attention_triton, case, 4, workspace_for(case, 2))


def test_choose_num_splits():
    # One long decode on 132 SMs: about two waves, clamped to max_splits.
    assert choose_num_splits(1, 1, 8, 32768, 132, 64) == 33
    assert choose_num_splits(1, 1, 8, 32768, 132, 16) == 16
    # Short context: at most cdiv(max_ctx, MIN_SPLIT_KEYS) splits.
    assert choose_num_splits(1, 1, 8, 1024, 132, 64) == 1024 // MIN_SPLIT_KEYS
    assert choose_num_splits(1, 1, 8, 100, 132, 64) == -(-100 // MIN_SPLIT_KEYS)
    assert choose_num_splits(1, 1, 8, MIN_SPLIT_KEYS, 132, 64) == 1
    # Prefill-sized or already wide work: no split.
    assert choose_num_splits(1, 4096, 8, 32768, 132, 64) == 1
    assert choose_num_splits(64, 1, 8, 32768, 132, 64) == 1


def test_attention_flops():
    d, h, length = 128, 32, 1024
    assert attention_flops(length, length, h, d) == 4 * d * h * length * (length + 1) / 2
    assert attention_flops(1, 4096, h, d) == 4 * d * h * 4096
    assert attention_flops(3, 100, h, d) == 4 * d * h * (98 + 99 + 100)


# ---------------------------------------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU_SHAPE = dict(hkv=8, group=4, head_dim=128, block_size=16, device="cuda")


def gpu_batch(seed, kind, batch):
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, 8193, (batch,), generator=gen).tolist()
    if kind == "decode":
        return [(1, c) for c in ctx]
    if kind == "verify":
        return [(k + 1, max(c, k + 1)) for k, c in zip(torch.randint(1, 4, (batch,), generator=gen).tolist(), ctx)]
    if kind == "short":  # chunks below PREFILL_WIDE_MIN_Q: the one-warp-group prompt tiles
        return [(512, 3584), (300, 300), PAD] + [(1 + i % 4, c) for i, c in enumerate(ctx)]
    # mixed: a 1024-token chunk over a 3K cached prefix (the wide prompt tiles), a fresh 700-token
    # prefill, decodes, verifies, padding
    return [(1024, 4096), (700, 700), PAD] + [(1 + i % 4, c) for i, c in enumerate(ctx)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind,batch", [("decode", 1), ("decode", 32), ("verify", 8), ("verify", 32), ("mixed", 6),
                                        ("short", 4)])
@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
@pytest.mark.parametrize("num_splits", [1, 4, 16])
def test_gpu_matches_reference(kind, batch, int8, num_splits):
    seed = seed_of(kind, batch, int8, num_splits)
    case, seqs, q_start = make_case(seed, gpu_batch(seed, kind, batch), dtype=torch.bfloat16, int8=int8, **GPU_SHAPE)
    ws = workspace_for(case, num_splits) if num_splits > 1 else None
    out = run(paged_attention, case, num_splits, ws)
    check(out, run(paged_attention_ref, case), seqs, q_start, 2e-2)



@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind,batch", [("decode", 1), ("decode", 8), ("verify", 8), ("mixed", 3)])
@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_gpu_wide_heads_match_reference(kind, batch, int8):
    """Qwen3-Next's attention heads (2 KV heads of 256, groups of 8): their decode tiles and the
    prompt tiles of heads wider than 128."""
    seed = seed_of("wide", kind, batch, int8)
    case, seqs, q_start = make_case(seed, gpu_batch(seed, kind, batch), dtype=torch.bfloat16, int8=int8,
                                    **dict(GPU_SHAPE, hkv=2, group=8, head_dim=256))
    ws = workspace_for(case, 8)
    check(run(paged_attention, case, 8, ws), run(paged_attention_ref, case), seqs, q_start, 2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 4])
def test_gpu_fp32_matches_reference_and_is_batch_invariant(num_splits):
    seqs = [(300, 2000), (1, 5000), (3, 4000), PAD, (2, 77), (1, 1)]
    case, seqs, q_start = make_case(seed_of("fp32", num_splits), seqs, dtype=torch.float32, **GPU_SHAPE)
    ws = workspace_for(case, num_splits) if num_splits > 1 else None
    check(run(paged_attention, case, num_splits, ws), run(paged_attention_ref, case), seqs, q_start, 1e-5)
    assert_batch_invariant(case, seqs, q_start, num_splits, check_seqs=(1, 2, 4, 5))


@pytest.mark.gpu
@needs_cuda
def test_gpu_splits_match_single_pass():
    case, seqs, q_start = make_case(seed_of("splits"), gpu_batch(3, "verify", 16), dtype=torch.bfloat16, **GPU_SHAPE)
    one = run(paged_attention, case)
    for num_splits in (2, 7, 32):
        check(run(paged_attention, case, num_splits, workspace_for(case, 32)), one, seqs, q_start, 1e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_gpu_cuda_graph_replay(int8):
    """Capture one launch, then replay it with new lengths, starts, tables and queries in the same tensors."""
    batch, max_q_len, num_splits = 12, 4, 8
    base = [(4, c) for c in torch.randint(64, 6000, (batch,), generator=torch.Generator().manual_seed(1)).tolist()]
    case, _, _ = make_case(seed_of("graph", int8), base, dtype=torch.bfloat16, int8=int8, extra_rows=5, **GPU_SHAPE)
    ws = workspace_for(case, num_splits)
    out = torch.full_like(case["q"], float("nan"))
    static = [case[k] for k in ("q", "k_cache", "v_cache", "block_tables", "q_start", "q_len", "ctx_len")]
    extra = {k: case[k] for k in ("k_scale", "v_scale") if k in case}

    def launch():
        paged_attention(*static, out, block_size=case["block_size"], max_q_len=max_q_len, scale=case["scale"],
                        num_splits=num_splits, workspace=ws, **extra)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    tables0, ctx0 = case["block_tables"].clone(), [c for _, c in base]
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        perm = torch.randperm(batch, generator=gen).tolist()
        q_lens = torch.randint(0, max_q_len + 1, (batch,), generator=gen).tolist()
        seqs, starts, row = [], [], 0
        for r, src in enumerate(perm):
            n = q_lens[r]
            ctx = int(torch.randint(max(n, 1), ctx0[src] + 1, (1,), generator=gen)) if n else 0
            seqs.append((n, ctx))
            starts.append(row if n else 0)
            row += n
        case["block_tables"].copy_(tables0[perm])
        case["q_len"].copy_(torch.tensor(q_lens, dtype=torch.int32))
        case["ctx_len"].copy_(torch.tensor([c for _, c in seqs], dtype=torch.int32))
        case["q_start"].copy_(torch.tensor(starts, dtype=torch.int32))
        case["q"].copy_(torch.randn(case["q"].shape, generator=gen).to(case["q"]))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, run(paged_attention_ref, case), seqs, starts, 2e-2)


def _timed_ms(fn, iters=20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@pytest.mark.gpu
@needs_cuda
def test_gpu_speed_report():
    """Prints prefill TFLOP/s and decode bandwidth (run with -s); asserts only that the numbers exist.
    Targets: 32K causal prefill >= 350 TFLOP/s; decode close to HBM bandwidth (H200: 4.8 TB/s)."""
    hq, hkv, d, bs = 32, 8, 128, 16
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count

    def setup(seqs):
        blocks = [math.ceil(c / bs) for _, c in seqs]
        num_blocks = 1 + sum(blocks)
        ids = torch.randperm(num_blocks - 1, device="cuda").int() + 1
        tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32, device="cuda")
        offset = 0
        for r, nb in enumerate(blocks):
            tables[r, :nb] = ids[offset:offset + nb]
            offset += nb
        k = torch.randn(num_blocks * bs, hkv, d, device="cuda", dtype=torch.bfloat16)
        n = sum(q for q, _ in seqs)
        q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
        starts = torch.tensor([0] + [q for q, _ in seqs][:-1], device="cuda").cumsum(0).int()
        lens = torch.tensor([q for q, _ in seqs], dtype=torch.int32, device="cuda")
        ctx = torch.tensor([c for _, c in seqs], dtype=torch.int32, device="cuda")
        return q, k, torch.randn_like(k), tables, starts, lens, ctx, torch.empty_like(q)

    q, k, v, tables, starts, lens, ctx, out = setup([(32768, 32768)])
    ms = _timed_ms(lambda: paged_attention(q, k, v, tables, starts, lens, ctx, out, block_size=bs,
                                           max_q_len=32768, scale=d ** -0.5), iters=5)
    tflops = attention_flops(32768, 32768, hq, d) / ms / 1e9
    print(f"\nprefill 32K: {ms:.2f} ms, {tflops:.0f} TFLOP/s")
    assert tflops > 0
    for batch in (1, 8, 32):
        for context in (4096, 32768):
            q, k, v, tables, starts, lens, ctx, out = setup([(1, context)] * batch)
            splits = choose_num_splits(batch, 1, hkv, context, num_sms, 64)
            ws = SplitWorkspace(batch, hq, d, 64, "cuda")
            ms = _timed_ms(lambda: paged_attention(q, k, v, tables, starts, lens, ctx, out, block_size=bs,
                                                   max_q_len=1, scale=d ** -0.5, num_splits=splits, workspace=ws))
            gbs = batch * context * hkv * d * 2 * 2 / ms / 1e6
            print(f"decode batch {batch:2d} ctx {context:5d}: {splits:2d} splits, {ms * 1e3:7.1f} us, {gbs:6.0f} GB/s")
            assert gbs > 0
