"""`strata bench determinism`: does a request's greedy answer depend on what else the server is doing?

One `strata serve` (the engine loop, the app and uvicorn as `strata serve` runs them, in a thread of
this process on a loopback port, as the decode bench's HTTP arm does) takes `--clients` greedy
streaming `/v1/completions` requests at once from a client process, with the sampled tokens'
logprobs; then the client sends each request again alone, one after another, and the answers are
compared token by token and logprob by logprob (bitwise: JSON floats round-trip exactly).

Prompts are token ids cut from the embedded model card's text at different offsets and lengths
(`--prompts`, cycled over the clients), and the read chunk is small (`--chunk`), so long prompts are
read in several chunks beside other requests' decodes. With the prefix cache on (the server's
default), the alone pass finds the blocks the concurrent pass cached: it compares a cold read in a
busy batch with a cached read alone. The API reports token texts, not ids; two tokens with the same
text would pass as equal, but their logprobs would differ, so `logprobs_altered` still counts them.

Run as `python -m strata.bench.determinism` this module is the client (standard library only, so it
shares no interpreter with the server it measures): a JSON job on stdin, the answers on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from strata.bench.http_client import lines_urllib, sse_chunks  # standard library only, like this client

COST_FIELDS = ("decode_b1_cost", "decode_b8_cost", "read_4096_cost", "read_32768_cost")
COST_NOTE = ("1 - (tok/s with --batch-invariant) / (tok/s without), same shape, same process, the default "
             "GPU chunk (2048) for reads; null unless --costs ran")
METRICS = ("strata_prefix_cache_hits_total", "strata_prefix_cache_cached_tokens_total", "strata_give_ways_total",
           "strata_preemptions_total", "strata_prompt_tokens_total", "strata_generation_tokens_total")


# -- the client (its own process) ------------------------------------------------------------------

def stream_answer(url: str, body: dict) -> dict:
    """One streamed completion: its token texts, their logprobs, the finish reason, and when it
    started and ended (seconds on this process's monotonic clock)."""
    tokens: list[str] = []
    logprobs: list[float] = []
    finish = None
    start = time.monotonic()
    for chunk in sse_chunks(lines_urllib(url + "/v1/completions", body)):
        for choice in chunk.get("choices", ()):
            lp = choice.get("logprobs")
            if lp:
                tokens += lp["tokens"]
                logprobs += lp["token_logprobs"]
            finish = choice.get("finish_reason") or finish
    return {"tokens": tokens, "logprobs": logprobs, "finish_reason": finish, "start": start, "end": time.monotonic()}


def read_metrics(url: str) -> dict[str, float]:
    """The counters of `METRICS` from the server's Prometheus text."""
    with urllib.request.urlopen(url + "/metrics") as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in METRICS:
            out[name] = float(value)
    return out


def peak_in_flight(answers: list[dict]) -> int:
    """The most streams that were open at once, from their start and end times."""
    edges = sorted([(a["start"], 1) for a in answers] + [(a["end"], -1) for a in answers])
    peak = now = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


def run_passes(url: str, bodies: list[dict]) -> dict:
    """All bodies at once (one thread each, released together), then each alone in order."""
    before = read_metrics(url)
    gate = threading.Barrier(len(bodies))

    def together(body: dict) -> dict:
        gate.wait()
        return stream_answer(url, body)

    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        concurrent = list(pool.map(together, bodies))
    middle = read_metrics(url)
    alone = [stream_answer(url, body) for body in bodies]
    after = read_metrics(url)
    return {"concurrent": concurrent, "alone": alone, "peak_in_flight": peak_in_flight(concurrent),
            "concurrent_metrics": _delta(before, middle), "alone_metrics": _delta(middle, after)}


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k.removeprefix("strata_").removesuffix("_total"): after.get(k, 0) - before.get(k, 0) for k in METRICS}


def client_main() -> int:
    job = json.load(sys.stdin)
    json.dump(run_passes(job["url"], job["bodies"]), sys.stdout)
    sys.stdout.write("\n")
    return 0


# -- comparing answers -----------------------------------------------------------------------------

def compare_answers(together_tokens: list[str], together_logprobs: list[float], alone_tokens: list[str],
                    alone_logprobs: list[float]) -> dict:
    """Where two answers to one request part: `token_divergence` is the first position whose token
    differs (a length difference counts at the shorter one's end), None when the tokens are equal;
    `logprob_divergence` the first position whose logprob is not bitwise equal, or where either
    answer has none. `altered`: the tokens differ; `logprobs_altered`: same tokens, some logprob not."""
    def first_difference(a: list, b: list) -> int | None:
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return i
        return None if len(a) == len(b) else min(len(a), len(b))

    token_at = first_difference(together_tokens, alone_tokens)
    lp_at = first_difference([float(x).hex() for x in together_logprobs], [float(x).hex() for x in alone_logprobs])
    return {"altered": token_at is not None, "logprobs_altered": token_at is None and lp_at is not None,
            "token_divergence": token_at, "logprob_divergence": lp_at}


