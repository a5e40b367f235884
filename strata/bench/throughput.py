"""`strata bench read|decode`: prompt-read and decode throughput of the serving engine, measured
beside HF transformers running the same shapes in the same process.

Random weights at a named shape (`strata.bench.random_model.SHAPES`: `qwen3-8b` by default,
`qwen3-8b-128k`, `qwen3-30b-a3b`; `tiny` and `tiny-moe` for CPU smoke runs), built straight on the
device (no checkpoint), bf16 on CUDA and fp32 on the CPU. Strata's arms run first and their model is
freed before HF's is built, so the two never share the device's memory.

Read: one prompt of each length at each chunk size, timed from submission to its first token; `mfu`
is its flops over the measured GEMM ceiling. Decode: `batch` requests of `prompt` tokens each, `tokens`
new tokens each with `ignore_eos`, timed after the reads are done; `bandwidth_fraction` is the bytes a
step must read (weights, K/V) times steps per second over the measured copy bandwidth. `--http` adds
batch-1 decode through the OpenAI server (`strata.bench.http_arm`). HF: one forward over the prompt
(read); `generate` with a fixed number of new tokens, timed from its first new token to its last
(decode, as Strata's: after the read).
Structured output's cost: `--tokenizer PATH` gives the engine a grammar compiler (the token-mask kernel
then runs in every decode graph, over all-ones rows), and `--grammar json` adds a json_object grammar
to every request (masks filled on the host each step). A grammar may end a request before `tokens`
(its object is complete): tok/s counts the tokens produced and `finished_early` says how many did.
Writes JSON under bench/results/ and, when matplotlib is installed, a PNG beside it.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import os
import time

import torch

from strata.bench import roofline
from strata.bench.http_arm import measure_http, percentile
from strata.bench.random_model import (SHAPES, random_hf_model, random_model, shape_config, synthetic_tokenizer,
                                       timed, with_tokenizer)
from strata.bench.results import print_tables, save, summary_table
from strata.config import EngineConfig, ModelConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.cli_args import add_field_flags
from strata.grammar import GrammarSpec
from strata.kernels import choices
from strata.kernels.choices import KernelChoices
from strata.loaders import LoadedModel
from strata.params import SamplingParams

__all__ = ["SHAPES", "run", "add_parsers", "build_engine", "engine_config", "summary_tables"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def engine_config(args, device: torch.device, ctx: int, parallel: int, chunk: int) -> EngineConfig:
    # An explicit KV size: the pool must not take the device's free memory (the next arm needs it).
    # No prefix cache: a repeated read of the same prompt would be a cache hit, not a read.
    kw = dict(device=str(device), dtype=args.dtype, ctx=ctx, parallel=parallel, chunk_size=chunk,
              max_num_batched_tokens=max(chunk, parallel), kv_size=ctx * parallel, kv=args.kv, prefix_cache=False)
    if args.no_cuda_graph and "cuda_graph" in EngineConfig.__dataclass_fields__:
        kw["cuda_graph"] = False
    if getattr(args, "no_async_scheduling", False):
        kw["async_scheduling"] = False
    if getattr(args, "batch_invariant", False):
        kw["batch_invariant"] = True
    return EngineConfig(**kw, **kernel_choice_args(args))


KERNEL_CHOICE_FIELDS = tuple(f.name for f in dataclasses.fields(KernelChoices))


def add_kernel_choice_flags(p) -> None:
    """EngineConfig's kernel choices as a bench command's flags (`--quant-decode`, `--moe-decode`,
    `--dequant-read-rows`, `--linear-attention-kernel`, `--pdl/--no-pdl`), defaults the config's."""
    group = p.add_argument_group("kernel choices (EngineConfig fields)")
    others = {f.name for f in dataclasses.fields(EngineConfig)} - set(KERNEL_CHOICE_FIELDS)
    add_field_flags(group, EngineConfig, skip=others)


def kernel_choice_args(args) -> dict:
    """The kernel choices typed on the command line (the others keep EngineConfig's defaults)."""
    return {name: getattr(args, name) for name in KERNEL_CHOICE_FIELDS if hasattr(args, name)}


def install_kernel_choices(args) -> None:
    """The command's kernel choices for the process before any model is built: a model packs before
    its engine starts (`LLMEngine(cfg, loaded=...)`), and the MoE layers choose their decode kernels then."""
    choices.set_choices(EngineConfig(**kernel_choice_args(args)).kernel_choices())


