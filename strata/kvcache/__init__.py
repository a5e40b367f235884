"""Paged KV cache: the block allocator (pure Python) and the torch pools (`strata.kvcache.pool`).

Only the allocator is re-exported here, so importing this package never pulls in torch.
"""

from strata.kvcache.allocator import NULL_BLOCK, BlockAllocator

__all__ = ["NULL_BLOCK", "BlockAllocator"]
