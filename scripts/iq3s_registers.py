"""The IQ3_S dp4a GEMV at its shipped configurations against the same tiles with the registers capped
(ptxas `maxnreg`: more programs resident per SM, some values spilled) and with eight warps, on the
Qwen3-8B shapes at M = 1 (CUDA). A development tool: which variant `gemv_config` should take.

    python scripts/iq3s_registers.py
"""

from __future__ import annotations

from dataclasses import replace

import torch

from strata.kernels.quant import iq3_s
from strata.kernels.quant.dp4a import SWEEP_SHAPES, launch
from strata.kernels.quant.iq3_s_dp4a import _iq3s_gemv_dp4a_kernel, gemv_config, workspace_numel
from strata.kernels.timing import time_us


def main(runs: int = 30) -> None:
    grid = iq3_s.grid_table(torch.device("cuda"))
    for n, k in SWEEP_SHAPES:
        planes = iq3_s.repack(torch.from_numpy(iq3_s.random_raw(n, k, seed=n + k)).cuda())
        copies = [planes] + [{key: t.clone() for key, t in planes.items()} for _ in range(max(1, (300 << 20) // (n * k)))]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        base = gemv_config(n, k)
        variants = {"shipped": (base, {}), "maxnreg 168": (base, {"maxnreg": 168}),
                    "maxnreg 128": (base, {"maxnreg": 128}), "8 warps": (replace(base, num_warps=8), {})}
        results, ref = {}, None
        for _ in range(2):  # interleaved twice: clock drift shows as disagreement between the passes
            for name, (cfg, opts) in variants.items():
                ws = torch.zeros(max(1, workspace_numel(n, k, cfg)), dtype=torch.int32, device="cuda")

                def call(p, cfg=cfg, opts=opts, ws=ws):
                    weights = (p["qs"], p["qh"], p["signs"], p["scales"], p["d"], grid)
                    return launch(_iq3s_gemv_dp4a_kernel, x, weights, n, k, out, ws, cfg, 256, SHARED_GRID=True, **opts)

                try:
                    got = call(planes).clone()
                    t = time_us([lambda p=p: call(p) for p in copies], runs)
                except Exception as exc:  # a variant this Triton refuses: reported, the others still run
                    results[name] = f"failed: {type(exc).__name__}: {exc}"[:120]
                    continue
                ref = got if ref is None else ref
                same = torch.equal(got, ref)
                prev = results.get(name)
                results[name] = (min(t, prev[0]) if isinstance(prev, tuple) else t, same)
        qbytes = n * k * 110 / 256
        for name, r in results.items():
            if isinstance(r, tuple):
                print(f"IQ3_S {n}x{k} M=1 {base.block_n}x{base.block_k} split {base.split_k} {name:12s}: {r[0]:7.2f} us "
                      f"{qbytes / r[0] / 1e3:5.0f} GB/s  same bits {r[1]}", flush=True)
            else:
                print(f"IQ3_S {n}x{k} {name}: {r}", flush=True)
        del copies, planes
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    main()