def build_engine(cfg: EngineConfig, loaded: LoadedModel) -> tuple[LLMEngine, float]:
    """(engine on the already-built model, seconds from construction to ready)."""
    if "loaded" not in inspect.signature(LLMEngine.__init__).parameters:
        raise RuntimeError("this benchmark needs LLMEngine(cfg, loaded=LoadedModel) to run on random weights")
    device = torch.device(cfg.resolved_device)
    _sync(device)
    return timed(lambda: LLMEngine(cfg, progress=False, loaded=loaded), device)


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def check_context(mc: ModelConfig, positions: int, shape: str) -> None:
    if positions > mc.max_position_embeddings:
        raise ValueError(f"{positions} positions do not fit shape {shape!r} (max_position_embeddings "
                         f"{mc.max_position_embeddings}); qwen3-8b-128k reads up to 131072 tokens")


def room_for_reads(loaded: LoadedModel, ctx: int) -> LoadedModel:
    """The model with the engine's context limit raised to `ctx` where it is short of it. A read of L
    tokens computes positions 0..L-1 only, but the engine also counts room for the token it samples
    (which this benchmark never feeds back), so a prompt of exactly max_position_embeddings tokens
    (131072 at qwen3-8b-128k) needs it. The weights and the rope frequencies are untouched: RoPE is
    computed from `RopeConfig`, which holds YaRN's original length itself."""
    if ctx <= loaded.config.max_position_embeddings:
        return loaded
    return dataclasses.replace(loaded, config=loaded.config.replace(max_position_embeddings=ctx))


def _ceilings(args, device: torch.device, dtype: torch.dtype) -> dict | None:
    if args.no_ceilings:
        return None
    c = roofline.measure_ceilings(device, dtype)
    print(f"ceilings: copy {c['copy_gbs']:.1f} GB/s, gemm {c['gemm_tflops']:.2f} TFLOP/s ({c['gemm_dtype']})",
          flush=True)
    return c


def _ceiling(ceilings: dict | None, key: str, unit: float) -> float | None:
    """The ceiling in base units (bytes/s, flop/s); None when not measured."""
    return ceilings[key] * unit if ceilings and ceilings.get(key) else None


# ---- read -------------------------------------------------------------------------------------------

def _random_weights(args, device, dtype) -> LoadedModel:
    return random_model(args.shape, device, dtype, seed=args.seed, quant=getattr(args, "quant", None))


def _strata_read(args, device, dtype, ceilings, info) -> list[dict]:
    chunks = args.chunks or [args.chunk]
    lengths = args.lengths
    mc = shape_config(args.shape)
    check_context(mc, max(lengths), args.shape)
    prompts = _prompts(mc.vocab_size, lengths, args.seed)
    loaded, info["model_init_s"] = timed(lambda: _random_weights(args, device, dtype), device)
    ctx = max(lengths) + 8
    loaded = room_for_reads(loaded, ctx)
    rows = []
    for chunk in chunks:
        eng, startup = build_engine(engine_config(args, device, ctx, 1, chunk), loaded)
        info.setdefault("startup_s", startup)
        info.setdefault("cuda_graph", getattr(eng.cfg, "cuda_graph", None))
        for n, ids in zip(lengths, prompts):
            times = []
            for rep in range(args.repeats + 1):  # the first run warms up
                req = EngineRequest(f"r{chunk}-{n}-{rep}", tuple(ids), SamplingParams(max_tokens=1), time.monotonic())
                _, s = timed(lambda: (eng.add_request(req), eng.run_to_completion()), device)
                times.append(s)
            best = min(times[1:])
            mfu = roofline.fraction(roofline.read_flops(mc, n) / best, _ceiling(ceilings, "gemm_tflops", 1e12))
            rows.append({"chunk": chunk, "prompt_tokens": n, "strata_tok_s": n / best, "strata_s": best,
                         "startup_s": startup, "mfu": mfu})
            print(f"read {n:6d} tokens, chunk {chunk:5d}: strata {n / best:10.1f} tok/s"
                  + (f"  mfu {mfu:.3f}" if mfu is not None else ""), flush=True)
        del eng
        _free(device)
    del loaded
    _free(device)
    return rows


