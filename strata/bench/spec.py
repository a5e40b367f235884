"""`strata bench spec`: MTP speculation on the embedded model.

Decode: `parallel` requests of a fixed prompt set, greedy, `tokens` new tokens each (`ignore_eos`),
for every `--spec N` × `--spec-min-p P` arm; reported: decode tok/s (timed after the reads), draft
acceptance and mean accepted length, and whether the output equals the `--spec 0` arm's.
Prompt read: one long prompt with `--spec N`, read with `STRATA_SPLIT_MTP_BATCH` off and on; reported:
read tok/s (submission to first token) and the acceptance of the decode that follows.
Batch groups: the same decode with `--batch-groups 2`, steps overlapped and not (`--no-overlap`), at
`--spec 0` and `--spec 3`, beside the `--batch-groups 1` arm of the same --spec.
All decode arms' engines are built up front and their timed repeats interleave (best of `--repeats`).
Arms run in one process; JSON under bench/results/, a PNG when matplotlib exists.
"""

from __future__ import annotations

import os
import time

import torch

from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.env import ENV, overridden
from strata.loaders import default_model_path
from strata.bench.results import print_tables, save, summary_table
from strata.params import SamplingParams

PROMPTS = [
    "It is a truth universally acknowledged, that",
    "In the beginning God created the heaven and the earth. And the earth was",
    "To be, or not to be:",
    "The list type in Python supports",
]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _decode_once(args, eng: LLMEngine, rep: int) -> tuple[float, dict[str, list[int]]]:
    for i in range(args.parallel):
        ids = eng.tokenizer.encode(PROMPTS[i % len(PROMPTS)])
        eng.add_request(EngineRequest(f"{rep}-{i}", tuple(ids), SamplingParams(max_tokens=args.tokens, ignore_eos=True),
                                      time.monotonic()))
    while any(r.num_computed_tokens < len(r.prompt_ids) for r in eng.requests.values()):
        eng.step()
    _sync(args.device)
    t0 = time.perf_counter()
    events = eng.run_to_completion()
    _sync(args.device)
    return time.perf_counter() - t0, {k.split("-")[1]: [t for ev in v for t in ev.token_ids] for k, v in events.items()}


def decode_arms(args, arms: list[tuple[int, float, int, bool]]) -> list[dict]:
    """arms: (spec, min_p, batch_groups, overlap). Every arm's engine is built first and the timed
    repeats go round the arms in turn, so a drift in the machine's speed touches all arms alike."""
    engines = [LLMEngine(EngineConfig(device=args.device, dtype=args.dtype, parallel=args.parallel, spec=spec,
                                      spec_min_p=min_p, batch_mtp=True, batch_groups=groups, overlap=overlap,
                                      kv_size=EngineConfig.ctx * args.parallel))
               for spec, min_p, groups, overlap in arms]
    best = [float("inf")] * len(arms)
    outs: list[dict] = [{} for _ in arms]
    for rep in range(args.repeats + 1):  # the first pass warms up
        for i, eng in enumerate(engines):
            seconds, outs[i] = _decode_once(args, eng, rep)
            if rep:
                best[i] = min(best[i], seconds)
    rows = []
    new = args.parallel * (args.tokens - 1)  # the first token of each came with its read
    for (spec, min_p, groups, overlap), eng, t, out in zip(arms, engines, best, outs):
        st = eng.stats().spec or {"acceptance": 0.0, "mean_accepted_length": 1.0, "drafts_proposed": 0}
        rows.append({"spec": spec, "spec_min_p": min_p, "batch_groups": groups, "overlap": overlap and groups > 1,
                     "decode_tok_s": new / t, "acceptance": st["acceptance"],
                     "mean_accepted_length": st["mean_accepted_length"], "drafts_proposed": st["drafts_proposed"],
                     "identical_to_spec0": out == outs[0]})
    return rows


def read_arm(args, split: bool) -> dict:
    with overridden(ENV.SPLIT_MTP_BATCH, "1" if split else "0"):
            eng = LLMEngine(EngineConfig(device=args.device, dtype=args.dtype, parallel=1, spec=args.read_spec,
                                     batch_mtp=True, chunk_size=args.chunk, max_num_batched_tokens=args.chunk))
    text = open(os.path.join(default_model_path(), "README.md")).read() * 4
    ids = eng.tokenizer.encode(text)[: args.read_tokens]
    best = float("inf")
    for rep in range(args.repeats + 1):
        eng.add_request(EngineRequest(f"read{rep}", tuple(ids), SamplingParams(max_tokens=args.tokens, ignore_eos=True),
                                      time.monotonic()))
        _sync(args.device)
        t0 = time.perf_counter()
        while eng.requests[f"read{rep}"].num_computed_tokens < len(ids):
            eng.step()
        _sync(args.device)
        if rep:
            best = min(best, time.perf_counter() - t0)
        eng.run_to_completion()
    st = eng.stats().spec
    return {"split_mtp_batch": split, "prompt_tokens": len(ids), "read_tok_s": len(ids) / best,
            "acceptance": st["acceptance"], "mean_accepted_length": st["mean_accepted_length"]}


