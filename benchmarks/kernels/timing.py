"""Timing of single kernel calls on the GPU, shared by the kernel micro-benchmarks in this folder
(`strata bench` owns the published end-to-end numbers), and the weight copies that make each timed
call read HBM rather than L2."""

from __future__ import annotations

import math
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


def l2_bytes() -> int:
    """The device's L2 size (60 MB, the H100/H200 figure, where torch does not report it)."""
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)


def copies_past_l2(bytes_each: int, least: int = 4) -> int:
    """How many copies of a `bytes_each` weight to cycle through so that together they are at least
    three times the L2 (and at least `least`): every timed call then reads its weight from HBM."""
    return max(least, math.ceil(3 * l2_bytes() / bytes_each))


def parse_ints(text: str | None) -> tuple[int, ...] | None:
    """'1,8,512' -> (1, 8, 512); None or '' -> None."""
    return tuple(int(v) for v in text.split(",")) if text else None


def parse_shapes(items: list[str] | None) -> list[tuple[int, int]] | None:
    """['6144x4096', ...] -> [(6144, 4096), ...]; None or [] -> None."""
    return [tuple(int(v) for v in s.lower().split("x")) for s in items] if items else None


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
