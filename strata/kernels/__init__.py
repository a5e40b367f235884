"""Triton kernels, each beside the torch reference it must match.

Every public op here has three names: `op_ref` (torch, the definition), `op_triton` (the kernel) and
`op` (dispatch: the kernel for CUDA tensors, the reference elsewhere). The CPU engine therefore runs
the references, and the CPU test suite runs the kernels themselves under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from strata.kernels import choices
from strata.kernels.device import current as device_spec


@lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _pdl_capable(device_index: int) -> bool:
    return device_spec(device_index).pdl


def use_pdl(t: torch.Tensor) -> bool:
    """Whether to launch a kernel on `t`'s device with programmatic dependent launch (PDL): Hopper and
    later, unless the kernel choices turn it off (`choices.current().pdl`). A kernel launched so must
    begin with `pdl_prologue(USE_PDL)` (strata.kernels.pdl): it then starts while its predecessor
    drains, and waits for it before its first memory access, so the launch latency of a chain of small
    kernels (a decode step's ~250) overlaps real work."""
    return t.is_cuda and choices.current().pdl and _pdl_capable(t.device.index if t.device.index is not None
                                                                else torch.cuda.current_device())


def use_triton(t: torch.Tensor) -> bool:
    """Whether `op` should run the Triton kernel for a tensor: on CUDA, and only where no gradient
    flows through it (the kernels have no backward; training on the GPU runs the references)."""
    return t.is_cuda and not (t.requires_grad and torch.is_grad_enabled()) and triton_available()


def kernels_run(x: torch.Tensor, kernel) -> bool:
    """Whether an op launches its Triton kernels for `x`: on CUDA (`use_triton`), or on any device
    while Triton interprets them (TRITON_INTERPRET=1, which Triton read when `kernel` was decorated:
    it is then an InterpretedFunction) — never where a gradient flows (the kernels have no backward)."""
    if use_triton(x):
        return True
    interpreted = type(kernel).__name__ == "InterpretedFunction"
    return interpreted and not (x.requires_grad and torch.is_grad_enabled())
