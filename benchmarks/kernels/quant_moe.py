"""Quantized MoE experts at the Qwen3-30B-A3B shape. Needs a CUDA device.

    python benchmarks/kernels/quant_moe.py                     # grouped GEMMs (`strata.kernels.quant.moe_q`)
    python benchmarks/kernels/quant_moe.py --formats Q8_0 --tokens 1,4096
    python benchmarks/kernels/quant_moe.py --decode            # fused decode kernels (`moe_decode_q`)

The grouped table: gate|up and down through `moe_q.grouped_matmul` against bf16 torch._grouped_mm of
the dequantized stacks. The decode table: both fused kernels (and each alone) against `MoE._grouped`
over the same stacks (sort, gather, two grouped GEMMs, SiLU·mul, weighting, scatter, sum). Timed calls
cycle over random routings, so the active experts' weights come from HBM.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from strata.kernels import moe_sort as k_sort
from strata.kernels.quant import format_module, random_blocks
from timing import parse_ints, require_cuda, time_us

SHAPE_30B = dict(experts=128, top_k=8, hidden=2048, inter=768)  # Qwen3-30B-A3B


def bench_grouped(formats=("Q8_0", "Q4_K", "IQ3_S"), tokens=(1, 16, 512, 4096), runs: int = 30) -> None:
    """gate|up and down at the 30B-A3B shape: µs, GB/s of the active experts' weight bytes, TFLOP/s,
    against bf16 `torch._grouped_mm` of the dequantized stacks; relative error vs the reference."""
    from strata.kernels.quant.moe_q import QExpertStack, grouped_matmul, grouped_matmul_ref

    e, top_k, h, inter = (SHAPE_30B[key] for key in ("experts", "top_k", "hidden", "inter"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'fmt':>6} {'proj':>7} {'T':>5} | {'ours us':>8} {'GB/s':>6} {'TFLOP/s':>7} | {'bf16 us':>8} {'GB/s':>6} | "
          f"{'rel err':>8}", flush=True)
    for fmt in formats:
        mod = format_module(fmt)
        for proj, n, k in (("gate_up", 2 * inter, h), ("down", h, inter)):
            stack = QExpertStack.from_raw(fmt, random_blocks(fmt, e * n, k, gen, "cuda").view(e, n, -1))
            w_bf16 = stack.dequantize().to(torch.bfloat16)
            for t in tokens:
                # Several routings, cycled: the active experts differ call to call, so weights come from HBM.
                cases = []
                for _ in range(8):
                    ids = torch.rand(t, e, device="cuda", generator=gen).topk(top_k, dim=-1).indices
                    xs = torch.randn(t * top_k, k, device="cuda", generator=gen).to(torch.bfloat16)
                    active = int((torch.bincount(ids.flatten(), minlength=e) > 0).sum())
                    cases.append((xs, k_sort.sort_tokens(ids, e)[1], active))
                ours = time_us([lambda c=c: grouped_matmul(c[0], stack, c[1]) for c in cases], runs)
                theirs = time_us([lambda c=c: torch._grouped_mm(c[0], w_bf16.transpose(1, 2), offs=c[1])
                                  for c in cases], runs)
                xs, offs, active = cases[0]
                ref = grouped_matmul_ref(xs, stack, offs).float()
                err = ((grouped_matmul(xs, stack, offs).float() - ref).norm() / ref.norm()).item()
                q_bytes = active * n * k // mod.BLOCK_VALUES * mod.BLOCK_BYTES
                flop = 2 * t * top_k * n * k / 1e6
                print(f"{fmt:>6} {proj:>7} {t:>5} | {ours:8.2f} {q_bytes / ours / 1e3:6.0f} {flop / ours:7.1f} | "
                      f"{theirs:8.2f} {active * n * k * 2 / theirs / 1e3:6.0f} | {err:8.1e}", flush=True)
            del stack, w_bf16
            torch.cuda.empty_cache()


def bench_decode(formats=None, tokens=(1, 4, 8, 16), runs: int = 50, routings: int = 8,
                 configs: dict[str, list] | None = None) -> list[dict]:
    """Per format and T at the Qwen3-30B-A3B shape: both kernels against the grouped path (`MoE._grouped`
    over the same stacks: sort, gather, two `moe_q` (FP8: `_scaled_grouped_mm`) launches, SiLU·mul,
    weighting, scatter, sum), µs, GB/s of the distinct active experts' bytes, relative error against
    the configuration's definition (`reference`). Each timed call takes the next of `routings` random
    routings, so weights come from HBM. `configs`: more `QMoeDecodeConfig`s to time per format (the
    first row is `decode_config`'s)."""
    from strata.kernels.moe_sort import sort_tokens_workspace
    from strata.kernels.quant import fp8
    from strata.kernels.quant.moe_decode_q import (
        FORMATS,
        Fp8Experts,
        _launch,
        decode_config,
        moe_decode_q_triton,
        reference,
    )
    from strata.kernels.quant.moe_q import QExpertStack
    from strata.models.moe import MoE

    e, k, h, inter = (SHAPE_30B[n] for n in ("experts", "top_k", "hidden", "inter"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'fmt':>6} {'T':>3} | {'fused us':>8} {'GB/s':>6} {'gate_up':>7} {'down':>7} | {'grouped us':>10} "
          f"{'GB/s':>6} | {'speedup':>7} {'rel err':>8} | config", flush=True)
    for fmt in formats or FORMATS:
        if fmt == "FP8":
            f13, f2 = (fp8.quantize_experts((torch.randn(e, n, kk, device="cuda", generator=gen) * 0.02).to(torch.bfloat16))
                       for n, kk in ((2 * inter, h), (h, inter)))
            w13, w2 = Fp8Experts(*f13), Fp8Experts(*f2)
            module = SimpleNamespace(num_experts=e, quant=None, fp8=(*f13, *f2), sort_ws=sort_tokens_workspace("cuda"))
            per_expert = sum(t.numel() * t.element_size() for t in (*f13, *f2)) / e
        else:
            w13 = QExpertStack.from_raw(fmt, random_blocks(fmt, e * 2 * inter, h, gen, "cuda").view(e, 2 * inter, -1))
            w2 = QExpertStack.from_raw(fmt, random_blocks(fmt, e * h, inter, gen, "cuda").view(e, h, -1))
            module = SimpleNamespace(num_experts=e, quant=(w13, w2), fp8=None, sort_ws=sort_tokens_workspace("cuda"))
            per_expert = (w13.nbytes + w2.nbytes) / e
        for cfg in [decode_config(fmt, h, inter), *((configs or {}).get(fmt, []))]:
            for t in tokens:
                x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
                routes = []
                for _ in range(routings):
                    w, ids = torch.rand(t, e, device="cuda", generator=gen).softmax(-1).topk(k, dim=-1)
                    routes.append((ids, (w / w.sum(-1, keepdim=True)).float()))
                out = torch.empty(t, h, device="cuda", dtype=torch.bfloat16)
                act = torch.empty(t * k, inter, device="cuda", dtype=torch.bfloat16)
                fused = time_us([lambda r=r: moe_decode_q_triton(x, r[0], r[1], w13, w2, out, config=cfg)
                                 for r in routes], runs)
                parts = [time_us([lambda r=r, p=p: _launch(x, r[0], r[1], w13, w2, act, out, cfg, p) for r in routes],
                                 runs) for p in ("gate_up", "down")]
                grouped = time_us([lambda r=r: MoE._grouped(module, x, r[1], r[0]) for r in routes], runs)
                ids, w = routes[0]
                got = moe_decode_q_triton(x, ids, w, w13, w2, config=cfg)
                ref = reference(x, ids, w, w13, w2, cfg)
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                gbytes = int(torch.unique(ids).numel()) * per_expert / 1e3
                row = dict(format=fmt, t=t, fused_us=fused, gate_up_us=parts[0], down_us=parts[1],
                           grouped_us=grouped, fused_gbs=gbytes / fused, grouped_gbs=gbytes / grouped, rel_err=err,
                           config=str(cfg))
                rows.append(row)
                print(f"{fmt:>6} {t:>3} | {fused:8.2f} {row['fused_gbs']:6.0f} {parts[0]:7.2f} {parts[1]:7.2f} | "
                      f"{grouped:10.2f} {row['grouped_gbs']:6.0f} | {grouped / fused:7.2f} {err:8.1e} | {cfg}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="quantized MoE expert kernels on the GPU (Qwen3-30B-A3B shape)")
    parser.add_argument("--decode", action="store_true", help="the fused decode kernels against MoE._grouped")
    parser.add_argument("--formats", default=None, help="comma-separated formats")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts")
    args = parser.parse_args(argv)
    require_cuda()
    formats = tuple(args.formats.split(",")) if args.formats else None
    tokens = parse_ints(args.tokens)
    if args.decode:
        bench_decode(formats, tokens or (1, 4, 8, 16))
    else:
        bench_grouped(formats or ("Q8_0", "Q4_K", "IQ3_S"), tokens or (1, 16, 512, 4096))


if __name__ == "__main__":
    main()
