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
With USE_PDL off (the CPU interpreter, older GPUs, STRATA_PDL=0) the prologue compiles to nothing.

The one thing a kernel may do before the wait: ask L2 to prefetch memory that no kernel of the step
writes (weights), with `prefetch_rows_l2`. A decode GEMV does, so the weight stream it exists for
starts while the small kernel before it (a norm, RoPE, attention) still runs and HBM would sit idle;
a prefetch reads nothing into registers, so it cannot observe a write it should have waited for.
"""

from __future__ import annotations

from strata.kernels.triton_import import jit, tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only installs: the kernels are never launched
    pass


@jit
def prefetch_rows_l2(row_ptrs, nbytes):
    """cp.async.bulk.prefetch.L2 of `nbytes` (a multiple of 16, each start 16-byte aligned) from every
    pointer of the tensor `row_ptrs`: a hint with no result, so it needs no wait and no fence."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [row_ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@jit
def pdl_prologue(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
