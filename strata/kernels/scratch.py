"""Kernel scratch shared by a model's calls, and the twins a second stage uses instead.

Some kernels keep scratch across calls: the decode GEMV's split-K counters (`CausalLM.gemv_ws`, each
`QWeight.workspace`), the MoE token sort's and router's counters, the stream-K GEMM's fix-up pool
(`QMatmulContext`). Each assumes its calls run one after another on one stream. A stage that runs
the same model beside the main loop on another stream (the concurrent read, `strata.runner.read_stage`)
must not share them, so it makes twins once, at start-up (`make_twins` of the model's scratch,
`strata.models.quantize.model_scratch`), and installs them for its worker thread (`use`). Call sites
ask `scratch(x)` for the calling thread's version of `x`.

The mapping is thread-local, as a CUDA stream is in PyTorch: threads that installed nothing (the
main loop) get the originals, and no call path has to carry a stage argument through the model.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch


class _Twins(threading.local):
    by_id: dict[int, object] | None = None


_THREAD = _Twins()


def scratch(x):
    """The calling thread's twin of `x` (a scratch tensor or context), or `x` itself."""
    twins = _THREAD.by_id
    if twins is None or x is None:
        return x
    return twins.get(id(x), x)


@contextmanager
def use(twins: dict[int, object]) -> Iterator[None]:
    """Install `twins` (from `make_twins`) for the calling thread."""
    before = _THREAD.by_id
    _THREAD.by_id = twins
    try:
        yield
    finally:
        _THREAD.by_id = before


def make_twins(objs: list[object]) -> dict[int, object]:
    """A zeroed twin of each scratch tensor and a fresh context for each stream-K context, keyed by the
    original's id. A context twin gets the original's reservation, so it allocates no more than it."""
    from strata.kernels.quant.streamk import QMatmulContext

    twins: dict[int, object] = {}
    for x in objs:
        if isinstance(x, torch.Tensor):
            twins[id(x)] = torch.zeros_like(x)
        elif isinstance(x, QMatmulContext):
            twin = QMatmulContext(x.device)
            twin.reserve_fixup(x.pool_bytes)
            twins[id(x)] = twin
        else:
            raise TypeError(f"no twin for scratch of type {type(x).__name__}")
    return twins


def twin_bytes(twins: dict[int, object]) -> int:
    from strata.kernels.quant.streamk import QMatmulContext

    return sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else
               t.pool_bytes if isinstance(t, QMatmulContext) else 0 for t in twins.values())
