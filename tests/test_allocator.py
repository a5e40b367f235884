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
