"""`strata bench kv-tier`: the host KV tier (--kv-resident) against every block on the device.

Arms, each its own engine on one model (`--model FILE`, else `--shape`: random weights at that shape,
else the embedded model): decode speed of one sequence at `--context` tokens with all K/V on the device
(`--arms all`) and with a resident window of `--resident` tokens (`tier`; `--kv int8` by default, as the
tier is meant to run); the read of that context in both; a second request on a prefix that went to the
host tier (its first token against reading the prefix again, or against the tier arm's own read when
the all-device arm is not run); and the growth of torch's allocator across another read (the prompt
reversed, twice the window and four chunks long) with the tier on (CUDA). `--gpu-memory`,
`--n-cpu-moe`, `--parallel` and `--ctx` are the engine's (the seed's deployment: a 16 GiB cap, two
slots, 262,144 tokens each). llama.cpp's `-nkvo` figures are read from `--llamacpp FILE`:
llama-server's /completion response (its `timings`) or a JSON with `decode_tok_s` and `read_tok_s`, at
the same context on the same machine. JSON (+ PNG) under bench/results/.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import time

import torch

from strata.attention.tiered import TieredAttention
from strata.bench.results import save
from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.kernels.device import release_unused_memory
from strata.params import SamplingParams


SLACK = 64  # positions past the prompt and its decode: the pool, sized in whole blocks, holds the context


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _engine(args, **kw) -> LLMEngine:
    base = dict(model=args.model, device=args.device, dtype=args.dtype, kv=args.kv,
                ctx=args.ctx or args.context + args.decode + SLACK, parallel=args.parallel, chunk_size=args.chunk,
                prefix_cache=True, gpu_memory=args.gpu_memory, n_cpu_moe=args.n_cpu_moe, host_experts=args.host_experts,
                kv_tier_graphs=args.kv_tier_graphs, kv_tier_decode=args.kv_tier_decode)
    cfg = EngineConfig(**{**base, **kw})
    if args.shape:
        from strata.bench.random_model import random_model

        r = cfg.resolved()
        return LLMEngine(cfg, progress=False, loaded=random_model(args.shape, r.resolved_device, r.torch_dtype))
    return LLMEngine(cfg, progress=False)


def prompt_ids(tokens: int, vocab: int) -> list[int]:
    """The prompt every arm reads (and `scripts/llama_server_once.py` sends llama-server): `tokens` ids
    drawn from 10..999 (fewer on a smaller vocabulary), seed 0."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, min(1000, vocab), (tokens,), generator=g).tolist()


def _vocab_size(args) -> int:
    if args.shape:
        from strata.bench.random_model import shape_config

        return shape_config(args.shape).vocab_size
    from strata.loaders import read_model

    return read_model(args.model)[1].vocab_size