def _hf_read(args, device, dtype, ceilings, info, rows: list[dict]) -> None:
    mc = shape_config(args.shape)
    prompts = _prompts(mc.vocab_size, args.lengths, args.seed)
    hf, info["hf_init_s"] = timed(lambda: random_hf_model(args.shape, device, dtype, seed=args.seed), device)
    for n, ids in zip(args.lengths, prompts):
        fields: dict = {"hf_tok_s": None, "hf_s": None, "hf_mfu": None}
        try:
            with torch.inference_mode():
                x = torch.tensor([ids], device=device)
                times = [timed(lambda: hf(x, logits_to_keep=1), device)[1] for _ in range(args.repeats + 1)]
            best = min(times[1:])
            fields = {"hf_tok_s": n / best, "hf_s": best,
                      "hf_mfu": roofline.fraction(roofline.read_flops(mc, n) / best,
                                                  _ceiling(ceilings, "gemm_tflops", 1e12))}
            print(f"read {n:6d} tokens: hf {n / best:10.1f} tok/s", flush=True)
        except torch.OutOfMemoryError:
            fields["hf_error"] = "out of memory"
            print(f"read {n:6d} tokens: hf out of memory", flush=True)
            _free(device)
        for r in rows:
            if r["prompt_tokens"] == n:
                r.update(fields)
    del hf
    _free(device)


# ---- decode -----------------------------------------------------------------------------------------

def _decode_once(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str, device) -> dict:
    t_add = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(EngineRequest(f"{tag}-{i}", tuple(p), params, time.monotonic()))
    first_s = None  # submission to the first request's first token (its read)
    while any(r.num_computed_tokens < len(r.prompt_ids) for r in eng.requests.values()):
        events = eng.step()  # finish the reads; decode timing starts after them
        if first_s is None and any(ev.token_ids for ev in events):
            _sync(device)
            first_s = time.perf_counter() - t_add
    # A request whose read ended early may have decoded a few tokens already: count only the rest.
    before = sum(len(r.output_ids) for r in eng.requests.values())
    _sync(device)
    step_s = []
    new = early = 0
    t0 = time.perf_counter()
    while eng.has_work():
        ts = time.perf_counter()
        events = eng.step()
        step_s.append(time.perf_counter() - ts)
        if params.grammar is not None:  # a grammar may finish a request before max_tokens
            new += sum(len(ev.token_ids) for ev in events)
            early += sum(ev.finish_reason is not None and ev.completion_tokens < params.max_tokens for ev in events)
    _sync(device)
    if params.grammar is None:
        new = len(prompts) * params.max_tokens - before
    return {"s": time.perf_counter() - t0, "new": new, "steps": len(step_s), "step_s": step_s,
            "finished_early": early, "first_s": first_s}


def _model_config(args) -> ModelConfig:
    """The config of the model a run measures: `--model`'s checkpoint, else the random `--shape`."""
    if getattr(args, "model", None):
        from strata.loaders import read_checkpoint

        return ModelConfig.from_hf(read_checkpoint(_model_path(args)).config)
    return shape_config(args.shape)


def _model_path(args) -> str:
    from strata.loaders import default_model_path

    return default_model_path() if args.model == "default" else args.model


def _load_weights(args, device, dtype) -> LoadedModel:
    if getattr(args, "model", None):
        from strata.loaders import load_model

        return load_model(_model_path(args), device, dtype, progress=False)
    return _random_weights(args, device, dtype)


def _median(values: list[float]) -> float | None:
    return percentile(values, 50)


def _summary(rows: list[dict], runs: list[dict], prompt: int) -> dict:
    """Batch 1's timed runs, as medians: decode tok/s (after the read), the first token's time for a
    `prompt`-token prompt (submission to the read's token) and the time per decoded token."""
    tok_s = [r["new"] / r["s"] for r in runs]
    return {"batch": 1, "prompt_tokens": prompt, "new_tokens": rows[0]["new_tokens"], "runs": len(runs),
            "decode_tok_s": _median(tok_s), "decode_tok_s_runs": tok_s,
            "first_token_ms": _median([r["first_s"] * 1e3 for r in runs if r["first_s"] is not None]),
            "per_token_ms": _median([r["s"] * 1e3 / r["new"] for r in runs]),
            "step_p50_ms": rows[0]["strata_step_p50_ms"]}


