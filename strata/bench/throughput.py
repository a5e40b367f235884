"""`strata bench read|decode`: prompt-read and decode throughput of the serving engine, measured
beside HF transformers running the same shapes in the same process.

Random weights at a named shape (`qwen3-8b` by default; `tiny` for CPU smoke runs), bf16 on CUDA and
fp32 on the CPU. Read: one prompt of each length, timed from submission to its first token. Decode:
`batch` requests of `prompt` tokens each, `tokens` new tokens each with `ignore_eos`, timed after the
reads are done. HF: one forward over the prompt (read), `generate` with a fixed number of new tokens
(decode). Writes JSON under bench/results/ and, when matplotlib is installed, a PNG beside it.
"""

from __future__ import annotations

import time

import torch

from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.bench.results import save
from strata.params import SamplingParams

SHAPES = {
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False),
    "tiny": dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_checkpoint(shape: str, path: str, device: torch.device, dtype: torch.dtype) -> None:
    """Writes an HF directory with random weights (built by HF transformers) so both engines load it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(SHAPES[shape])
    mt = d.pop("model_type")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **d), dtype=dtype)
    model.save_pretrained(path)
    del model


def _engine(path: str, device: torch.device, dtype: str, ctx: int, parallel: int, chunk: int) -> LLMEngine:
    # An explicit KV size: the HF model shares the GPU, so the pool must not take the free memory.
    cfg = EngineConfig(model=path, device=str(device), dtype=dtype, ctx=ctx, parallel=parallel,
                       chunk_size=chunk, max_num_batched_tokens=max(chunk, parallel), kv_size=ctx * parallel)
    return LLMEngine(cfg)


def bench_read(args, path: str, device: torch.device, dtype: torch.dtype) -> list[dict]:
    rows = []
    vocab = SHAPES[args.shape]["vocab_size"]
    eng = _engine(path, device, args.dtype, max(args.lengths) + 8, 1, args.chunk)
    hf = _hf(path, device, dtype)
    for n in args.lengths:
        ids = torch.randint(0, vocab, (n,)).tolist()
        times = []
        for rep in range(args.repeats + 1):  # the first run warms up
            _sync(device)
            t0 = time.perf_counter()
            eng.add_request(EngineRequest(f"r{n}-{rep}", tuple(ids), SamplingParams(max_tokens=1), time.monotonic()))
            eng.run_to_completion()
            _sync(device)
            times.append(time.perf_counter() - t0)
        strata_s = min(times[1:])
        hf_times = []
        with torch.inference_mode():
            x = torch.tensor([ids], device=device)
            for _ in range(args.repeats + 1):
                _sync(device)
                t0 = time.perf_counter()
                hf(x, logits_to_keep=1)
                _sync(device)
                hf_times.append(time.perf_counter() - t0)
        hf_s = min(hf_times[1:])
        rows.append({"prompt_tokens": n, "strata_tok_s": n / strata_s, "hf_tok_s": n / hf_s,
                     "strata_s": strata_s, "hf_s": hf_s})
        print(f"read {n:6d} tokens: strata {n / strata_s:10.1f} tok/s   hf {n / hf_s:10.1f} tok/s", flush=True)
    return rows


def bench_decode(args, path: str, device: torch.device, dtype: torch.dtype) -> list[dict]:
    rows = []
    vocab = SHAPES[args.shape]["vocab_size"]
    hf = _hf(path, device, dtype)
    for b in args.batch:
        eng = _engine(path, device, args.dtype, args.prompt + args.tokens + 8, b, args.chunk)
        prompts = [torch.randint(0, vocab, (args.prompt,)).tolist() for _ in range(b)]
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        best = float("inf")
        for rep in range(args.repeats + 1):
            for i, p in enumerate(prompts):
                eng.add_request(EngineRequest(f"d{b}-{rep}-{i}", tuple(p), params, time.monotonic()))
            while any(r.num_computed_tokens < len(r.prompt_ids) for r in eng.requests.values()):
                eng.step()  # finish the reads; decode timing starts after them
            _sync(device)
            t0 = time.perf_counter()
            eng.run_to_completion()
            _sync(device)
            if rep:
                best = min(best, time.perf_counter() - t0)
        new = b * (args.tokens - 1)  # the first token of each came with its read
        hf_best = float("inf")
        with torch.inference_mode():
            x = torch.tensor(prompts, device=device)
            for rep in range(args.repeats + 1):
                _sync(device)
                t0 = time.perf_counter()
                hf.generate(x, max_new_tokens=1, min_new_tokens=1, do_sample=False)
                _sync(device)
                t_read = time.perf_counter() - t0
                t0 = time.perf_counter()
                hf.generate(x, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
                _sync(device)
                if rep:
                    hf_best = min(hf_best, time.perf_counter() - t0 - t_read)
        rows.append({"batch": b, "new_tokens": new, "strata_tok_s": new / best, "hf_tok_s": new / hf_best})
        print(f"decode batch {b}: strata {new / best:8.1f} tok/s   hf {new / hf_best:8.1f} tok/s", flush=True)
    return rows


def _hf(path: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def run(args) -> int:
    import tempfile

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        random_checkpoint(args.shape, tmp, device, dtype)
        rows = (bench_read if args.which == "read" else bench_decode)(args, tmp, device, dtype)
    info = {"bench": args.which, "shape": args.shape, "device": str(device), "dtype": args.dtype,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__, "args": {k: v for k, v in vars(args).items() if k != "func"}, "rows": rows}
    out = args.out or f"bench/results/{args.which}_{args.shape}_{device.type}.json"
    save(info, out, _draw)
    return 0


def _draw(plt, info: dict) -> None:
    x_key = "prompt_tokens" if info["bench"] == "read" else "batch"
    xs = [str(r[x_key]) for r in info["rows"]]
    _, ax = plt.subplots(figsize=(6, 3.5))
    w = 0.38
    pos = range(len(xs))
    ax.bar([p - w / 2 for p in pos], [r["strata_tok_s"] for r in info["rows"]], w, label="Strata")
    ax.bar([p + w / 2 for p in pos], [r["hf_tok_s"] for r in info["rows"]], w, label="HF transformers")
    ax.set_xticks(list(pos), xs)
    ax.set_xlabel(x_key.replace("_", " "))
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{info['bench']} — {info['shape']} on {info['gpu'] or info['device']} ({info['dtype']})")
    ax.legend()


def add_parsers(sub) -> None:
    for which in ("read", "decode"):
        p = sub.add_parser(which, help=f"{'prompt-read' if which == 'read' else 'decode'} tok/s beside HF transformers")
        p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
        p.add_argument("--device", default=None)
        p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
        p.add_argument("--chunk", type=int, default=8192, help="prompt tokens per step")
        p.add_argument("--repeats", type=int, default=2)
        p.add_argument("--out", default=None)
        if which == "read":
            p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 32768])
        else:
            p.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
            p.add_argument("--prompt", type=int, default=512)
            p.add_argument("--tokens", type=int, default=128)
        p.set_defaults(func=run, which=which)
