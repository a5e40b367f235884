"""The batch-invariant MoE kernels (`strata.kernels.moe_invariant`) at the Qwen3-30B-A3B shape, bf16:
each expert projection through `grouped_matmul_invariant` against `torch._grouped_mm`, and the
combine against `MoE._grouped`'s tail (weight, unsort, sum). Needs a CUDA device.

    python benchmarks/kernels/moe_invariant.py             # T = 1, 8, 64, 512, 2048, 8192
    python benchmarks/kernels/moe_invariant.py --tokens 1,512
"""

from __future__ import annotations

import argparse

import torch

from strata.kernels.moe_invariant import grouped_matmul_invariant, moe_combine_invariant
from strata.kernels.moe_sort import sort_tokens
from timing import parse_ints, require_cuda, time_us

SHAPE_30B = dict(experts=128, top_k=8, hidden=2048, inter=768)  # Qwen3-30B-A3B
TOKENS = (1, 8, 64, 512, 2048, 8192)


def bench(tokens=TOKENS, runs: int = 30, device="cuda") -> list[dict]:
    """µs per call at the 30B-A3B shape, bf16: each projection through `grouped_matmul_invariant` against
    `torch._grouped_mm`, and the combine against `MoE._grouped`'s tail (weight, unsort, `.sum(1)`)."""
    e, top_k, h, inter = (SHAPE_30B[key] for key in ("experts", "top_k", "hidden", "inter"))
    gen = torch.Generator(device=device).manual_seed(0)
    weights = {"gate_up": (torch.randn(e, 2 * inter, h, device=device, generator=gen) * h ** -0.5).bfloat16(),
               "down": (torch.randn(e, h, inter, device=device, generator=gen) * inter ** -0.5).bfloat16()}
    rows = []
    print(f"{'op':>8} {'T':>5} | {'invariant us':>12} {'torch us':>9} {'ratio':>6}", flush=True)
    for t in tokens:
        ids = torch.rand(t, e, device=device, generator=gen).topk(top_k, dim=-1).indices
        w = torch.rand(t, top_k, device=device, generator=gen)
        order, offs = sort_tokens(ids, e)
        timed = {}
        for name, stack in weights.items():
            xs = torch.randn(t * top_k, stack.shape[2], device=device, generator=gen).bfloat16()
            timed[name] = (time_us([lambda: grouped_matmul_invariant(xs, stack, offs)], runs),
                           time_us([lambda: torch._grouped_mm(xs, stack.transpose(1, 2), offs=offs)], runs))
        y = torch.randn(t * top_k, h, device=device, generator=gen).bfloat16()

        def grouped_tail():
            scaled = (y * w.reshape(-1)[order, None]).to(y.dtype)
            unsorted = torch.empty_like(scaled)
            unsorted[order] = scaled
            return unsorted.view(t, top_k, h).sum(1)

        timed["combine"] = (time_us([lambda: moe_combine_invariant(y, order, w)], runs), time_us([grouped_tail], runs))
        for name, (ours, theirs) in timed.items():
            print(f"{name:>8} {t:>5} | {ours:12.2f} {theirs:9.2f} {ours / theirs:6.2f}", flush=True)
            rows.append(dict(op=name, tokens=t, invariant_us=ours, torch_us=theirs))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="batch-invariant MoE kernels against torch on the GPU")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts")
    parser.add_argument("--runs", type=int, default=30, help="timed calls per measurement")
    args = parser.parse_args(argv)
    require_cuda()
    bench(parse_ints(args.tokens) or TOKENS, runs=args.runs)


if __name__ == "__main__":
    main()
