"""The host KV tier's bookkeeping (pure Python): which of a request's blocks live in the host pool.

A request's table stays one list of logical blocks (`Request.block_ids`); the leading ones that moved
to the host pool read `NULL_BLOCK` there and their host ids are `Request.host_blocks`, so the host
part of a sequence is always positions [0, len(host_blocks) * block_size) and the device part the rest.

Moving a block is two-phase so that no step waits for a copy:
1. `plan` picks, per request not in flight, the full blocks older than the resident window (and
   already registered in the prefix cache, or written by the MTP layer, as the engine's `written`
   says), takes a host block for each and returns the `Move`s; the engine copies them (on CUDA on a
   side stream after the step that wrote them). The request keeps reading its device blocks.
2. `complete` runs once the copy is done (an event queried, never waited on): the table entry turns
   to NULL_BLOCK, the host id joins `host_blocks`, the device block is freed (a keyed block stays in
   the device prefix cache) and the host block takes the device block's prefix key, so that once the
   request finishes it stays in the host tier of the prefix cache.
A move whose request was preempted, finished or re-admitted meanwhile (its table is another list)
frees its host block instead.

The same host allocator keeps the prefix cache's host tier: `evicted` device blocks (the device
allocator's `take_evicted`) are copied to host blocks registered under their keys (`keep`), and
`lookup` at admission takes a leading run of host blocks when that is longer than the device's.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

from strata.kvcache.allocator import NULL_BLOCK, BlockAllocator


@dataclass(eq=False)
class Move:
    """Block `index` of `request`'s table: device block `device` copied to host block `host`."""

    request: object  # a sched Request (not imported: the scheduler imports this package)
    table: list[int]  # the request's block_ids list when planned: a new list means a new admission
    index: int
    device: int
    host: int


@dataclass
class MoveBatch:
    """The moves of one copy: the engine attaches what it waits on (`done`: a CUDA event or None)."""

    moves: list[Move] = field(default_factory=list)
    done: object = None