def run(args) -> int:
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    spec_arms = [(spec, min_p, 1, False) for spec in args.specs for min_p in (args.min_ps if spec else [0.0])]
    if spec_arms[0][0] != 0:
        spec_arms.insert(0, (0, 0.0, 1, False))  # the reference output
    group_arms = [(spec, 0.0, g, o) for spec in args.group_specs for g, o in ((1, False), (2, True), (2, False))
                  if (spec, 0.0, g, o) not in spec_arms]
    rows = dict(zip(spec_arms + group_arms, decode_arms(args, spec_arms + group_arms)))
    decode = [rows[a] for a in spec_arms]
    for r in decode:
        print(f"decode spec {r['spec']} min-p {r['spec_min_p']:.1f}: {r['decode_tok_s']:8.1f} tok/s  "
              f"acceptance {r['acceptance']:.3f}  accepted length {r['mean_accepted_length']:.2f}  "
              f"same output {r['identical_to_spec0']}", flush=True)
    groups = []
    for spec in args.group_specs:
        groups += [rows[(spec, 0.0, 1, False)], rows[(spec, 0.0, 2, True)], rows[(spec, 0.0, 2, False)]]
    for r in groups:
        print(f"decode spec {r['spec']} batch-groups {r['batch_groups']} overlap {int(r['overlap'])}: "
              f"{r['decode_tok_s']:8.1f} tok/s  same output {r['identical_to_spec0']}", flush=True)
    read = [read_arm(args, split) for split in (False, True)]
    for r in read:
        print(f"read {r['prompt_tokens']} tokens, STRATA_SPLIT_MTP_BATCH={int(r['split_mtp_batch'])}: "
              f"{r['read_tok_s']:9.1f} tok/s  acceptance {r['acceptance']:.3f}", flush=True)
    info = {"bench": "spec", "model": "default", "device": args.device, "dtype": args.dtype,
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
            "parallel": args.parallel, "tokens": args.tokens, "decode": decode, "read": read, "groups": groups}
    out = args.out or f"bench/results/spec_{args.device.split(':')[0]}.json"
    save(info, out, _draw)
    print_tables(summary_tables(info))
    return 0


def summary_tables(info: dict) -> list:
    """Decode arms, batch-groups arms and prompt reads as rich tables (the JSON holds the same numbers)."""
    on = f"default model, {info['parallel']} slots, {info.get('gpu') or info['device']} ({info['dtype']})"
    decode = [("spec", "spec", "d"), ("min-p", "spec_min_p", ".1f"), ("decode tok/s", "decode_tok_s", ".1f"),
              ("acceptance", "acceptance", ".3f"), ("accepted length", "mean_accepted_length", ".2f"),
              ("drafts", "drafts_proposed", "d"), ("same output", "identical_to_spec0", "")]
    groups = [("spec", "spec", "d"), ("batch groups", "batch_groups", "d"), ("overlap", "overlap", ""),
              ("decode tok/s", "decode_tok_s", ".1f"), ("same output", "identical_to_spec0", "")]
    read = [("STRATA_SPLIT_MTP_BATCH", "split_mtp_batch", ""), ("prompt tokens", "prompt_tokens", "d"),
            ("read tok/s", "read_tok_s", ".1f"), ("acceptance", "acceptance", ".3f"),
            ("accepted length", "mean_accepted_length", ".2f")]
    tables = [summary_table(f"spec decode: {on}", decode, info["decode"])]
    if info.get("groups"):
        tables.append(summary_table(f"batch groups: {on}", groups, info["groups"]))
    if info.get("read"):
        tables.append(summary_table("prompt read with speculation", read, info["read"]))
    return tables


def _draw(plt, info: dict) -> None:
    rows = info["decode"]
    labels = [f"spec {r['spec']}" + (f"\nmin-p {r['spec_min_p']}" if r["spec"] else "") for r in rows]
    groups = info.get("groups", [])
    _, axes = plt.subplots(1, 2 if groups else 1, figsize=(11 if groups else 7, 3.5), squeeze=False,
                           gridspec_kw={"width_ratios": [7, 4]} if groups else None)
    ax = axes[0][0]
    ax.bar(range(len(rows)), [r["decode_tok_s"] for r in rows])
    for i, r in enumerate(rows):
        if r["spec"]:
            ax.text(i, r["decode_tok_s"], f"{r['acceptance']:.0%}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("decode tokens / s")
    ax.set_title(f"MTP speculation, default model, {info['parallel']} slots, {info['gpu'] or info['device']}")
    if groups:
        ax = axes[0][1]
        glabels = [f"spec {r['spec']}\nG={r['batch_groups']}" + (" overlap" if r["overlap"] else "") for r in groups]
        ax.bar(range(len(groups)), [r["decode_tok_s"] for r in groups], color="tab:green")
        ax.set_xticks(range(len(groups)), glabels, fontsize=7)
        ax.set_title("batch groups", fontsize=9)


def add_parser(sub) -> None:
    p = sub.add_parser("spec", help="MTP speculation: decode tok/s and acceptance per --spec / --spec-min-p")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--specs", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2, 3])
    p.add_argument("--min-ps", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.7])
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--read-tokens", type=int, default=3000)
    p.add_argument("--read-spec", type=int, default=3)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--group-specs", type=lambda s: [int(x) for x in s.split(",")], default=[0, 3],
                   help="--spec values of the batch-groups arms")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)
