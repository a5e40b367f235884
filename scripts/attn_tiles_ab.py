"""Whole-model batch-1 decode with the shipped bf16 decode-attention tiles against another tile, in one
process and interleaved (A B A B), per weight format: whether a kernel that is faster alone makes the
step faster. The eighth round's 128-key tiles ran attention 1.03-1.16x faster alone, yet the Q4_K 8B
decode fell from 329 to 302 tok/s in two leases (docs/KERNELS.md); this times both in one lease, with
and without PDL. A development tool: `strata bench` owns the published numbers.

    python scripts/attn_tiles_ab.py --formats bf16,Q4_K --tile 128,4,2 [--tile 128,4,2,64 ...] [--pdl both]

A tile is keys, warps, stages and optionally MIN_SPLIT_KEYS (the shipped one's when left out).
"""

from __future__ import annotations

import argparse

import torch

from strata.bench import quant
from strata.env import ENV, overridden
from strata.kernels import attention as A


def arm_args(shape: str) -> argparse.Namespace:
    """`strata bench quant`'s arguments with a short read (the decode is what is compared)."""
    parser = argparse.ArgumentParser()
    quant._add_args(parser)
    return parser.parse_args(["--shape", shape, "--read-tokens", "512", "--no-ceilings", "--tokens", "32"])


def decode_tok_s(args: argparse.Namespace, fmt: str, tiles: tuple[int, ...], device: str = "cuda") -> float:
    kv_tile, warps, stages, split_keys = tiles
    saved = A.KV_TILE_DECODE, A.DECODE_CONFIG, A.MIN_SPLIT_KEYS
    A.KV_TILE_DECODE, A.DECODE_CONFIG = kv_tile, A.TileConfig(block_m=16, num_warps=warps, num_stages=stages)
    A.MIN_SPLIT_KEYS = split_keys
    A.select_config.cache_clear()
    try:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        return quant._arm(args, fmt, torch.device(device), dtype, None)["decode_b1_tok_s"]
    finally:
        A.KV_TILE_DECODE, A.DECODE_CONFIG, A.MIN_SPLIT_KEYS = saved
        A.select_config.cache_clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--formats", default="bf16,Q4_K")
    ap.add_argument("--tile", action="append", help="another tile: keys,warps,stages[,min split keys] (repeatable;"
                    " default 128,4,2)")
    ap.add_argument("--pdl", default="on", choices=["on", "off", "both"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu only checks the plumbing (the reference attention)")
    opts = ap.parse_args()
    shipped = (A.KV_TILE_DECODE, A.DECODE_CONFIG.num_warps, A.DECODE_CONFIG.num_stages, A.MIN_SPLIT_KEYS)
    others = [tuple(int(v) for v in t.split(",")) for t in opts.tile or ["128,4,2"]]
    others = [t if len(t) == 4 else (*t, A.MIN_SPLIT_KEYS) for t in others]
    args = arm_args(opts.shape)
    for pdl in (["1", "0"] if opts.pdl == "both" else ["1" if opts.pdl == "on" else "0"]):
        with overridden(ENV.PDL, pdl):
            for fmt in opts.formats.split(","):
                times = {t: [] for t in (shipped, *others)}
                for _ in range(opts.rounds):
                    for tiles in times:
                        times[tiles].append(decode_tok_s(args, fmt, tiles, opts.device))
                line = " | ".join(",".join(map(str, t)) + ": " + " ".join(f"{v:.1f}" for v in vs) + (
                    "" if t == shipped else f" ({max(vs) / max(times[shipped]):.3f}x)") for t, vs in times.items())
                print(f"PDL {pdl} {fmt:6s} decode b1 tok/s  {line}", flush=True)


if __name__ == "__main__":
    main()
