"""Every Triton kernel in `strata.kernels` reads only globals that compile.

Triton's compiler refuses a kernel that reads a plain module global (`E4M3_MAX = 448.0`): only
`tl.constexpr` values, modules and other jitted functions may be named. The interpreter that runs the
CPU suite does not check this, so such a kernel passes every CPU test and fails at its first launch
on the GPU. This test reads each kernel's source and resolves the names it reads that are neither its
arguments, its locals nor builtins.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import strata.kernels  # noqa: E402


def _kernels():
    """(module name, function name, function) of every jitted function defined in strata.kernels."""
    found = []
    for info in pkgutil.walk_packages(strata.kernels.__path__, "strata.kernels."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)
            if (type(obj).__name__ in ("JITFunction", "InterpretedFunction") and inspect.isfunction(fn)
                    and fn.__module__ == module.__name__):
                found.append((module.__name__, name, fn))
    return found


def _free_names(fn) -> set[str]:
    """Names the function reads that it does not bind itself (arguments, assignments, loop targets)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    bound = {a.arg for a in func.args.args + func.args.kwonlyargs}
    read = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, (ast.Store, ast.Del)) else read).add(node.id)
    return read - bound - set(dir(builtins))


def _compiles(value) -> bool:
    return (isinstance(value, (types.ModuleType, tl.constexpr))
            or type(value).__name__ in ("JITFunction", "InterpretedFunction")
            or getattr(value, "__module__", "").startswith("triton"))


KERNELS = _kernels()


def test_the_kernels_are_found():
    names = {name for _, name, _ in KERNELS}
    assert len(KERNELS) > 40 and {"_rms_norm_kernel", "_quantize_rows_kernel", "_matmul_kernel"} <= names


@pytest.mark.parametrize("module, name, fn", KERNELS, ids=[f"{m.split('.', 2)[-1]}.{n}" for m, n, _ in KERNELS])
def test_kernel_reads_only_compilable_globals(module, name, fn):
    bad = {}
    for free in sorted(_free_names(fn)):
        if free not in fn.__globals__:
            bad[free] = "undefined"
        elif not _compiles(fn.__globals__[free]):
            bad[free] = type(fn.__globals__[free]).__name__
    assert not bad, f"{module}.{name} reads globals Triton will not compile: {bad} (pass them as constexpr arguments)"
