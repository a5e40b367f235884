"""The formats' micro-benchmark (CUDA; `python -m strata.kernels.quant.<format>`): a format module's
`matmul` against bf16 torch.matmul of its dequantized weight, both cycling over copies of the weight
so every call reads HBM, not L2."""

from __future__ import annotations

import math
from types import ModuleType

import torch

from strata.kernels.timing import time_us

BENCH_SHAPES = [("8B qkv", 6144, 4096), ("8B o_proj", 4096, 4096), ("8B gate_up", 24576, 4096),
                ("8B down", 4096, 12288)]


def plane_bytes(planes: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in planes.values())


def weight_copies(mod: ModuleType, n: int, k: int) -> list[dict[str, torch.Tensor]]:
    """Enough repacked random weights (≥ 4, ≥ 3x the L2 in all) that cycling through them reads HBM."""
    first = mod.repack(torch.from_numpy(mod.random_raw(n, k, 0)).cuda())
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    count = max(4, math.ceil(3 * l2 / plane_bytes(first)))
    return [first] + [mod.repack(torch.from_numpy(mod.random_raw(n, k, seed)).cuda()) for seed in range(1, count)]


def bench_format(mod: ModuleType, ms=(1, 4096), shapes=BENCH_SHAPES) -> list[dict]:
    """Per shape and M: the format's µs, GB/s of its planes and TFLOP/s, the same for bf16 (its bytes),
    and the relative error against the fp32 product of the dequantized weight. Row keys are prefixed
    by the format's short name (`q4k_us`, `q6k_gbs`, ...)."""
    key = mod.GGML_TYPE.lower().replace("_", "")
    label = mod.GGML_TYPE.lower()
    rows = []
    print(f"{'shape':>12} {'N x K':>12} {'M':>5} | {label + ' us':>9} {'GB/s':>6} {'TFLOP/s':>7} | "
          f"{'bf16 us':>9} {'GB/s':>6} {'TFLOP/s':>7} | rel err", flush=True)
    for name, n, k in shapes:
        planes = weight_copies(mod, n, k)
        dense = [mod.dequantize(p, n, k).to(torch.bfloat16) for p in planes]
        qbytes = plane_bytes(planes[0])
        ws = torch.zeros(max(1, mod.gemv_workspace_numel(n, k)), dtype=torch.int32, device="cuda")
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            t_q = time_us([lambda p=p: mod.matmul(x, p, n, k, out, workspace=ws) for p in planes])
            t_d = time_us([lambda w=w: torch.matmul(x, w.t()) for w in dense])
            ref = torch.matmul(x.float(), dense[0].float().t())
            err = ((mod.matmul(x, planes[0], n, k, workspace=ws).float() - ref).norm() / ref.norm()).item()
            flops = 2 * m * n * k
            row = {"shape": name, "n": n, "k": k, "m": m, f"{key}_us": t_q, "bf16_us": t_d,
                   f"{key}_gbs": qbytes / t_q / 1e3, "bf16_gbs": n * k * 2 / t_d / 1e3,
                   f"{key}_tflops": flops / t_q / 1e6, "bf16_tflops": flops / t_d / 1e6, "rel_err": err}
            rows.append(row)
            print(f"{name:>12} {f'{n}x{k}':>12} {m:>5} | {t_q:9.2f} {row[key + '_gbs']:6.0f} "
                  f"{row[key + '_tflops']:7.1f} | {t_d:9.2f} {row['bf16_gbs']:6.0f} {row['bf16_tflops']:7.1f} | "
                  f"{err:.1e}", flush=True)
        del planes, dense
        torch.cuda.empty_cache()
    return rows
