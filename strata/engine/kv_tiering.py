"""The engine's side of the host KV tier (`--kv-resident`, `--kv-host-memory`): the host pool and its
allocator, the copier between the pools, and the two moments of each step that drive them — before
scheduling, blocks that left their requests' windows start copying to the host (and finished copies
take effect); after scheduling (each lane's, with the concurrent read), device blocks the prefix cache
evicted are copied to host blocks that keep their keys. The bookkeeping of which block is where is
`strata.kvcache.tier.KVTier`'s."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from strata.config import EngineConfig, ModelConfig
from strata.kvcache.allocator import BlockAllocator
from strata.kvcache.host_pool import BlockCopier
from strata.kvcache.pool import KVPool, make_pool
from strata.kvcache.tier import KVTier, MoveBatch
from strata.sched.request import Request
from strata.sched.scheduler import Scheduler

log = logging.getLogger("strata")


class HostKVTier:
    def __init__(self, cfg: EngineConfig, mc: ModelConfig, pool: KVPool, allocator: BlockAllocator, layers: int,
                 per_token: int, dtype: torch.dtype, device: torch.device):
        """The host pool (pinned on CUDA, allocated now), its allocator, the copier's staging and the
        tier's bookkeeping."""
        self.device = device
        bs = cfg.block_size
        host_tokens = (int(cfg.kv_host_memory * 2**30) // per_token if cfg.kv_host_memory is not None
                       else cfg.ctx * cfg.parallel)
        host_blocks = max(host_tokens // bs, 1) + 1  # +1: block 0 is the padding block
        self.host_pool = make_pool(cfg.kv, layers, host_blocks, bs, mc.num_key_value_heads, mc.head_dim, "cpu",
                                   dtype, pin=device.type == "cuda")
        max_moves = cfg.max_num_batched_tokens // bs + 2 * cfg.parallel
        self.copier = BlockCopier(pool, self.host_pool, max_moves)
        self.tier = KVTier(BlockAllocator(host_blocks, bs), allocator, cfg.kv_resident, max_moves)
        self.allocator = allocator
        allocator.record_evictions = cfg.prefix_cache
        # With a resident window a request's older blocks live in the host pool: context it adds.
        self.host_capacity = (host_blocks - 1) * bs
        self._copies: list[tuple[int | None, MoveBatch]] = []  # moves copying or waiting to apply, in order
        self._keeps: list[int] = []  # copies of device blocks the prefix cache evicted, in flight
        log.info("host KV pool: %d blocks of %d tokens (%s, %.1f MiB%s); resident window %s; copy staging "
                 "%.1f MiB device, %.1f MiB host", host_blocks, bs, cfg.kv, host_blocks * bs * per_token / 2**20,
                 ", pinned" if device.type == "cuda" else "",
                 f"{cfg.kv_resident} tokens" if cfg.kv_resident is not None else "off (prefix cache only)",
                 self.copier.nbytes_device / 2**20, self.copier.nbytes_host / 2**20)

    def before_schedule(self, scheduler: Scheduler, written: Callable[[Request], int]) -> None:
        """Apply the moves whose copies are done (never waiting for one), then start copying the next
        blocks that left their requests' windows. `written(req)`: positions whose K/V are final in every
        layer and may move."""
        for ticket in self._keeps:  # queued before the step that reused their blocks, which has completed
            self.copier.finish(ticket)
        self._keeps = []
        busy = scheduler.in_flight_ids
        left: list[tuple[int | None, MoveBatch]] = []
        for ticket, batch in self._copies:
            if ticket is not None:
                if not self.copier.ready(ticket):
                    left.append((ticket, batch))
                    continue
                self.copier.finish(ticket)
            rest = self.tier.complete(batch, busy)
            if rest:
                left.append((None, MoveBatch(rest)))
        self._copies = left
        if self.tier.window is None or not self.copier.idle:
            return
        batch = self.tier.plan(scheduler.running, written, busy)
        if batch.moves:
            ticket = self.copier.start([m.device for m in batch.moves], [m.host for m in batch.moves])
            self._copies.append((ticket, batch))
            if self.device.type != "cuda" and self.copier.ready(ticket):  # copied already: the blocks leave now
                self._copies.pop()
                self.copier.finish(ticket)
                rest = self.tier.complete(batch, busy)
                if rest:
                    self._copies.append((None, MoveBatch(rest)))

    def wait_for_copy(self) -> bool:
        """Blocks until the oldest copy of moves is done (False: none is under way). The host runs ahead of
        the device through a read's chunks, so a request whose pool is full while its old blocks are still
        being copied out waits here, not in a loop of empty steps."""
        for ticket, _ in self._copies:
            if ticket is not None:
                self.copier.wait(ticket)
                return True
        return False

    def after_schedule(self, stream=None) -> None:
        """Before the step that overwrites them: device blocks the prefix cache evicted are copied to host
        blocks that take their keys (the prefix cache's host tier). `stream`: the CUDA stream that step
        runs on (the concurrent read's), else the current one."""
        pairs = self.tier.keep(self.allocator.take_evicted())
        for i in range(0, len(pairs), self.copier.max_blocks):
            part = pairs[i : i + self.copier.max_blocks]
            ticket = self.copier.start([d for d, _ in part], [h for _, h in part])
            while ticket is None:  # every staging set busy: finish the oldest copy (rare)
                if self._keeps:
                    self.copier.finish(self._keeps.pop(0))
                else:
                    t, batch = next((c for c in self._copies if c[0] is not None))
                    self._copies.remove((t, batch))
                    self.copier.finish(t)
                    self._copies.insert(0, (None, batch))
                ticket = self.copier.start([d for d, _ in part], [h for _, h in part])
            if self.device.type == "cuda":
                # The step about to be launched may overwrite these blocks: it waits for the copy on the device.
                (stream or torch.cuda.current_stream(self.device)).wait_event(self.copier.sets[ticket].event)
                self._keeps.append(ticket)
            else:
                self.copier.finish(ticket)

    def stats(self) -> dict:
        t = self.tier
        return dict(prefix_cache_host_hits_total=t.host_hits_total,
                    prefix_cache_host_cached_tokens_total=t.host_hit_tokens_total,
                    kv_host_blocks_used=t.host.num_used, kv_host_blocks_total=t.host.capacity,
                    kv_blocks_moved_total=t.moved_blocks_total)
