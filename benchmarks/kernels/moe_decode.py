"""The fused bf16 MoE decode kernels (`strata.kernels.moe_decode`: gate|up + SwiGLU, then down +
combine) against `MoE._grouped` (sort, gather, two grouped GEMMs, scatter) at the Qwen3-30B-A3B
layer shape. Needs a CUDA device. (Quantized experts: benchmarks/kernels/quant_moe.py.)

    python benchmarks/kernels/moe_decode.py                # T = 1, 2, 4, 8, 16
    python benchmarks/kernels/moe_decode.py --tokens 1,8
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from strata.kernels.moe_decode import (
    MoeDecodeConfig,
    _launch_down_combine,
    _launch_gate_up,
    moe_decode_config,
    moe_experts_decode_ref,
    moe_experts_decode_triton,
)
from timing import parse_ints, require_cuda, time_us

SHAPE_30B = dict(experts=128, top_k=8, hidden=2048, inter=768)  # Qwen3-30B-A3B
TOKENS = (1, 2, 4, 8, 16)


def bench_moe_decode(device="cuda", tokens=TOKENS, runs: int = 50, dtype=torch.bfloat16,
                     config: MoeDecodeConfig | None = None, routings: int = 8) -> list[dict]:
    """Prints (and returns) per T: kernel 1, kernel 2, both, and `MoE._grouped` on the same inputs
    (µs), the TB/s of distinct active expert bytes, and the max error / max |ref| against the
    reference. Each timed call uses the next of `routings` random routings, so the reads come
    from HBM: one copy of the 30B layer's weights (1.2 GB) is far larger than L2."""
    from strata.models.moe import MoE

    e, k, h, inter = (SHAPE_30B[n] for n in ("experts", "top_k", "hidden", "inter"))
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(e, 2 * inter, h, device=device, generator=gen) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, device=device, generator=gen) * inter ** -0.5).to(dtype)
    # What MoE._grouped reads:
    module = SimpleNamespace(num_experts=e, w13=w13, w2=w2, sort_ws=None, fp8=None, quant=None)
    cfg = config or moe_decode_config(h, inter)
    rows = []
    print(f"{'T':>3} | {'gate_up us':>10} {'down us':>8} {'both us':>8} {'TB/s':>5} | {'grouped us':>10} "
          f"{'TB/s':>5} | {'speedup':>7} {'rel err':>8} {'bitwise':>7}", flush=True)
    for t in tokens:
        x = torch.randn(t, h, device=device, generator=gen).to(dtype)
        routes = []
        for _ in range(routings):
            scores = torch.rand(t, e, device=device, generator=gen)
            w, ids = scores.softmax(-1).topk(k, dim=-1)
            routes.append((ids, (w / w.sum(-1, keepdim=True)).float()))
        act = torch.empty(t * k, inter, device=device, dtype=dtype)
        out = torch.empty(t, h, device=device, dtype=dtype)
        t_gate_up = time_us([lambda r=r: _launch_gate_up(x, r[0], w13, act, cfg) for r in routes], runs)
        t_down = time_us([lambda r=r: _launch_down_combine(act, r[0], r[1], w2, out, cfg) for r in routes], runs)
        t_both = time_us([lambda r=r: moe_experts_decode_triton(x, r[0], r[1], w13, w2, out, config=cfg)
                           for r in routes], runs)
        t_grouped = time_us([lambda r=r: MoE._grouped(module, x, r[1], r[0]) for r in routes], runs)
        ids, w = routes[0]
        got = moe_experts_decode_triton(x, ids, w, w13, w2, config=cfg)
        ref = moe_experts_decode_ref(x, ids, w, w13, w2)
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        distinct = int(torch.unique(ids).numel())  # bytes of distinct experts: what must come from HBM
        tb = distinct * 3 * inter * h * w13.element_size() / 1e6
        row = dict(t=t, gate_up_us=t_gate_up, down_us=t_down, both_us=t_both, grouped_us=t_grouped,
                   tbs=tb / t_both, grouped_tbs=tb / t_grouped, rel_err=err, bitwise=bool(torch.equal(got, ref)))
        rows.append(row)
        print(f"{t:>3} | {t_gate_up:10.2f} {t_down:8.2f} {t_both:8.2f} {row['tbs']:5.2f} | {t_grouped:10.2f} "
              f"{row['grouped_tbs']:5.2f} | {t_grouped / t_both:7.2f} {err:8.1e} {str(row['bitwise']):>7}", flush=True)
    print(f"config: {cfg}")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="fused bf16 MoE decode kernels against MoE._grouped on the GPU")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts (≤ 16)")
    parser.add_argument("--runs", type=int, default=50, help="timed calls per measurement")
    args = parser.parse_args(argv)
    require_cuda()
    bench_moe_decode(tokens=parse_ints(args.tokens) or TOKENS, runs=args.runs)


if __name__ == "__main__":
    main()
