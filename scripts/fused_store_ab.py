"""Whole-model batch-1 decode and a 4K read with the K/V store fused into q/k-norm + RoPE
(`STRATA_FUSED_KV_STORE=1`) against the separate `store_kv` launch (the default; on an H100 the fused
store was ~1% faster, 2026-12-06), in one process and interleaved (A B A B), per weight format. A development tool: `strata
bench` owns the published numbers.

    python scripts/fused_store_ab.py --formats bf16,Q4_K [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attn_tiles_ab import arm_args  # noqa: E402

from strata.bench import quant  # noqa: E402
from strata.env import ENV, overridden  # noqa: E402


def arm(args: argparse.Namespace, fmt: str, fused: bool, device: str = "cuda") -> dict:
    with overridden(ENV.FUSED_KV_STORE, "1" if fused else "0"):
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        return quant._arm(args, fmt, torch.device(device), dtype, None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--formats", default="bf16,Q4_K")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu only checks the plumbing (no fused store there)")
    opts = ap.parse_args()
    args = arm_args(opts.shape)
    args.read_tokens, args.tokens = (4096, 96) if opts.device == "cuda" else (64, 4)
    for fmt in opts.formats.split(","):
        runs = {True: [], False: []}
        for _ in range(opts.rounds):
            for fused in runs:
                runs[fused].append(arm(args, fmt, fused, opts.device))
        cols = []
        for key, fmt_v in (("decode_b1_tok_s", "{:.1f}"), (f"read_{args.read_tokens}_tok_s", "{:.0f}")):
            vals = {f: [r[key] for r in rs] for f, rs in runs.items()}
            cols.append(f"{key}: fused {' '.join(fmt_v.format(v) for v in vals[True])} | separate "
                        f"{' '.join(fmt_v.format(v) for v in vals[False])} ({max(vals[True]) / max(vals[False]):.3f}x)")
        print(f"{fmt:6s} " + "; ".join(cols), flush=True)


if __name__ == "__main__":
    main()
