"""What a kernel's launch configuration may depend on besides shapes: the GPU's SM count, the shared
memory one block may use, and its compute capability.

Configurations are functions of (shapes, `DeviceSpec`), so they can be computed for a card without
having it (`PRESETS`: the offline compile tests, sweeps planned on the host). `current(device)` reads a
CUDA device's spec from `torch.cuda.get_device_properties` once; off CUDA (the CPU engine, the
interpreter tests) it is `REFERENCE`, the device the tuned tables were measured on, so there every
configuration is the reference's.

Tables tuned by sweeps apply where `tuned(spec)` holds (the reference's SM count and shared memory);
elsewhere the modules' rules run with the device's own numbers, and a rule's pipeline stages are cut
to what fits the device's shared memory (`fit_stages`).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator

import torch


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    capability: tuple[int, int]
    sm_count: int
    smem_per_block: int  # bytes of shared memory one block may use (the opt-in maximum)

    @property
    def arch(self) -> int:
        """The capability as Triton's target number: 80, 86, 89, 90."""
        return 10 * self.capability[0] + self.capability[1]

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch (griddepcontrol): sm_90 and later."""
        return self.capability >= (9, 0)

    @property
    def wgmma(self) -> bool:
        """Warp-group MMAs that read their operands from shared memory (wgmma on sm_90, tcgen05 on
        sm_100 / sm_110). Ampere, Ada and consumer Blackwell (sm_120) issue mma.sync from registers: a
        tile whose accumulator and operands fit a Hopper thread's registers spills there, so those
        devices take tiles of their own."""
        return 9 <= self.capability[0] <= 11

    @property
    def fp8(self) -> bool:
        """e4m3 conversions in hardware (Triton's fp8e4nv, cuBLASLt's FP8 GEMMs): sm_89 and later."""
        return self.capability >= (8, 9)


# Per-block opt-in limits: 227 KiB on sm_90, 163 KiB on sm_80, 99 KiB on sm_86 / sm_89.
SM80 = DeviceSpec("sm_80 (A100)", (8, 0), 108, 163 << 10)
SM86 = DeviceSpec("sm_86 (RTX 3090)", (8, 6), 82, 99 << 10)
SM89 = DeviceSpec("sm_89 (RTX 4090)", (8, 9), 128, 99 << 10)
SM90 = DeviceSpec("sm_90 (H100 / H200)", (9, 0), 132, 227 << 10)
PRESETS = {"sm_80": SM80, "sm_86": SM86, "sm_89": SM89, "sm_90": SM90}
REFERENCE = SM90  # where the tables were tuned; the spec off CUDA


def tuned(spec: DeviceSpec) -> bool:
    """Whether configurations swept on the reference apply as they are: its SM count, at least its shared
    memory, Hopper or later."""
    return (spec.sm_count == REFERENCE.sm_count and spec.smem_per_block >= REFERENCE.smem_per_block
            and spec.capability >= REFERENCE.capability)


def fit_stages(spec: DeviceSpec, stages: int, stage_bytes: int, fixed_bytes: int = 0, least: int = 2) -> int:
    """`stages` pipeline stages of `stage_bytes` each, fewer where they and `fixed_bytes` would not fit
    the device's shared memory per block (never fewer than `least`). Triton's pipeliner buffers
    num_stages - 1 stages of a loop's loads in shared memory (the compiled kernels' `shared` shows it)."""
    fit = (spec.smem_per_block - fixed_bytes) // max(stage_bytes, 1) + 1
    return max(least, min(stages, fit))


@lru_cache(maxsize=16)
def _cuda_spec(index: int) -> DeviceSpec:
    p = torch.cuda.get_device_properties(index)
    smem = getattr(p, "shared_memory_per_block_optin", 0) or (p.shared_memory_per_multiprocessor - 1024)
    return DeviceSpec(p.name, (p.major, p.minor), p.multi_processor_count, int(smem))


_chosen: ContextVar[DeviceSpec | None] = ContextVar("strata_device_spec", default=None)


def current(device=None) -> DeviceSpec:
    """The spec of `device` (a torch.device, index, name or tensor), or `REFERENCE` off CUDA. None: the
    spec `using` holds, else the current CUDA device's (`REFERENCE` without CUDA)."""
    if isinstance(device, torch.Tensor):
        device = device.device
    if device is None:
        chosen = _chosen.get()
        if chosen is not None:
            return chosen
        if not torch.cuda.is_available():
            return REFERENCE
        return _cuda_spec(torch.cuda.current_device())
    if isinstance(device, int):
        return _cuda_spec(device)
    device = torch.device(device)
    if device.type != "cuda":
        return REFERENCE
    return _cuda_spec(device.index if device.index is not None else torch.cuda.current_device())


@contextmanager
def using(spec_or_device) -> Iterator[DeviceSpec]:
    """`current()` (no argument) answers this spec, or this device's, inside the block: configurations
    computed without a tensor (a weight's workspace at pack time) then follow the device the weight is on."""
    spec = spec_or_device if isinstance(spec_or_device, DeviceSpec) else current(spec_or_device)
    token = _chosen.set(spec)
    try:
        yield spec
    finally:
        _chosen.reset(token)


def release_unused_memory() -> None:
    """What this process holds on its GPU and no longer uses, given back: objects in reference cycles
    (an engine built before), blocks in torch's cache, and cuBLAS's workspaces. Torch keeps one
    workspace for each stream cuBLAS ran on (32 MiB on Hopper) until they are cleared, so a process that
    built engines one after another, each with streams of its own, holds a gigabyte of them. Only where
    no CUDA graph of this process lives on: a captured graph keeps the address of the workspace it ran
    with (benchmark arms and tests call it between engines)."""
    gc.collect()
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
