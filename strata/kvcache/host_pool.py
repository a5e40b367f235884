"""The host KV pool's copies: whole blocks from the device pool to the host pool, never waited on.

`BlockCopier.start` queues one batch: on CUDA on a side stream that first waits for everything queued
so far on the current stream (the steps that wrote the blocks), layer by layer through a one-layer
device staging buffer (`index_select` of the batch's blocks) into a pinned host staging buffer, then
records an event. `ready` queries the event; `finish` scatters the staged blocks into the host pool on
the CPU. Every buffer (staging, index vectors) is allocated at start-up: a batch of more than
`max_blocks` blocks is refused, and at most `sets` batches are in flight.

On the CPU the "device" pool is a second CPU pool and the same code runs without streams: a batch is
ready as soon as it is started.
"""

from __future__ import annotations

import torch

from strata.kvcache.pool import KVPool, pool_tensors


class _StagingSet:
    def __init__(self, src: list[torch.Tensor], max_blocks: int, block_size: int, cuda: bool, device):
        self.host = [torch.zeros((t.shape[0], max_blocks, block_size * _row_numel(t)), dtype=t.dtype,
                                 pin_memory=cuda) for t in src]
        self.dev = [torch.zeros((max_blocks, block_size * _row_numel(t)), dtype=t.dtype, device=device)
                    for t in src]
        self.h_src = torch.zeros(max_blocks, dtype=torch.long, pin_memory=cuda)
        self.d_src = torch.zeros(max_blocks, dtype=torch.long, device=device) if cuda else self.h_src
        self.h_dst = torch.zeros(max_blocks, dtype=torch.long)
        self.event = torch.cuda.Event() if cuda else None
        self.n = 0


def _row_numel(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape[2:]:
        n *= d
    return n


class BlockCopier:
    def __init__(self, device_pool: KVPool, host_pool: KVPool, max_blocks: int, sets: int = 2):
        if device_pool.block_size != host_pool.block_size:
            raise ValueError("the host pool must have the device pool's block size")
        self.src, self.dst = pool_tensors(device_pool), pool_tensors(host_pool)
        self.block_size, self.max_blocks = device_pool.block_size, max_blocks
        self.device = device_pool.device
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.sets = [_StagingSet(self.src, max_blocks, self.block_size, cuda, self.device) for _ in range(sets)]
        self.idle = list(range(sets))
        self.blocks_total = 0

    @property
    def nbytes_device(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.sets for t in s.dev)

    @property
    def nbytes_host(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.sets for t in s.host)

    def start(self, src_blocks: list[int], dst_blocks: list[int]) -> int | None:
        """Queues the copy of device blocks `src_blocks` to host blocks `dst_blocks`; returns its ticket,
        or None when every staging set is in flight (try again after `finish`)."""
        n = len(src_blocks)
        if n != len(dst_blocks) or not 0 < n <= self.max_blocks:
            raise ValueError(f"a batch copies 1..{self.max_blocks} blocks, got {n}")
        if not self.idle:
            return None
        ticket = self.idle.pop()
        s = self.sets[ticket]
        s.n = n
        s.h_src.numpy()[:n] = src_blocks
        s.h_dst.numpy()[:n] = dst_blocks
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self._copy(s, n)
                s.event.record(self.stream)
        else:
            self._copy(s, n)
        self.blocks_total += n
        return ticket

    def _copy(self, s: _StagingSet, n: int) -> None:
        if s.d_src is not s.h_src:
            s.d_src[:n].copy_(s.h_src[:n], non_blocking=True)
        idx = s.d_src[:n]
        for src, dev, host in zip(self.src, s.dev, s.host):
            blocks = src.view(src.shape[0], src.shape[1] // self.block_size, -1)
            for layer in range(src.shape[0]):
                torch.index_select(blocks[layer], 0, idx, out=dev[:n])
                host[layer, :n].copy_(dev[:n], non_blocking=True)

    def ready(self, ticket: int) -> bool:
        ev = self.sets[ticket].event
        return ev is None or ev.query()

    def wait(self, ticket: int) -> None:
        """Blocks until the copy `ticket` is done (its host side may then be finished)."""
        ev = self.sets[ticket].event
        if ev is not None:
            ev.synchronize()

    def finish(self, ticket: int) -> None:
        """Scatters a ready batch into the host pool (CPU work) and frees its staging set."""
        s = self.sets[ticket]
        if s.event is not None:
            s.event.synchronize()  # ready() said so: returns at once
        idx = s.h_dst[: s.n]
        for dst, host in zip(self.dst, s.host):
            blocks = dst.view(dst.shape[0], dst.shape[1] // self.block_size, -1)
            blocks.index_copy_(1, idx, host[:, : s.n])
        s.n = 0
        self.idle.append(ticket)
