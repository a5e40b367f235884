"""The host KV tier: its bookkeeping (pure Python), block copies, attention over both tiers merged by
log-sum-exp against one attention over all keys, on fresh random inputs; with a batch-invariant backend
(the torch reference, and the Triton kernels in the interpreter) the bits of one attention over all keys,
wherever the host part ends."""

from __future__ import annotations

import pytest
import torch
from test_attention_lse import tiny_tiles  # noqa: F401 (a fixture)

from strata.attention import tiered as tiered_mod
from strata.attention.reference import PagedAttention
from strata.attention.tiered import TieredAttention, attend_all, block_runs, merge
from strata.kvcache.allocator import NULL_BLOCK, BlockAllocator
from strata.kvcache.host_pool import BlockCopier
from strata.kvcache.pool import make_pool
from strata.kvcache.tier import KVTier
from strata.kernels import cpu_decode
from strata.sched.request import Request


def test_merge_of_two_key_sets_equals_attention_over_all():
    g = torch.Generator().manual_seed(11)
    q = torch.randn(5, 4, 16, generator=g)
    k, v = torch.randn(40, 2, 16, generator=g), torch.randn(40, 2, 16, generator=g)
    o, lse = attend_all(q, k, v, 0.25)
    o1, l1 = attend_all(q, k[:24], v[:24], 0.25)
    o2, l2 = attend_all(q, k[24:], v[24:], 0.25)
    torch.testing.assert_close(merge(o1, l1, o2, l2), o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.logaddexp(l1, l2), lse, rtol=1e-5, atol=1e-6)
    empty = torch.full_like(l1, float("-inf"))
    torch.testing.assert_close(merge(o1, l1, torch.zeros_like(o1), empty), o1)