def _strata_decode(args, device, dtype, ceilings, info) -> list[dict]:
    mc = _model_config(args)
    ctx = args.prompt + args.tokens + 8
    check_context(mc, args.prompt + args.tokens, args.shape)
    loaded, info["model_init_s"] = timed(lambda: _load_weights(args, device, dtype), device)
    grammar = getattr(args, "grammar", None)
    if grammar and not getattr(args, "tokenizer", None):
        raise SystemExit("--grammar json needs --tokenizer: a vocab GGUF (e.g. .cache/llama-cpp-vocab-0.3.16/"
                         "ggml-vocab-qwen2.gguf from tests/fetch_vocab.py) or an HF model directory")
    if getattr(args, "tokenizer", None):
        loaded = with_tokenizer(loaded, _load_tokenizer(args.tokenizer))
    info["grammar"] = grammar
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True,
                            grammar=BENCH_GRAMMARS[grammar]() if grammar else None)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    # Mean context a timed step reads: tokens 2..T see prompt + 1 .. prompt + T - 1.
    context = args.prompt + args.tokens / 2
    rows = []
    for b in args.batch:
        eng, startup = build_engine(engine_config(args, device, ctx, b, args.chunk), loaded)
        info.setdefault("startup_s", startup)
        info.setdefault("cuda_graph", getattr(eng.cfg, "cuda_graph", None))
        info.setdefault("async_scheduling", getattr(eng.cfg, "async_scheduling", None))
        prompts = _prompts(mc.vocab_size, [args.prompt] * b, args.seed + b)
        runs = [_decode_once(eng, prompts, params, f"d{b}-{rep}", device) for rep in range(args.repeats + 1)]
        best = min(runs[1:], key=lambda r: r["s"] / max(r["new"], 1))
        if b == 1:
            batch1 = runs[1:]
        w = roofline.weight_bytes_per_step(mc, b, itemsize)
        kv = roofline.kv_bytes_per_step(mc, b, context, args.kv, dtype)
        steps_per_s = best["steps"] / best["s"]
        frac = roofline.fraction((w + kv) * steps_per_s, _ceiling(ceilings, "copy_gbs", 1e9))
        step_ms = sorted(s * 1e3 for r in runs[1:] for s in r["step_s"])
        rows.append({"batch": b, "new_tokens": best["new"], "strata_tok_s": best["new"] / best["s"],
                     "strata_s": best["s"], "steps": best["steps"], "startup_s": startup,
                     "strata_step_p50_ms": percentile(step_ms, 50), "strata_step_p99_ms": percentile(step_ms, 99),
                     "finished_early": best["finished_early"],
                     "weight_bytes_per_step": w, "kv_bytes_per_step": kv, "bandwidth_fraction": frac})
        print(f"decode batch {b:3d}: strata {best['new'] / best['s']:9.1f} tok/s"
              + (f"  bandwidth {frac:.3f}" if frac is not None else ""), flush=True)
        if b == 1:
            info["summary"] = _summary(rows[-1:], batch1, args.prompt)
        del eng
        _free(device)
    if args.http:
        info["http"] = _http(args, device, loaded, mc)
        b1 = next((r for r in rows if r["batch"] == 1), None)
        if b1 is not None:
            b1.update({k: v for k, v in info["http"].items() if k in HTTP_ROW_FIELDS})
        if "summary" in info and info["http"].get("http_b1_tok_s"):
            # The server's batch-1 rate (its best run, as the engine row's `strata_tok_s`) beside the engine's.
            info["summary"]["http_decode_tok_s"] = info["http"]["http_b1_tok_s"]
            info["summary"]["http_vs_engine"] = info["http"]["http_b1_tok_s"] / b1["strata_tok_s"]
    del loaded
    _free(device)
    return rows


# json: any JSON object (what response_format json_object asks). Random weights may close it early,
# shrinking the batch; json-array asks for JSON objects in an array too long to finish, so the batch
# stays full with the same kind of masks.
BENCH_GRAMMARS = {
    "json": GrammarSpec.json_object,
    "json-array": lambda: GrammarSpec.json_schema({"type": "array", "items": {"type": "object"}, "minItems": 100000},
                                                  strict=False),
}


