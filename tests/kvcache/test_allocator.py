"""BlockAllocator: all-or-nothing allocation, the reserved padding block, and loud misuse."""

from __future__ import annotations

import pytest

from strata.kvcache import NULL_BLOCK, BlockAllocator


def test_allocate_is_all_or_nothing_and_never_hands_out_block_0():
    a = BlockAllocator(num_blocks=9, block_size=16)
    assert (a.capacity, a.num_free, a.num_used) == (8, 8, 0)
    first = a.allocate(5)
    assert len(first) == 5 and len(set(first)) == 5 and NULL_BLOCK not in first
    assert (a.num_free, a.num_used) == (3, 5)
    assert a.allocate(4) is None
    assert (a.num_free, a.num_used) == (3, 5)  # the failed call took nothing
    rest = a.allocate(3)
    assert sorted(first + rest) == list(range(1, 9))
    assert a.allocate(1) is None and a.num_free == 0
    assert a.allocate(0) == []


def test_free_returns_blocks_for_reuse():
    a = BlockAllocator(num_blocks=5, block_size=4)
    ids = a.allocate(4)
    a.free(ids[:2])
    assert (a.num_free, a.num_used) == (2, 2)
    again = a.allocate(2)
    assert sorted(again) == sorted(ids[:2])
    a.free(again + ids[2:])
    assert (a.num_free, a.num_used) == (4, 0)


def test_double_free_and_foreign_ids_raise_and_change_nothing():
    a = BlockAllocator(num_blocks=6, block_size=4)
    ids = a.allocate(3)
    a.free([ids[0]])
    with pytest.raises(ValueError, match="double free"):
        a.free([ids[0]])
    for bad in ([NULL_BLOCK], [6], [-1], [99]):
        with pytest.raises(ValueError, match="never handed out"):
            a.free(bad)
    unallocated = next(b for b in range(1, 6) if b not in ids)
    with pytest.raises(ValueError, match="double free"):
        a.free([unallocated])
    with pytest.raises(ValueError, match="twice"):
        a.free([ids[1], ids[1]])
    # A bad id anywhere in the list leaves the good ones allocated.
    with pytest.raises(ValueError):
        a.free([ids[1], ids[2], 0])
    assert a.num_used == 2
    a.free(ids[1:])
    assert a.num_used == 0


def test_blocks_for_is_ceil():
    a = BlockAllocator(num_blocks=4, block_size=16)
    assert [a.blocks_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        a.blocks_for(-1)


def test_bad_construction():
    with pytest.raises(ValueError):
        BlockAllocator(num_blocks=1, block_size=16)
    with pytest.raises(ValueError):
        BlockAllocator(num_blocks=8, block_size=0)
    with pytest.raises(ValueError):
        BlockAllocator(num_blocks=8, block_size=4).allocate(-1)


# ---------------------------------------------------------------- prefix cache: refcounts, keys, LRU


def test_registered_blocks_are_shared_by_lookup_and_counted_by_reference():
    a = BlockAllocator(num_blocks=6, block_size=4)
    ids = a.allocate(3)
    for b, key in zip(ids, "xyz"):
        assert a.register(b, key)
    assert a.lookup(["x", "y", "q", "z"]) == ids[:2]  # the leading run only
    assert [a.refcount(b) for b in ids] == [2, 2, 1] and a.num_used == 3
    a.free(ids)  # the first owner is done: its shared blocks stay in use, its own keyed one is cached
    assert [a.refcount(b) for b in ids] == [1, 1, 0]
    assert (a.num_used, a.num_cached, a.num_free) == (2, 1, 3)
    assert a.lookup(["x", "y", "z"]) == ids  # the cached block comes back, with its key
    a.free(ids)
    a.free(ids[:2])
    assert (a.num_used, a.num_cached, a.num_free) == (0, 3, 5)
    with pytest.raises(ValueError, match="double free"):
        a.free([ids[0]])
    assert a.lookup([]) == [] and a.lookup(["nope"]) == []


def test_cached_blocks_count_as_free_and_are_evicted_lru_after_plain_ones():
    a = BlockAllocator(num_blocks=7, block_size=4)
    first, second = a.allocate(3), a.allocate(2)
    for i, b in enumerate(first + second):
        a.register(b, i)
    a.free(second)  # freed earlier: evicted first; within one free(), the table's tail goes first
    a.free(first)
    assert (a.num_free, a.num_cached, a.can_allocate(6), a.can_allocate(7)) == (6, 5, True, False)
    order = a.allocate(6)
    assert order[0] not in first + second  # the never-used block comes before any cached one
    assert order[1:] == [second[1], second[0], first[2], first[1], first[0]]
    assert a.num_cached == 0 and all(a.key_of(b) is None for b in order)
    assert a.lookup([0]) == []  # evicted blocks lost their keys
    a.free(order)
    assert (a.num_free, a.num_cached) == (6, 0)  # without keys they are plain free blocks again


def test_a_hit_is_no_longer_evictable_and_refreshes_recency():
    a = BlockAllocator(num_blocks=4, block_size=4)
    ids = a.allocate(3)
    for b, key in zip(ids, "abc"):
        a.register(b, key)
    a.free(ids)  # LRU order: c, b, a
    assert a.lookup(["a"]) == [ids[0]]
    assert a.allocate(3) is None  # only b and c are free now
    a.free([ids[0]])  # a is now the most recently freed
    assert a.allocate(2) == [ids[2], ids[1]]
    assert a.lookup(["a", "b"]) == [ids[0]]


def test_register_rules():
    a = BlockAllocator(num_blocks=5, block_size=4)
    x, y = a.allocate(2)
    assert a.register(x, "k") and a.register(x, "k")  # idempotent
    assert not a.register(y, "k")  # another block already holds the content: y stays private
    assert a.key_of(y) is None
    with pytest.raises(ValueError, match="another key"):
        a.register(x, "other")
    with pytest.raises(ValueError, match="not in use"):
        a.register(3, "z")
    a.free([x, y])
    assert a.num_cached == 1 and a.lookup(["k"]) == [x]
