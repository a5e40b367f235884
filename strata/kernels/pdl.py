"""Programmatic dependent launch (PDL) for the Triton kernels, Hopper and later.

A kernel launched with `launch_pdl=True` may start while the kernel before it on the stream is still
running; `pdl_prologue` makes it wait for that kernel's completion (and memory) before its first
load or store, then lets the kernel after it launch early in turn. A decode step is a chain of ~250
small kernels: overlapping each launch with its predecessor's tail removes most of the fixed gap
between them. The wait comes first so correctness never depends on what a kernel touches: every
kernel in the chain sees all writes of every kernel before it (each one's wait completes only after
its own predecessor finished). Kernels not launched this way (torch's, cuBLAS) start as usual.

Usage in a kernel: a `USE_PDL: tl.constexpr` parameter and `pdl_prologue(USE_PDL)` as the first
statement; at the launch, `USE_PDL=on, launch_pdl=on` with `on = strata.kernels.use_pdl(tensor)`.
With USE_PDL off (the CPU interpreter, older GPUs, the kernel choice `pdl` off) the prologue compiles
to nothing.
"""

from __future__ import annotations

from strata.kernels.triton_import import jit, tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only installs: the kernels are never launched
    pass


@jit
def pdl_prologue(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
