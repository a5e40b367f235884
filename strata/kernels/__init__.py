"""Triton kernels, each beside the torch reference it must match.

Every public op here has three names: `op_ref` (torch, the definition), `op_triton` (the kernel) and
`op` (dispatch: the kernel for CUDA tensors, the reference elsewhere). The CPU engine therefore runs
the references, and the CPU test suite runs the kernels themselves under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Whether `op` should run the Triton kernel for a tensor: on CUDA, and only where no gradient
    flows through it (the kernels have no backward; training on the GPU runs the references)."""
    return t.is_cuda and not (t.requires_grad and torch.is_grad_enabled()) and triton_available()