def _arm(args, ids: list[int], **kw) -> dict:
    """Read `ids`, then decode `--decode` tokens: read and decode tok/s."""
    e = _engine(args, **kw)
    tiered = e.runner.attn if isinstance(e.runner.attn, TieredAttention) else None
    arm = "tier" if tiered is not None else "all-device"
    host_at_first = None
    profiler = cProfile.Profile() if args.profile else None
    _sync(e.device)
    t0 = time.perf_counter()
    e.add_request(EngineRequest("read", tuple(ids), SamplingParams(max_tokens=args.decode, ignore_eos=True),
                                time.monotonic()))
    first = None
    while e.has_work():
        for ev in e.step():
            if ev.error is not None:
                raise RuntimeError(f"the engine failed the read: {ev.error}")
            if ev.finish_reason is not None and first is None and not ev.token_ids:
                raise RuntimeError(f"the read finished ({ev.finish_reason!r}) before its first token: "
                                   f"{e.stats().kv_blocks_moved_total if tiered else 0} blocks moved to the host")
            if first is None and ev.token_ids:
                _sync(e.device)
                first = time.perf_counter()
        if first is not None and host_at_first is None:
            host_at_first = tiered.host_seconds_total if tiered is not None else 0.0
            if profiler is not None:
                profiler.enable()
    _sync(e.device)
    end = time.perf_counter()
    if profiler is not None:
        profiler.disable()
        print(f"the {arm} arm's decode, by cumulative time:", flush=True)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
    res = {"read_tok_s": len(ids) / (first - t0), "decode_tok_s": (args.decode - 1) / (end - first)}
    # Printed as each part ends: a run cut short (a device lease) still shows what it measured.
    print(f"{arm} arm: read {len(ids)} tokens in {first - t0:.1f} s ({res['read_tok_s']:.0f} tok/s), "
          f"decode {res['decode_tok_s']:.2f} tok/s", flush=True)
    if tiered is not None:
        res["decode_host_part"] = e.runner.tier_decode  # where decode rows attended it: cpu, stream or pcie
        # auto's start-up probe: one layer's host part over TIER_PROBE_TOKENS tokens, each way
        res["decode_host_part_probe_ms"] = {k: v * 1e3 for k, v in e.runner.tier_decode_seconds.items()}
        # The decode's time in the host part on the CPU (each step's wait for its rows included; 0 streamed).
        res["decode_host_attention_s_per_token"] = (tiered.host_seconds_total - host_at_first) / (args.decode - 1)
    if kw.get("kv_resident") is not None:
        res["blocks_moved"] = e.stats().kv_blocks_moved_total
        if e.cfg.prefix_cache:  # a hybrid model runs without it: no prefix to find
            # A second request on the same prefix: its blocks come from the host tier.
            _sync(e.device)
            t1 = time.perf_counter()
            e.add_request(EngineRequest("again", tuple(ids), SamplingParams(max_tokens=1, ignore_eos=True),
                                        time.monotonic()))
            evs = e.run_to_completion()["again"]
            _sync(e.device)
            res["host_prefix_ttft_s"] = time.perf_counter() - t1
            res["host_prefix_cached_tokens"] = evs[-1].cached_tokens
            print(f"{arm} arm: the same prompt again in {res['host_prefix_ttft_s']:.2f} s "
                  f"({res['host_prefix_cached_tokens']} tokens cached)", flush=True)
        if e.device.type == "cuda" and args.alloc_check:
            before = torch.cuda.memory_stats(e.device)["reserved_bytes.all.current"]
            # Long enough to move blocks, stream a host prefix to its chunks and decode with a host part.
            third = ids[::-1][: min(len(ids), 2 * args.resident + 4 * e.cfg.chunk_size)]
            e.add_request(EngineRequest("third", tuple(third), SamplingParams(max_tokens=4, ignore_eos=True),
                                        time.monotonic()))
            e.run_to_completion()
            res["alloc_growth_bytes"] = torch.cuda.memory_stats(e.device)["reserved_bytes.all.current"] - before
    # The next arm's engine sizes its pool from the memory this one leaves free: give it all back.
    e.close()
    del e
    release_unused_memory()
    return res


def run(args) -> dict:
    if args.model and args.shape:
        raise SystemExit("kv-tier: --model or --shape, not both")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.device = device
    if args.shape:
        from strata.bench.random_model import shape_config

        most = shape_config(args.shape).max_position_embeddings
        if args.context + args.decode + SLACK > most:
            raise SystemExit(f"--shape {args.shape} holds {most} positions: --context {args.context} + --decode "
                             f"{args.decode} + {SLACK} do not fit (a -128k shape holds 131072)")
    ids = prompt_ids(args.context, _vocab_size(args))
    arms = set(args.arms.split(","))
    if not arms <= {"all", "tier"} or "tier" not in arms:
        raise SystemExit(f"--arms {args.arms}: tier, or all,tier")
    # The all-device arm's pool holds its one context (the card's free memory beside it stays free).
    all_device = (_arm(args, ids, prefix_cache=False, kv_size=args.context + args.decode + SLACK)
                  if "all" in arms else None)
    tier = _arm(args, ids, kv_resident=args.resident)
    nkvo = llamacpp_figures(args.llamacpp) if args.llamacpp else None
    # Reading the prefix again: at the all-device arm's rate, else the tier arm's own.
    reread = args.context / (all_device or tier)["read_tok_s"]
    tag = f"{max(1, round(args.context / 1024))}k"  # 130,944 tokens, their decode and SLACK fill 131,072 positions: "128k"
    summary = {
        f"decode_{tag}_over_all_gpu": tier["decode_tok_s"] / all_device["decode_tok_s"] if all_device else None,
        f"decode_{tag}_over_llamacpp_nkvo": (tier["decode_tok_s"] / nkvo["decode_tok_s"]
                                              if nkvo and nkvo["decode_tok_s"] else None),
        # Against a partial read: llama.cpp's rate over its first part, where each token costs it less
        # than later ones, so the ratio is a lower bound of the whole read's.
        f"read_{tag}_over_llamacpp_nkvo": tier["read_tok_s"] / nkvo["read_tok_s"] if nkvo else None,
        f"read_{tag}_over_llamacpp_nkvo_is_lower_bound": bool(nkvo and nkvo.get("partial")),
        "host_prefix_ttft_over_reread": tier["host_prefix_ttft_s"] / reread if "host_prefix_ttft_s" in tier else None,
        "alloc_growth_bytes": tier.get("alloc_growth_bytes"),
    }
    return {"device": device, "model": args.model, "shape": args.shape or ("file" if args.model else "embedded"),
            "context": args.context, "resident": args.resident, "kv": args.kv, "gpu_memory": args.gpu_memory,
            "parallel": args.parallel, "all_device": all_device, "tier": tier, "llamacpp_nkvo": nkvo,
            "summary": summary}


