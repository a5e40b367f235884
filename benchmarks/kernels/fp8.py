"""FP8 (e4m3) weights (`strata.kernels.quant.fp8`): the decode GEMV against the bf16 GEMV and
torch._scaled_mm, the sweep of its configurations (the source of `fp8.GEMV_CONFIGS`), and the per-row
activation quantization kernels (`strata.kernels.quant.fp8_rows`) against their torch forms. Needs a
CUDA device.

    python benchmarks/kernels/fp8.py                       # decode GEMV table, M = 1, 4, 8, 16
    python benchmarks/kernels/fp8.py --sweep [NxK ...]     # GEMV configurations
    python benchmarks/kernels/fp8.py --rows                # row quantization at a 4K read
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from strata.kernels import gemv as k_gemv
from strata.kernels.gemv import GemvConfig
from strata.kernels.quant import fp8
from timing import copies_past_l2, parse_ints, parse_shapes, require_cuda, time_us

SHAPES = [  # (name, N, K): the Qwen3 projections FP8 converts (not the LM head)
    ("8B qkv", 6144, 4096), ("8B o_proj", 4096, 4096), ("8B gate_up", 24576, 4096), ("8B down", 4096, 12288),
    ("30B qkv", 5120, 2048), ("30B o_proj", 2048, 4096),
]


def _planes_copies(n: int, k: int, device) -> list[dict[str, torch.Tensor]]:
    """Enough FP8 weights that cycling through them reads HBM, not L2 (>= 4, >= 3x the L2 size)."""
    return [fp8.repack(torch.randn(n, k, device=device) * k ** -0.5) for _ in range(copies_past_l2(n * k))]


def _bf16_copies(n: int, k: int, device, dtype) -> list[torch.Tensor]:
    return [torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5 for _ in range(copies_past_l2(n * k * 2))]


def bench_gemv(device="cuda", ms=(1, 4, 8, 16), shapes=None, runs: int = 100, dtype=torch.bfloat16) -> list[dict]:
    """Prints (and returns) per shape and M: the FP8 decode GEMV (µs, TB/s of its weight bytes), the
    bf16 GEMV on the same shape, torch._scaled_mm with per-token x (the path decode took before), the
    speed-ups over both, and the GEMV's relative error against `matmul_ref`."""
    rows = []
    print(f"{'shape':>12} {'N x K':>12} {'M':>3} | {'fp8 us':>7} {'TB/s':>5} | {'bf16 us':>7} {'x':>5} | "
          f"{'scaled_mm':>9} {'x':>5} | {'rel err':>8} | config", flush=True)
    for name, n, k in shapes or SHAPES:
        fp8_w, bf16_w = _planes_copies(n, k, device), _bf16_copies(n, k, device, dtype)
        cfg = fp8.gemv_config(n, k)
        ws = torch.zeros(max(1, fp8.gemv_workspace_numel(n, k)), dtype=torch.int32, device=device)
        ws16 = k_gemv.gemv_workspace(n, k, device)
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=dtype)
            t8 = time_us([lambda p=p: fp8.gemv(x, p, n, k, workspace=ws) for p in fp8_w], runs)
            t16 = time_us([lambda w=w: k_gemv.gemv_triton(x, w, workspace=ws16) for w in bf16_w], runs)
            tmm = time_us([lambda p=p: fp8.scaled_mm_matmul(x, p, n, k) for p in fp8_w], runs)
            ref = fp8.matmul_ref(x, fp8_w[0], n, k).float()
            err = ((fp8.gemv(x, fp8_w[0], n, k, workspace=ws).float() - ref).abs().max() / ref.abs().max()).item()
            row = dict(shape=name, n=n, k=k, m=m, fp8_us=t8, bf16_us=t16, scaled_mm_us=tmm, fp8_tbs=n * k / 1e6 / t8,
                       vs_bf16=t16 / t8, vs_scaled_mm=tmm / t8, rel_err=err, config=cfg)
            rows.append(row)
            print(f"{name:>12} {f'{n}x{k}':>12} {m:>3} | {t8:7.2f} {row['fp8_tbs']:5.2f} | {t16:7.2f} "
                  f"{row['vs_bf16']:5.2f} | {tmm:9.2f} {row['vs_scaled_mm']:5.2f} | {err:8.1e} | {cfg}", flush=True)
        del fp8_w, bf16_w
        torch.cuda.empty_cache()
    return rows


