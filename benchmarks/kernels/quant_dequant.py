"""Whole-weight dequantization (`strata.kernels.quant.dequant.dequantize_into`, bf16) per format and
shape, and the fused quantized GEMM against dequantize_into + torch.mm into preallocated buffers at
read sizes (the choice the buffer path makes); with --sweep, dequantize_into's tile configurations
(the source of `dequant.CONFIGS`). Needs a CUDA device.

    python benchmarks/kernels/quant_dequant.py                 # Q8_0, Q4_K, IQ3_S, Q6_K; M = 512, 2048, 4096
    python benchmarks/kernels/quant_dequant.py --formats Q4_K --ms 4096
    python benchmarks/kernels/quant_dequant.py --sweep
"""

from __future__ import annotations

import argparse

import torch

from strata.kernels.quant import format_module, random_blocks
from strata.kernels.quant.dequant import CONFIGS, MIN_BLOCK_K, DequantConfig, dequantize_into, dequantize_into_triton
from timing import copies_past_l2, parse_ints, parse_shapes, require_cuda, time_us

SHAPES = ((6144, 4096), (24576, 4096), (4096, 12288))
FORMATS = ("Q8_0", "Q4_K", "IQ3_S", "Q6_K")


def read_bytes(planes: dict[str, torch.Tensor]) -> int:
    """Bytes of the planes a kernel reads (not IQ3_S's GEMV workspace)."""
    return sum(t.numel() * t.element_size() for name, t in planes.items() if name != "workspace")


def _plane_copies(ggml_type: str, n: int, k: int, generator: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Random weights (>= 2, >= 3x the L2 in all), so that cycling over them reads HBM, not L2."""
    mod = format_module(ggml_type)
    first = mod.repack(random_blocks(ggml_type, n, k, generator, "cuda"))
    count = copies_past_l2(read_bytes(first), least=2)
    return [first] + [mod.repack(random_blocks(ggml_type, n, k, generator, "cuda")) for _ in range(count - 1)]


def bench(shapes=SHAPES, formats=FORMATS, ms=(512, 2048, 4096)) -> list[dict]:
    """Per format and shape: dequantize_into (bf16) in µs and GB/s of quantized bytes read + bf16
    bytes written; then per M the fused GEMM (`format_module(t).matmul`) against dequantize_into +
    torch.mm into preallocated buffers, in µs and TFLOP/s (fused / dq+mm > 1: the buffer path wins)."""
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    print(f"{'format':>6} {'N x K':>11} | {'dequant us':>10} {'GB/s':>6} | {'M':>5} | {'fused us':>9} {'TFLOP/s':>7} | "
          f"{'dq+mm us':>9} {'TFLOP/s':>7} | {'fused/dq+mm':>11}", flush=True)
    for t in formats:
        mod = format_module(t)
        for n, k in shapes:
            copies = _plane_copies(t, n, k, gen)
            buf = torch.empty(n * k, dtype=torch.bfloat16, device="cuda")
            t_dq = time_us([lambda p=p: dequantize_into(t, p, n, k, buf) for p in copies])
            gbs = (read_bytes(copies[0]) + 2 * n * k) / t_dq / 1e3
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                t_fused = time_us([lambda p=p: mod.matmul(x, p, n, k, y) for p in copies])
                t_mm = time_us([lambda p=p: torch.mm(x, dequantize_into(t, p, n, k, buf).t(), out=y) for p in copies])
                flop = 2 * m * n * k / 1e6
                rows.append({"format": t, "n": n, "k": k, "m": m, "dequant_us": t_dq, "dequant_gbs": gbs,
                             "fused_us": t_fused, "dq_mm_us": t_mm})
                print(f"{t:>6} {f'{n}x{k}':>11} | {t_dq:10.1f} {gbs:6.0f} | {m:>5} | {t_fused:9.1f} "
                      f"{flop / t_fused:7.1f} | {t_mm:9.1f} {flop / t_mm:7.1f} | {t_fused / t_mm:11.2f}", flush=True)
            del copies, buf
            torch.cuda.empty_cache()
    return rows


def sweep(shapes=SHAPES, formats=FORMATS) -> None:
    """Times tile configurations of dequantize_into (bf16) per format and shape; prints the best four."""
    gen = torch.Generator("cuda").manual_seed(0)
    for t in formats:
        for n, k in shapes:
            copies = _plane_copies(t, n, k, gen)
            buf = torch.empty(n * k, dtype=torch.bfloat16, device="cuda")
            moved = read_bytes(copies[0]) + 2 * n * k
            results = []
            for block_n in (16, 32, 64, 128):
                for block_k in (128, 256, 512):
                    for warps in (4, 8):
                        cfg = DequantConfig(block_n, block_k, warps)
                        if block_k < MIN_BLOCK_K[t] or block_n * block_k // (32 * warps) > 256:
                            continue
                        us = time_us([lambda p=p: dequantize_into_triton(t, p, n, k, buf, config=cfg)
                                      for p in copies], runs=30)
                        results.append((us, cfg))
            results.sort(key=lambda r: r[0])
            print(f"{t} {n}x{k}: default {CONFIGS[t]}", flush=True)
            for us, cfg in results[:4]:
                print(f"   {us:8.1f} us {moved / us / 1e3:6.0f} GB/s  {cfg}", flush=True)
            del copies, buf
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="dequantize_into and dequantize + mm against the fused GEMMs on the GPU")
    parser.add_argument("--sweep", action="store_true", help="time dequantize_into's tile configurations")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated formats")
    parser.add_argument("--ms", default=None, help="comma-separated M values")
    parser.add_argument("--shapes", nargs="*", metavar="NxK", help="weight shapes")
    args = parser.parse_args(argv)
    require_cuda()
    formats = tuple(args.formats.split(","))
    shapes = parse_shapes(args.shapes) or SHAPES
    if args.sweep:
        sweep(shapes, formats)
    else:
        bench(shapes, formats, parse_ints(args.ms) or (512, 2048, 4096))


if __name__ == "__main__":
    main()
