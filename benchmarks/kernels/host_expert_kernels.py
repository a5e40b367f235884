"""The CPU kernels a routed expert held in host RAM can run through, at a Qwen3-30B-A3B expert's
gate|up shape ([1536, 2048]) and M = 1..64 rows, on fresh random weights; with CUDA also the pinned
and pageable host-to-device copy rates (the streamer's ceiling). Prints per kernel: microseconds per
expert and the expert bytes read per second.

- int8pack / int4pack: torch's weight-only packed kernels (`HostProjection` int8 / int4);
- bf16: `F.linear` on bf16 weights (oneDNN);
- int_mm_dyn: int8 weights and per-token int8 activations through `torch._int_mm` (`w8a8`);
- fbgemm_dyn: FBGEMM's dynamic-quantized linear (uint8 activations per call: `fbgemm`).

Then whole layers as a decode step computes them (`HostExperts.forward`: T tokens, each routed to k
distinct experts, the grouping and the weighted sum included) at the 30B-A3B and 80B-A3B expert shapes,
for the int8 formats (fbgemm's calls from Python and, as the engine makes them, from TorchScript, "(ts)";
compiled: a step's layer as one kernel torch.compile generates, for one token or many; the one-token
step of fbgemm (ts) also with a quarter, half, three quarters and all of torch's threads):
milliseconds per layer and the distinct experts' bytes read per second.

    python benchmarks/kernels/host_expert_kernels.py [--layers-only]
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from strata.models.host_experts import HostExperts, HostProjection, int8_tokens, int8_rows

H, I = 2048, 768
EXPERTS = 24  # more than the caches hold: each call reads its weights from memory


def bench(fn, n: int = 10) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


# (name, experts, experts per token, hidden, expert intermediate)
LAYERS = [("30B-A3B", 128, 8, 2048, 768), ("80B-A3B", 512, 10, 2048, 512)]


def layers() -> None:
    g = torch.Generator().manual_seed(0)
    for name, e, k, h, inter in LAYERS:
        w13 = torch.randn(e, 2 * inter, h, generator=g) * 0.02
        w2 = torch.randn(e, h, inter, generator=g) * 0.02
        for fmt, scripted in (("w8a8", False), ("fbgemm", False), ("fbgemm", True), ("compiled", True)):
            host = HostExperts.from_stacks(w13, w2, fmt)
            host.scripted = scripted
            label = fmt + " (ts)" * (scripted and fmt == "fbgemm")
            per_expert = 3 * inter * h
            for t in (1, 4, 16):
                x = torch.randn(t, h, generator=g)
                ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
                w = torch.rand(t, k, generator=g)
                sec = bench(lambda: host.forward(x, ids, w), 20)
                read = len(ids.unique()) * per_expert
                print(f"layer {name} {label:11s} T={t:2d}: {sec * 1e3:6.2f} ms, {read / sec / 1e9:6.1f} GB/s of experts",
                      flush=True)
            if scripted and fmt == "fbgemm":  # a decode step's few small GEMMs: does a smaller thread team pay?
                everyone = torch.get_num_threads()
                x = torch.randn(1, h, generator=g)
                ids = torch.randperm(e, generator=g)[:k][None]
                w = torch.rand(1, k, generator=g)
                for threads in sorted({max(1, everyone // 4), max(1, everyone // 2), everyone * 3 // 4, everyone}):
                    torch.set_num_threads(threads)
                    sec = bench(lambda: host.forward(x, ids, w), 20)
                    print(f"layer {name} {label:11s} T= 1, {threads:2d} threads: {sec * 1e3:6.2f} ms, "
                          f"{k * per_expert / sec / 1e9:6.1f} GB/s of experts", flush=True)
                torch.set_num_threads(everyone)
            del host


def main() -> None:
    os.system("lscpu | grep -E 'Model name|^CPU\\(s\\)'")
    print("torch", torch.__version__, "threads", torch.get_num_threads())
    big = torch.ones(2**29)
    print(f"host read (a sum over 2 GiB): {big.numel() * 4 / bench(big.sum, 5) / 1e9:.1f} GB/s")
    del big
    if "--layers-only" in sys.argv:
        layers()
        return
    ws = [torch.randn(2 * I, H) * 0.02 for _ in range(EXPERTS)]

    def projection(fmt):
        p = HostProjection(fmt, len(ws), 2 * I, H)
        p.set(0, torch.stack(ws))
        return [(p, e) for e in range(len(ws))], lambda x, pe: pe[0].mm(pe[1], x)

    def fbgemm():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            packs = []
            for w in ws:
                q, s = int8_rows(w)
                qw = torch.quantize_per_channel(w, s.double(), torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
                packs.append(torch.ops.quantized.linear_prepack(qw, None))
        return packs, lambda x, p: torch.ops.quantized.linear_dynamic(x, p, False)

    def int_mm():
        prepared = [int8_rows(w) for w in ws]

        def run(x, p):
            xq, xs = int8_tokens(x)
            return torch._int_mm(xq, p[0].t()).float() * xs * p[1]
        return prepared, run

    kinds = {"int8pack": (projection("int8"), 2 * I * H), "int4pack": (projection("int4"), I * H),
             "bf16": (([w.bfloat16() for w in ws], lambda x, w: F.linear(x.bfloat16(), w)), 4 * I * H),
             "int_mm_dyn": (int_mm(), 2 * I * H), "fbgemm_dyn": (fbgemm(), 2 * I * H)}
    for name, ((weights, fn), nbytes) in kinds.items():
        for m in (1, 4, 16, 64):
            x = torch.randn(m, H)
            t = bench(lambda: [fn(x, w) for w in weights], 5) / len(weights)
            print(f"{name:11s} M={m:3d}: {t * 1e6:7.0f} us per expert, {nbytes / t / 1e9:6.1f} GB/s")
    if torch.cuda.is_available():
        for n in (2**24, 2**30):
            host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(n, dtype=torch.uint8, device="cuda")
            t = bench(lambda: (dev.copy_(host, non_blocking=True), torch.cuda.synchronize()))
            print(f"pinned host-to-device, {n >> 20} MiB: {n / t / 1e9:.1f} GB/s")
        pageable = torch.empty(2**30, dtype=torch.uint8)
        t = bench(lambda: (dev.copy_(pageable), torch.cuda.synchronize()), 5)
        print(f"pageable host-to-device: {2**30 / t / 1e9:.1f} GB/s")
    layers()


if __name__ == "__main__":
    main()
