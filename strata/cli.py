"""`strata generate|chat|serve|bench` — command-line entry points.

Generated text goes to stdout and nothing else does; loading progress, speed figures and errors go
to stderr, so `strata generate ... > out.txt` captures exactly the completion.
"""

from __future__ import annotations

import argparse
import sys
import time

from strata.config import EngineConfig
from strata.runner.sampling import SamplingParams

_SP = SamplingParams()
_EC = EngineConfig()


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=_EC.model,
                   help="HF model directory or .gguf file (default: the embedded model)")
    p.add_argument("--device", default=_EC.device, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--dtype", default=_EC.dtype, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--ctx", type=int, default=_EC.ctx, help="context length in tokens (prompt + output)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=_SP.max_tokens)
    p.add_argument("--temperature", "--temp", type=float, default=_SP.temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=_SP.top_k)
    p.add_argument("--top-p", type=float, default=_SP.top_p)
    p.add_argument("--min-p", type=float, default=_SP.min_p)
    p.add_argument("--repetition-penalty", type=float, default=_SP.repetition_penalty)
    p.add_argument("--seed", type=int, default=_SP.seed)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS (benchmarks)")


def _sampling(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
        repetition_penalty=a.repetition_penalty, seed=a.seed, stop=a.stop, ignore_eos=a.ignore_eos,
    )


def _load(a: argparse.Namespace):
    from strata.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(a.model, device=a.device, dtype=a.dtype, ctx=a.ctx, parallel=1, progress=True)
    cfg = llm.engine_config
    print(f"loaded {llm.config.model_type} on {cfg.resolved_device} ({cfg.resolved_dtype}) "
          f"in {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    return llm


def _stream(llm, ids: list[int], params: SamplingParams) -> str:
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
          f"finish: {reason}", file=sys.stderr)
    return text


def cmd_generate(a: argparse.Namespace) -> int:
    llm = _load(a)
    if a.chat:
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": a.prompt}])
        ids = llm.tokenizer.encode(text, add_special=False)
    else:
        ids = llm.tokenizer.encode(a.prompt)
    _stream(llm, ids, _sampling(a))
    sys.stdout.write("\n")
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    llm = _load(a)
    messages: list[dict[str, str]] = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    params = _sampling(a)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Strata LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
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
    try:
        from strata.server.cli import add_serve_parser
    except ImportError:  # the server's dependencies (fastapi, uvicorn) are not installed
        pass
    else:
        add_serve_parser(sub)
    b = sub.add_parser("bench", help="benchmarks; each writes JSON under bench/results/")
    bsub = b.add_subparsers(dest="bench", required=True)
    from strata.bench import kv_quality, spec, throughput

    kv_quality.add_parser(bsub)
    spec.add_parser(bsub)
    throughput.add_parsers(bsub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from strata.loaders import LoadError

    try:
        return args.func(args)
    except (LoadError, ValueError) as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
