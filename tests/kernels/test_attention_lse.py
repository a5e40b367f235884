"""The paged attention kernel's log-sum-exp output (`lse=`), what the host KV tier merges by.

Kernel level: the LSE of decode rows with key splits (merged in the workspace), of prompt-chunk rows
over several query tiles, of int8 tiles and of the invariant mode, against the torch reference's; the
output is bitwise the same with and without it, and rows outside every sequence stay unwritten.
Backend level: `TritonPagedAttention.attend_lse` against the reference backend's `attend_lse` over the
same pool (decodes that split, a chunk, int8 read directly and through the dequantized copy), and the
tiered backend with the Triton backend inside against one attention over every key.

CPU: the interpreter at small shapes, splits and key tiles shrunk so contexts of ~100 keys split.
"""

from __future__ import annotations

import pytest
import torch
from test_attention import MIXED, PAD, check, make_case, run, seed_of, workspace_for

from strata.attention import triton_backend as TB
from strata.attention.reference import PagedAttention
from strata.attention.tiered import TieredAttention, attend_all
from strata.attention.triton_backend import TritonPagedAttention
from strata.kernels import attention as A
from strata.kvcache.pool import make_pool

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


@pytest.fixture
def tiny_tiles(monkeypatch):
    """Splits of 16 keys and key tiles of 16, so contexts of a few dozen keys split several ways and a
    20-row chunk spans two query tiles."""
    monkeypatch.setattr(A, "MIN_SPLIT_KEYS", 16)
    monkeypatch.setattr(A, "INVARIANT_SPLIT_KEYS", 64)
    for name in ("KV_TILE", "KV_TILE_DECODE", "KV_TILE_INT8", "PREFILL_KV_TILE"):
        monkeypatch.setattr(A, name, 16)
    monkeypatch.setattr(A, "PREFILL_CONFIG_NARROW", A.TileConfig(block_m=32, num_warps=4, num_stages=2))
    A.select_config.cache_clear()
    yield
    A.select_config.cache_clear()


def with_lse(fn, lse, **extra):
    return lambda *a, **kw: fn(*a, lse=lse, **extra, **kw)


def check_lse(got, want, seqs, q_start, tol):
    owned = torch.zeros(got.shape[0], dtype=torch.bool)
    for (n, _), row in zip(seqs, q_start):
        if n:
            owned[row:row + n] = True
    assert torch.isfinite(got[owned]).all(), "a sequence row's LSE not written"
    torch.testing.assert_close(got[owned], want[owned], rtol=tol, atol=tol)
    assert got[~owned].isnan().all(), "an LSE row outside every sequence was written"


# A chunk over a cached prefix (several query tiles), decodes and a verify whose contexts split, padding.
SEQS = [(20, 60), (1, 97), (3, 64), PAD, (1, 9), (2, 33)]


@pytest.mark.parametrize("int8,dtype,num_splits,invariant,tol", [
    (False, torch.float32, 1, False, 1e-5),
    (False, torch.float32, 8, False, 1e-5),
    (True, torch.float32, 8, False, 1e-5),
    (False, torch.float16, 8, False, 2e-3),
    (True, torch.float32, 4, True, 1e-5),
    (False, torch.float32, 1, True, 1e-5),
], ids=["fp32", "fp32-split", "int8-split", "fp16-split", "invariant-split", "invariant-walked"])
def test_lse_matches_the_reference_and_leaves_the_output_alone(tiny_tiles, int8, dtype, num_splits, invariant, tol):
    case, seqs, q_start = make_case(seed_of("lse", int8, dtype, num_splits, invariant), SEQS, hkv=2, group=2,
                                    head_dim=16, block_size=4, dtype=dtype, int8=int8)
    n, hq, _ = case["q"].shape
    want = torch.full((n, hq), float("nan"))
    run(with_lse(A.paged_attention_ref, want), case)
    ws = workspace_for(case, num_splits) if num_splits > 1 else None
    if ws is not None:
        ws.m.fill_(float("nan"))
    got = torch.full((n, hq), float("nan"))
    out = run(with_lse(A.paged_attention_triton, got, invariant=invariant), case, num_splits, ws)
    check_lse(got, want, seqs, q_start, tol)
    if ws is not None:  # some sequence really merged partials in the workspace
        assert not ws.m[:n, :hq, 1].isnan().all()
    plain = run(with_lse(A.paged_attention_triton, None, invariant=invariant), case, num_splits, ws)
    assert torch.equal(out.nan_to_num(7.0), plain.nan_to_num(7.0)), "the LSE output changed the attention output"
    if ws is not None:
        assert not ws.counters.any()