def _two_tiers(kind: str, host_counts=(3, 5), seed: int = 5, runs: int = 1):
    """Two sequences (a decode row, a 20-row chunk) in a pool holding everything (`full`) and, the same
    K/V, split between a device pool and a host pool holding each one's first `host_counts` blocks (the
    chunk's in `runs` runs of consecutive ids, in no order)."""
    g = torch.Generator().manual_seed(seed)
    bs, hkv, hq, d = 4, 2, 4, 16
    full = make_pool(kind, 1, 32, bs, hkv, d, "cpu", torch.float32)
    dev = make_pool(kind, 1, 32, bs, hkv, d, "cpu", torch.float32)
    host = make_pool(kind, 1, 16, bs, hkv, d, "cpu", torch.float32)
    lens, news = [37, 52], [1, 20]
    tables = [list(range(1, 11)), list(range(11, 24))]
    first = [3, 3 + host_counts[0]]
    host_blocks = [list(range(f, f + c)) for f, c in zip(first, host_counts)]
    cut = [len(host_blocks[1]) * j // runs for j in range(runs + 1)]
    host_blocks[1] = [b for j in reversed(range(runs)) for b in host_blocks[1][cut[j]:cut[j + 1]]]
    starts = [n - k for n, k in zip(lens, news)]
    for r, (table, n) in enumerate(zip(tables, starts)):  # the context before the step, in both layouts
        k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        full.write(0, slots, k, v)
        dev.write(0, slots, k, v)
        nh = len(host_blocks[r])
        hs = torch.tensor([host_blocks[r][p // bs] * bs + p % bs for p in range(nh * bs)], dtype=torch.long)
        host.write(0, hs, k[: nh * bs], v[: nh * bs])
    q = torch.randn(sum(news), hq, d, generator=g)
    k, v = torch.randn(sum(news), hkv, d, generator=g), torch.randn(sum(news), hkv, d, generator=g)
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, s, n in zip(tables, starts, news) for p in range(s, s + n)])

    def table_tensor(rows):
        t = torch.zeros(2, 16, dtype=torch.int32)
        for r, row in enumerate(rows):
            t[r, : len(row)] = torch.tensor(row)
        return t

    full_layout = (slots, starts, news, table_tensor(tables))
    offs = [len(h) * bs for h in host_blocks]
    shifted = [s - o for s, o in zip(starts, offs)]
    tiered_layout = (slots, shifted, news, table_tensor([t[len(h):] for t, h in zip(tables, host_blocks)]))
    spans = [(0, 1, host_blocks[0], 0, shifted[0]), (1, 20, host_blocks[1], 1, shifted[1])]
    return full, dev, host, full_layout, tiered_layout, spans, (q, k, v)


def _over_everything(full, full_layout, qkv) -> torch.Tensor:
    """The plain backend's attention over the pool that holds every key (what the tiers must give)."""
    ref = PagedAttention(full)
    ref.prepare(*full_layout)
    return ref.attend(0, *qkv)


def test_block_runs():
    assert block_runs([]) == []
    assert block_runs([7, 8, 9, 3, 4, 11]) == [(0, 7, 3), (3, 3, 2), (5, 11, 1)]


@pytest.mark.parametrize("kind", ["auto", "int8"])
@pytest.mark.parametrize("runs,max_runs", [(1, 256), (2, 256), (2, 1)], ids=["one-run", "two-runs", "gathered"])
def test_tiered_attention_matches_one_pool(kind, runs, max_runs, monkeypatch):
    """The tiered backend over the shifted device layout gives what the plain backend gives over
    everything; the streamed chunk's host part in key tiles of one block, merged in order, its blocks
    copied run by run or (more runs than MAX_STREAM_RUNS) gathered."""
    monkeypatch.setattr(tiered_mod, "STREAM_SCORE_BYTES", 4 * 20 * 4 * 4)  # 20 rows x 4 heads: tiles of 4 keys
    monkeypatch.setattr(tiered_mod, "MAX_STREAM_RUNS", max_runs)
    full, dev, host, full_layout, tiered_layout, spans, qkv = _two_tiers(kind, runs=runs)
    want = _over_everything(full, full_layout, qkv)

    tiered = TieredAttention(PagedAttention(dev), host, device="cpu", decode_rows=1, max_host_tokens=64, num_layers=1)
    tiered.prepare(*tiered_layout)
    tiered.set_host([sp[:3] for sp in spans])
    assert (1 in tiered.runs) == (runs <= max_runs)
    got = tiered.attend(0, *qkv)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["auto", "int8"])
def test_decode_rows_stream_their_host_part_when_asked(kind, monkeypatch):
    """With `stream_decode` the decode row's host part goes up as the chunk's does (`--kv-tier-decode
    stream`): both spans streamed, the same rows as the plain backend over everything."""
    monkeypatch.setattr(tiered_mod, "STREAM_SCORE_BYTES", 4 * 20 * 4 * 4)
    full, dev, host, full_layout, tiered_layout, spans, qkv = _two_tiers(kind)
    want = _over_everything(full, full_layout, qkv)
    tiered = TieredAttention(PagedAttention(dev), host, device="cpu", decode_rows=1, max_host_tokens=64, num_layers=1)
    tiered.stream_decode = True
    tiered.prepare(*tiered_layout)
    tiered.set_host([sp[:3] for sp in spans])
    assert tiered.streamed == [0, 1]
    torch.testing.assert_close(tiered.attend(0, *qkv), want, rtol=1e-4, atol=1e-5)
    assert tiered.host_seconds_total == 0  # nothing attended on the CPU's side path


@pytest.mark.parametrize("kind", ["auto", "bf16", "int8"])
@pytest.mark.parametrize("part_keys", [2048, 4])
@pytest.mark.parametrize("split", ["openmp", "python"])
def test_tiered_attention_reads_the_host_part_in_place_through_the_c_kernel(kind, part_keys, split, monkeypatch,
                                                                             tmp_path):
    """With the CPU kernels the decode row's host part is read where it lies, in one part or split over
    threads (parts of 4 keys: 3 blocks give 3 parts) and merged, by the library's OpenMP team in one call
    or by Python's threads (a library built without OpenMP): what the plain backend gives over
    everything."""
    kernels = cpu_decode.load(tmp_path)
    if kernels is None:
        pytest.skip("no C compiler to build the CPU decode kernels")
    if split == "openmp" and not kernels.threaded_split:
        pytest.skip("the C compiler has no OpenMP")
    monkeypatch.setattr(kernels, "threaded_split", split == "openmp")
    monkeypatch.setattr(tiered_mod, "SPAN_PART_KEYS", part_keys)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    full, dev, host, full_layout, tiered_layout, spans, qkv = _two_tiers(kind)
    want = _over_everything(full, full_layout, qkv)
    tiered = TieredAttention(PagedAttention(dev), host, device="cpu", decode_rows=1, max_host_tokens=64, num_layers=1,
                             cpu_kernels=kernels)
    assert tiered.cpu_kernels is kernels and (tiered.executor is not None) == (split == "python")
    tiered.prepare(*tiered_layout)
    tiered.set_host([sp[:3] for sp in spans])
    for _ in range(2):  # the second step reuses the first's buffers
        got = tiered.attend(0, *qkv)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 if kind != "bf16" else 1e-2)


