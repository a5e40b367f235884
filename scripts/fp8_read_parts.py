"""Where an FP8 read's matmul time goes (CUDA), per Qwen3-8B projection at M tokens: bf16 cuBLAS, the
shipped path (`fp8.scaled_mm_matmul`: activations quantized per row by one kernel, then
`torch._scaled_mm` with row-wise scales), its two parts alone, and `_scaled_mm` with one scale per tensor
(cuBLASLt's FP8 GEMM) on the same operands: whether the row-wise GEMM or the activation pass is what keeps
FP8 reads at ~1.4x of bf16 (issue 10's goal: 1.5x). A development tool; `strata bench quant` owns the
published numbers.

    python scripts/fp8_read_parts.py [--m 4096]
"""

from __future__ import annotations

import argparse

import torch

from strata.kernels.activation import silu_mul_triton
from strata.kernels.quant import fp8, fp8_rows
from strata.kernels.timing import time_us

SHAPES = (("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=30)
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_read_parts times CUDA kernels")
    m, dev = opts.m, torch.device("cuda")
    print(f"M = {m}: us per call (TFLOP/s)", flush=True)
    totals, counts = {}, {}
    for name, n, k in SHAPES:
        w = torch.randn(n, k, device=dev) * k ** -0.5
        planes = fp8.repack(w)
        wb = w.to(torch.bfloat16)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        xq, xs = fp8.quantize_rows(x, 0)
        one = torch.ones((), device=dev, dtype=torch.float32)
        wt = planes["w"].t()
        calls = {
            "bf16 matmul": lambda: torch.matmul(x, wb.t()),
            "fp8 shipped": lambda: fp8.scaled_mm_matmul(x, planes, n, k),
            "  quantize rows": lambda: fp8.quantize_rows(x, 0),
            "  scaled_mm rowwise": lambda: torch._scaled_mm(xq, wt, scale_a=xs[:, None], scale_b=planes["scale"][None, :],
                                                            out_dtype=torch.bfloat16),
            "scaled_mm tensorwise": lambda: torch._scaled_mm(xq, wt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        }
        if name == "down":  # its input is SwiGLU's product: the fused path quantizes it from gate|up
            gate_up = torch.randn(m, 2 * k, device=dev, dtype=torch.bfloat16)
            calls["fp8 shipped"] = lambda: fp8.silu_mul_matmul(gate_up, planes, n, k)
            calls["  quantize rows"] = lambda: fp8_rows.silu_mul_quantize_rows_triton(gate_up, 0)
            calls["bf16 matmul"] = lambda: torch.matmul(silu_mul_triton(gate_up), wb.t())
            calls["fp8 two steps"] = lambda: fp8.scaled_mm_matmul(silu_mul_triton(gate_up), planes, n, k)
        flops = 2 * m * n * k
        cells = []
        for label, fn in calls.items():
            t = min(time_us([fn], opts.runs) for _ in range(3))
            totals[label] = totals.get(label, 0.0) + t
            counts[label] = counts.get(label, 0) + 1
            cells.append(f"{label} {t:8.1f} ({flops / t / 1e6:6.0f})")
        print(f"{name:8s} {n}x{k}: " + " | ".join(cells), flush=True)
        del w, planes, wb, x, xq
        torch.cuda.empty_cache()
    base = totals["bf16 matmul"]
    print("a layer's four: " + " | ".join(f"{label.strip()} {t:8.1f} us ({base / t:4.2f}x bf16)"
                                          for label, t in totals.items() if counts[label] == len(SHAPES)), flush=True)


if __name__ == "__main__":
    main()
