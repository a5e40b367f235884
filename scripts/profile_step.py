"""Where a decode step's time goes, on a GPU: engine step wall time, graph replay device time, and the
kernels of one eager step (torch.profiler), grouped by name. Or, with --read N, where a prompt read of
N tokens in one chunk goes: its wall time and its kernels, grouped by name. A development tool, not a
benchmark: `strata bench` owns the published numbers.

    python scripts/profile_step.py --shape qwen3-8b --batch 1 --prompt 512 [--quant Q4_K]
    python scripts/profile_step.py --shape qwen3-8b --read 4096 [--quant FP8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from strata.bench.random_model import random_model
from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.params import SamplingParams


def print_kernels(prof: torch.profiler.profile, runs: int, top: int, what: str) -> None:
    """The CUDA kernels of `runs` profiled repetitions, per repetition, grouped by name."""
    per = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.device_time_total / runs
            per[ev.name][1] += 1 / runs
    total = sum(v[0] for v in per.values())
    print(f"{what}: {total / 1e3:.3f} ms of kernels, {sum(v[1] for v in per.values()):.0f} launches")
    for name, (us, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{us:9.1f} us {n:6.0f}x  {us / max(n, 1):8.2f} us/launch  {name[:110]}")


def profile_read(a: argparse.Namespace) -> None:
    """One prompt of a.read tokens read in one chunk (max_tokens 1): warmed once, then timed three
    times and profiled once."""
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    loaded = random_model(a.shape, dev, dtype, quant=a.quant)
    chunk = max(8192, a.read)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cfg = EngineConfig(device=a.device, dtype=str(dtype).removeprefix("torch."), parallel=1, ctx=a.read + 256, kv=a.kv, kv_size=a.read + 256,
                       chunk_size=chunk, max_num_batched_tokens=chunk)
    eng = LLMEngine(cfg, progress=False, loaded=loaded)
    vocab = loaded.config.vocab_size

    def read(tag: str) -> float:
        ids = torch.randint(0, vocab, (a.read,)).tolist()
        eng.add_request(EngineRequest(tag, tuple(ids), SamplingParams(max_tokens=1, ignore_eos=True), time.monotonic()))
        sync()
        t0 = time.perf_counter()
        while eng.has_work():
            eng.step()
        sync()
        return time.perf_counter() - t0

    read("warm")
    walls = [read(f"r{i}") for i in range(3)]
    print(f"read {a.read} tokens: wall p50 {statistics.median(walls) * 1e3:.2f} ms "
          f"({a.read / statistics.median(walls):,.0f} tok/s)")
    if dev.type != "cuda":
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        read("profiled")
    print_kernels(prof, 1, a.top, f"one read of {a.read}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--kv", default="auto")
    ap.add_argument("--quant", default=None, help="weights kept quantized: a GGUF type or mix (Q8_0, Q4_K_M, ...) or FP8")
    ap.add_argument("--spec", type=int, default=0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--read", type=int, default=0, help="profile a prompt read of this many tokens instead")
    ap.add_argument("--device", default="cuda", help="--read only: cpu checks the plumbing")
    a = ap.parse_args()
    if a.read:
        return profile_read(a)
    dev = torch.device("cuda")
    loaded = random_model(a.shape, dev, torch.bfloat16, quant=a.quant)
    cfg = EngineConfig(device="cuda", dtype="bfloat16", parallel=a.batch, ctx=a.prompt + 256, kv=a.kv,
                       kv_size=(a.prompt + 256) * a.batch, chunk_size=8192, max_num_batched_tokens=8192)
    eng = LLMEngine(cfg, progress=False, loaded=loaded)
    vocab = loaded.config.vocab_size
    for i in range(a.batch):
        ids = torch.randint(0, vocab, (a.prompt,)).tolist()
        eng.add_request(EngineRequest(f"p{i}", tuple(ids), SamplingParams(max_tokens=200, ignore_eos=True), time.monotonic()))
    while any(r.num_computed_tokens < len(r.prompt_ids) for r in eng.requests.values()):
        eng.step()
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    walls = []
    for _ in range(40):
        t0 = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
    print(f"engine step wall: p50 {statistics.median(walls) * 1e3:.3f} ms  min {min(walls) * 1e3:.3f} ms")
    g = eng.runner.graphs.get(min(b for b in eng.runner.graphs if b >= a.batch)) if eng.runner.graphs else None
    if g is not None:
        times = []
        for _ in range(30):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.graph.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        print(f"graph replay (device): p50 {statistics.median(times):.3f} ms  min {min(times):.3f} ms")
    # One eager step's kernels. The prompt-chunk graphs go too: a one-sequence decode step fits their
    # smallest bucket, whose padded rows would take the many-row kernels instead of the decode GEMVs.
    pg = eng.runner.prompt_graphs
    graphs, eng.runner.graphs = eng.runner.graphs, {}
    prompt_graphs, pg.graphs = pg.graphs, {}
    eng.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            eng.step()
        torch.cuda.synchronize()
    eng.runner.graphs, pg.graphs = graphs, prompt_graphs
    print_kernels(prof, 3, a.top, "eager step")


if __name__ == "__main__":
    main()
