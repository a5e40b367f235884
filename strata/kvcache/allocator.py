"""Paged KV cache bookkeeping: which fixed-size blocks of the pool belong to nobody.

Pure Python (no torch): the scheduler owns one of these and is tested on the CPU without a model.
"""

from __future__ import annotations

NULL_BLOCK = 0


class BlockAllocator:
    """A free list over block ids `0 .. num_blocks-1` of `block_size` token positions each.

    Block 0 (`NULL_BLOCK`) is reserved and never handed out: the runner pads block tables with it, so
    a padded entry points at a real block whose contents nobody reads. The usable capacity is
    therefore `num_blocks - 1`; `num_used` and `num_free` count usable blocks only (an idle
    allocator has `num_used == 0`).
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
        self._used: set[int] = set()

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def blocks_for(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """`n` distinct block ids, or None (and nothing taken) when fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        ids = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        ids.reverse()
        self._used.update(ids)
        return ids

    def free(self, ids) -> None:
        """Give blocks back. Every id is checked before any is freed, so a bad call changes nothing."""
        ids = list(ids)
        seen: set[int] = set()
        for b in ids:
            if b in seen:
                raise ValueError(f"block {b} appears twice in one free()")
            seen.add(b)
            if b not in self._used:
                if isinstance(b, int) and NULL_BLOCK < b < self.num_blocks:
                    raise ValueError(f"double free of block {b}")
                raise ValueError(f"block {b!r} was never handed out by this allocator")
        self._used.difference_update(ids)
        self._free.extend(reversed(ids))

    def __repr__(self) -> str:
        return f"BlockAllocator(used={self.num_used}/{self.capacity}, block_size={self.block_size})"
