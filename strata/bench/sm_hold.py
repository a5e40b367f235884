"""`SmHold`: some of a GPU's SMs kept busy doing nothing, so that whatever runs meanwhile gets only the
others. An instrument of `strata bench sm-split`, not part of serving.

A green context of `held` SMs (`torch.cuda.green_contexts`, the one `STRATA_READ_SMS` uses) confines a
spinning kernel to those SMs. Its grid is `BLOCKS_PER_SM` one-warp programs per SM, the resident-block
limit of sm_80 and sm_90, so no other kernel's program can start there however little it asks; the
spinners sleep between polls of their flag, so they draw neither issue slots nor L2 traffic worth
counting. `release()` sets the flag. The spinners also stop at a deadline: a device-wide synchronize
while the hold is on would otherwise wait for ever.

`sms_used()` launches many short programs on the current stream and returns how many distinct SMs they
ran on: the check that a hold holds (on an idle GPU, every SM). `stream_gbs()` is the HBM bandwidth
that the SMs left can draw: the best of a few read-only kernels over a buffer far larger than L2."""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer, smid

BLOCKS_PER_SM = 32  # the most programs an sm_80 / sm_90 SM keeps resident
POLL_NS = 100_000  # a spinner's sleep between polls of its flag
PROBE_NS = 20_000  # how long each probe program stays on its SM


@triton.jit
def _sleep(ns):
    return tl.inline_asm_elementwise("nanosleep.u32 $1;\n\tmov.u32 $0, 0;", "=r,r", [ns], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _hold_kernel(flag_ptr, sm_ptr, limit_ns, poll_ns):
    tl.store(sm_ptr + tl.program_id(0), smid())
    t0 = globaltimer()
    go = tl.load(flag_ptr, volatile=True)
    while (go == 0) & (globaltimer() - t0 < limit_ns):
        _sleep(poll_ns)
        go = tl.load(flag_ptr, volatile=True)


@triton.jit
def _probe_kernel(sm_ptr, busy_ns):
    t0 = globaltimer()
    while globaltimer() - t0 < busy_ns:
        _sleep(1000)
    tl.store(sm_ptr + tl.program_id(0), smid())


@triton.jit
def _stream_kernel(x_ptr, out_ptr, PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * PER_PROGRAM
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(0, PER_PROGRAM, BLOCK):
        acc += tl.load(x_ptr + base + i + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def sms_used(device: torch.device, programs_per_sm: int = 16) -> int:
    """Distinct SMs that programs launched now on the current stream run on."""
    n = programs_per_sm * num_sms(device)
    out = torch.full((n,), -1, dtype=torch.int32, device=device)
    _probe_kernel[(n,)](out, PROBE_NS, num_warps=1)
    return int(torch.unique(out).numel())


class SmHold:
    """`held` SMs of `device` kept busy from construction to `release()` (or `limit_s`)."""

    def __init__(self, device: torch.device, held: int, limit_s: float = 120.0):
        from strata.runner.read_stage import _green_context

        self.device, self.requested = device, held
        self.green = _green_context(device.index or 0, held)
        self.stream = self.green.Stream()
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        n = BLOCKS_PER_SM * held
        self.sm_ids = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.stream.wait_stream(torch.cuda.current_stream(device))  # the flag is zero before any spinner reads it
        with torch.cuda.stream(self.stream):
            _hold_kernel[(n,)](self.flag, self.sm_ids, int(limit_s * 1e9), POLL_NS, num_warps=1)
        self.started = time.perf_counter()
        self.limit_s = limit_s
        time.sleep(0.05)  # every spinner resident before anything else is launched

    def release(self) -> int:
        """Stops the spinners; the number of distinct SMs they held."""
        self.flag.fill_(1)
        self.stream.synchronize()
        if time.perf_counter() - self.started >= self.limit_s:
            raise RuntimeError(f"the SM hold reached its {self.limit_s:.0f} s limit: something waited for it")
        return int(torch.unique(self.sm_ids).numel())


def events_seconds(fn, iters: int) -> float:
    """Median seconds of `fn` on the current stream (CUDA events, after one warm-up call)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def stream_gbs(device: torch.device, nbytes: int = 4 * 2**30, iters: int = 5) -> dict:
    """GB/s read from HBM by the SMs free now: each candidate kernel reads `nbytes` once per run
    (median of `iters`); `best` is the highest."""
    x = torch.ones(nbytes // 4, dtype=torch.int32, device=device)
    per_program = 2**18
    out = torch.empty(x.numel() // per_program, dtype=torch.int32, device=device)
    candidates = {
        "triton_4096x8": lambda: _stream_kernel[(out.numel(),)](x, out, PER_PROGRAM=per_program, BLOCK=4096,
                                                                      num_warps=8),
        "triton_8192x16": lambda: _stream_kernel[(out.numel(),)](x, out, PER_PROGRAM=per_program, BLOCK=8192,
                                                                        num_warps=16),
        "torch_sum": lambda: x.sum(),
    }
    got = {name: nbytes / events_seconds(fn, iters) / 1e9 for name, fn in candidates.items()}
    del x, out
    return {**got, "best": max(got.values())}