def _load_tokenizer(path: str):
    """A vocab GGUF or an HF model directory (tokenizer.json), for `--tokenizer`."""
    if path.endswith(".gguf"):
        from strata.loaders.gguf import open_reader
        from strata.loaders.gguf_vocab import tokenizer_from_gguf

        return tokenizer_from_gguf(open_reader(path), path)
    from strata.tokenizer import Tokenizer

    return Tokenizer.from_hf_dir(path)


HTTP_ROW_FIELDS = ("http_b1_tok_s", "http_itl_p50_ms", "http_itl_p99_ms")


def _http(args, device, loaded: LoadedModel, mc: ModelConfig) -> dict:
    # The server needs a tokenizer: it checks prompt ids against the vocabulary and streams text, one
    # chunk per token only when every token decodes to text of its own (a real model's may merge some:
    # `http_tokens_per_chunk` says so).
    served = loaded if getattr(args, "model", None) else with_tokenizer(loaded, synthetic_tokenizer(mc.vocab_size))
    eng, startup = build_engine(engine_config(args, device, args.prompt + args.tokens + 8, 1, args.chunk), served)
    out = measure_http(eng, _name(args), args.prompt, args.tokens, mc.vocab_size, args.repeats, seed=args.seed,
                       stream_interval_ms=getattr(args, "stream_interval_ms", None))
    out["http_startup_s"] = startup
    del eng
    _free(device)
    print(f"decode http b1: {out['http_b1_tok_s'] or 0:9.1f} tok/s  itl p50 {out['http_itl_p50_ms'] or 0:.2f} ms"
          f"  p99 {out['http_itl_p99_ms'] or 0:.2f} ms", flush=True)
    return out