def tally(prompt_lengths: list[int], concurrent: list[dict], alone: list[dict]) -> tuple[list[dict], int, int]:
    """(one row per request, altered, logprobs_altered)."""
    rows = []
    for i, (n, c, a) in enumerate(zip(prompt_lengths, concurrent, alone)):
        cmp = compare_answers(c["tokens"], c["logprobs"], a["tokens"], a["logprobs"])
        rows.append({"request": i, "prompt_tokens": n, "tokens": len(c["tokens"]), **cmp,
                     "max_abs_logprob_diff": max((abs(x - y) for x, y in zip(c["logprobs"], a["logprobs"])), default=0.0)})
    return rows, sum(r["altered"] for r in rows), sum(r["logprobs_altered"] for r in rows)


# -- the bench (the server's side) -----------------------------------------------------------------

def build_prompts(source_ids: list[int], lengths: list[int], clients: int, limit: int) -> list[list[int]]:
    """`clients` distinct prompts: client i takes `lengths[i % len]` + i tokens (at most `limit`) of
    `source_ids` (repeated as needed) from offset 97 * i, so no two share a start."""
    out = []
    for i in range(clients):
        n = min(lengths[i % len(lengths)] + i, limit)
        offset = 97 * i
        need = offset + n
        ids = source_ids * (1 + need // max(len(source_ids), 1))
        out.append(ids[offset:need])
    return out


def _child_client(url: str, bodies: list[dict], timeout_s: float) -> dict:
    import strata
    from strata.env import child_environment

    root = os.path.dirname(os.path.dirname(os.path.abspath(strata.__file__)))
    res = subprocess.run([sys.executable, "-m", "strata.bench.determinism"], input=json.dumps({"url": url, "bodies": bodies}),
                         capture_output=True, text=True, env=child_environment(root), timeout=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"the determinism client failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def run(args) -> int:
    import torch

    from strata.bench.http_arm import running_server
    from strata.bench.results import print_tables, save, summary_table
    from strata.config import EngineConfig
    from strata.engine.engine import LLMEngine
    from strata.loaders import default_model_path

    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, parallel=args.parallel,
                       chunk_size=args.chunk, prefix_cache=not args.no_prefix_cache, batch_invariant=args.batch_invariant)
    device, dtype = cfg.resolved_device, cfg.resolved_dtype
    # Costs first: their engines free themselves between arms, while the server's engine below may
    # still hold its pool (through the server's threads) when the run ends (an OOM on the H200).
    if args.quant and not args.shape:
        raise SystemExit("--quant makes random --shape weights kept quantized: it needs --shape")
    costs = (measure_costs(args.cost_shape, device, dtype, args.quant) if args.costs
             else {k: None for k in COST_FIELDS})
    limit = cfg.ctx - args.max_tokens
    if args.shape:  # random weights; token ids drawn at random, texts from a tokenizer that names every id
        from strata.bench.random_model import random_model, shape_config, synthetic_tokenizer

        vocab = shape_config(args.shape).vocab_size
        loaded = random_model(args.shape, device, getattr(torch, dtype), tokenizer=synthetic_tokenizer(vocab),
                              quant=args.quant)
        eng = LLMEngine(cfg, progress=False, loaded=loaded)
        gen = torch.Generator().manual_seed(0)
        source = torch.randint(0, vocab, (max(args.prompts) + args.clients + 64,), generator=gen).tolist()
        model_name = args.shape
    else:
        eng = LLMEngine(cfg, progress=False)
        source = eng.tokenizer.encode(open(os.path.join(default_model_path(), "README.md")).read())
        model_name = os.path.basename(os.path.normpath(args.model)) if args.model else "default"
    prompts = build_prompts(source, args.prompts, args.clients, limit)
    bodies = [{"model": model_name, "prompt": ids, "max_tokens": args.max_tokens, "temperature": 0,
               "ignore_eos": True, "logprobs": 0, "stream": True} for ids in prompts]
    resolved = cfg.resolved()
    chunk = resolved.chunk_size
    t0 = time.perf_counter()
    with running_server(eng, model_name) as url:
        res = _child_client(url, bodies, args.timeout)
    seconds = time.perf_counter() - t0
    rows, altered, lp_altered = tally([len(p) for p in prompts], res["concurrent"], res["alone"])
    eng.close()
    info = {
        "bench": "determinism", "model": args.model or args.shape or "default", "device": device, "dtype": dtype,
        "quant": args.quant,
        "batch_invariant": args.batch_invariant,
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "config": {"clients": args.clients, "parallel": args.parallel, "max_tokens": args.max_tokens,
                   "chunk_size": chunk, "max_num_batched_tokens": resolved.max_num_batched_tokens,
                   "async_scheduling": resolved.async_scheduling, "prompt_lengths": args.prompts, "prefix_cache": not args.no_prefix_cache,
                   "alone_pass": "each request alone, in order, on the same server"
                                 + (" with its prefix cache on: alone reads may hit the blocks the concurrent pass cached"
                                    if not args.no_prefix_cache else " (prefix cache off)"),
                   "endpoint": "/v1/completions (token-id prompt, greedy, ignore_eos, logprobs=0, stream)"},
        "requests": len(rows), "altered": altered, "logprobs_altered": lp_altered,
        "peak_in_flight": res["peak_in_flight"], "concurrent_metrics": res["concurrent_metrics"],
        "alone_metrics": res["alone_metrics"], "seconds": seconds,
        **costs, "cost_shape": args.cost_shape if args.costs else None, "cost_note": COST_NOTE, "per_request": rows,
    }
    out = args.out or f"bench/results/determinism{'_' + args.quant if args.quant else ''}_{device.split(':')[0]}.json"
    save(info, out, _draw)
    title = (f"determinism: {info['requests']} requests, {args.clients} at once on {args.parallel} slots "
             f"({info['gpu'] or device}, {dtype}, chunk {chunk}, prefix cache {'on' if cfg.prefix_cache else 'off'}): "
             f"altered {altered}, logprobs altered {lp_altered}")
    print_tables([summary_table(title, [("request", "request", "d"), ("prompt", "prompt_tokens", "d"),
                                        ("tokens", "tokens", "d"), ("altered", "altered", ""),
                                        ("logprobs altered", "logprobs_altered", ""),
                                        ("first token diff", "token_divergence", "d"),
                                        ("first logprob diff", "logprob_divergence", "d"),
                                        ("max |Δ logprob|", "max_abs_logprob_diff", ".3g")], rows)])
    return 0


def measure_costs(shape: str, device: str, dtype: str, quant: str | None = None) -> dict:
    """COST_FIELDS at `shape` (random weights, kept quantized in `quant` when given): decode batch 1 and
    8, reads of 4K and 32K tokens, each timed with the switch off, then on, through the decode and read
    benches' own code."""
    import torch

    from strata.bench import throughput as tp

    common = dict(shape=shape, device=device, dtype=dtype, kv="auto", repeats=1, seed=0, no_hf=True, quant=quant,
                  no_cuda_graph=False, no_async_scheduling=False, no_ceilings=True, http=False)
    speeds: dict[tuple, float] = {}
    for on in (False, True):
        dec = argparse.Namespace(**common, which="decode", chunk=2048, batch=[1, 8], prompt=512, tokens=64,
                                 tokenizer=None, grammar=None, batch_invariant=on)
        for r in tp._strata_decode(dec, torch.device(device), getattr(torch, dtype), None, {}):
            speeds[("decode", r["batch"], on)] = r["strata_tok_s"]
        read = argparse.Namespace(**common, which="read", chunk=2048, chunks=None, lengths=[4096, 32768],
                                  batch_invariant=on)
        for r in tp._strata_read(read, torch.device(device), getattr(torch, dtype), None, {}):
            speeds[("read", r["prompt_tokens"], on)] = r["strata_tok_s"]
    return {f"{kind}_{'b' if kind == 'decode' else ''}{n}_cost": 1.0 - speeds[(kind, n, True)] / speeds[(kind, n, False)]
            for kind, n in (("decode", 1), ("decode", 8), ("read", 4096), ("read", 32768))}


def _draw(plt, info: dict) -> None:
    rows = info["per_request"]
    colors = ["tab:red" if r["altered"] else "tab:orange" if r["logprobs_altered"] else "tab:green" for r in rows]
    plt.figure(figsize=(8, 3))
    plt.bar([str(r["request"]) for r in rows], [r["prompt_tokens"] for r in rows], color=colors)
    plt.xlabel("request (red: tokens altered, orange: logprobs altered, green: identical)")
    plt.ylabel("prompt tokens")
    plt.title(f"{info['altered']} of {info['requests']} altered, {info['device']} {info['dtype']}", fontsize=9)


def _lengths(s: str) -> list[int]:
    values = [int(x) for x in s.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("prompt lengths are positive integers")
    return values


def add_parser(sub) -> None:
    p = sub.add_parser("determinism", help="concurrent streaming clients against the same requests alone: altered answers")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL", help="HF directory or .gguf (default: the embedded model)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--clients", type=int, default=16, help="requests sent at once")
    p.add_argument("--parallel", type=int, default=4, help="the server's slots")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompts", type=_lengths, default=[12, 40, 100, 250, 600],
                   help="prompt lengths in tokens, cycled over the clients (client i adds i)")
    p.add_argument("--chunk", type=int, default=64, help="read chunk size, small so reads interleave with decodes")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--shape", default=None, help="random weights at this shape instead of MODEL (e.g. qwen3-8b)")
    p.add_argument("--batch-invariant", action="store_true", help="the server runs with --batch-invariant")
    p.add_argument("--quant", default=None, choices=["Q8_0", "FP8"],
                   help="--shape's random weights (and --costs') kept quantized: the formats the invariant mode serves")
    p.add_argument("--costs", action="store_true",
                   help="also time decode b1/b8 and reads of 4K/32K with the switch off and on (the cost ratios)")
    p.add_argument("--cost-shape", default="qwen3-8b", help="the shape --costs times (random weights)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds the client may take")
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)


if __name__ == "__main__":
    sys.exit(client_main())
