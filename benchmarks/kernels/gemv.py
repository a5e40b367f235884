"""The bf16/fp16 decode GEMV (`strata.kernels.gemv`) against F.linear (cuBLAS), and the sweep of its
configurations (the source of `gemv.GEMV_CONFIGS`). Needs a CUDA device.

    python benchmarks/kernels/gemv.py                      # the table at M = 1, 2, 4, 8, 16
    python benchmarks/kernels/gemv.py --ms 1,8             # other M values
    python benchmarks/kernels/gemv.py --sweep              # every candidate configuration, all shapes
    python benchmarks/kernels/gemv.py --sweep 6144x4096    # some shapes (NxK)
    python benchmarks/kernels/gemv.py --sweep 4096x12288 --act silu_mul
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from strata.kernels.gemv import GemvConfig, gemv_config, gemv_triton, gemv_workspace
from timing import copies_past_l2, parse_ints, parse_shapes, require_cuda, time_us

SHAPES = [  # (name, N, K)
    ("8B qkv", 6144, 4096), ("8B o_proj", 4096, 4096), ("8B gate_up", 24576, 4096), ("8B down", 4096, 12288),
    ("8B lm_head", 151936, 4096), ("30B qkv", 5120, 2048), ("30B o_proj", 2048, 4096),
    ("30B lm_head", 151936, 2048),
]
SILU_SHAPES = [("8B down+silu", 4096, 12288)]
MS = (1, 2, 4, 8, 16)


def weight_copies(n: int, k: int, device, dtype) -> list[torch.Tensor]:
    """Enough copies that cycling through them reads HBM, not L2 (≥ 4, ≥ 3x the L2 size in all)."""
    return [torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5 for _ in range(copies_past_l2(n * k * 2))]


def _time_pair(n: int, k: int, m: int, weights, silu_mul: bool, runs: int, config=None, with_ref=True):
    device, dtype = weights[0].device, weights[0].dtype
    x = torch.randn(m, 2 * k if silu_mul else k, device=device, dtype=dtype)
    act = "silu_mul" if silu_mul else None
    ws = gemv_workspace(n, k, device, config)

    def ref(w):
        h = F.silu(x[:, :k]) * x[:, k:] if silu_mul else x
        return F.linear(h, w)

    ours = [lambda w=w: gemv_triton(x, w, act=act, workspace=ws, config=config) for w in weights]
    theirs = [lambda w=w: ref(w) for w in weights]
    expect = ref(weights[0]).float()
    err = ((ours[0]().float() - expect).abs().max() / expect.abs().max()).item()
    return time_us(ours, runs), time_us(theirs, runs) if with_ref else float("nan"), err


def bench_gemv(device="cuda", ms=MS, shapes=None, runs: int = 100, dtype=torch.bfloat16) -> list[dict]:
    """Prints (and returns) gemv_triton against F.linear (cuBLAS) per shape and M: µs, TB/s of weight
    bytes, speed-up, and the relative error against F.linear. `shapes`: (name, N, K, silu_mul)."""
    if shapes is None:
        shapes = [(name, n, k, False) for name, n, k in SHAPES]
        shapes += [(name, n, k, True) for name, n, k in SILU_SHAPES]
    rows = []
    print(f"{'shape':>14} {'N x K':>14} {'M':>3} | {'triton us':>9} {'TB/s':>5} | {'cuBLAS us':>9} {'TB/s':>5} | "
          f"{'speedup':>7} {'rel err':>8} | config", flush=True)
    for name, n, k, silu_mul in shapes:
        weights = weight_copies(n, k, device, dtype)
        for m in ms:
            t_ours, t_ref, err = _time_pair(n, k, m, weights, silu_mul, runs)
            tb = n * k * 2 / 1e6
            row = dict(shape=name, n=n, k=k, m=m, triton_us=t_ours, cublas_us=t_ref, triton_tbs=tb / t_ours,
                       cublas_tbs=tb / t_ref, speedup=t_ref / t_ours, rel_err=err, config=gemv_config(n, k))
            rows.append(row)
            print(f"{name:>14} {f'{n}x{k}':>14} {m:>3} | {t_ours:9.2f} {row['triton_tbs']:5.2f} | {t_ref:9.2f} "
                  f"{row['cublas_tbs']:5.2f} | {row['speedup']:7.3f} {err:8.1e} | {row['config']}, "
                  f"{row['config'].programs(n)} programs", flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


def sweep_candidates(n: int, k: int) -> list[GemvConfig]:
    """Configurations worth timing for (N, K): 100-2400 programs, ≥ 2 K blocks per program, and
    16-113 KB of pipeline buffers (so ≥ 2 programs fit an SM, the rule the table follows)."""
    out = []
    for block_n in (32, 64, 128):
        for block_k in (64, 128, 256):
            if k % block_k:
                continue
            for split in (1, 2, 4, 8):
                programs = -(-n // block_n) * split
                if split > (k // block_k) // 2 or not 100 <= programs <= 2400:
                    continue
                for stages in (3, 4, 5, 6):
                    cfg = GemvConfig(block_n, block_k, split, 4, stages)
                    if 16 << 10 <= cfg.smem_bytes() <= 113 << 10:
                        out.append(cfg)
    return out


def sweep_gemv(device="cuda", shapes=None, ms=(1, 4, 8), runs: int = 50, act: str | None = None,
               dtype=torch.bfloat16) -> dict[tuple[int, int], GemvConfig]:
    """Times every candidate configuration per shape (mean µs over `ms`), prints the five best and a
    GEMV_CONFIGS line per shape to paste. Each candidate compiles once (~1 s)."""
    shapes = [(n, k) for _, n, k in SHAPES] if shapes is None else shapes
    best = {}
    for n, k in shapes:
        weights = weight_copies(n, k, device, dtype)
        results = []
        for cfg in sweep_candidates(n, k):
            try:
                times = [_time_pair(n, k, m, weights, act == "silu_mul", runs, cfg, with_ref=False)[0] for m in ms]
            except Exception as exc:  # out of shared memory or registers: skip the candidate
                print(f"  {n}x{k} {cfg}: {type(exc).__name__}", file=sys.stderr)
                continue
            results.append((statistics.mean(times), times, cfg))
        results.sort(key=lambda r: r[0])
        cur = gemv_config(n, k)
        cur_t = [_time_pair(n, k, m, weights, act == "silu_mul", runs, with_ref=False)[0] for m in ms]
        print(f"{n}x{k}{' silu_mul' if act else ''}: current {cur} {statistics.mean(cur_t):.2f} us "
              f"({n * k * 2 / 1e6 / statistics.mean(cur_t):.2f} TB/s)")
        for mean_t, times, cfg in results[:5]:
            print(f"   {mean_t:8.2f} us {n * k * 2 / 1e6 / mean_t:5.2f} TB/s  per M {[round(t, 2) for t in times]}  {cfg}")
        if results:
            c = results[0][2]
            best[(n, k)] = c
            print(f"    ({n}, {k}): GemvConfig({c.block_n}, {c.block_k}, split_k={c.split_k}, "
                  f"num_warps={c.num_warps}, num_stages={c.num_stages}),", flush=True)
        del weights
        torch.cuda.empty_cache()
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="gemv_triton against cuBLAS on the GPU, or its configuration sweep")
    parser.add_argument("--sweep", nargs="*", metavar="NxK", help="sweep configurations (all shapes if none given)")
    parser.add_argument("--act", choices=["silu_mul"], help="sweep with the SwiGLU prologue")
    parser.add_argument("--ms", default=None, help="comma-separated M values")
    parser.add_argument("--runs", type=int, default=None, help="timed calls per measurement")
    args = parser.parse_args(argv)
    require_cuda()
    ms = parse_ints(args.ms)
    if args.sweep is None:
        bench_gemv(ms=ms or MS, runs=args.runs or 100)
    else:
        sweep_gemv(shapes=parse_shapes(args.sweep), ms=ms or (1, 4, 8), act=args.act, runs=args.runs or 50)


if __name__ == "__main__":
    main()