class KVTier:
    def __init__(self, host: BlockAllocator, device: BlockAllocator, window: int | None, max_moves: int):
        """`window`: tokens of each request kept on the device (None: no move by age, only the prefix
        cache's host tier); `max_moves`: the most blocks one batch copies (the staging buffers' size)."""
        if host.block_size != device.block_size:
            raise ValueError("host and device pools must have the same block size")
        self.host, self.device = host, device
        self.block_size = host.block_size
        self.window = window
        self.max_moves = max_moves
        self.moving: dict[str, int] = {}  # request id -> blocks planned and not yet completed
        self.moved_blocks_total = 0
        self.host_hits_total = 0
        self.host_hit_tokens_total = 0
        self.kept_blocks_total = 0

    # ---- moves by age -------------------------------------------------------------------------------
    def plan(self, requests: Iterable, written: Callable[[object], int], busy: set[str]) -> MoveBatch:
        """The next batch of moves (maybe empty). `written(req)`: positions whose K/V are final in every
        layer (the prefix cache's registered blocks bound it too); `busy`: request ids in flight."""
        batch = MoveBatch()
        if self.window is None:
            return batch
        bs = self.block_size
        for req in requests:
            rid = req.request_id
            if rid in busy:
                continue
            first = len(req.host_blocks) + self.moving.get(rid, 0)
            target = min(max(written(req) - self.window, 0) // bs, len(req.block_ids))
            for k in range(first, target):
                if len(batch.moves) >= self.max_moves:
                    return batch
                b = req.block_ids[k]
                if b == NULL_BLOCK:
                    break
                got = self.host.allocate(1)
                if got is None:
                    return batch  # the host pool is full: the blocks stay on the device
                batch.moves.append(Move(req, req.block_ids, k, b, got[0]))
                self.moving[rid] = self.moving.get(rid, 0) + 1
        return batch

    def complete(self, batch: MoveBatch, busy: set[str]) -> list[Move]:
        """Applies the moves of a finished copy whose requests are not in flight; returns those left
        (to complete later). Moves of requests that were released meanwhile free their host block."""
        left = []
        for m in batch.moves:
            req = m.request
            rid = req.request_id
            if m.table is not req.block_ids:
                self.host.free([m.host])  # released (and maybe re-admitted) since: the copy is stale
                self._settle(rid)
                continue
            if rid in busy:
                left.append(m)
                continue
            if m.index != len(req.host_blocks) or req.block_ids[m.index] != m.device:
                raise RuntimeError(f"request {rid}: block {m.index} moved out of order")
            key = self.device.key_of(m.device)
            req.block_ids[m.index] = NULL_BLOCK
            req.host_blocks.append(m.host)
            self.device.free([m.device])
            if key is not None:
                self.host.register(m.host, key)
            self.moved_blocks_total += 1
            self._settle(rid)
        return left

    def _settle(self, rid: str) -> None:
        n = self.moving.get(rid, 0) - 1
        if n > 0:
            self.moving[rid] = n
        else:
            self.moving.pop(rid, None)

    def release(self, req) -> None:
        """Frees a released request's host blocks (the scheduler calls it with its device blocks)."""
        if req.host_blocks:
            self.host.free(req.host_blocks)
        req.host_blocks = []

    # ---- the prefix cache's host tier ------------------------------------------------------------
    def keep(self, evicted: list[tuple[int, Hashable]]) -> list[tuple[int, int]]:
        """Host blocks for device blocks the device cache evicted: (device block, host block) pairs to
        copy, each host block registered under the evicted block's key (skipped when the host tier
        holds the key already or has no block to give). The copy must be queued before the step
        that overwrites the device block."""
        pairs = []
        for block, key in evicted:
            if self.host.cached_run([key]):
                continue
            got = self.host.allocate(1)
            if got is None:
                break
            self.host.register(got[0], key)
            self.host.free(got)  # unreferenced: a cached, evictable host block
            pairs.append((block, got[0]))
            self.kept_blocks_total += 1
        return pairs

    def lookup(self, keys: list[Hashable]) -> tuple[list[int], list[int]]:
        """A new request's cached prefix: (host blocks of its leading run, device blocks after them),
        each with a reference taken. The host run is used only where it is longer than the device's
        own leading run (device blocks are read faster)."""
        on_device = self.device.cached_run(keys)
        on_host = self.host.cached_run(keys)
        if on_host <= on_device:
            return [], self.device.lookup(keys)
        host = self.host.lookup(keys[:on_host])
        return host, self.device.lookup(keys[on_host:])


def tier_tokens(window: int, chunk: int, lookahead: int, block_size: int) -> int:
    """Device positions one request may hold with the tier: its window, the chunk being computed past it,
    the chunk before it (its blocks left the window when this step was scheduled and are still being
    copied to the host), the drafter's lookahead, and two blocks of slack (a partly filled block, a
    decode's move in flight)."""
    return window + 2 * chunk + lookahead + 2 * block_size


def tiered_backends(*, drafter: bool, concurrent_read: bool, read_drafts: bool) -> int:
    """The tiered attention backends of a run: the runner's, the drafter's, the concurrent read's and its
    draft K/V's."""
    return 1 + drafter + concurrent_read + read_drafts


def device_context_buffers(*, drafter: bool, concurrent_read: bool, read_drafts: bool, batch_invariant: bool) -> int:
    """One-layer K/V buffers at the full context that the tiered attention backends keep on the device:
    two per backend (a host prefix streamed to prompt chunks, double-buffered); and under
    --batch-invariant one per runner (the runner's, the concurrent read's), where a tiered sequence is
    assembled whole."""
    backends = tiered_backends(drafter=drafter, concurrent_read=concurrent_read, read_drafts=read_drafts)
    return 2 * backends + (1 + concurrent_read) * batch_invariant
