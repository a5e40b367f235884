"""Triton, imported once for every kernel module: `from strata.kernels.triton_import import jit, tl`.

CPU-only installs have no Triton. There the torch references still work and the kernels are never
launched, so a kernel module must still import: `triton`, `tl` and `libdevice` are None and `jit` is
a decorator that returns the function unchanged (as `@jit` and as `@jit(...)`). A kernel reads these
names from its own module's globals, where Triton's JIT finds them as it would the modules themselves.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    jit = triton.jit
except ImportError:  # CPU-only installs: the references work, the kernels are never launched
    triton = tl = libdevice = None

    def jit(fn=None, **_options):
        return fn if fn is not None else (lambda f: f)


__all__ = ["jit", "libdevice", "tl", "triton"]