def _hf_decode_seconds(hf, x: torch.Tensor, tokens: int) -> float:
    """Seconds from HF's first new token (the read's) to its last, clocked by a streamer: `generate`
    hands it each step's tokens after copying them to the host, i.e. once the step is done."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:  # first the prompt, then each step's new tokens
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    clock = Clock()
    with torch.inference_mode():
        hf.generate(x, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, streamer=clock)
    return clock.times[-1] - clock.times[1]


def _hf_decode(args, device, dtype, ceilings, info, rows: list[dict]) -> None:
    mc = shape_config(args.shape)
    hf, info["hf_init_s"] = timed(lambda: random_hf_model(args.shape, device, dtype, seed=args.seed), device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    context = args.prompt + args.tokens / 2
    for r in rows:
        b = r["batch"]
        prompts = _prompts(mc.vocab_size, [args.prompt] * b, args.seed + b)
        x = torch.tensor(prompts, device=device)
        best = min([_hf_decode_seconds(hf, x, args.tokens) for _ in range(args.repeats + 1)][1:])
        steps = args.tokens - 1  # the first token of each came with its read
        w = roofline.weight_bytes_per_step(mc, b, itemsize)
        kv = roofline.kv_bytes_per_step(mc, b, context, "auto", dtype)
        r.update({"hf_tok_s": b * steps / best, "hf_s": best,
                  "hf_bandwidth_fraction": roofline.fraction((w + kv) * steps / best,
                                                             _ceiling(ceilings, "copy_gbs", 1e9))})
        print(f"decode batch {b:3d}: hf {b * steps / best:9.1f} tok/s", flush=True)
    del hf
    _free(device)


# ---- entry ------------------------------------------------------------------------------------------

def default_out(which: str, shape: str, kv: str, device: torch.device, quant: str | None = None) -> str:
    return (f"bench/results/{which}_{shape}{'_' + quant if quant else ''}{'_int8' if kv == 'int8' else ''}"
            f"_{device.type}.json")


def _name(args) -> str:
    """What the run measured, in file names and titles: `default` (the embedded model), a checkpoint's
    name, or `random-SHAPE`."""
    model = getattr(args, "model", None)
    if model:
        return model if model == "default" else os.path.basename(os.path.normpath(model)).removesuffix(".gguf")
    return f"random-{args.shape}"


# `bench decode` of a real model (`--model`) measures what its user sees first: one request, a short
# prompt, a long answer, five timed runs (medians in `summary`); a random shape keeps the batch sweep.
_DECODE_DEFAULTS = {"batch": ([1, 8, 32], [1]), "prompt": (512, 32), "tokens": (128, 256), "repeats": (2, 5)}


def run(args) -> int:
    if args.which == "decode":
        for key, (shape_default, model_default) in _DECODE_DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, model_default if args.model else shape_default)
    elif args.repeats is None:
        args.repeats = 2
    if getattr(args, "model", None):
        if not args.no_hf:
            print("--model: Strata only (the HF arm runs random shapes)", flush=True)
            args.no_hf = True
        args.shape = _name(args)
    install_kernel_choices(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, args.dtype)
    if getattr(args, "quant", None) and not args.no_hf:
        raise SystemExit("--quant times Strata's kept-quantized weights only: add --no-hf")
    if args.which == "decode" and args.http and 1 not in args.batch:
        print("--http measures batch 1; its numbers go in the top-level `http` object only", flush=True)
    info: dict = {"bench": args.which, "shape": args.shape, "device": str(device), "dtype": args.dtype,
                  "kv": args.kv, "quant": getattr(args, "quant", None),
                  "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "torch": torch.__version__}
    mc = _model_config(args)
    info["params"] = {"total": roofline.total_params(mc), "active_per_token": roofline.active_params_per_token(mc)}
    info["ceilings"] = _ceilings(args, device, dtype)
    strata_arm, hf_arm = (_strata_read, _hf_read) if args.which == "read" else (_strata_decode, _hf_decode)
    rows = strata_arm(args, device, dtype, info["ceilings"], info)
    if not args.no_hf:
        hf_arm(args, device, dtype, info["ceilings"], info, rows)
    info["args"] = {k: v for k, v in vars(args).items() if k != "func"}
    info["rows"] = rows
    out = args.out or default_out(args.which, args.shape, args.kv, device, getattr(args, "quant", None))
    if not args.out and getattr(args, "tokenizer", None):  # beside the plain arm's file, not over it
        out = out.removesuffix(".json") + f"_{'grammar-' + args.grammar if args.grammar else 'masked'}.json"
    save(info, out, _draw)
    print_tables(summary_tables(info))
    return 0


_READ_COLUMNS = [("chunk", "chunk", "d"), ("prompt tokens", "prompt_tokens", "d"), ("strata tok/s", "strata_tok_s", ".1f"),
                 ("mfu", "mfu", ".3f"), ("hf tok/s", "hf_tok_s", ".1f"), ("hf mfu", "hf_mfu", ".3f"),
                 ("strata / hf", "vs_hf", ".2f"), ("hf error", "hf_error", "")]
_DECODE_COLUMNS = [("batch", "batch", "d"), ("new tokens", "new_tokens", "d"), ("strata tok/s", "strata_tok_s", ".1f"),
                   ("step p50 ms", "strata_step_p50_ms", ".2f"), ("step p99 ms", "strata_step_p99_ms", ".2f"),
                   ("bandwidth", "bandwidth_fraction", ".3f"), ("hf tok/s", "hf_tok_s", ".1f"),
                   ("hf bandwidth", "hf_bandwidth_fraction", ".3f"), ("strata / hf", "vs_hf", ".2f"),
                   ("http b1 tok/s", "http_b1_tok_s", ".1f"), ("http itl p50 ms", "http_itl_p50_ms", ".2f"),
                   ("http itl p99 ms", "http_itl_p99_ms", ".2f")]


def summary_tables(info: dict) -> list:
    """The run's rows as one rich table (the JSON holds the same numbers)."""
    rows = [{**r, "vs_hf": r["strata_tok_s"] / r["hf_tok_s"] if r.get("hf_tok_s") else None} for r in info["rows"]]
    read = info["bench"] == "read"
    kv = f", KV {info['kv']}" if info.get("kv") not in (None, "auto") else ""
    title = f"{info['bench']}: {info['shape']} on {info.get('gpu') or info['device']} ({info['dtype']}{kv})"
    return [summary_table(title, _READ_COLUMNS if read else _DECODE_COLUMNS, rows)]


