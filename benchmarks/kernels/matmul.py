"""The batch-invariant dense GEMM (`strata.kernels.matmul.matmul_invariant`) against cuBLAS and the
bf16 decode GEMV, each configuration's rows checked bitwise against the same rows computed alone;
with --sweep, every candidate configuration too (the source of `invariant_config`'s tiles). Needs a
CUDA device.

    python benchmarks/kernels/matmul.py                    # Qwen3-8B shapes, M = 1 ... 8192
    python benchmarks/kernels/matmul.py --ms 1,8 --shapes 6144x4096
    python benchmarks/kernels/matmul.py --sweep            # also time every candidate configuration
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from strata.kernels.gemv import gemv_supported, gemv_triton, gemv_workspace
from strata.kernels.matmul import (
    DECODE_MAX_M,
    INVARIANT_FALLBACK,
    MatmulConfig,
    invariant_config,
    invariant_split_k,
    matmul_triton,
)
from strata.kernels.splitk import split_k_numel
from timing import parse_ints, require_cuda, time_us

SHAPES = [  # (name, N, K), Qwen3-8B
    ("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288),
    ("lm_head", 151936, 4096),
]
MS = (1, 8, 32, 512, 2048, 8192)


def _weight_copies(n: int, k: int, m: int, device) -> list[torch.Tensor]:
    """At decode sizes enough copies that cycling through them reads HBM, not L2; one at large M,
    where the product is compute bound and the weight is read from L2 anyway."""
    count = min(64, max(4, math.ceil(3 * (60 << 20) / (n * k * 2)))) if m <= 2 * DECODE_MAX_M else 1
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5 for _ in range(count)]


def _rate(m: int, n: int, k: int, us: float) -> str:
    """TB/s of weight bytes at decode sizes, TFLOP/s above."""
    if m <= 2 * DECODE_MAX_M:
        return f"{n * k * 2 / us / 1e6:5.2f}TB/s"
    return f"{2 * m * n * k / us / 1e6:5.0f}TF/s"


def sweep_candidates(m: int, n: int, k: int) -> list[MatmulConfig]:
    """Decode: tiles × stages × split ranges. Longer: tiles × stages, without ranges and with the
    weight's own (`invariant_split_k`), which shows what walking the ranges costs a read."""
    if m <= DECODE_MAX_M:
        out = [MatmulConfig(64, bn, 64, 4, st, split_k=sk)
               for bn in (16, 32, 64, 128) for st in (3, 4, 6, 8) for sk in (1, 2, 4, 8)]
    else:
        shapes = [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 4), (128, 128, 8), (128, 256, 8), (256, 128, 8)]
        out = [MatmulConfig(bm, bn, 64, w, st, split_k=sk) for bm, bn, w in shapes for st in (3, 4)
               for sk in sorted({1, invariant_split_k(n, k)})]
    return [c for c in out if c.smem_bytes() <= 220 << 10] + [INVARIANT_FALLBACK]


def make_cancelling(x: torch.Tensor, weight: torch.Tensor) -> None:
    """In place: weight's second half of K repeats its first half and x's even rows negate theirs
    there, so those rows' exact products are 0 and what comes out is the residue of the fp32 roundings
    on the way: any difference in the order or rounding of the sums shows."""
    half = x.shape[1] // 2
    weight[:, half:2 * half] = weight[:, :half]
    x[0::2, half:2 * half] = -x[0::2, :half]


def _check_input(m: int, k: int, device) -> torch.Tensor:
    """x for the invariance check: exponents spread over 2^±12 (so that partial sums round)."""
    x = torch.randn(m, k, device=device) * torch.exp2(torch.randint(-12, 13, (m, k), device=device).float())
    return x.to(torch.bfloat16)


