"""The batch-invariant quantized GEMMs (`strata.kernels.quant.invariant.matmul_invariant_q`) against
the formats' own kernels (`QWeight.matmul`, not invariant) and cuBLAS on the dequantized bf16 weight,
per format, Qwen3-8B shape and M. Needs a CUDA device.

    python benchmarks/kernels/quant_invariant.py               # M = 1, 8, 64, 512, 2048, 8192
    python benchmarks/kernels/quant_invariant.py --ms 1,8,512,4096
"""

from __future__ import annotations

import argparse

import torch

from strata.kernels.quant import QWeight, random_blocks
from strata.kernels.quant.invariant import FORMATS, invariant_q_workspace_parts, matmul_invariant_q, q_config
from timing import parse_ints, require_cuda, time_us

SHAPES = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]
MS = (1, 8, 64, 512, 2048, 8192)


def random_qweight(ggml_type: str, n: int, k: int, seed: int, device) -> QWeight:
    """A random Q8_0 (scales ~2e-4) or FP8 (from N(0, 1/K) values) weight made on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if ggml_type == "FP8":
        dense = torch.randn(n, k, generator=gen, device=device) * k ** -0.5
        return QWeight.from_raw("FP8", dense, n, k)
    return QWeight.from_raw(ggml_type, random_blocks(ggml_type, n, k, gen, device), n, k)


def bench(shapes=SHAPES, ms=MS, runs: int = 30, formats=FORMATS) -> list[dict]:
    """Per format, shape and M: µs of the invariant kernel, of the format's own kernels
    (`QWeight.matmul`, not invariant) and of cuBLAS on the dequantized bf16 weight; prints the table."""
    rows = []
    print(f"{'fmt':>5} {'shape':>8} {'M':>5} | {'inv us':>8} {'own us':>8} {'cuBLAS':>8} | config", flush=True)
    for fmt in formats:
        for name, n, k in shapes:
            w = random_qweight(fmt, n, k, seed=n + k, device="cuda")
            dense = w.dequantize().to(torch.bfloat16)
            ws = torch.zeros(sum(invariant_q_workspace_parts(w)), dtype=torch.int32, device="cuda")
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                t_inv = time_us([lambda: matmul_invariant_q(x, w, out=out, workspace=ws)], runs)
                t_own = time_us([lambda: w.matmul(x, out)], runs)
                t_blas = time_us([lambda: torch.matmul(x, dense.t(), out=out)], runs)
                cfg = q_config(fmt, m, n, k, x.dtype, True)
                rows.append(dict(fmt=fmt, shape=name, n=n, k=k, m=m, inv_us=t_inv, own_us=t_own, cublas_us=t_blas,
                                 config=cfg))
                print(f"{fmt:>5} {name:>8} {m:>5} | {t_inv:8.2f} {t_own:8.2f} {t_blas:8.2f} | {cfg.block_m}x"
                      f"{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} k{cfg.split_k}", flush=True)
            del w, dense, ws
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="batch-invariant quantized GEMMs against the formats' kernels and cuBLAS")
    parser.add_argument("--ms", default=None, help="comma-separated M values")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated formats")
    parser.add_argument("--runs", type=int, default=30, help="timed calls per measurement")
    args = parser.parse_args(argv)
    require_cuda()
    bench(ms=parse_ints(args.ms) or MS, runs=args.runs, formats=tuple(args.formats.split(",")))


if __name__ == "__main__":
    main()
