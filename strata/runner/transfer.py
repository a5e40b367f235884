"""Small host-to-device transfers that never make the host wait for the GPU.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory, which synchronises with the
device; when steps overlap, that one wait would serialise them. These go through pinned memory from
torch's caching host allocator, which keeps each pinned block until its copy has finished.
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