# A chunk longer than its context (a host prefix of a few blocks), a decode, padding, a chunk over more keys.
WHOLE = [(20, 12), (1, 40), PAD, (9, 64)]


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
def test_whole_context_rows_see_every_key(tiny_tiles, int8):
    """`whole_context` (a prompt chunk over a streamed host prefix): every row of a sequence attends all
    of its ctx_len keys, also where the chunk has more rows than the prefix has keys. The kernel's output
    and LSE against the reference's, and the reference against attention over all of a sequence's keys."""
    case, seqs, q_start = make_case(seed_of("whole", int8), WHOLE, hkv=2, group=2, head_dim=16, block_size=4,
                                    dtype=torch.float32, int8=int8)
    n, hq, _ = case["q"].shape
    want = torch.full((n, hq), float("nan"))
    ref = run(with_lse(A.paged_attention_ref, want, whole_context=True), case)
    got = torch.full((n, hq), float("nan"))
    out = run(with_lse(A.paged_attention_triton, got, whole_context=True), case)
    check_lse(got, want, seqs, q_start, 1e-5)
    for (rows, ctx), row in zip(seqs, q_start):
        if rows:
            torch.testing.assert_close(out[row:row + rows], ref[row:row + rows], rtol=1e-5, atol=1e-5)
    if not int8:
        (rows, ctx), row = seqs[0], q_start[0]
        t = torch.arange(ctx)
        slots = case["block_tables"][0].long()[t // 4] * 4 + t % 4
        o, lse = attend_all(case["q"][row:row + rows], case["k_cache"][slots], case["v_cache"][slots], case["scale"])
        torch.testing.assert_close(ref[row:row + rows], o, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(want[row:row + rows], lse, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
@pytest.mark.parametrize("heads", [(8, 4, 128), (2, 8, 256)], ids=["h128", "h256"])
def test_gpu_whole_context_matches_the_reference(int8, heads):
    """A 2048-row chunk over a 6K streamed prefix and one over a 100-key prefix (more rows than keys), at
    the prompt tiles of the 8B shape and of Qwen3-Next's wide heads; output and LSE."""
    hkv, group, d = heads
    case, seqs, q_start = make_case(seed_of("whole-gpu", int8, d), [(2048, 6144), (2048, 100)], hkv=hkv,
                                    group=group, head_dim=d, block_size=16, dtype=torch.bfloat16, int8=int8,
                                    device="cuda")
    n, hq, _ = case["q"].shape
    want = torch.full((n, hq), float("nan"), device="cuda")
    ref = run(with_lse(A.paged_attention_ref, want, whole_context=True), case)
    got = torch.full((n, hq), float("nan"), device="cuda")
    out = run(with_lse(A.paged_attention_triton, got, whole_context=True), case)
    check(out, ref, seqs, q_start, 2e-2)
    check_lse(got.cpu(), want.cpu(), seqs, q_start, 2e-2)


def test_lse_must_be_fp32_rows_by_heads():
    case, _, _ = make_case(3, MIXED, hkv=1, group=2, head_dim=16, block_size=4, dtype=torch.float32)
    n, hq, _ = case["q"].shape
    with pytest.raises(ValueError, match="lse"):
        run(with_lse(A.paged_attention_triton, torch.zeros(n, hq, dtype=torch.float16)), case)
    with pytest.raises(ValueError, match="lse"):
        run(with_lse(A.paged_attention_triton, torch.zeros(n - 1, hq)), case)


# ---- backends ---------------------------------------------------------------------------------------

BS, HKV, HQ, D = 4, 2, 4, 16


def _layout(ctxs, news, gen):
    """Block tables (shuffled blocks, never block 0), the new tokens' slots and the per-sequence starts."""
    blocks = [-(-c // BS) for c in ctxs]
    ids = (torch.randperm(sum(blocks), generator=gen) + 1).tolist()
    tables = torch.zeros(len(ctxs), max(blocks) + 1, dtype=torch.int32)
    for r, nb in enumerate(blocks):
        tables[r, :nb] = torch.tensor(ids[:nb], dtype=torch.int32)
        ids = ids[nb:]
    starts = [c - k for c, k in zip(ctxs, news)]
    slots = torch.tensor([int(tables[r, p // BS]) * BS + p % BS for r, (s, k) in enumerate(zip(starts, news))
                          for p in range(s, s + k)])
    return tables, slots, starts, sum(blocks) + 1


def _fill(pool, tables, ctxs, news, gen):
    for r, (c, k) in enumerate(zip(ctxs, news)):
        t = torch.arange(c - k)
        slots = tables[r].long()[t // BS] * BS + t % BS
        pool.write(0, slots, torch.randn(c - k, HKV, D, generator=gen), torch.randn(c - k, HKV, D, generator=gen))


@pytest.mark.parametrize("kind,ctxs,news,dequant", [
    ("auto", [70, 37, 9], [1, 1, 3], False),  # decodes and a verify: rows <= max_split_rows, keys split
    ("auto", [90, 12], [30, 1], False),  # a chunk beside a decode: one split
    ("int8", [70, 37, 9], [1, 1, 3], False),
    ("int8", [90, 12], [30, 1], False),  # int8 read directly
    ("int8", [90, 12], [30, 1], True),  # int8 through the dequantized copy
], ids=["decodes", "chunk", "int8-decodes", "int8-chunk", "int8-chunk-dequant"])
def test_triton_backend_attend_lse_matches_the_reference(tiny_tiles, monkeypatch, kind, ctxs, news, dequant):
    monkeypatch.setattr(TB, "DEQUANT_MIN_Q", 16 if dequant else 1 << 30)
    gen = torch.Generator().manual_seed(seed_of("backend-lse", kind, tuple(ctxs), dequant))
    tables, slots, starts, nb = _layout(ctxs, news, gen)
    pool = make_pool(kind, 1, nb + 1, BS, HKV, D, "cpu", torch.float32)
    _fill(pool, tables, ctxs, news, gen)
    n = sum(news)
    q, k, v = (torch.randn(n, h, D, generator=gen) for h in (HQ, HKV, HKV))

    ref = PagedAttention(pool)
    ref.prepare(slots, starts, news, tables)
    want_o, want_lse = ref.attend_lse(0, q, k, v)

    tri = TritonPagedAttention(pool, num_q_heads=HQ, max_seqs=4, max_rows=64, max_split_rows=8, device="cpu",
                               dtype=torch.float32, max_context=128)
    tri.prepare(slots, starts, news, tables)
    assert (tri.num_splits > 1) == (n <= 8)
    assert (tri.dq_slots is not None) == dequant
    o, lse = tri.attend_lse(0, q, k, v)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o, want_o, rtol=1e-4, atol=1e-5)
    assert torch.equal(o, tri.attend(0, q, k, v)), "attend and attend_lse differ in their output"


@pytest.mark.parametrize("kind", ["auto", "int8"])
def test_tiered_attention_with_the_triton_backend_matches_one_pool(tiny_tiles, kind):
    """A decode row and a 20-row chunk whose first blocks sit in a host pool: the tiered backend over the
    Triton backend (the device part, split for the decode) gives attention over every key."""
    gen = torch.Generator().manual_seed(seed_of("tiered-triton", kind))
    ctxs, news, host_nb = [57, 52], [1, 20], [3, 5]
    tables, slots, starts, nb = _layout(ctxs, news, gen)
    full = make_pool(kind, 1, nb + 1, BS, HKV, D, "cpu", torch.float32)
    dev = make_pool(kind, 1, nb + 1, BS, HKV, D, "cpu", torch.float32)
    host = make_pool(kind, 1, 16, BS, HKV, D, "cpu", torch.float32)
    host_blocks, first = [], 1
    for r, (c, k) in enumerate(zip(ctxs, news)):
        t = torch.arange(c - k)
        kk, vv = torch.randn(c - k, HKV, D, generator=gen), torch.randn(c - k, HKV, D, generator=gen)
        s = tables[r].long()[t // BS] * BS + t % BS
        full.write(0, s, kk, vv)
        dev.write(0, s, kk, vv)
        host_blocks.append(list(range(first, first + host_nb[r])))
        first += host_nb[r]
        hs = torch.tensor([host_blocks[r][p // BS] * BS + p % BS for p in range(host_nb[r] * BS)])
        host.write(0, hs, kk[: host_nb[r] * BS], vv[: host_nb[r] * BS])
    n = sum(news)
    q, k, v = (torch.randn(n, h, D, generator=gen) for h in (HQ, HKV, HKV))

    ref = PagedAttention(full)
    ref.prepare(slots, starts, news, tables)
    want = ref.attend(0, q, k, v)

    tri = TritonPagedAttention(dev, num_q_heads=HQ, max_seqs=4, max_rows=64, max_split_rows=32, device="cpu",
                               dtype=torch.float32, max_context=128)
    tiered = TieredAttention(tri, host, device="cpu", decode_rows=1, max_host_tokens=64, num_layers=1)
    offs = [h * BS for h in host_nb]
    shifted = torch.zeros_like(tables)
    for r, h in enumerate(host_nb):
        shifted[r, : tables.shape[1] - h] = tables[r, h:]
    tiered.prepare(slots, [s - o for s, o in zip(starts, offs)], news, shifted)
    assert tri.num_splits > 1
    tiered.set_host([(0, 1, host_blocks[0]), (1, 20, host_blocks[1])])
    got = tiered.attend(0, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
