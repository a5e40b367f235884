import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("STRATA_NO_PROGRESS", "1")


def _cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


# Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before strata.kernels
# is imported: without a GPU the kernel tests run in Triton's interpreter on CPU tensors.
if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
    Triton launches no room for their local memory ("CUDA out of memory" at launch, 2026-12-05)."""
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
