"""Key splits of the paged attention kernel: splits sized from each context under a larger grid, the
merge done by the last split of a query tile (one launch), int8 tiles, determinism and counters.

CPU: the interpreter at small shapes, with MIN_SPLIT_KEYS and the key tiles shrunk so that contexts of a
few hundred keys get many splits. GPU (`pytest -m gpu`): real shapes with the graph-style grid of 32
splits, repeated calls and a graph replay.
"""

from __future__ import annotations

import pytest
import torch
from test_attention import PAD, check, make_case, run, seed_of, workspace_for

from strata.kernels import attention as A

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, unwritten (NaN) rows included."""
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def expected_parts(q_len: int, ctx: int, num_splits: int, kv_tile: int) -> int:
    """Splits a decode/verify sequence's (single) query tile uses: the kernel's rule, restated."""
    active = min(num_splits, cdiv(ctx, A.MIN_SPLIT_KEYS), max(A.FEW_SPLITS, cdiv(ctx, A.LONG_SPLIT_KEYS)))
    split_len = cdiv(cdiv(ctx, active), kv_tile) * kv_tile
    return (ctx - 1) // split_len + 1


@pytest.fixture
def tiny_tiles(monkeypatch):
    """Splits of 32 keys, key tiles of 32 and prompt tiles of 128 rows, so CPU-sized contexts split many
    ways and a CPU-sized prompt chunk spans several query tiles."""
    monkeypatch.setattr(A, "MIN_SPLIT_KEYS", 32)
    monkeypatch.setattr(A, "KV_TILE", 32)
    monkeypatch.setattr(A, "KV_TILE_DECODE", 32)
    monkeypatch.setattr(A, "PREFILL_KV_TILE", 32)
    monkeypatch.setattr(A, "PREFILL_CONFIG", A.TileConfig(block_m=128, num_warps=4, num_stages=2))
    A.select_config.cache_clear()
    yield
    A.select_config.cache_clear()


# Decode and verify rows: a context below one split, several long ones, padding, a verify whose first
# row sees no key of the second split.
SPLIT_SEQS = [(1, 9), (2, 390), PAD, (1, 64), (3, 33)]
GRID_SPLITS = 16  # more than any of these contexts uses: cdiv(390, 32) = 13


def test_splits_follow_the_context_and_merge_in_one_launch(tiny_tiles):
    case, seqs, q_start = make_case(seed_of("ctx-splits"), SPLIT_SEQS, hkv=2, group=2, head_dim=16, block_size=4,
                                    dtype=torch.float32)
    ws = workspace_for(case, GRID_SPLITS)
    ws.m.fill_(float("nan"))
    out = run(A.paged_attention_triton, case, GRID_SPLITS, ws)
    check(out, run(A.paged_attention_ref, case), seqs, q_start, 1e-5)
    assert not ws.counters.any(), "arrival counters must be back at zero after a call"
    hq = case["q"].shape[1]
    for (n, ctx), row in zip(seqs, q_start):
        if not n:
            continue
        parts = expected_parts(n, ctx, GRID_SPLITS, A.KV_TILE_DECODE)
        assert parts < GRID_SPLITS
        written = ~ws.m[row:row + n, :hq].isnan()  # [n, Hq, splits]: which partials some program stored
        if parts == 1:  # a single split writes its output directly
            assert not written.any(), f"ctx {ctx}: single split went through the workspace"
        else:
            assert written[:, :, :parts].all() and not written[:, :, parts:].any(), (
                f"ctx {ctx}: expected partials of splits 0..{parts - 1} only")


def test_split_count_depends_only_on_the_context_when_the_grid_is_large(tiny_tiles):
    """Bitwise: any num_splits >= cdiv(ctx, MIN_SPLIT_KEYS) gives the same rows; a context of at most
    MIN_SPLIT_KEYS keys matches num_splits = 1; two identical calls are equal (deterministic merge)."""
    case, seqs, q_start = make_case(seed_of("invariant"), SPLIT_SEQS, hkv=1, group=4, head_dim=16, block_size=4,
                                    dtype=torch.float32)
    ws = workspace_for(case, 64)
    wide = run(A.paged_attention_triton, case, GRID_SPLITS, ws)
    assert same(wide, run(A.paged_attention_triton, case, GRID_SPLITS, ws))
    assert same(wide, run(A.paged_attention_triton, case, cdiv(390, A.MIN_SPLIT_KEYS), ws))
    single = run(A.paged_attention_triton, case)
    for (n, ctx), row in zip(seqs, q_start):
        if n and ctx <= A.MIN_SPLIT_KEYS:
            assert same(wide[row:row + n], single[row:row + n])
    assert not ws.counters.any()


def test_merge_over_several_query_tiles(tiny_tiles):
    """A prompt chunk of two query tiles beside decodes, split: each tile has its own counter."""
    seqs = [(40, 150), (1, 97), (3, 64), PAD, (17, 17), (1, 1)]
    case, seqs, q_start = make_case(seed_of("q-tiles"), seqs, hkv=1, group=4, head_dim=16, block_size=4,
                                    dtype=torch.float32)
    assert A.select_config(40, 4).block_m // 4 < 40  # the 40-query sequence spans two query tiles
    ws = workspace_for(case, 8)
    out = run(A.paged_attention_triton, case, 8, ws)
    check(out, run(A.paged_attention_ref, case), seqs, q_start, 1e-5)
    check(out, run(A.paged_attention_triton, case), seqs, q_start, 1e-5)
    assert not ws.counters.any()


@pytest.mark.parametrize("kv_tile_int8,dtype,tol", [(64, torch.float32, 1e-5), (128, torch.float16, 5e-3)],
                         ids=["64-fp32", "128-fp16"])
def test_int8_tiles(monkeypatch, kv_tile_int8, dtype, tol):
    """int8 K/V at both key tiles (the scales applied to score columns and probabilities), split and not."""
    monkeypatch.setattr(A, "MIN_SPLIT_KEYS", 64)
    monkeypatch.setattr(A, "KV_TILE_INT8", kv_tile_int8)
    A.select_config.cache_clear()
    try:
        seqs = [(1, 400), (2, 300), (1, 40), PAD, (4, 129)]
        case, seqs, q_start = make_case(seed_of("int8", kv_tile_int8, dtype), seqs, hkv=2, group=2, head_dim=16,
                                        block_size=16, dtype=dtype, int8=True)
        assert A.select_config(4, 2, True).kv_tile == kv_tile_int8
        ref = run(A.paged_attention_ref, case)
        check(run(A.paged_attention_triton, case), ref, seqs, q_start, tol)
        ws = workspace_for(case, 16)
        check(run(A.paged_attention_triton, case, 16, ws), ref, seqs, q_start, tol)
        assert not ws.counters.any()
    finally:
        A.select_config.cache_clear()


def test_choose_num_splits_is_bounded_by_the_split_length():
    # A graph captured for 40960 keys keeps the runner's cap; the kernel shortens it per context.
    assert A.choose_num_splits(1, 1, 8, 40960, 132, 32) == 32
    assert A.choose_num_splits(1, 1, 8, 576, 132, 32) == cdiv(576, A.MIN_SPLIT_KEYS)
    assert A.choose_num_splits(1, 1, 8, 1, 132, 32) == 1
    # Short contexts split into key tiles up to FEW_SPLITS ways, long ones into ~LONG_SPLIT_KEYS-key splits.
    assert [A.active_splits(ctx, 32) for ctx in (128, 129, 576, 1024, 2048, 4096, 6000, 8192, 40960)] == \
        [1, 2, 5, 8, 8, 16, 24, 32, 32]
    assert A.active_splits(4096, 8) == 8


# ---------------------------------------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU_SHAPE = dict(hkv=8, group=4, head_dim=128, block_size=16, device="cuda")
GPU_SEQS = [(1, 5), (1, 576), (1, 4096), (2, 30000), PAD, (1, 255), (4, 1000), (1, 257)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_gpu_graph_grid_short_and_long_contexts(int8):
    """The graph-style grid (32 splits) over short and long contexts: matches the reference, the same
    bits over repeated calls (whichever split finishes last), counters at zero, and a graph replay."""
    case, seqs, q_start = make_case(seed_of("gpu-grid", int8), GPU_SEQS, dtype=torch.bfloat16, int8=int8,
                                    **GPU_SHAPE)
    ws = workspace_for(case, 32)
    first = run(A.paged_attention, case, 32, ws)
    check(first, run(A.paged_attention_ref, case), seqs, q_start, 2e-2)
    for _ in range(5):
        assert same(run(A.paged_attention, case, 32, ws), first)
    assert not ws.counters.any()
    out = torch.full_like(case["q"], float("nan"))
    static = [case[k] for k in ("q", "k_cache", "v_cache", "block_tables", "q_start", "q_len", "ctx_len")]
    extra = {k: case[k] for k in ("k_scale", "v_scale") if k in case}

    def launch():
        A.paged_attention(*static, out, block_size=case["block_size"], max_q_len=case["max_q_len"],
                          scale=case["scale"], num_splits=32, workspace=ws, **extra)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):  # back-to-back launches share the counters, as a step's layers do
            launch()
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert same(out, first)
        assert not ws.counters.any()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kv_tile_int8", [64, 128])
def test_gpu_int8_tiles(monkeypatch, kv_tile_int8):
    monkeypatch.setattr(A, "KV_TILE_INT8", kv_tile_int8)
    A.select_config.cache_clear()
    try:
        case, seqs, q_start = make_case(seed_of("gpu-int8", kv_tile_int8), GPU_SEQS, dtype=torch.bfloat16,
                                        int8=True, **GPU_SHAPE)
        ref = run(A.paged_attention_ref, case)
        for num_splits in (1, 8, 32):
            ws = workspace_for(case, num_splits) if num_splits > 1 else None
            check(run(A.paged_attention, case, num_splits, ws), ref, seqs, q_start, 2e-2)
    finally:
        A.select_config.cache_clear()