class _RunAtCut:
    """A stand-in for a graph capture on the CPU: each cut's host part runs at once, which is what a replay
    of the pieces does between them (the CPU has no graphs; the data path is the same)."""

    capturing = True

    def __init__(self):
        self.cuts = 0

    def cut(self, host_part):
        self.cuts += 1
        host_part(None)


@pytest.mark.parametrize("kind", ["auto", "int8"])
def test_tiered_attention_cut_for_graph_pieces_gives_the_eager_rows(kind):
    """Captured in pieces, the backend hands every span's rows to the host part through its pinned rows and
    merges every row after the cut: a sequence without a host part keeps its device rows (lse -inf gives
    the host side no weight), one with a host part gets the eager step's output."""
    full, dev, host, full_layout, tiered_layout, spans, qkv = _two_tiers(kind)
    want = _over_everything(full, full_layout, qkv)
    tiered = TieredAttention(PagedAttention(dev), host, device="cpu", decode_rows=20, max_host_tokens=64, num_layers=1)
    tiered.prepare(*tiered_layout)
    tiered.reserve_graph_rows(24, qkv[0].shape[1])
    for step_spans in (spans, spans[:1]):
        tiered.set_host([sp[:3] for sp in step_spans])
        eager = tiered.attend(0, *qkv)
        tiered.graph_cut = cutter = _RunAtCut()
        try:
            got = tiered.attend(0, *qkv)
        finally:
            tiered.graph_cut = None
        assert cutter.cuts == 1
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
        if len(step_spans) == 2:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # A replayed step without any host part: every row is the device part's.
    tiered.set_host([])
    tiered.graph_cut = _RunAtCut()
    torch.testing.assert_close(tiered.attend(0, *qkv), tiered.inner.attend(0, *qkv))


def _invariant_backend(kind: str, pool):
    if kind == "reference":
        return PagedAttention(pool, batch_invariant=True)
    from strata.attention.triton_backend import TritonPagedAttention

    return TritonPagedAttention(pool, num_q_heads=4, max_seqs=3, max_rows=64, max_split_rows=8, device="cpu",
                                dtype=torch.float32, max_context=64, batch_invariant=True)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("kind", ["auto", "int8"])
def test_batch_invariant_tiered_attention_is_bitwise_one_pool(backend, kind, tiny_tiles):
    """Batch-invariant: each tiered sequence is attended whole, so its rows carry the bits of the plain
    backend over every key, wherever its host part ends (none, 1 or 5 blocks)."""
    full, _, _, full_layout, _, _, qkv = _two_tiers(kind)
    ref = _invariant_backend(backend, full)
    ref.prepare(*full_layout)
    want = ref.attend(0, *qkv).clone()
    for counts in ((1, 5), (5, 2), (0, 3)):
        _, dev, host, _, tiered_layout, spans, qkv = _two_tiers(kind, counts)
        tiered = TieredAttention(_invariant_backend(backend, dev), host, device="cpu", decode_rows=1,
                                 max_host_tokens=64, num_layers=1)
        tiered.prepare(*tiered_layout)
        tiered.set_host([sp for sp in spans if sp[2]])
        got = tiered.attend(0, *qkv)
        assert torch.equal(got, want), counts
        assert tiered.whole_sequences_total == sum(c > 0 for c in counts)
    with pytest.raises(ValueError, match="sequence and start"):
        tiered.set_host([sp[:3] for sp in spans])


