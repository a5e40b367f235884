"""The host KV tier: its bookkeeping (pure Python), block copies, attention over both tiers merged by
log-sum-exp against one attention over all keys, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from strata.attention.reference import PagedAttention
from strata.attention.tiered import TieredAttention, attend_all, merge
from strata.kvcache.allocator import NULL_BLOCK, BlockAllocator
from strata.kvcache.host_pool import BlockCopier
from strata.kvcache.pool import make_pool
from strata.kvcache.tier import KVTier
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


@pytest.mark.parametrize("kind", ["auto", "int8"])
def test_tiered_attention_matches_one_pool(kind):
    """Two sequences (a decode row and a 20-row chunk) whose first blocks sit in a host pool: the tiered
    backend over the shifted device layout gives what the plain backend gives over everything."""
    g = torch.Generator().manual_seed(5)
    bs, hkv, hq, d = 4, 2, 4, 16
    full = make_pool(kind, 1, 32, bs, hkv, d, "cpu", torch.float32)
    dev = make_pool(kind, 1, 32, bs, hkv, d, "cpu", torch.float32)
    host = make_pool(kind, 1, 16, bs, hkv, d, "cpu", torch.float32)
    lens, news = [37, 52], [1, 20]
    tables = [list(range(1, 11)), list(range(11, 24))]
    host_blocks = [[3, 4, 5], [6, 7, 8, 9, 10]]  # the first 3 and 5 blocks of each sequence
    starts = [n - k for n, k in zip(lens, news)]
    for r, (table, n) in enumerate(zip(tables, starts)):  # the context before the step, in both layouts
        k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        full.write(0, slots, k, v)
        dev.write(0, slots, k, v)
        nh = len(host_blocks[r])
        hs = torch.tensor([host_blocks[r][p // bs] * bs + p % bs for p in range(nh * bs)])
        host.write(0, hs, k[: nh * bs], v[: nh * bs])
    q = torch.randn(sum(news), hq, d, generator=g)
    k, v = torch.randn(sum(news), hkv, d, generator=g), torch.randn(sum(news), hkv, d, generator=g)
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, s, n in zip(tables, starts, news) for p in range(s, s + n)])

    def table_tensor(rows):
        t = torch.zeros(2, 16, dtype=torch.int32)
        for r, row in enumerate(rows):
            t[r, : len(row)] = torch.tensor(row)
        return t

    ref = PagedAttention(full)
    ref.prepare(slots, starts, news, table_tensor(tables))
    want = ref.attend(0, q, k, v)

    tiered = TieredAttention(PagedAttention(dev), host, device="cpu", decode_rows=1, max_host_tokens=64, num_layers=1)
    offs = [len(h) * bs for h in host_blocks]
    tiered.prepare(slots, [s - o for s, o in zip(starts, offs)], news,
                   table_tensor([t[len(h):] for t, h in zip(tables, host_blocks)]))
    tiered.set_host([(0, 1, host_blocks[0]), (1, 20, host_blocks[1])])
    got = tiered.attend(0, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


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
