"""`strata generate|chat|plan|serve|tui|bench` — command-line entry points.

Generated text goes to stdout and nothing else does; loading progress, speed figures and errors go
to stderr, so `strata generate ... > out.txt` captures exactly the completion.
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
import sys
import time

from strata.cli_args import add_engine_flags, add_model_arg, engine_config, run_command, strata_parser
from strata.config import EngineConfig
from strata.sampling import SamplingParams

_EC = EngineConfig()
# generate and chat sample as llama.cpp's CLI does, so a small model does not loop on its likeliest
# words; `--temperature 0` is greedy. The server keeps OpenAI's defaults (strata.server.protocol).
CLI_SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)

# `--seed` on generate and chat is the request's sampling seed; the engine's `seed` field (which seeds
# requests that bring none) has a flag of its own, `--engine-seed`, and is `seed` in a --config file
# as in `strata serve`'s.
ENGINE_DESTS = {"seed": "engine_seed"}


def _server_option_names() -> frozenset[str]:
    # A --config file written for `strata serve` also holds server options; generate and chat skip them.
    from strata.server.config import ServerConfig

    return frozenset(f.name for f in dataclasses.fields(ServerConfig))


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--config", metavar="FILE", default=None,
                   help="JSON file of EngineConfig options (field names as keys; a `strata serve` file's server "
                        "options are skipped); flags given here override it")
    add_engine_flags(p, dests=ENGINE_DESTS)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    sp = CLI_SAMPLING
    p.add_argument("--max-tokens", "-n", type=int, default=sp.max_tokens, help="(default: %(default)s)")
    p.add_argument("--temperature", "--temp", type=float, default=sp.temperature,
                   help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=sp.top_k, help="0 = off (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=sp.top_p, help="1 = off (default: %(default)s)")
    p.add_argument("--min-p", type=float, default=sp.min_p, help="0 = off (default: %(default)s)")
    p.add_argument("--repetition-penalty", type=float, default=sp.repetition_penalty,
                   help="1 = off (default: %(default)s)")
    p.add_argument("--seed", type=int, default=sp.seed,
                   help="the request's sampling seed (chat: every turn's); without it (and without --engine-seed) "
                        "a random one, printed on stderr so the run can be repeated")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS (benchmarks)")


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    """The SamplingParams of `strata generate|chat`'s sampling flags."""
    return SamplingParams(
        max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
        repetition_penalty=a.repetition_penalty, seed=a.seed, stop=a.stop, ignore_eos=a.ignore_eos,
    )


def _seeded(params: SamplingParams, cfg: EngineConfig) -> SamplingParams:
    """`params` with a seed: a sampled run given neither --seed nor --engine-seed gets a random one,
    printed on stderr, so that `--seed N` repeats it."""
    if params.greedy or params.seed is not None or cfg.seed is not None:
        return params
    seed = secrets.randbits(31)
    print(f"seed: {seed} (--seed {seed} repeats this run; --temperature 0 is greedy)", file=sys.stderr)
    return dataclasses.replace(params, seed=seed)


def resolve_engine(a: argparse.Namespace) -> EngineConfig:
    """The EngineConfig `strata generate|chat` runs with: defaults < --config file < engine flags."""
    return engine_config(a, dests=ENGINE_DESTS, ignore_file_keys=_server_option_names())


def _changed(cfg: EngineConfig) -> str:
    return " ".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                    if f.name not in ("model", "device", "dtype") and getattr(cfg, f.name) != getattr(_EC, f.name))


def _load(a: argparse.Namespace):
    from strata.llm import LLM

    cfg = resolve_engine(a)
    t0 = time.perf_counter()
    llm = LLM(progress=True, **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    cfg = llm.engine_config
    changed = _changed(cfg)
    print(f"loaded {llm.config.model_type} on {cfg.resolved_device} ({cfg.resolved_dtype}) "
          f"in {time.perf_counter() - t0:.2f}s" + (f"; engine: {changed}" if changed else ""), file=sys.stderr)
    return llm


def _drafts(llm) -> tuple[int, int]:
    spec = llm.engine.stats().spec
    return (spec["drafts_proposed"], spec["drafts_accepted"]) if spec else (0, 0)


def _stream(llm, ids: list[int], params: SamplingParams) -> str:
    proposed0, accepted0 = _drafts(llm)
    t0 = time.perf_counter()
    t_first = None
    text, n, reason = "", 0, None
    for ev in llm.stream(ids, params):
        if t_first is None:
            t_first = time.perf_counter()
        sys.stdout.write(ev.text)
        sys.stdout.flush()
        text += ev.text
        n, reason = ev.completion_tokens, ev.finish_reason or reason
    t_end = time.perf_counter()
    t_first = t_first or t_end
    print(file=sys.stderr)
    print(f"prompt: {len(ids)} tokens in {t_first - t0:.3f}s ({len(ids) / max(t_first - t0, 1e-9):.1f} tok/s) | "
          f"generated: {n} tokens in {t_end - t_first:.3f}s ({max(n - 1, 0) / max(t_end - t_first, 1e-9):.1f} tok/s) | "
          f"finish: {reason}" + _draft_summary(llm, proposed0, accepted0), file=sys.stderr)
    return text


def _draft_summary(llm, proposed0: int, accepted0: int) -> str:
    if not llm.engine_config.spec:
        return ""
    proposed, accepted = _drafts(llm)
    return f" | drafts: {accepted - accepted0}/{proposed - proposed0} accepted"


def cmd_generate(a: argparse.Namespace) -> int:
    llm = _load(a)
    if a.chat:
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": a.prompt}])
        ids = llm.tokenizer.encode(text, add_special=False)
    else:
        ids = llm.tokenizer.encode(a.prompt)
    _stream(llm, ids, _seeded(sampling_params(a), llm.engine_config))
    sys.stdout.write("\n")
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    llm = _load(a)
    messages: list[dict[str, str]] = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    params = _seeded(sampling_params(a), llm.engine_config)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        text = llm.tokenizer.apply_chat_template(messages)
        reply = _stream(llm, llm.tokenizer.encode(text, add_special=False), params)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})


