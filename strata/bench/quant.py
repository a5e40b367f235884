"""`strata bench quant`: weights kept quantized (GGUF Q8_0 / Q4_K / IQ3_S / Q6_K) against bf16.

One random model per format at `--shape` (`random_model(..., quant=...)`: the linear weights a GGUF
load keeps quantized, MoE experts included (`--shape qwen3-30b-a3b`: the grouped kernels of
`strata.kernels.quant.moe_q`), are random valid blocks of the format, made on the device; embeddings
and norms stay in the model dtype). Per format: the device bytes of all weights (`weights_gib`),
batch-1 decode (`decode_b1_tok_s`, `--prompt` tokens then `--tokens` new ones, timed after the read),
the read of one `--read-tokens` prompt (`read_4096_tok_s` by default), and the decode's bandwidth
fraction: the bytes a step streams (every weight except the embedding table; for MoE shapes that
counts every expert, not the few a step reads) times steps per second over the measured copy rate.
The arms run one after another in one process; ratios against the bf16 row are in the JSON.
"""

from __future__ import annotations

import argparse
import time

import torch

from strata.bench import roofline
from strata.bench.random_model import SHAPES, random_model, shape_config, timed
from strata.bench.results import print_tables, save, summary_table
from strata.bench.throughput import (_decode_once, _free, _prompts, add_kernel_choice_flags, build_engine,
                                     engine_config, install_kernel_choices)
from strata.engine.types import EngineRequest
from strata.kernels.quant import FORMATS
from strata.kernels.quant.mixes import MIXES
from strata.kernels.quant.moe_q import QExpertStack
from strata.models.layers import QuantizedEmbedding
from strata.models.quantize import qweights_of, quantize_fp8
from strata.params import SamplingParams


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(all weight bytes on the device, the embedding table's): each storage counted once (stacked
    projections are views of one buffer), quantized weights by their planes."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_meta or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    total += sum(q.nbytes for q in qweights_of(model))
    for m in model.modules():
        for t in getattr(m, "fp8", None) or ():  # MoE experts in e4m3 (`quantize_fp8`)
            total += t.numel() * t.element_size()
        for stack in getattr(m, "quant", None) or ():  # MoE experts kept quantized (`moe_q.QExpertStack`)
            total += stack.nbytes if isinstance(stack, QExpertStack) else 0
    emb = model.model.embed_tokens
    return total, emb.q.nbytes if isinstance(emb, QuantizedEmbedding) else emb.weight.numel() * emb.weight.element_size()


def _arm(args, fmt: str, device: torch.device, dtype: torch.dtype, copy_bps: float | None) -> dict:
    mc = shape_config(args.shape)
    gguf = fmt not in ("bf16", "FP8")
    loaded, init_s = timed(lambda: random_model(args.shape, device, dtype, seed=args.seed,
                                                quant=fmt if gguf else None), device)
    if fmt == "FP8":  # made at load from the float weights, as `--quantize fp8` does
        quantize_fp8(loaded.model)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    total, emb = weight_bytes(loaded.model)
    row = {"format": fmt, "weights_gib": total / 2**30, "model_init_s": init_s}
    ctx = max(args.prompt + args.tokens, args.read_tokens) + 8
    eng, row["startup_s"] = build_engine(engine_config(args, device, ctx, 1, args.chunk), loaded)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    prompt = _prompts(mc.vocab_size, [args.prompt], args.seed)
    runs = [_decode_once(eng, prompt, params, f"{fmt}-d{rep}", device) for rep in range(args.repeats + 1)]
    best = min(runs[1:], key=lambda r: r["s"] / max(r["new"], 1))
    row["decode_b1_tok_s"] = best["new"] / best["s"]
    row["bandwidth_fraction"] = roofline.fraction((total - emb) * best["steps"] / best["s"], copy_bps)
    ids = _prompts(mc.vocab_size, [args.read_tokens], args.seed + 1)[0]
    times = []
    for rep in range(args.repeats + 1):  # the first run warms up
        req = EngineRequest(f"{fmt}-r{rep}", tuple(ids), SamplingParams(max_tokens=1), time.monotonic())
        times.append(timed(lambda: (eng.add_request(req), eng.run_to_completion()), device)[1])
    row[f"read_{args.read_tokens}_tok_s"] = args.read_tokens / min(times[1:])
    print(f"{fmt:6s}: weights {row['weights_gib']:.2f} GiB, decode b1 {row['decode_b1_tok_s']:.1f} tok/s, "
          f"read {args.read_tokens} {row[f'read_{args.read_tokens}_tok_s']:.0f} tok/s", flush=True)
    del eng, loaded
    _free(device)
    return row


def run(args) -> int:
    install_kernel_choices(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    ceilings = None if args.no_ceilings or device.type != "cuda" else roofline.measure_ceilings(device, dtype)
    copy_bps = ceilings["copy_gbs"] * 1e9 if ceilings else None
    rows = [_arm(args, fmt, device, dtype, copy_bps) for fmt in args.formats]
    base = next((r for r in rows if r["format"] == "bf16"), None)
    read_key = f"read_{args.read_tokens}_tok_s"
    for r in rows:
        if base:
            r["decode_vs_bf16"] = r["decode_b1_tok_s"] / base["decode_b1_tok_s"]
            r["read_vs_bf16"] = r[read_key] / base[read_key]
    info = {"bench": "quant", "shape": args.shape, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "ceilings": ceilings, "args": {k: v for k, v in vars(args).items() if k != "func"}, "rows": rows}
    out = args.out or f"bench/results/quant_{args.shape}_{device.type}.json"

    def draw(plt, info):
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        names = [r["format"] for r in info["rows"]]
        axes[0].bar(names, [r["decode_b1_tok_s"] for r in info["rows"]])
        axes[0].set_ylabel("decode batch 1 (tok/s)")
        axes[1].bar(names, [r[read_key] for r in info["rows"]])
        axes[1].set_ylabel(f"read {args.read_tokens} (tok/s)")

    save(info, out, draw)
    print_tables([summary_table(f"quantized weights: {args.shape} on {info['gpu'] or device.type}",
                                [("format", "format", ""), ("weights GiB", "weights_gib", ".3f"),
                                 ("decode b1 tok/s", "decode_b1_tok_s", ".1f"), ("vs bf16", "decode_vs_bf16", ".2f"),
                                 (f"read {args.read_tokens} tok/s", read_key, ".0f"), ("vs bf16", "read_vs_bf16", ".2f"),
                                 ("bandwidth", "bandwidth_fraction", ".3f")], rows)])
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("quant", help="quantized weights (Q8_0 / Q4_K / IQ3_S / Q6_K / FP8) against bf16: memory, "
                                     "decode, read")
    _add_args(p)


def _formats(s: str) -> list[str]:
    out = [f.strip() for f in s.split(",") if f.strip()]
    bad = [f for f in out if f not in ("bf16", "FP8") and f not in FORMATS and f not in MIXES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown format(s) {bad}; choose from bf16, {', '.join(FORMATS)}, "
                                         f"{', '.join(MIXES)}, FP8")
    return out


def _add_args(p) -> None:
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--formats", type=_formats, default=["bf16", *FORMATS, "FP8"],
                   help=f"comma-separated, of bf16, {', '.join(FORMATS)}, FP8, or the mixes {', '.join(MIXES)}")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--read-tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv", default="auto")
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--no-ceilings", action="store_true")
    add_kernel_choice_flags(p)
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="strata bench quant")
    _add_args(parser)
    ns = parser.parse_args()
    raise SystemExit(ns.func(ns))