@pytest.mark.parametrize("kind", ["auto", "int8"])
@pytest.mark.parametrize("split_keys", [1024, 4], ids=["one-program", "split"])  # PCIE_MIN_SPLIT_KEYS
@pytest.mark.parametrize("decode_rows", [1, 20], ids=["chunk-streamed", "both-in-place"])
def test_decode_rows_read_their_host_part_in_place_with_the_kernel(kind, split_keys, decode_rows, tiny_tiles,
                                                                   monkeypatch):
    """`pcie_decode`: decode rows' host parts are read where they lie by the paged attention kernel (here
    interpreted, the host pool in CPU memory), in one launch over every such span, one program each or
    their keys split over several; a 20-row chunk beyond `decode_rows` still streams; the rows are those
    of one attention over everything, and nothing ran on the CPU's side path."""
    from strata.attention.triton_backend import TritonPagedAttention

    monkeypatch.setattr(tiered_mod, "PCIE_MIN_SPLIT_KEYS", split_keys)
    full, dev, host, full_layout, tiered_layout, spans, qkv = _two_tiers(kind)
    want = _over_everything(full, full_layout, qkv)
    inner = TritonPagedAttention(dev, num_q_heads=4, max_seqs=3, max_rows=64, max_split_rows=8, device="cpu",
                                 dtype=torch.float32, max_context=64)
    tiered = TieredAttention(inner, host, device="cpu", decode_rows=decode_rows, max_host_tokens=64, num_layers=1)
    assert (tiered.pcie_splits > 1) == (split_keys < 64)
    assert tiered.pcie_workspace.max_splits == tiered.pcie_splits
    tiered.pcie_decode = True
    tiered.prepare(*tiered_layout)
    tiered.set_host([sp[:3] for sp in spans])
    assert (tiered.pcie_spans, tiered.streamed) == (([0], [1]) if decode_rows == 1 else ([0, 1], []))
    for j, i in enumerate(tiered.pcie_spans):
        assert tiered.pcie_table[j, : len(spans[i][2])].tolist() == spans[i][2]
        assert tiered.pcie_meta[:, j].tolist() == [spans[i][0], spans[i][1], len(spans[i][2]) * 4]
    assert tiered.pcie_meta[1, len(tiered.pcie_spans):].eq(0).all()
    torch.testing.assert_close(tiered.attend(0, *qkv), want, rtol=1e-4, atol=1e-5)
    assert tiered.host_seconds_total == 0


def test_copier_moves_whole_blocks_of_every_layer():
    g = torch.Generator().manual_seed(3)
    for kind in ("auto", "int8"):
        dev = make_pool(kind, 3, 8, 4, 2, 16, "cpu", torch.float32)
        host = make_pool(kind, 3, 6, 4, 2, 16, "cpu", torch.float32)
        for layer in range(3):
            dev.write(layer, torch.arange(32), torch.randn(32, 2, 16, generator=g), torch.randn(32, 2, 16, generator=g))
        cp = BlockCopier(dev, host, max_blocks=3)
        t = cp.start([5, 2], [1, 4])
        assert cp.ready(t)
        cp.finish(t)
        for layer in range(3):
            for src, dst in ((5, 1), (2, 4)):
                a = dev.gather(layer, torch.arange(src * 4, src * 4 + 4), torch.float32)
                b = host.gather(layer, torch.arange(dst * 4, dst * 4 + 4), torch.float32)
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        with pytest.raises(ValueError):
            cp.start([1, 2, 3, 4], [1, 2, 3, 4])


