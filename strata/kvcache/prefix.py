"""Keys of full KV blocks for the prefix cache: a hash chain over the tokens they hold.

key(block k) = blake2b(key(block k-1), tokens of block k, [first token of block k+1], salt). The
chain makes a key name the whole prefix, not just one block's tokens. `salt` names everything else
the K/V depend on (the engine passes the model, dtype and KV storage). With the MTP layer in use its
K/V at position p also depend on the token at p + 1, so `with_next=True` folds in the next block's
first token: a block is keyed only once that token is known, and a hit is then valid for the MTP
layer's K/V too. blake2b (16 bytes) rather than Python's hash: 128 bits make a collision, which would
silently serve another prompt's K/V, practically impossible.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable


class PrefixKeys:
    """The keys of one token sequence's full blocks, extended as the sequence grows."""

    __slots__ = ("block_size", "salt", "with_next", "keys")

    def __init__(self, block_size: int, salt: bytes, with_next: bool):
        self.block_size, self.salt, self.with_next = block_size, salt, with_next
        self.keys: list[bytes] = []

    def extend(self, token_ids: Callable[[int, int], list[int]], num_tokens: int) -> list[bytes]:
        """Key every full block that `num_tokens` known tokens allow; `token_ids(start, stop)` gives the
        tokens. Returns all keys so far (block k's key is keys[k])."""
        bs, extra = self.block_size, int(self.with_next)
        while (len(self.keys) + 1) * bs + extra <= num_tokens:
            k = len(self.keys)
            h = hashlib.blake2b(self.keys[-1] if self.keys else self.salt, digest_size=16)
            h.update(array("q", token_ids(k * bs, (k + 1) * bs + extra)).tobytes())
            self.keys.append(h.digest())
        return self.keys
