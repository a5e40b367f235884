"""The decode GEMVs on the SMs a concurrent read leaves them (issue 11): each Qwen3-8B decode product
timed alone under `strata.bench.sm_hold.SmHold` with its tuned configuration and with candidates,
and whether a candidate's output has the tuned configuration's bits (same split-K: the same sums in
the same order). A development tool: its findings go into `strata.kernels.plan` and the docs.

    python scripts/gemv_few_sms.py --held 0,104,112 [--out bench/results/gemv_few_sms_cuda.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from strata.bench.sm_hold import SmHold, events_seconds, num_sms, stream_gbs
from strata.kernels.gemv import GemvConfig, gemv_config, gemv_triton, gemv_workspace

SHAPES = {"qkv": (6144, 4096, None), "o_proj": (4096, 4096, None), "gate_up": (24576, 4096, None),
          "down+silu": (4096, 12288, "silu_mul"), "lm_head": (151936, 4096, None)}
SMEM_LIMIT = 220 << 10


def candidates(n: int, k: int) -> list[GemvConfig]:
    """The tuned configuration first, then tile widths, depths and splits around it."""
    base = gemv_config(n, k)
    out = [base]
    for block_n, block_k, stages_list in ((64, 128, (4, 6)), (128, 128, (3,)), (64, 256, (3,)), (128, 64, (4,))):
        if k % block_k:
            continue
        for split in (1, 2, 4, 8, 16):
            if split > k // block_k // 2:
                continue
            for stages in stages_list:
                cfg = GemvConfig(block_n, block_k, split, 4, stages)
                if cfg != base and cfg.smem_bytes() + (2 << 10) <= SMEM_LIMIT:
                    out.append(cfg)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--held", default="0,104,112")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    setups = {}
    for name in a.shapes.split(","):
        n, k, act = SHAPES[name]
        copies = max(3, math.ceil(3 * l2 / (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        x = torch.randn(1, 2 * k if act else k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        runs: list[dict] = []
        ref = None
        for cfg in candidates(n, k):
            ws = gemv_workspace(n, k, dev, cfg)
            try:  # compiles here, with every SM free: nothing is compiled or allocated under a hold
                y = gemv_triton(x, weights[0], act=act, workspace=ws, config=cfg).clone()
            except Exception as exc:  # noqa: BLE001 (a candidate out of shared memory or registers is skipped)
                print(f"{name} {cfg}: {type(exc).__name__}")
                continue
            ref = y if ref is None else ref
            # A CUDA graph of back-to-back launches (each weight copy twice), as the decode graph runs
            # them: timing eager launches would time Python's launch cost instead on few SMs.
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for w in weights * 2:
                    gemv_triton(x, w, out=out, act=act, workspace=ws, config=cfg)
            runs.append({"cfg": cfg, "same_bits": bool(torch.equal(y, ref)), "graph": graph, "calls": 2 * copies,
                         "workspace": ws})  # the graph reads it: kept alive with it
        setups[name] = (n * k * 2, runs, (weights, x, out))  # the graphs read these: kept alive with them
        print(f"{name}: {len(runs)} configurations compiled", flush=True)
    torch.cuda.synchronize()
    results = {"gpu": torch.cuda.get_device_name(dev), "rows": []}
    for held in [int(v) for v in a.held.split(",")]:
        hold = SmHold(dev, held) if held else None
        try:
            stream = stream_gbs(dev, iters=3)["best"]
            timed = {name: [(r, events_seconds(r["graph"].replay, a.iters) / r["calls"]) for r in runs]
                     for name, (_, runs, _) in setups.items()}
        finally:
            got = hold.release() if hold else 0
        sms = num_sms(dev) - got
        print(f"=== {got} SMs held, {sms} left: stream {stream:.0f} GB/s", flush=True)
        total_default = total_same = total_any = 0.0
        for name, rows in timed.items():
            nbytes = setups[name][0]
            mult = 1 if name == "lm_head" else 36
            default = rows[0][1]
            same = min((t for r, t in rows if r["same_bits"]), default=default)
            best_r, best = min(rows, key=lambda rt: rt[1])
            best_same_r = min(((r, t) for r, t in rows if r["same_bits"]), key=lambda rt: rt[1])[0]
            total_default += mult * default
            total_same += mult * same
            total_any += mult * best
            print(f"{name:>10}: tuned {default * 1e6:7.1f} us {nbytes / default / 1e9:5.0f} GB/s | same bits "
                  f"{same * 1e6:7.1f} us {nbytes / same / 1e9:5.0f} GB/s {best_same_r['cfg']} | any "
                  f"{best * 1e6:7.1f} us {nbytes / best / 1e9:5.0f} GB/s {best_r['cfg']}", flush=True)
            for r, t in sorted(rows, key=lambda rt: rt[1])[:4]:
                print(f"            {t * 1e6:7.1f} us  same_bits={r['same_bits']}  {r['cfg']}")
            results["rows"].append({"held": got, "sms": sms, "shape": name, "bytes": nbytes, "stream_gbs": stream,
                                    "times_us": [{"cfg": vars(r["cfg"]), "same_bits": r["same_bits"], "us": t * 1e6}
                                                 for r, t in rows]})
        print(f"a layer x36 + lm_head: tuned {total_default * 1e3:.2f} ms, same bits {total_same * 1e3:.2f} ms, "
              f"any {total_any * 1e3:.2f} ms", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
