"""Split-K beyond 8 for the batch-1 dp4a GEMVs (CUDA), per GGUF format: every H200 sweep so far
(`python -m strata.kernels.quant.<format>_dp4a`, splits 1-8) had its best M = 1 configuration at split 8
for the latency-bound shapes (4096 x 4096, 6144 x 4096, 4096 x 12288), the edge of the grid it tried.

1. Kernels: per format and Qwen3-8B shape at M = 1, the shipped configuration against the same tile
   with 2x and 4x the split and against the other tile height, interleaved, weight copies cycled past L2,
   each checked against the shipped result (split-K changes the order of the partial sums: close, not equal).
2. Whole model (`--model`): batch-1 decode at 8B shapes with `dp4a.config_for`'s split rule as shipped and
   as given by --rules, interleaved in one process (as `strata bench quant` measures it).

    python scripts/dp4a_splits.py [--formats Q8_0,Q4_K,IQ3_S,Q6_K] [--model] [--rules 8,1,16;16,1,32]

A development tool: `strata bench quant` owns the published numbers.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from strata.kernels.quant import dp4a

SHAPES = dp4a.SWEEP_SHAPES


def format_calls(fmt: str):
    """(planes(n, k), gemv(x, planes, n, k, out, ws, cfg), shipped config(n, k)) of a format's dp4a GEMV."""
    if fmt == "Q8_0":
        from strata.kernels.quant import q8_0
        return (lambda n, k: q8_0.repack(torch.from_numpy(q8_0.random_raw(n, k, seed=n + k)).cuda()),
                lambda x, p, n, k, out, ws, cfg: dp4a.q8_gemv_dp4a(x, p["qs"], p["d"], out, workspace=ws, config=cfg),
                dp4a.gemv_config)
    if fmt == "Q4_K":
        from strata.kernels.quant import q4_k, q4_k_dp4a
        return (lambda n, k: q4_k.repack(torch.from_numpy(q4_k.random_raw(n, k, seed=n + k)).cuda()),
                lambda x, p, n, k, out, ws, cfg: q4_k_dp4a.q4k_gemv_dp4a(x, p, n, k, out, workspace=ws, config=cfg),
                q4_k_dp4a.gemv_config)
    if fmt == "IQ3_S":
        from strata.kernels.quant import iq3_s, iq3_s_dp4a
        grid = iq3_s.grid_table(torch.device("cuda"))
        return (lambda n, k: iq3_s.repack(torch.from_numpy(iq3_s.random_raw(n, k, seed=n + k)).cuda()),
                lambda x, p, n, k, out, ws, cfg: iq3_s_dp4a.iq3s_gemv_dp4a(x, p, grid, n, k, out, workspace=ws,
                                                                           config=cfg),
                iq3_s_dp4a.gemv_config)
    if fmt == "Q6_K":
        from strata.kernels.quant import q6_k, q6_k_dp4a
        return (lambda n, k: q6_k.repack(torch.from_numpy(q6_k.random_raw(n, k, seed=n + k)).cuda()),
                lambda x, p, n, k, out, ws, cfg: q6_k_dp4a.q6k_gemv_dp4a(x, p, n, k, out, workspace=ws, config=cfg),
                q6_k_dp4a.gemv_config)
    raise ValueError(f"no dp4a GEMV for {fmt}")


def candidates(shipped: dp4a.Dp4aConfig, k: int) -> list[dp4a.Dp4aConfig]:
    steps = k // shipped.block_k
    other_n = 64 if shipped.block_n == 128 else 128
    out = [shipped]
    for cfg in (replace(shipped, split_k=2 * shipped.split_k), replace(shipped, split_k=4 * shipped.split_k),
                replace(shipped, block_n=other_n), replace(shipped, block_n=other_n, split_k=2 * shipped.split_k)):
        if cfg.split_k <= steps and cfg not in out:
            out.append(cfg)
    return out


def time_kernels(fmt: str, runs: int = 40) -> None:
    from strata.kernels.timing import time_us

    make, gemv, shipped_of = format_calls(fmt)
    for n, k in SHAPES:
        planes = make(n, k)
        per_copy = sum(t.numel() * t.element_size() for t in planes.values())
        copies = [planes] + [{key: t.clone() for key, t in planes.items()} for _ in range(max(3, (240 << 20) // per_copy))]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        cfgs = candidates(shipped_of(n, k), k)
        spaces = {c: torch.zeros(max(1, dp4a.workspace_for(c, n)), dtype=torch.int32, device="cuda") for c in cfgs}
        ref = gemv(x, planes, n, k, None, spaces[cfgs[0]], cfgs[0]).float()
        times = {c: [] for c in cfgs}
        for _ in range(3):
            for c in cfgs:
                times[c].append(time_us([lambda p=p, c=c: gemv(x, p, n, k, out, spaces[c], c) for p in copies], runs))
        base = min(times[cfgs[0]])
        for c in cfgs:
            got = gemv(x, planes, n, k, None, spaces[c], c).float()
            err = ((got - ref).norm() / ref.norm()).item()
            t = min(times[c])
            tag = " (shipped)" if c == cfgs[0] else " " * 10
            print(f"{fmt:5s} {n}x{k} M=1 rows {c.block_n:3d} split {c.split_k:2d}{tag}: "
                  f"{t:7.2f} us {per_copy / t / 1e3:5.0f} GB/s  {base / t:4.2f}x  rel diff {err:.1e}", flush=True)
        del copies, planes
        torch.cuda.empty_cache()


def whole_model(formats: list[str], rules: list[tuple[int, int, int]], rounds: int = 2) -> None:
    import sys
    sys.path.insert(0, "scripts")
    from attn_tiles_ab import arm_args
    from strata.bench import quant

    args = arm_args("qwen3-8b")
    shipped = (dp4a.PROGRAMS_PER_SM, dp4a.MIN_STEPS_PER_SPLIT, dp4a.MAX_SPLIT)
    for fmt in formats:
        times = {r: [] for r in (shipped, *rules)}
        for _ in range(rounds):
            for rule in times:
                dp4a.PROGRAMS_PER_SM, dp4a.MIN_STEPS_PER_SPLIT, dp4a.MAX_SPLIT = rule
                try:
                    times[rule].append(quant._arm(args, fmt, torch.device("cuda"), torch.bfloat16, None)["decode_b1_tok_s"])
                finally:
                    dp4a.PROGRAMS_PER_SM, dp4a.MIN_STEPS_PER_SPLIT, dp4a.MAX_SPLIT = shipped
        line = " | ".join(",".join(map(str, r)) + ": " + " ".join(f"{v:.1f}" for v in vs)
                          + ("" if r == shipped else f" ({max(vs) / max(times[shipped]):.3f}x)") for r, vs in times.items())
        print(f"{fmt:6s} decode b1 tok/s (programs per SM, min steps, max split)  {line}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="Q8_0,Q4_K,IQ3_S,Q6_K")
    ap.add_argument("--model", action="store_true", help="also the whole-model A/B")
    ap.add_argument("--model-formats", default=None, help="formats of the whole-model A/B (default: --formats)")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--rules", default="8,1,16;16,1,32", help="programs per SM, min steps per split, max split; ...")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dp4a_splits times CUDA kernels")
    formats = opts.formats.split(",")
    if not opts.no_kernels:
        for fmt in formats:
            time_kernels(fmt)
    if opts.model:
        rules = [tuple(int(v) for v in r.split(",")) for r in opts.rules.split(";")]
        whole_model(opts.model_formats.split(",") if opts.model_formats else formats, rules)


if __name__ == "__main__":
    main()