def llamacpp_figures(path: str) -> dict:
    """llama.cpp's read and decode rates from `path`: llama-server's /completion response (its `timings`:
    the prompt's tokens per second and the generated ones'), a read given up part way (`partial`: the
    rate over the tokens read, no decode), or a JSON that names them already."""
    data = json.load(open(path))
    if data.get("partial"):  # a read given up (llama_server_once.py --read-timeout): its rate so far
        return {"read_tok_s": data["read_tok_s"], "decode_tok_s": None, "partial": True,
                "prompt_tokens_read": data["prompt_tokens_read"]}
    t = data.get("timings")
    if t is not None:
        return {"read_tok_s": t["prompt_per_second"], "decode_tok_s": t["predicted_per_second"],
                "prompt_tokens": t.get("prompt_n"), "decode_tokens": t.get("predicted_n")}
    return {"read_tok_s": data["read_tok_s"], "decode_tok_s": data["decode_tok_s"]}


def _draw(plt, info) -> None:
    arms = [a for a in ("all_device", "tier") if info[a] is not None]
    fig, ax = plt.subplots(1, 2, figsize=(8, 3))
    for i, key in enumerate(("decode_tok_s", "read_tok_s")):
        ax[i].bar(arms, [info[a][key] for a in arms])
        ax[i].set_title(f"{key} at {info['context']} tokens")


def main(args) -> int:
    info = run(args)
    out = args.out or f"bench/results/kv_tier_{info['shape']}_{info['device']}.json"
    save(info, out, _draw)
    print(json.dumps(info["summary"], indent=1))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("kv-tier", help="host KV tier (--kv-resident): decode, read and a host-prefix hit")
    p.add_argument("--device", default=None)
    p.add_argument("--model", default=None, help="a model file or directory (else --shape, else the embedded model)")
    p.add_argument("--shape", default=None, help="random weights at this shape (strata.bench.random_model)")
    p.add_argument("--arms", default="all,tier", help="all (every block on the device) and tier, or tier alone")
    p.add_argument("--gpu-memory", type=float, default=None, help="the engine's --gpu-memory cap, GiB")
    p.add_argument("--n-cpu-moe", type=int, default=None, help="the first N MoE layers' experts in RAM (else the plan)")
    p.add_argument("--host-experts", default=EngineConfig.host_experts, help="the format of the experts in RAM")
    p.add_argument("--parallel", type=int, default=1, help="the engine's slots (one request runs at a time)")
    p.add_argument("--ctx", type=int, default=None, help="the engine's context per slot (default: the read, "
                                                         "its decode and a block of slack)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--kv", default="int8", choices=["auto", "bf16", "int8"])
    p.add_argument("--context", type=int, default=4096, help="tokens read before decoding (131072 on the device)")
    p.add_argument("--resident", type=int, default=1024, help="--kv-resident of the tier arm")
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--chunk", type=int, default=None)
    p.add_argument("--kv-tier-graphs", action="store_true",
                   help="the engine's --kv-tier-graphs: decode steps with a host part replay graphs in pieces")
    p.add_argument("--kv-tier-decode", default="auto", choices=["auto", "cpu", "stream", "pcie"],
                   help="the engine's --kv-tier-decode: where the tier arm's decode rows attend their host part")
    p.add_argument("--profile", action="store_true", help="print where each arm's decode spends its time (cProfile)")
    p.add_argument("--llamacpp", default=None, help="JSON of llama.cpp -nkvo figures on the same machine")
    p.add_argument("--no-alloc-check", dest="alloc_check", action="store_false",
                   help="leave out the allocator check (another read, reversed, of twice the window and four chunks)")
    p.add_argument("--out", default=None)
    p.set_defaults(func=main)