def _draw(plt, info: dict) -> None:
    read = info["bench"] == "read"
    x_key = "prompt_tokens" if read else "batch"
    rows = info["rows"]
    xs = sorted({r[x_key] for r in rows})
    series: list[tuple[str, dict]] = []
    chunks = sorted({r["chunk"] for r in rows if r.get("chunk") is not None})
    if read and len(chunks) > 1:
        for c in chunks:
            series.append((f"Strata, chunk {c}", {r[x_key]: r["strata_tok_s"] for r in rows if r.get("chunk") == c}))
    else:
        series.append(("Strata", {r[x_key]: r["strata_tok_s"] for r in rows}))
    if any(r.get("http_b1_tok_s") for r in rows):
        series.append(("Strata over HTTP", {r[x_key]: r["http_b1_tok_s"] for r in rows if r.get("http_b1_tok_s")}))
    hf = {r[x_key]: r["hf_tok_s"] for r in rows if r.get("hf_tok_s")}
    if hf:
        series.append(("HF transformers", hf))
    _, ax = plt.subplots(figsize=(7, 3.8))
    w = 0.8 / len(series)
    for i, (label, values) in enumerate(series):
        pos = [j + (i - (len(series) - 1) / 2) * w for j, x in enumerate(xs) if x in values]
        ax.bar(pos, [values[x] for x in xs if x in values], w, label=label)
    ax.set_xticks(list(range(len(xs))), [str(x) for x in xs])
    ax.set_xlabel(x_key.replace("_", " "))
    ax.set_ylabel("tokens / s")
    kv = f", KV {info['kv']}" if info.get("kv") not in (None, "auto") else ""
    ax.set_title(f"{info['bench']} — {info['shape']} on {info['gpu'] or info['device']} ({info['dtype']}{kv})")
    ax.legend()


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_parsers(sub) -> None:
    for which in ("read", "decode"):
        p = sub.add_parser(which, help=f"{'prompt-read' if which == 'read' else 'decode'} tok/s beside HF transformers")
        p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
        p.add_argument("--device", default=None)
        p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
        p.add_argument("--kv", default="auto", choices=["auto", "bf16", "int8"], help="KV cache storage")
        p.add_argument("--chunk", type=int, default=8192, help="prompt tokens per step")
        p.add_argument("--repeats", type=int, default=None,
                       help="timed runs after one warm-up (default: 2; decode of a --model: 5)")
        p.add_argument("--seed", type=int, default=0, help="weights and prompts")
        p.add_argument("--no-hf", action="store_true", help="Strata only")
        p.add_argument("--no-cuda-graph", action="store_true", help="EngineConfig(cuda_graph=False)")
        p.add_argument("--no-async-scheduling", action="store_true", help="EngineConfig(async_scheduling=False)")
        p.add_argument("--no-ceilings", action="store_true", help="skip the copy/GEMM ceilings (fractions null)")
        p.add_argument("--batch-invariant", action="store_true", help="EngineConfig(batch_invariant=True)")
        add_kernel_choice_flags(p)
        p.add_argument("--quant", default=None,
                       help="random weights kept quantized: a GGUF format (Q8_0, Q4_K, IQ3_S, ...) or FP8 (made at "
                            "load, as --quantize fp8); Strata only (HF runs bf16: use --no-hf)")
        p.add_argument("--out", default=None,
                       help="default: bench/results/{which}_{shape}[_{quant}][_int8]_{device}.json")
        if which == "read":
            p.add_argument("--lengths", type=_int_list, default=[4096, 32768])
            p.add_argument("--chunks", type=_int_list, default=None,
                           help="time each length at these chunk sizes (e.g. 512,2048,8192); overrides --chunk")
        else:
            p.add_argument("--model", default=None,
                           help="`default` (the embedded model) or an HF directory / .gguf file, instead of random "
                                "weights at --shape; Strata only, and a `summary` of batch 1 in the JSON")
            p.add_argument("--batch", type=_int_list, default=None, help="default: 1,8,32; with --model 1")
            p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default: 512; with --model 32)")
            p.add_argument("--tokens", type=int, default=None, help="new tokens (default: 128; with --model 256)")
            p.add_argument("--http", action="store_true", help="also batch-1 decode through the OpenAI server")
            p.add_argument("--stream-interval-ms", type=float, default=None,
                           help="with --http: the server's --stream-interval-ms (default: the server's, 16 on the "
                                "CPU and 0 elsewhere; 0 writes every step)")
            p.add_argument("--tokenizer", default=None,
                           help="a vocab GGUF or HF model dir: the engine gets a grammar compiler (mask kernel on)")
            p.add_argument("--grammar", default=None, choices=["json", "json-array"],
                           help="every request gets a json_object grammar (json-array: a list of objects that cannot "
                                "end early, so the batch stays full); needs --tokenizer")
        p.set_defaults(func=run, which=which)