def _rows_to_check(m: int) -> list[int]:
    """Every row of a decode-sized launch, else 32 rows spread over it (even ones cancel)."""
    return list(range(m)) if m <= DECODE_MAX_M else sorted({*range(0, m, max(1, m // 32)), m - 1})


def sweep_matmul(shapes=None, ms=MS, runs: int = 30, candidates: bool = True, device="cuda") -> list[dict]:
    """Per shape and M: cuBLAS (torch.matmul), the bf16 GEMV (M ≤ 16), the current configuration and
    (with `candidates`) every candidate, each with its rows checked bitwise against the same rows
    computed alone (M = 1, current configuration; `make_cancelling` inputs). Prints the table and
    returns its rows: per cell the current configuration and the three fastest candidates."""
    shapes = SHAPES if shapes is None else shapes
    results = []
    print(f"{'shape':>8} {'M':>5} | {'cuBLAS us':>9} {'gemv us':>8} | {'config':<44} {'us':>9} {'rate':>10} "
          f"{'vs cuBLAS':>9} {'vs gemv':>7} | rows = M=1", flush=True)
    for name, n, k in shapes:
        for m in ms:
            weights = _weight_copies(n, k, m, device)
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            x_check = _check_input(m, k, device)
            make_cancelling(x_check, weights[0])
            current = invariant_config(m, n, k)
            alone = {i: matmul_triton(x_check[i:i + 1], weights[0])[0] for i in _rows_to_check(m)}
            t_cublas = time_us([lambda w=w: torch.matmul(x, w.t()) for w in weights], runs)
            t_gemv = float("nan")
            if gemv_supported(m, n, k, x.dtype):
                ws = gemv_workspace(n, k, device)
                t_gemv = time_us([lambda w=w: gemv_triton(x, w, workspace=ws) for w in weights], runs)
            todo = [("current", current)]
            if candidates:
                todo += [("", c) for c in sweep_candidates(m, n, k) if c != current]
            timed = []
            for label, cfg in todo:
                try:
                    ws = torch.zeros(split_k_numel(n, cfg.block_n, cfg.split_k, cfg.block_m), dtype=torch.int32,
                                     device=device)
                    got = matmul_triton(x_check, weights[0], config=cfg, workspace=ws)
                    t = time_us([lambda w=w, c=cfg: matmul_triton(x, w, config=c, workspace=ws) for w in weights], runs)
                except Exception as exc:  # out of shared memory or registers: skip the candidate
                    print(f"  {name} M={m} {cfg}: {type(exc).__name__}", file=sys.stderr)
                    continue
                same = all(torch.equal(got[i], row) for i, row in alone.items())
                timed.append((t, label, cfg, same))
            best = sorted(timed, key=lambda r: r[0])[:3]
            shown = [r for r in timed if r[1] == "current"] + [r for r in best if r[1] != "current"]
            for t, label, cfg, same in shown:
                row = dict(shape=name, n=n, k=k, m=m, cublas_us=t_cublas, gemv_us=t_gemv, config=cfg, us=t,
                           current=label == "current", invariant=same)
                results.append(row)
                desc = (f"{'*' if label else ' '}{cfg.block_m}x{cfg.block_n}x{cfg.block_k} "
                        f"w{cfg.num_warps} s{cfg.num_stages} k{cfg.split_k}")
                desc += " (fallback)" if cfg == INVARIANT_FALLBACK else ""
                print(f"{name:>8} {m:>5} | {t_cublas:9.2f} {t_gemv:8.2f} | {desc:<44} {t:9.2f} {_rate(m, n, k, t):>10} "
                      f"{t_cublas / t:9.3f} {t_gemv / t:7.3f} | {'same' if same else 'DIFFERS'}", flush=True)
            del weights, x
            torch.cuda.empty_cache()
    print("* = the current invariant_config; 'vs' columns are speed-ups (> 1: faster than that path)")
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="matmul_invariant against cuBLAS and the bf16 GEMV on the GPU")
    parser.add_argument("--sweep", action="store_true", help="also time every candidate configuration")
    parser.add_argument("--ms", default=None, help="comma-separated M values")
    parser.add_argument("--shapes", nargs="*", metavar="NxK", help="weight shapes (default: Qwen3-8B's)")
    parser.add_argument("--runs", type=int, default=30, help="timed calls per measurement")
    args = parser.parse_args(argv)
    require_cuda()
    shapes = [(s, *(int(v) for v in s.lower().split("x"))) for s in args.shapes] if args.shapes else None
    sweep_matmul(shapes, parse_ints(args.ms) or MS, runs=args.runs, candidates=args.sweep)


if __name__ == "__main__":
    main()
