"""MoE routing kernels (`strata.kernels.moe_routing`, `strata.kernels.moe_sort`) against the torch
paths they replace: the fused decode router, `route` on given logits, and the token sort; with --sweep,
the fused router's configurations per shape (what `router_decode_config` should pick). Needs a CUDA
device.

    python benchmarks/kernels/moe_routing.py               # the table
    python benchmarks/kernels/moe_routing.py --sweep       # router configurations at T = 1 and 8
"""

from __future__ import annotations

import argparse

import torch

from strata.kernels.moe_routing import (
    DECODE_BLOCK_T,
    RouterDecodeConfig,
    route_ref,
    route_triton,
    router_decode_config,
    router_decode_ref,
    router_decode_triton,
    router_decode_workspace,
)
from strata.kernels.moe_sort import SortConfig, sort_tokens_ref, sort_tokens_triton, sort_tokens_workspace
from timing import require_cuda, time_us

ROUTERS = {  # name: (E, H, settings)
    "qwen3-30b-a3b": (128, 2048, dict(scoring="softmax", top_k=8, norm_topk_prob=True)),
    "E160 g8 sigmoid": (160, 4096, dict(scoring="sigmoid", top_k=8, norm_topk_prob=True, n_group=8, topk_group=4,
                                        scale=2.5)),
    "qwen3-next-80b-a3b": (512, 2048, dict(scoring="softmax", top_k=10, norm_topk_prob=True)),
}
ROUTER_TOKENS = (1, 4, 16)
ROUTE_TOKENS = (512, 4096)  # scoring + top-k alone, on given logits (the path of T > 16)
SORT_TOKENS = (512, 4096)


def _row(op: str, shape: str, t: int, ours: list, theirs: list, runs: int, check) -> dict:
    t_ours, t_theirs = time_us(ours, runs), time_us(theirs, runs)
    equal = check(ours[0](), theirs[0]())
    print(f"{op:>7} {shape:>18} {t:>5} | {t_ours:9.2f} {t_theirs:9.2f} {t_theirs / t_ours:7.2f} | {equal}", flush=True)
    return dict(op=op, shape=shape, t=t, kernel_us=t_ours, torch_us=t_theirs, equal=equal)


def bench_routing(device="cuda", runs: int = 100, dtype=torch.bfloat16) -> list[dict]:
    """Prints (and returns) µs per call of: the fused router against the torch router (x.float(),
    F.linear, scoring, top-k: `Router.forward` before the kernels) at T = 1, 4, 16; `route` against the
    torch scoring on given logits at large T; `sort_tokens` against argsort + searchsorted. `equal`:
    ids (router, route) or order and offs (sort) equal to the torch path's (route at T = 4096: a near
    tie may differ)."""
    gen = torch.Generator(device=device).manual_seed(0)
    same_ids = lambda a, b: bool(torch.equal(a[1], b[1]))  # noqa: E731
    rows = []
    print(f"{'op':>7} {'shape':>18} {'T':>5} | {'kernel us':>9} {'torch us':>9} {'speedup':>7} | equal")
    for name, (e, h, settings) in ROUTERS.items():
        weight = torch.randn(e, h, device=device, generator=gen) * h ** -0.5
        if settings["scoring"] == "sigmoid":
            settings = dict(settings, bias=torch.randn(e, device=device, generator=gen) * 0.1)
        ws = router_decode_workspace(device)
        for t in ROUTER_TOKENS:
            xs = [torch.randn(t, h, device=device, generator=gen).to(dtype) for _ in range(8)]
            rows.append(_row("router", name, t,
                             [lambda x=x: router_decode_triton(x, weight, workspace=ws, **settings) for x in xs],
                             [lambda x=x: router_decode_ref(x, weight, **settings) for x in xs], runs, same_ids))
        for t in ROUTE_TOKENS:
            logits = [torch.randn(t, e, device=device, generator=gen) for _ in range(4)]
            rows.append(_row("route", name, t, [lambda v=v: route_triton(v, **settings) for v in logits],
                             [lambda v=v: route_ref(v, **settings) for v in logits], runs, same_ids))
    ws = sort_tokens_workspace(device)
    for e, k in ((128, 8), (160, 8)):
        for t in SORT_TOKENS:
            idss = [torch.rand(t, e, device=device, generator=gen).topk(k, dim=-1)[1] for _ in range(8)]
            rows.append(_row("sort", f"E {e}, k {k}", t,
                             [lambda i=i: sort_tokens_triton(i, e, workspace=ws) for i in idss],
                             [lambda i=i: sort_tokens_ref(i, e) for i in idss], runs,
                             lambda a, b: bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))))
    configs = {n: router_decode_config(e, h) for n, (e, h, _) in ROUTERS.items()}
    print(f"router configs: {configs}; sort: {SortConfig()}")
    return rows


def sweep_router_configs(device="cuda", runs: int = 100, dtype=torch.bfloat16, t: int = 1,
                         shapes=("qwen3-30b-a3b", "qwen3-next-80b-a3b")) -> list[dict]:
    """µs per fused-router call at T tokens over experts per program, H per step and warps, for each
    `ROUTERS` shape, best first: what `router_decode_config` should pick (the routing tail, run by the
    last program with the kernel's warps, may want fewer warps than the logits)."""
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name in shapes:
        e, h, settings = ROUTERS[name]
        weight = torch.randn(e, h, device=device, generator=gen) * h ** -0.5
        if settings["scoring"] == "sigmoid":
            settings = dict(settings, bias=torch.randn(e, device=device, generator=gen) * 0.1)
        ws = router_decode_workspace(device)
        xs = [torch.randn(t, h, device=device, generator=gen).to(dtype) for _ in range(8)]
        default = router_decode_config(e, h)
        configs = [RouterDecodeConfig(be, bh, w) for be in (1, 2) for bh in (256, 512, 1024) for w in (1, 2, 4)
                   if DECODE_BLOCK_T * be * bh // (32 * w) <= 128]  # the product tile: ≤ 128 fp32 a thread
        timed = []
        for cfg in configs + [default] * (default not in configs):
            us = time_us([lambda x=x, c=cfg: router_decode_triton(x, weight, workspace=ws, config=c, **settings)
                          for x in xs], runs)
            timed.append(dict(shape=name, t=t, config=cfg, us=us))
        timed.sort(key=lambda r: r["us"])
        for r in timed[:6]:
            print(f"{name:>18} T={t} {r['us']:7.2f} us  {r['config']}{'  (default)' if r['config'] == default else ''}")
        print(f"{name:>18} T={t} default {next(r['us'] for r in timed if r['config'] == default):7.2f} us  {default}",
              flush=True)
        rows += timed
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="MoE routing and token sort kernels against torch on the GPU")
    parser.add_argument("--sweep", action="store_true", help="time the fused router's configurations")
    parser.add_argument("--tokens", default="1,8", help="with --sweep: comma-separated token counts")
    parser.add_argument("--runs", type=int, default=100, help="timed calls per measurement")
    args = parser.parse_args(argv)
    require_cuda()
    if args.sweep:
        for tokens in (int(v) for v in args.tokens.split(",")):
            sweep_router_configs(t=tokens, runs=args.runs)
    else:
        bench_routing(runs=args.runs)


if __name__ == "__main__":
    main()
