"""`strata bench prefix`: a conversation's next turn with the prefix cache against a cold read.

Turn 1 is a `--tokens`-long prompt (the default model's card, repeated) answered with `--reply`
greedy tokens. With `--shape` (e.g. `qwen3-8b`) the model is random weights at that shape, built once
on the device for both arms, and the conversation is random token ids: the ratio then reflects a
model whose reads cost what real ones do, where the embedded model's are mostly fixed step costs. Turn 2 re-sends turn 1 and its reply, then a short new question (a different one each
repeat, so only the conversation so far can be cached). Reported per arm (`--no-prefix-cache` and
the cache on, each its own engine): turn 2's time to first token (best of `--repeats`), the tokens
the cache supplied, and whether both arms answer alike (greedy). `--busy`: another request decodes
throughout turn 2 (a second slot), as on a server with other clients; a third arm keeps the cache but
turns solo reads off (`--no-solo-reads`: the turn's read shares an eager step with that decode instead
of a prompt-chunk graph step of its own). JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import time

import torch

from strata.bench.results import print_tables, save, summary_table
from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.loaders import default_model_path
from strata.params import SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _ttft(eng: LLMEngine, rid: str, ids: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """(seconds from submission to the first token, the greedy answer, cached tokens)."""
    _sync(eng.device)
    t0 = time.perf_counter()
    eng.add_request(EngineRequest(rid, tuple(ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                  time.monotonic()))
    first, out, cached, done = None, [], 0, False
    while not done:  # until this request ends: a --busy background request decodes on
        for ev in eng.step():
            if ev.request_id == rid:
                done = done or ev.finish_reason is not None
                if first is None and ev.token_ids:
                    # The token is on the host now (its step has finished), which is what a client sees.
                    # No sync here: the device may already run the next decode step (async scheduling),
                    # and waiting for it added a whole step to both arms.
                    first = time.perf_counter() - t0
                out.extend(ev.token_ids)
                cached = ev.cached_tokens if ev.finish_reason else cached
    return first, out, cached


def _random_ids(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def arm(args, prefix_cache: bool, loaded=None, solo_reads: bool = True) -> dict:
    slots = 2 if args.busy else 1
    cfg = EngineConfig(device=args.device, dtype=args.dtype, ctx=args.tokens + 1024, chunk_size=args.chunk,
                       prefix_cache=prefix_cache, parallel=slots, solo_reads=solo_reads,
                       **({"kv_size": slots * (args.tokens + 1024)} if loaded else {}))
    eng = LLMEngine(cfg, progress=False, loaded=loaded)
    if loaded is None:
        text = open(f"{default_model_path()}/README.md").read()
        ids = eng.tokenizer.encode(text * (1 + args.tokens * 6 // max(len(text), 1)))[: args.tokens]
        warmup = eng.tokenizer.encode("Hello there")
        questions = [eng.tokenizer.encode(f" Question {rep}: what does the text above say about speed?")
                     for rep in range(args.repeats)]
    else:  # random weights: token ids stand for text
        vocab = loaded.config.vocab_size
        ids, warmup = _random_ids(vocab, args.tokens, 1), _random_ids(vocab, 3, 2)
        questions = [_random_ids(vocab, 14, 10 + rep) for rep in range(args.repeats)]
    _ttft(eng, "warmup", warmup, 4)
    _, reply, _ = _ttft(eng, "turn1", ids, args.reply)
    if args.busy:  # another client's request, decoding from here to the end of the arm
        eng.add_request(EngineRequest("background", tuple(warmup), SamplingParams(max_tokens=1000, ignore_eos=True),
                                      time.monotonic()))
        for _ in range(4):
            eng.step()
    best, answers, cached = float("inf"), [], 0
    for rep, question in enumerate(questions):
        seconds, answer, cached = _ttft(eng, f"turn2-{rep}", ids + reply + question, 8)
        best = min(best, seconds)
        answers.append(answer)
    solos = eng.scheduler.solo_reads_total
    if args.busy:
        eng.abort("background")
        eng.run_to_completion()
    return {"prefix_cache": prefix_cache, "solo_reads": solo_reads, "busy": args.busy,
            "turn2_prompt_tokens": len(ids) + len(reply) + len(question), "ttft_s": best, "cached_tokens": cached,
            "answers": answers, "solo_reads_total": solos, "device": str(eng.device)}


def run(args) -> int:
    loaded = None
    if args.shape:
        from strata.bench.random_model import random_model

        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
        loaded = random_model(args.shape, device, dtype)
    arms = [arm(args, False, loaded), arm(args, True, loaded)]
    if args.busy:
        arms.append(arm(args, True, loaded, solo_reads=False))
    cold, warm = arms[:2]
    info = {"bench": "prefix", "shape": args.shape or "default", "tokens": args.tokens, "reply": args.reply,
            "repeats": args.repeats, "busy": args.busy, "arms": arms,
            "ttft_ratio": warm["ttft_s"] / cold["ttft_s"], "same_answers": cold["answers"] == warm["answers"]}
    if args.busy:
        info["ttft_ratio_no_solo"] = arms[2]["ttft_s"] / cold["ttft_s"]
    device = "cuda" if cold["device"].startswith("cuda") else "cpu"
    busy = "_busy" if args.busy else ""
    out = args.out or f"bench/results/prefix{busy}{'_' + args.shape if args.shape else ''}_{device}.json"
    names = [_arm_name(a) for a in arms]

    def draw(plt, info):
        plt.bar(names, [a["ttft_s"] * 1e3 for a in info["arms"]])
        plt.ylabel("turn-2 TTFT (ms)")

    save(info, out, draw)
    rows = [{"arm": name, "ttft_ms": a["ttft_s"] * 1e3, "cached": a["cached_tokens"], "prompt": a["turn2_prompt_tokens"],
             "solo": a["solo_reads_total"]} for name, a in zip(names, arms)]
    print_tables([summary_table(f"next turn of a {args.tokens}-token conversation (ratio {info['ttft_ratio']:.3f}, "
                                f"same answers: {info['same_answers']})",
                                [("arm", "arm", ""), ("turn-2 prompt", "prompt", "d"), ("cached", "cached", "d"),
                                 ("TTFT ms", "ttft_ms", ".1f"), ("solo reads", "solo", "d")], rows)])
    return 0


def _arm_name(a: dict) -> str:
    if not a["prefix_cache"]:
        return "cold"
    return "prefix cache" if a["solo_reads"] else "prefix cache, no solo reads"


def add_parser(sub) -> None:
    p = sub.add_parser("prefix", help="prefix cache: a conversation's next-turn TTFT against a cold read")
    _add_args(p)


def _add_args(p) -> None:
    p.add_argument("--device", default=None)
    from strata.bench.random_model import SHAPES

    p.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="random weights at this shape instead of the embedded model (token-id conversation)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tokens", type=int, default=3584,
                   help="turn 1's prompt tokens (turn 2 re-sends them with the reply: ~3.7K, within the embedded model's 4,096 positions)")
    p.add_argument("--reply", type=int, default=64, help="turn 1's answer tokens")
    p.add_argument("--chunk", type=int, default=None, help="read chunk size (default: the engine's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--busy", action="store_true", help="another request decodes throughout turn 2 (two slots)")
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="strata bench prefix")
    _add_args(parser)
    ns = parser.parse_args()
    raise SystemExit(ns.func(ns))
