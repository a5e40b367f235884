"""Timing of single kernel calls on the GPU, for the kernels' micro-benchmarks (`python -m
strata.kernels.<module>`): `strata bench` owns the published numbers."""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch


def time_us(calls: Sequence[Callable[[], object]], runs: int = 50) -> float:
    """Median of `runs` single-call CUDA-event timings in µs, cycling over `calls` (e.g. one per copy
    of a weight, so that together they exceed L2 and each call reads HBM). The GPU first sleeps while
    the host queues every launch, so host launch overhead never shows in a timing."""
    for call in list(calls) * 2:
        call()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    torch.cuda._sleep(40_000_000)  # ~20 ms at ~2 GHz, longer than queueing `runs` launches
    for i, (start, end) in enumerate(events):
        start.record()
        calls[i % len(calls)]()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3