def _request(rid: str, n: int, device: BlockAllocator) -> Request:
    r = Request(rid, list(range(n)))
    r.block_ids = device.allocate(-(-n // device.block_size))
    r.num_computed_tokens = n
    return r


def test_tier_moves_blocks_past_the_window_and_frees_them():
    device, host = BlockAllocator(20, 4), BlockAllocator(10, 4)
    tier = KVTier(host, device, window=8, max_moves=16)
    a = _request("a", 30, device)  # 8 blocks; the window keeps the last 8 tokens: (30 - 8) // 4 = 5 move
    used = device.num_used
    batch = tier.plan([a], lambda r: r.num_computed_tokens, busy=set())
    assert [m.index for m in batch.moves] == [0, 1, 2, 3, 4]
    assert tier.plan([a], lambda r: r.num_computed_tokens, busy=set()).moves == []  # already planned
    assert tier.complete(batch, busy={"a"}) == batch.moves  # in flight: nothing applied yet
    assert tier.complete(batch, busy=set()) == []
    assert a.block_ids[:5] == [NULL_BLOCK] * 5 and len(a.host_blocks) == 5
    assert device.num_used == used - 5 and host.num_used == 5
    tier.release(a)
    assert host.num_used == 0


def test_stale_moves_free_their_host_blocks():
    device, host = BlockAllocator(20, 4), BlockAllocator(10, 4)
    tier = KVTier(host, device, window=4, max_moves=16)
    a = _request("a", 16, device)
    batch = tier.plan([a], lambda r: r.num_computed_tokens, busy=set())
    device.free(a.block_ids)
    a.block_ids = []  # released (preempted) while copying
    tier.complete(batch, busy=set())
    assert host.num_used == 0 and a.host_blocks == [] and not tier.moving


def test_host_tier_of_the_prefix_cache():
    """Keyed blocks moved to the host keep their keys: after the request ends, a lookup takes the host
    run when it is longer than the device's; evicted device blocks are kept on the host once."""
    device, host = BlockAllocator(20, 4), BlockAllocator(10, 4)
    tier = KVTier(host, device, window=4, max_moves=16)
    a = _request("a", 16, device)
    keys = [b"k0", b"k1", b"k2", b"k3"]
    for b, key in zip(a.block_ids, keys):
        device.register(b, key)
    tier.complete(tier.plan([a], lambda r: 16, busy=set()), busy=set())
    assert len(a.host_blocks) == 3
    device.free([b for b in a.block_ids if b != NULL_BLOCK])
    tier.release(a)
    host_run, dev_run = tier.lookup(keys)
    assert host_run == [] and len(dev_run) == 4  # the device still caches all four
    device.free(dev_run)
    device.record_evictions = True
    taken = device.allocate(device.num_free)  # evicts every cached device block
    evicted = device.take_evicted()
    assert sorted(k for _, k in evicted) == sorted(keys)
    pairs = tier.keep(evicted)
    assert len(pairs) == 1  # k0..k2 are on the host already
    host_run, dev_run = tier.lookup(keys)
    assert len(host_run) == 4 and dev_run == []
    device.free(taken)


def test_pcie_reads_split_a_host_part_for_programs_on_every_sm():
    """A few K/V heads (Qwen3-Next's 2) get more splits than many (an 8B's 8): one decode row's launch
    puts PCIE_PROGRAMS_PER_SM programs on each SM, no split under PCIE_MIN_SPLIT_KEYS keys."""
    per_sm, least = tiered_mod.PCIE_PROGRAMS_PER_SM, tiered_mod.PCIE_MIN_SPLIT_KEYS
    assert tiered_mod.pcie_splits(229_376, 2, 132) == -(-per_sm * 132 // 2)
    assert tiered_mod.pcie_splits(114_688, 8, 132) == -(-per_sm * 132 // 8)
    assert tiered_mod.pcie_splits(4 * least, 2, 132) == 4  # a short host part: splits of the least keys
    assert tiered_mod.pcie_splits(1, 8, 132) == 1
