"""`strata bench kv-tier`: the host KV tier (--kv-resident) against every block on the device.

Arms, each its own engine on one model (`--shape`: random weights at that shape, else the embedded
model): decode speed of one sequence at `--context` tokens with all K/V on the device and with a
resident window of `--resident` tokens (`--kv int8` by default, as the tier is meant to run); the
read of that context in both; a second request on a prefix that went to the host tier (its first
token against reading the prefix again); and the growth of torch's allocator across a second long
read with the tier on (CUDA). llama.cpp's `-nkvo` figures are not run here: their summary keys are
null unless `--llamacpp FILE` names a JSON with `decode_tok_s` and `read_tok_s` measured on the same
machine. JSON (+ PNG) under bench/results/.
"""

from __future__ import annotations

import json
import time

import torch

from strata.bench.results import save
from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.params import SamplingParams


SLACK = 64  # positions past the prompt and its decode: the pool, sized in whole blocks, holds the context


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _engine(args, **kw) -> LLMEngine:
    base = dict(device=args.device, dtype=args.dtype, kv=args.kv, ctx=args.context + args.decode + SLACK, parallel=1,
                chunk_size=args.chunk, prefix_cache=True)
    cfg = EngineConfig(**{**base, **kw})
    if args.shape:
        from strata.bench.random_model import random_model

        r = cfg.resolved()
        return LLMEngine(cfg, progress=False, loaded=random_model(args.shape, r.resolved_device, r.torch_dtype))
    return LLMEngine(cfg, progress=False)


def _arm(args, ids: list[int], **kw) -> dict:
    """Read `ids`, then decode `--decode` tokens: read and decode tok/s."""
    e = _engine(args, **kw)
    _sync(e.device)
    t0 = time.perf_counter()
    e.add_request(EngineRequest("read", tuple(ids), SamplingParams(max_tokens=args.decode, ignore_eos=True),
                                time.monotonic()))
    first = None
    while e.has_work():
        for ev in e.step():
            if first is None and ev.token_ids:
                _sync(e.device)
                first = time.perf_counter()
    _sync(e.device)
    end = time.perf_counter()
    res = {"read_tok_s": len(ids) / (first - t0), "decode_tok_s": (args.decode - 1) / (end - first)}
    if kw.get("kv_resident") is not None:
        res["blocks_moved"] = e.stats().kv_blocks_moved_total
        # A second request on the same prefix: its blocks come from the host tier.
        _sync(e.device)
        t1 = time.perf_counter()
        e.add_request(EngineRequest("again", tuple(ids), SamplingParams(max_tokens=1, ignore_eos=True),
                                    time.monotonic()))
        evs = e.run_to_completion()["again"]
        _sync(e.device)
        res["host_prefix_ttft_s"] = time.perf_counter() - t1
        res["host_prefix_cached_tokens"] = evs[-1].cached_tokens
        if e.device.type == "cuda":
            before = torch.cuda.memory_stats(e.device)["reserved_bytes.all.current"]
            e.add_request(EngineRequest("third", tuple(ids[::-1]), SamplingParams(max_tokens=4, ignore_eos=True),
                                        time.monotonic()))
            e.run_to_completion()
            res["alloc_growth_bytes"] = torch.cuda.memory_stats(e.device)["reserved_bytes.all.current"] - before
    return res


def run(args) -> dict:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.device = device
    if args.shape:
        from strata.bench.random_model import shape_config

        most = shape_config(args.shape).max_position_embeddings
        if args.context + args.decode + SLACK > most:
            raise SystemExit(f"--shape {args.shape} holds {most} positions: --context {args.context} + --decode "
                             f"{args.decode} + {SLACK} do not fit (a -128k shape holds 131072)")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 1000, (args.context,), generator=g).tolist()
    all_device = _arm(args, ids, prefix_cache=False)
    tier = _arm(args, ids, kv_resident=args.resident)
    nkvo = json.load(open(args.llamacpp)) if args.llamacpp else None
    reread = args.context / all_device["read_tok_s"]
    tag = f"{round(args.context / 1024)}k"  # 130,944 tokens, their decode and SLACK fill 131,072 positions: "128k"
    summary = {
        f"decode_{tag}_over_all_gpu": tier["decode_tok_s"] / all_device["decode_tok_s"],
        f"decode_{tag}_over_llamacpp_nkvo": tier["decode_tok_s"] / nkvo["decode_tok_s"] if nkvo else None,
        f"read_{tag}_over_llamacpp_nkvo": tier["read_tok_s"] / nkvo["read_tok_s"] if nkvo else None,
        "host_prefix_ttft_over_reread": tier["host_prefix_ttft_s"] / reread,
        "alloc_growth_bytes": tier.get("alloc_growth_bytes"),
    }
    return {"device": device, "shape": args.shape or "embedded", "context": args.context, "resident": args.resident,
            "kv": args.kv, "all_device": all_device, "tier": tier, "llamacpp_nkvo": nkvo, "summary": summary}


def _draw(plt, info) -> None:
    arms = ["all_device", "tier"]
    fig, ax = plt.subplots(1, 2, figsize=(8, 3))
    for i, key in enumerate(("decode_tok_s", "read_tok_s")):
        ax[i].bar(arms, [info[a][key] for a in arms])
        ax[i].set_title(f"{key} at {info['context']} tokens")


def main(args) -> int:
    info = run(args)
    out = args.out or f"bench/results/kv_tier_{args.shape or 'embedded'}_{info['device']}.json"
    save(info, out, _draw)
    print(json.dumps(info["summary"], indent=1))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("kv-tier", help="host KV tier (--kv-resident): decode, read and a host-prefix hit")
    p.add_argument("--device", default=None)
    p.add_argument("--shape", default=None, help="random weights at this shape (strata.bench.random_model)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--kv", default="int8", choices=["auto", "bf16", "int8"])
    p.add_argument("--context", type=int, default=4096, help="tokens read before decoding (131072 on the device)")
    p.add_argument("--resident", type=int, default=1024, help="--kv-resident of the tier arm")
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--chunk", type=int, default=None)
    p.add_argument("--llamacpp", default=None, help="JSON of llama.cpp -nkvo figures on the same machine")
    p.add_argument("--out", default=None)
    p.set_defaults(func=main)
