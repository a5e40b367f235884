"""The host KV tier's decode row over its host part on the CPU (`TieredAttention._span_parts`): one row of
the 8B shape (32 query heads, 8 KV heads of 128) and of the Qwen3-Next shape (16 / 2 of 256) over an int8
host pool of N tokens of one layer, its keys split over torch's threads, with the parts run by the C
library's OpenMP team in one call (at 1, 4, 8 and all threads) and by Python's threads (one call a part,
merged in torch). Prints milliseconds per layer, the K/V bytes read per second beside the host's read
bandwidth, and key-heads a second per thread.

    python benchmarks/kernels/host_span_attention.py [TOKENS]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from strata.attention.reference import PagedAttention
from strata.attention.tiered import TieredAttention
from strata.kernels import cpu_decode
from strata.kvcache.pool import make_pool


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 114688
    kernels = cpu_decode.load(Path(tempfile.mkdtemp()))
    a = torch.ones(2 << 28)
    a.sum()
    t0 = time.perf_counter()
    a.sum()
    print(f"torch threads {torch.get_num_threads()}; OpenMP in the library: {kernels.threaded_split}; host read "
          f"(a sum over 2 GiB): {a.numel() * 4 / (time.perf_counter() - t0) / 1e9:.1f} GB/s", flush=True)
    del a
    bs = 16
    for name, hq, hkv, d in (("8B", 32, 8, 128), ("80B-A3B", 16, 2, 256)):
        host = make_pool("int8", 1, tokens // bs, bs, hkv, d, "cpu", torch.float32)
        host.k[0].random_(-100, 100)
        host.v[0].random_(-100, 100)
        host.k_scale[0].fill_(0.01)
        host.v_scale[0].fill_(0.01)
        dev = make_pool("auto", 1, 4, bs, hkv, d, "cpu", torch.float32)
        q, blocks = torch.randn(1, hq, d), torch.arange(tokens // bs)
        every = torch.get_num_threads()
        # The OpenMP team at a few sizes (how the host part scales with threads), then Python's threads.
        arms = [(True, n) for n in sorted({1, 4, 8, every}) if n <= every] if kernels.threaded_split else []
        for split, threads in arms + [(False, every)]:
            kernels.threaded_split = split
            torch.set_num_threads(threads)
            tiered = TieredAttention(PagedAttention(dev), host, device="cpu", decode_rows=1, max_host_tokens=tokens,
                                     num_layers=1, cpu_kernels=kernels)
            times = []
            for _ in range(12):
                t0 = time.perf_counter()
                tiered._span_parts(0, q, blocks, tokens)
                times.append(time.perf_counter() - t0)
            med = sorted(times[2:])[5]
            print(f"{name} {tokens} tokens, {'OpenMP team' if split else 'Python threads'} of {threads}: "
                  f"{med * 1e3:.2f} ms a layer, {tokens * hkv * d * 2 / med / 1e9:.1f} GB/s of K/V, "
                  f"{tokens * hkv / med / threads / 1e6:.1f} M key-heads/s a thread", flush=True)
        kernels.threaded_split = True
        torch.set_num_threads(every)
        del host


if __name__ == "__main__":
    main()
