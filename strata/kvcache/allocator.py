"""Paged KV cache bookkeeping: which fixed-size blocks of the pool belong to nobody, and which hold a
known prefix (the prefix cache).

Pure Python (no torch): the scheduler owns one of these and is tested on the CPU without a model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

NULL_BLOCK = 0


class BlockAllocator:
    """A free list over block ids `0 .. num_blocks-1` of `block_size` token positions each.

    Block 0 (`NULL_BLOCK`) is reserved and never handed out: the runner pads block tables with it, so
    a padded entry points at a real block whose contents nobody reads. The usable capacity is
    therefore `num_blocks - 1`; `num_used` and `num_free` count usable blocks only (an idle
    allocator has `num_used == 0`).

    Prefix cache: a used block may be `register`ed under a key naming its contents (see
    `strata.kvcache.prefix`). Blocks are reference counted; `lookup` hands the same block to several
    requests. A keyed block whose last reference is freed stays cached: it counts as free, and
    `allocate` takes plain free blocks first, then evicts cached ones least recently freed first
    (dropping their keys). Every operation is O(1) per block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popped from the end: the first allocations get ids 1, 2, 3, ... which reads well in logs.
        self._free: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self._refs: dict[int, int] = {}  # used blocks: how many block tables hold each
        self._cached: OrderedDict[int, Hashable] = OrderedDict()  # unreferenced keyed blocks, LRU first
        self._key_of: dict[int, Hashable] = {}  # every keyed block, used or cached
        self._block_of: dict[Hashable, int] = {}
        # With a host tier of the prefix cache: (block, key) of each cached block `allocate` evicted
        # since `take_evicted`, whose contents are still in the pool until the step that reuses it.
        self.record_evictions = False
        self._evicted: list[tuple[int, Hashable]] = []

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: plain free ones and evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for their contents (part of `num_free`)."""
        return len(self._cached)

    def refcount(self, block: int) -> int:
        return self._refs.get(block, 0)

    def key_of(self, block: int) -> Hashable | None:
        return self._key_of.get(block)

    def blocks_for(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def allocate(self, n: int) -> list[int] | None:
        """`n` distinct block ids, or None (and nothing taken) when fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            return None
        plain = min(n, len(self._free))
        ids = self._free[len(self._free) - plain :]
        del self._free[len(self._free) - plain :]
        ids.reverse()
        for _ in range(n - plain):
            block, key = self._cached.popitem(last=False)
            del self._key_of[block], self._block_of[key]
            if self.record_evictions:
                self._evicted.append((block, key))
            ids.append(block)
        for b in ids:
            self._refs[b] = 1
        return ids

    def free(self, ids) -> None:
        """Drop one reference to each block. Every id is checked before any is freed, so a bad call
        changes nothing. A keyed block left without references stays cached (most recently freed last:
        pass a block table in order and its tail is evicted before its head)."""
        ids = list(ids)
        seen: set[int] = set()
        for b in ids:
            if b in seen:
                raise ValueError(f"block {b} appears twice in one free()")
            seen.add(b)
            if b not in self._refs:
                if isinstance(b, int) and NULL_BLOCK < b < self.num_blocks:
                    raise ValueError(f"double free of block {b}")
                raise ValueError(f"block {b!r} was never handed out by this allocator")
        plain: list[int] = []
        for b in reversed(ids):
            if self._refs[b] > 1:
                self._refs[b] -= 1
                continue
            del self._refs[b]
            key = self._key_of.get(b)
            if key is None:
                plain.append(b)
            else:
                self._cached[b] = key
        self._free.extend(plain)

    # ---- prefix cache ------------------------------------------------------------------------------
    def register(self, block: int, key: Hashable) -> bool:
        """Name a used, fully written block's contents. False (and nothing changes) when another block
        already holds `key` (two requests computed the same prefix at once: this one stays private)."""
        if block not in self._refs:
            raise ValueError(f"block {block!r} is not in use: only written blocks can be registered")
        held = self._block_of.get(key)
        if held is not None:
            return held == block
        old = self._key_of.get(block)
        if old is not None:
            raise ValueError(f"block {block} is already registered under another key")
        self._key_of[block] = key
        self._block_of[key] = block
        return True

    def take_evicted(self) -> list[tuple[int, Hashable]]:
        evicted, self._evicted = self._evicted, []
        return evicted

    def cached_run(self, keys: Iterable[Hashable]) -> int:
        """How many leading `keys` name a block (used or cached), taking no reference."""
        n = 0
        for key in keys:
            if key not in self._block_of:
                break
            n += 1
        return n

    def lookup(self, keys: Iterable[Hashable]) -> list[int]:
        """The blocks of the longest leading run of `keys` that are cached, each with a reference taken
        (free them like allocated blocks)."""
        hit: list[int] = []
        for key in keys:
            b = self._block_of.get(key)
            if b is None:
                break
            if b in self._cached:
                del self._cached[b]
                self._refs[b] = 1
            else:
                self._refs[b] += 1
            hit.append(b)
        return hit

    def __repr__(self) -> str:
        return (f"BlockAllocator(used={self.num_used}/{self.capacity}, cached={self.num_cached}, "
                f"block_size={self.block_size})")