def cmd_plan(a: argparse.Namespace) -> int:
    """The memory plan start-up would print on a GPU for this model and these flags, from the file's index
    alone (no weight is read), as llama.cpp's --fit-print shows its estimate: one table, or each pipeline
    stage's, or the one line that says what would fit."""
    import torch

    from strata.dist.plan import layer_ranges, parse_devices, parse_shares, stage_count
    from strata.engine import placement
    from strata.engine.startup import plan_one_device
    from strata.loaders import read_model
    from strata.memory_plan import GiB
    from strata.speculative.drafter import MTPDrafter

    cfg = resolve_engine(a)
    if cfg.device is not None and not cfg.device.startswith("cuda"):
        raise ValueError("strata plan places a model on a GPU: no --device other than cuda")
    cfg = dataclasses.replace(cfg, device=cfg.device or "cuda").resolved()
    if cfg.gpu_memory is not None:
        budget = int(cfg.gpu_memory * GiB)
    elif torch.cuda.is_available():
        budget = placement.gpu_budget(cfg, torch.device(cfg.device))
    else:
        raise ValueError("strata plan: no GPU here to measure; give the budget with --gpu-memory GIB")
    ckpt, mc = read_model(cfg.model)
    if cfg.split_mode == "layer":
        world = stage_count(cfg.tensor_split, parse_devices(cfg.devices), cfg.nnodes, torch.cuda.device_count(), True)
        ranges = tuple(layer_ranges(mc.num_hidden_layers, parse_shares(cfg.tensor_split, world)))
        plans = placement.plan_stages(cfg, mc, ckpt, cfg.torch_dtype, ranges, [budget] * world, MTPDrafter.split_mode())
        for r, ((first, end), plan) in enumerate(zip(ranges, plans)):
            print(f"pipeline stage {r}, layers {first}-{end - 1}: {plan.table()}")
        return 0
    print(plan_one_device(cfg, mc, ckpt, cfg.torch_dtype, budget)[0].table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser, sub = strata_parser()
    g = sub.add_parser("generate", help="complete one prompt, streaming to stdout")
    _add_engine_args(g)
    g.add_argument("--prompt", "-p", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat on stdin/stdout")
    _add_engine_args(c)
    c.add_argument("--system", default=None, help="system message")
    _add_sampling_args(c)
    c.set_defaults(func=cmd_chat)
    pl = sub.add_parser("plan", help="print the memory plan start-up would make on a GPU (what goes on the GPU, "
                                     "what stays in RAM), without loading the model")
    _add_engine_args(pl)
    pl.set_defaults(func=cmd_plan)
    try:
        from strata.server.serve import add_serve_parser
    except ImportError:  # the server's dependencies (fastapi, uvicorn) are not installed
        pass
    else:
        add_serve_parser(sub)
    from strata.tui import add_tui_parser  # loads neither textual nor httpx until `strata tui` runs

    add_tui_parser(sub)
    b = sub.add_parser("bench", help="benchmarks; each writes JSON under bench/results/")
    bsub = b.add_subparsers(dest="bench", required=True)
    from strata.bench import (concurrent, determinism, kv_quality, kv_tier, offload, prefix, quant, quant_kl, soak,
                              spec, throughput)

    from strata.bench import split as bench_split

    bench_split.add_parser(bsub)
    concurrent.add_parser(bsub)
    kv_quality.add_parser(bsub)
    offload.add_parser(bsub)
    quant.add_parser(bsub)
    quant_kl.add_parser(bsub)
    determinism.add_parser(bsub)
    soak.add_parser(bsub)
    prefix.add_parser(bsub)
    kv_tier.add_parser(bsub)
    spec.add_parser(bsub)
    throughput.add_parsers(bsub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
