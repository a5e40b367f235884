"""Small host-to-device transfers that never make the host wait for the GPU.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory, which synchronises with the
device; when steps overlap, that one wait would serialise them. These go through pinned memory from
torch's caching host allocator, which keeps each pinned block until its copy has finished.

A stage that must not allocate on its path (the concurrent read) installs an `UpRing` for its thread
(`UpRing.installed`): `to_device` then carves each upload from the ring's preallocated pinned buffer
and its device mirror instead.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch


class _Ring(threading.local):
    ring: "UpRing | None" = None


_THREAD = _Ring()
_ALIGN = 16  # bytes: every upload starts aligned for any dtype's view


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    ring = _THREAD.ring
    if ring is not None and ring.device == torch.device(device):
        return ring.put(values, dtype)
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class UpRing:
    """A stage's uploads, carved in turn from one pinned host buffer and its device mirror.

    `reserve_uploads(nbytes)` grows both (with nothing in flight) so that a step's uploads fit; `put`
    takes the next aligned piece, writes the values on the host and queues the copy. `reset()` at a
    step boundary starts again from the front: the stage waits for its step before the next, so the
    previous step's copies are done. An upload that does not fit grows the ring (`grows` counts it:
    the allocation guard fails on it) rather than overwrite a piece in use."""

    def __init__(self, device, nbytes: int = 0):
        self.device = torch.device(device)
        self.offset = 0
        self.grows = 0
        self.high_water = 0
        self._alloc(max(nbytes, _ALIGN))
        self.grows = 0

    def _alloc(self, nbytes: int) -> None:
        nbytes = -(-nbytes // _ALIGN) * _ALIGN
        cuda = self.device.type == "cuda"
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.dev = self.host if not cuda else torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.grows += 1

    @property
    def nbytes(self) -> int:
        return self.host.numel()

    def reserve_uploads(self, nbytes: int) -> None:
        if nbytes > self.nbytes:
            self._alloc(nbytes)

    def reset(self) -> None:
        self.offset = 0

    @contextmanager
    def installed(self) -> Iterator["UpRing"]:
        """`to_device` on the calling thread goes through this ring."""
        before = _THREAD.ring
        _THREAD.ring = self
        try:
            yield self
        finally:
            _THREAD.ring = before

    def put(self, values, dtype: torch.dtype) -> torch.Tensor:
        arr = values.numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        arr = np.ascontiguousarray(arr, dtype=np_dtype)
        start = -(-self.offset // _ALIGN) * _ALIGN
        end = start + arr.nbytes
        if end > self.nbytes:
            # Nothing may be overwritten while the step's earlier copies are queued: grow instead.
            keep = self.host[: self.offset].clone()
            self._alloc(max(2 * self.nbytes, end))
            self.host[: keep.numel()] = keep
            if self.dev is not self.host:
                self.dev[: keep.numel()].copy_(self.host[: keep.numel()])
        self.host[start:end].numpy()[:] = arr.view(np.uint8).reshape(-1)
        out = self.dev[start:end]
        if self.dev is not self.host:
            out.copy_(self.host[start:end], non_blocking=True)
        self.offset = end
        self.high_water = max(self.high_water, end)
        return out.view(dtype).view(arr.shape)
