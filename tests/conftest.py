import dataclasses
import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
# The shared builders (tiny_models, serving, ...) sit here; test modules of one area import another
# area's builders by module name (basenames are unique across tests/).
sys.path[:0] = [TESTS] + sorted(e.path for e in os.scandir(TESTS) if e.is_dir() and not e.name.startswith((".", "_")))
os.environ.setdefault("STRATA_NO_PROGRESS", "1")


def _share_the_cores() -> None:
    """Each pytest-xdist worker, and each server it starts, gets its share of the cores for torch's and
    OpenBLAS's threads. Left alone, every process starts a thread per core, and on CI's two cores two
    workers' thread pools spin against each other: two CPU test files took 133 s and 118 s side by side
    that way, 59 s and 52 s with a thread each."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # Before torch (and numpy's OpenBLAS, which the interpreter's kernels run on) starts its threads;
    # the servers and scripts the tests start inherit it.
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers))


_share_the_cores()


def _cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


# Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before strata.kernels
# is imported: without a GPU the kernel tests run in Triton's interpreter on CPU tensors.
if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_skips_dropped_overflow_checks() -> None:
    """Triton's interpreter redoes every int32 add, sub and mul in int64 to build an overflow assert,
    then drops the assert (`device_assert` returns unless the options' `debug`, which Triton 3.6's
    interpreter never sets), as the GPU compile does. That dead work was 5/6 of the packed-int8 (dp4a)
    kernels' interpreter time: their Q4_K tests took 106 s, 17.5 s without it. Where `debug` is on, the
    checks stay."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    options = interpreter.interpreter_builder.options
    if not options.debug:
        interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)


_interpreter_skips_dropped_overflow_checks()

from tiny_models import ARCH_CONFIGS, save_tiny_model  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter_rounds_bf16_to_nearest(monkeypatch):
    """Triton 3.6's interpreter truncates fp32 -> bf16 casts where the GPU rounds to nearest even. Round
    like the GPU, so the kernels' bf16 rounding is what the CPU tests check."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import numpy as np
        import torch
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._convert_float

    def convert(data, src_ty, dst_ty, rounding_mode):
        if src_ty == tl.float32 and dst_ty == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return original(data, src_ty, dst_ty, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


@pytest.fixture(autouse=True)
def _gpu_memory_released(request):
    """After each `gpu` test, what it left (engines in reference cycles, blocks in torch's cache) goes
    back to the driver. On an 80 GB card the 8B-shape tests of one file otherwise left the next file's
    Triton launches no room for their local memory ("CUDA out of memory" at launch)."""
    yield
    if request.node.get_closest_marker("gpu") is None or not _cuda_present():
        return
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """{arch: (path, hf_model)} for every supported architecture, built once per session."""
    out = {}
    for arch in ARCH_CONFIGS:
        path = str(tmp_path_factory.mktemp(f"tiny_{arch}"))
        out[arch] = (path, save_tiny_model(arch, path))
    return out
