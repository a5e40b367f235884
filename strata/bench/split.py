"""`strata bench split`: pipeline stages by layer ranges (--split-mode layer) against one stage, on CUDA.

Arms, each an engine of its own, one after another: one stage with one slot and with two, then the split
with one slot and with two (its decode groups as micro-batches, --batch-groups). Each arm reads one
prompt of --read tokens (read tok/s) and decodes --decode tokens per slot (decode tok/s, all slots
together). The summary holds `gpus`, `two_slots_over_one` (the split's two slots against its one),
`two_stages_over_one` (the split's one-slot decode against one stage's; null when the model does not fit
one card), and `decode_over_llamacpp` / `read_over_llamacpp` against llama.cpp's `-sm layer` figures
given with --llamacpp (a JSON of `decode_tok_s` and `read_tok_s`), null without them.
"""

from __future__ import annotations

import dataclasses
import json
import time

from strata.bench.results import save


def _ratio(a, b):
    return None if a is None or not b else a / b


def summarize(arms: dict[str, dict | None], gpus: int, llamacpp: dict | None) -> dict:
    """The summary of the arms' figures (an arm that could not run is None)."""
    def get(arm, key):
        return (arms.get(arm) or {}).get(key)

    llama = llamacpp or {}
    return {
        "gpus": gpus,
        "two_slots_over_one": _ratio(get("split_2", "decode_tok_s"), get("split_1", "decode_tok_s")),
        "two_stages_over_one": _ratio(get("split_1", "decode_tok_s"), get("one_1", "decode_tok_s")),
        "decode_over_llamacpp": _ratio(get("split_1", "decode_tok_s"), llama.get("decode_tok_s")),
        "read_over_llamacpp": _ratio(get("split_1", "read_tok_s"), llama.get("read_tok_s")),
    }


def _arm(cfg, read: int, decode: int) -> dict:
    from strata.engine.engine import LLMEngine
    from strata.engine.types import EngineRequest
    from strata.params import SamplingParams

    e = LLMEngine(cfg, progress=False)
    try:
        vocab = e.model_config.vocab_size
        ids = tuple((7 * i + 11) % (vocab - 1) + 1 for i in range(read))

        def run(prompts: list[tuple[int, ...]], max_tokens: int) -> tuple[float, float, int]:
            t0 = time.perf_counter()
            first, n = None, 0
            for i, p in enumerate(prompts):
                e.add_request(EngineRequest(f"b{time.monotonic_ns()}-{i}", p,
                                            SamplingParams(max_tokens=max_tokens, ignore_eos=True), time.monotonic()))
            while e.has_work():
                for ev in e.step():
                    n += len(ev.token_ids)
                    if first is None and ev.token_ids:
                        first = time.perf_counter()
            return first - t0, time.perf_counter() - first, n

        run([ids[:16]], 4)  # warm-up
        ttft, _, _ = run([ids], 1)
        slots = cfg.parallel
        _, t, n = run([ids[: 32 + s] for s in range(slots)], decode)
        return {"read_tok_s": read / ttft, "decode_tok_s": (n - slots) / t, "slots": slots}
    finally:
        e.close()


def run(args) -> dict:
    import torch

    from strata.config import EngineConfig
    from strata.dist.plan import parse_devices

    if not torch.cuda.is_available():
        raise ValueError("strata bench split measures GPUs: it needs CUDA")
    devices = parse_devices(args.devices)
    gpus = len(args.tensor_split.split(",")) if args.tensor_split else len(devices or range(torch.cuda.device_count()))
    base = EngineConfig(model=args.model, device="cuda", dtype=args.dtype, kv=args.kv, ctx=args.read + args.decode + 64,
                        gpu_memory=args.gpu_memory, spec=args.spec, batch_mtp=bool(args.spec))
    split = dict(split_mode="layer", tensor_split=args.tensor_split, devices=args.devices)
    arms: dict[str, dict | None] = {}
    for name, kw in (("one_1", {}), ("one_2", dict(parallel=2)), ("split_1", split),
                     ("split_2", dict(split, parallel=2, batch_groups=2))):
        try:
            arms[name] = _arm(dataclasses.replace(base, **kw), args.read, args.decode)
        except torch.OutOfMemoryError as e:  # one stage may not hold the model: that figure stays null
            arms[name] = None
            print(f"{name}: out of memory ({str(e).splitlines()[0]})")
        torch.cuda.empty_cache()
    llamacpp = json.load(open(args.llamacpp)) if args.llamacpp else None
    return {"device": "cuda", "gpu": torch.cuda.get_device_name(), "model": args.model or "embedded",
            "read_tokens": args.read, "decode_tokens": args.decode, "arms": arms, "llamacpp": llamacpp,
            "summary": summarize(arms, gpus, llamacpp)}


def draw(plt, info) -> None:
    """Decode and read rates per arm (an arm that could not run is left out)."""
    arms = {name: a for name, a in info["arms"].items() if a}
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, title in ((axes[0], "decode_tok_s", "decode (tok/s)"), (axes[1], "read_tok_s", "read (tok/s)")):
        ax.bar(list(arms), [a[key] for a in arms.values()])
        ax.set_title(title)


def main(args) -> int:
    info = run(args)
    out = args.out or f"bench/results/layer_split_{args.shape}_cuda.json"
    save(info, out, draw)
    print(json.dumps(info["summary"], indent=1))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("split", help="pipeline stages (--split-mode layer) against one stage and llama.cpp (CUDA)")
    p.add_argument("model", nargs="?", default=None, help="HF directory or .gguf (default: the embedded model)")
    p.add_argument("--shape", default="embedded", help="the name in the output file: layer_split_{shape}_cuda.json")
    p.add_argument("--tensor-split", default=None, help="stage shares, as strata serve takes them")
    p.add_argument("--devices", default=None)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--kv", default="auto", choices=["auto", "bf16", "int8"])
    p.add_argument("--gpu-memory", type=float, default=None, help="GiB per stage (--gpu-memory)")
    p.add_argument("--spec", type=int, default=0)
    p.add_argument("--read", type=int, default=4096, help="prompt tokens of the read")
    p.add_argument("--decode", type=int, default=128, help="tokens decoded per slot")
    p.add_argument("--llamacpp", default=None, help="JSON of llama.cpp -sm layer figures: decode_tok_s, read_tok_s")
    p.add_argument("--out", default=None)
    p.set_defaults(func=main)