def sweep_candidates(n: int, k: int) -> list[GemvConfig]:
    """Configurations worth timing: wgmma-sized tiles, 100-2400 programs, >= 2 K blocks per program,
    and pipeline buffers (e4m3 tiles, x tiles and x's even/odd halves) of at most 113 KB."""
    out = []
    for block_n in (64, 128):
        for block_k in (128, 256, 512):
            for split in (1, 2, 4, 8):
                programs = -(-n // block_n) * split
                if k % block_k or k // block_k < 2 * split or not 100 <= programs <= 2400:
                    continue
                for stages in (3, 4, 5):
                    cfg = GemvConfig(block_n, block_k, split, 4, stages)
                    if cfg.smem_bytes(w_bytes=1) + 32 * block_k <= 113 << 10:
                        out.append(cfg)
    return out


def sweep_gemv(device="cuda", shapes=None, ms=(1, 4, 8), runs: int = 50) -> dict[tuple[int, int], GemvConfig]:
    """Times every candidate per shape (mean µs over `ms`), prints the five best and a GEMV_CONFIGS
    line per shape to paste."""
    best = {}
    for n, k in shapes or [(n, k) for _, n, k in SHAPES]:
        weights = _planes_copies(n, k, device)
        xs = {m: torch.randn(m, k, device=device, dtype=torch.bfloat16) for m in ms}

        def mean_us(cfg):
            ws = torch.zeros(max(1, k_gemv.gemv_workspace_numel(n, k, cfg)), dtype=torch.int32, device=device)
            return statistics.mean(time_us([lambda p=p, x=x: fp8.gemv(x, p, n, k, workspace=ws, config=cfg)
                                            for p in weights], runs) for x in xs.values())

        results = []
        for cfg in sweep_candidates(n, k):
            try:
                results.append((mean_us(cfg), cfg))
            except Exception as exc:  # out of shared memory or registers: skip the candidate
                print(f"  {n}x{k} {cfg}: {type(exc).__name__}", file=sys.stderr)
        results.sort(key=lambda r: r[0])
        print(f"{n}x{k}: current {fp8.gemv_config(n, k)} {mean_us(fp8.gemv_config(n, k)):.2f} us")
        for t, cfg in results[:5]:
            print(f"   {t:8.2f} us {n * k / 1e6 / t:5.2f} TB/s  {cfg}")
        if results:
            c = best[(n, k)] = results[0][1]
            print(f"    ({n}, {k}): GemvConfig({c.block_n}, {c.block_k}, split_k={c.split_k}, "
                  f"num_warps={c.num_warps}, num_stages={c.num_stages}),", flush=True)
        del weights
        torch.cuda.empty_cache()
    return best


def bench_rows(m: int = 4090, ks=(4096, 12288), inter: int = 12288, pad: int = 6, runs: int = 50) -> list[dict]:
    """A read's activations (M rows, `pad` padding rows) at the 8B shapes: `quantize_rows` against
    its torch form per K, and the fused silu·up quantization (`silu_mul_quantize_rows_triton`, the down
    projection's input, I = `inter`) against its two kernels and the torch form, in µs."""
    from strata.kernels.activation import silu_mul_triton
    from strata.kernels.quant.fp8_rows import (
        quantize_rows,
        quantize_rows_ref,
        quantize_rows_triton,
        silu_mul_quantize_rows_ref,
        silu_mul_quantize_rows_triton,
    )

    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    for k in ks:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        t_kernel = time_us([lambda: quantize_rows(x, pad)], runs)
        t_ref = time_us([lambda: quantize_rows_ref(x, pad)], runs)
        rows.append(dict(op="quantize_rows", m=m, k=k, kernel_us=t_kernel, torch_us=t_ref))
        print(f"fp8 row quantization {m}x{k}: kernel {t_kernel:.1f} us, torch {t_ref:.1f} us "
              f"({t_ref / t_kernel:.1f}x)", flush=True)
    gate_up = torch.randn(m, 2 * inter, device="cuda", generator=gen).to(torch.bfloat16)
    t_fused = time_us([lambda: silu_mul_quantize_rows_triton(gate_up, pad)], runs)
    t_two = time_us([lambda: quantize_rows_triton(silu_mul_triton(gate_up), pad)], runs)
    t_ref = time_us([lambda: silu_mul_quantize_rows_ref(gate_up, pad)], runs)
    rows.append(dict(op="silu_mul_quantize_rows", m=m, k=inter, kernel_us=t_fused, two_kernels_us=t_two,
                     torch_us=t_ref))
    print(f"silu*up fp8 quantization {m}x{inter}: fused {t_fused:.1f} us, two kernels {t_two:.1f} us "
          f"({t_two / t_fused:.2f}x), torch {t_ref:.1f} us", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="FP8 decode GEMV and row quantization timings on the GPU")
    parser.add_argument("--sweep", nargs="*", metavar="NxK", help="sweep GEMV configurations (all shapes if none)")
    parser.add_argument("--rows", action="store_true", help="time the per-row activation quantization kernels")
    parser.add_argument("--ms", default=None, help="comma-separated M values")
    args = parser.parse_args(argv)
    require_cuda()
    ms = parse_ints(args.ms)
    if args.rows:
        bench_rows()
    elif args.sweep is not None:
        sweep_gemv(shapes=parse_shapes(args.sweep), ms=ms or (1, 4, 8))
    else:
        bench_gemv(ms=ms or (1, 4, 8, 16))


if __name__ == "__main__":
    main()
