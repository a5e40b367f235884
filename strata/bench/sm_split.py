"""`strata bench sm-split`: what splitting the GPU's SMs between a decode and a read can give at best.

Issue 11 asks two things of a read beside a decoding slot at once: the decode's inter-token latency
within 1.3x of idle (p50), and the read at 0.85x or more of its speed alone. `STRATA_READ_SMS` splits the
SMs between the two (docs/CONCURRENT_READ.md). This bench measures the split's limits with nothing
beside anything: for each count in `--held`, an `SmHold` keeps that many SMs busy doing nothing, and on
the SMs left, one after another on one engine:
- `probe_sms`: how many SMs short programs reach (the check that the hold holds);
- `stream_gbs`: the HBM bandwidth those SMs can draw (`sm_hold.stream_gbs`, read-only kernels);
- the decode: one slot decoding greedily through the engine (CUDA graphs), inter-token latency p50/p99;
- the read: a `--read`-token prompt read alone, tok/s.

`frontier()` pairs them: a split gives the decode d SMs and the read the rest, so its point is
(read with S - d SMs / read with all, decode latency with d / with all). With no contention for HBM or
L2 between the two, every point is what that split gives at best; the real concurrent read
(`strata bench concurrent --read-sms`) can only do worse. `bound_over_idle` adds a latency no decode
kernel on d SMs can beat: the weights it streams per token over the bandwidth those SMs draw.
`--kernels` times each decode product of one layer and the LM head alone on the SMs free (where a
slow decode on few SMs loses its time; `scripts/profile_step.py --held` profiles the whole step).
`--plan-sms` adds `planned_over_idle`: the decode of a fresh engine whose CUDA graphs were captured
inside `strata.kernels.plan.planning_for(d)` (the 16-bit GEMVs' tiles for d SMs, the same bits), the
graphs the engine replays beside a read with `STRATA_READ_SMS`.
JSON `bench/results/sm_split_{shape}[_{quant}]_cuda.json` and a PNG of both views."""

from __future__ import annotations

import time

import torch

from strata.bench.concurrent import Trace, _req
from strata.bench.http_arm import percentile
from strata.bench.quant import weight_bytes
from strata.bench.random_model import SHAPES, random_model
from strata.bench.results import print_tables, save, summary_table
from strata.bench.throughput import _free, _int_list, build_engine, check_context, engine_config, room_for_reads

GOAL_ITL = 1.3  # issue 11: decode latency during the read, p50, at most this times idle
GOAL_READ = 0.85  # issue 11: the read beside a decode, at least this times alone
DEC_PROMPT = 16
SKIP = 8  # decode events before timing starts
TOP_KERNELS = 6  # kernels by name kept in a profile's summary


def _interpolate(points: list[tuple[int, float]], x: int) -> tuple[float, bool]:
    """(y at x, measured) on a curve measured at `points` (SMs, fraction): linear between measured
    counts; below the lowest, proportional to the SMs (a compute-bound read's scaling)."""
    pts = sorted(points)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return (y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)), x in (x0, x1)
    if x > pts[-1][0]:
        return pts[-1][1], False
    return pts[0][1] * x / pts[0][0], False


def frontier(rows: list[dict], total_sms: int, stream_bytes: float) -> list[dict]:
    """One point per measured decode SM count d < all: the read's fraction with the other SMs, the
    decode's latency over idle, and the bound from bandwidth; whether each meets both goals."""
    ref = next(r for r in rows if r["sms"] == total_sms)
    read = [(r["sms"], r["read_tok_s"] / ref["read_tok_s"]) for r in rows]
    out = []
    for r in sorted(rows, key=lambda r: -r["sms"]):
        d = r["sms"]
        if d >= total_sms:
            continue
        read_frac, measured = _interpolate(read, total_sms - d)
        dec = r["itl_p50_ms"] / ref["itl_p50_ms"]
        bound = stream_bytes / (r["stream_gbs"]["best"] * 1e9) * 1e3 / ref["itl_p50_ms"]
        point = {"decode_sms": d, "read_sms": total_sms - d, "read_over_alone": read_frac,
                 "read_measured": measured, "decode_over_idle": dec, "bound_over_idle": bound,
                 "meets_goals": dec <= GOAL_ITL and read_frac >= GOAL_READ,
                 "bound_meets_goals": bound <= GOAL_ITL and read_frac >= GOAL_READ}
        if "planned_itl_p50_ms" in r:  # --plan-sms: the decode planned for its d SMs
            planned = r["planned_itl_p50_ms"] / ref["itl_p50_ms"]
            point.update(planned_over_idle=planned, planned_meets_goals=planned <= GOAL_ITL and read_frac >= GOAL_READ)
        out.append(point)
    return out


def _decode(eng, dec_ids: list[int], tokens: int, tag: str) -> dict:
    """Greedy decode of one slot: inter-token latency after SKIP events."""
    tr = Trace(eng)
    eng.add_request(_req(tag, dec_ids, SKIP + tokens))
    tr.drain()
    gaps = [b - a for (a, _), (b, _) in zip(tr.events[tag][SKIP:], tr.events[tag][SKIP + 1:])]
    return {"itl_p50_ms": percentile(gaps, 50) * 1e3, "itl_p99_ms": percentile(gaps, 99) * 1e3}


def decode_products(model) -> dict[str, tuple[object, torch.Tensor | None]]:
    """The batch-1 decode's weight products of one layer and the LM head, as the model runs them:
    name -> (weight or kept-quantized QWeight, the GEMV workspace)."""
    from strata.models.layers import MLP, Attention

    attn = next(m for m in model.modules() if isinstance(m, Attention))
    mlp = next(m for m in model.modules() if isinstance(m, MLP))
    pick = lambda q, w: q if q is not None else w  # noqa: E731
    return {"qkv": (pick(attn.qkv_q, attn.qkv_weight), attn.gemv_ws),
            "o_proj": (pick(attn.o_q, attn.o_proj.weight), attn.gemv_ws),
            "gate_up": (pick(mlp.gate_up_q, mlp.gate_up_weight), mlp.gemv_ws),
            "down": (pick(mlp.down_q, mlp.down_proj.weight), mlp.gemv_ws),
            "lm_head": (pick(model.lm_head_q, model.lm_head.weight), model.gemv_ws)}


def kernel_times(model, device: torch.device, iters: int = 20) -> dict:
    """Each decode product of `decode_products` alone at batch 1, on the SMs free now: microseconds
    (CUDA events, median of `iters`; no device-wide synchronize, so it runs under a hold) and GB/s of
    its weight bytes."""
    from strata.bench.sm_hold import events_seconds
    from strata.models.layers import linear

    out = {}
    for name, (w, ws) in decode_products(model).items():
        k = w.k if hasattr(w, "k") else w.shape[1]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        seconds = events_seconds(lambda: linear(x, w, None, ws), iters)
        out[name] = {"us": seconds * 1e6, "gbs": w.nbytes / seconds / 1e9}  # a tensor's or a QWeight's planes
    return out


def _kernel_seconds(prof) -> dict[str, float]:
    """Device seconds per kernel name in a profile."""
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", 0.0)
        if us and ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.key] = out.get(ev.key, 0.0) + us / 1e6
    return out


def _kernel_classes(prof) -> dict:
    """Device seconds by kind of kernel, and the top kernels by name (`top:` prefix)."""
    per_name = _kernel_seconds(prof)
    out: dict[str, float] = {}
    for key, seconds in per_name.items():
        kind = next((k for k, words in KERNEL_CLASSES if any(w in key.lower() for w in words)), "other")
        out[kind] = out.get(kind, 0.0) + seconds
    for key, seconds in sorted(per_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]:
        out[f"top:{key[:80]}"] = seconds
    return out


def _read(eng, ids: list[int], tag: str, profile: bool = False) -> dict:
    """The prompt read alone: submission to first token. No device-wide synchronize (the hold would
    stall it): the engine is idle here, and its step returns once the token is on the host.
    `profile`: also the device seconds by kind of kernel (torch.profiler), timed apart from the read;
    with all SMs only, since the profiler synchronizes the device when it stops, which would wait for a hold."""
    tr = Trace(eng)
    t0 = time.perf_counter()
    eng.add_request(_req(tag, ids, 1))
    tr.run_until(lambda: tag in tr.first)
    seconds = tr.first[tag] - t0
    tr.drain()
    row = {"read_s": seconds, "read_tok_s": len(ids) / seconds, "read_token": tr.tokens[tag][0]}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            tr = Trace(eng)
            eng.add_request(_req(tag + "-p", ids, 1))
            tr.drain()
        row["read_kernel_s"] = _kernel_classes(prof)
    return row


def measure(eng, device: torch.device, held: int, ids: list[int], dec_ids: list[int], tokens: int,
            carveout: bool = False, profile: bool = False, kernels: bool = False) -> dict:
    """One SM count. `carveout`: the read's cuBLAS products are also told the SMs held (torch's SM
    carveout), so that cuBLAS may plan its tiles for the SMs left. On torch's default cuBLAS path it
    changed nothing on an H100; with cuBLASLt preferred, the first carved-out product synchronized the
    device, which waits for the hold (docs/CONCURRENT_READ.md)."""
    from strata.bench.sm_hold import SmHold, num_sms, sms_used, stream_gbs

    hold = SmHold(device, held) if held else None
    held_sms = 0
    try:
        row = {"held_requested": held, "probe_sms": sms_used(device), "stream_gbs": stream_gbs(device)}
        row.update(_decode(eng, dec_ids, tokens, f"d{held}"))
        if kernels:
            row["decode_products"] = kernel_times(eng.model, device)
        if carveout and held:
            torch._C._set_sm_carveout_experimental(held)
        try:
            row.update(_read(eng, ids, f"r{held}", profile and not held))
        finally:
            if carveout:
                torch._C._set_sm_carveout_experimental(None)
    finally:
        if hold is not None:
            held_sms = hold.release()
    row["held_sms"] = held_sms
    row["sms"] = num_sms(device) - held_sms
    print(f"held {held_sms:3d} SMs ({row['probe_sms']:3d} reached): stream {row['stream_gbs']['best']:7.0f} GB/s, "
          f"decode itl p50 {row['itl_p50_ms']:6.2f} ms p99 {row['itl_p99_ms']:6.2f} ms, "
          f"read {row['read_tok_s']:8.0f} tok/s"
          + "".join(f", read {k} {v:.3f} s" for k, v in sorted(row.get("read_kernel_s", {}).items())
                    if not k.startswith("top:"))
          + "".join(f", {k} {v['us']:.0f} us {v['gbs']:.0f} GB/s" for k, v in row.get("decode_products", {}).items()),
          flush=True)
    return row


def planned_decode(loaded, cfg, device: torch.device, held: int, dec_ids: list[int], tokens: int) -> dict:
    """The decode of an engine whose CUDA graphs were captured inside `planning_for(SMs left)` (GEMV
    tiles for those SMs, `gemv.few_sms_config`), timed under a hold of `held` SMs."""
    from strata.bench.sm_hold import SmHold, num_sms
    from strata.kernels.plan import planning_for

    with planning_for(num_sms(device) - held):
        eng, _ = build_engine(cfg, loaded)  # captures (a device-wide synchronize): before the hold
    try:
        _decode(eng, dec_ids, 16, "warm-planned")
        hold = SmHold(device, held)
        try:
            got = _decode(eng, dec_ids, tokens, f"planned{held}")
        finally:
            hold.release()
    finally:
        eng.close()
        del eng
        _free(device)
    print(f"held {held:3d} SMs, decode planned for the {num_sms(device) - held} left: itl p50 "
          f"{got['itl_p50_ms']:6.2f} ms p99 {got['itl_p99_ms']:6.2f} ms", flush=True)
    return {f"planned_{k}": v for k, v in got.items()}


def run(args) -> int:
    device = torch.device(args.device or "cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit("strata bench sm-split needs a CUDA GPU (green contexts hold the SMs)")
    from strata.bench.sm_hold import num_sms

    dtype = getattr(torch, args.dtype)
    loaded = random_model(args.shape, device, dtype, seed=args.seed, quant=args.quant)
    name = args.shape + (f"_{args.quant}" if args.quant else "")
    ctx = args.read + 8
    check_context(loaded.config, ctx, args.shape)
    loaded = room_for_reads(loaded, ctx)
    total, emb = weight_bytes(loaded.model)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, loaded.config.vocab_size, (args.read,), generator=gen).tolist()
    dec_ids = torch.randint(0, loaded.config.vocab_size, (DEC_PROMPT,), generator=gen).tolist()
    args.kv, args.no_cuda_graph = "auto", False
    cfg = engine_config(args, device, ctx, 1, args.chunk)
    eng, startup = build_engine(cfg, loaded)
    try:
        _read(eng, ids[: 2 * args.chunk + 1], "warm-read")
        _decode(eng, dec_ids, 16, "warm-decode")
        rows = [measure(eng, device, held, ids, dec_ids, args.tokens, args.carveout, args.profile, args.kernels)
                for held in sorted(set([0, *args.held]))]
    finally:
        eng.close()
    sms = num_sms(device)
    if args.plan_sms:
        del eng
        _free(device)
        for row in rows:
            if row["held_sms"]:
                row.update(planned_decode(loaded, cfg, device, row["held_sms"], dec_ids, args.tokens))
    points = frontier(rows, sms, total - emb)
    info = {"bench": "sm-split", "shape": name, "quant": args.quant, "dtype": args.dtype, "device": str(device),
            "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "num_sms": sms,
            "read_tokens": args.read, "carveout": args.carveout, "plan_sms": args.plan_sms,
            "decode_tokens": args.tokens, "chunk": args.chunk, "startup_s": startup,
            "decode_weight_bytes": total - emb, "goals": {"itl_over_idle": GOAL_ITL, "read_over_alone": GOAL_READ},
            "rows": rows, "frontier": points,
            "summary": {"splits": len(points), "splits_meeting_goals": sum(p["meets_goals"] for p in points),
                        "splits_whose_bound_meets_goals": sum(p["bound_meets_goals"] for p in points),
                        "splits_planned_meeting_goals": sum(p.get("planned_meets_goals", False) for p in points),
                        "outputs_identical": len({r["read_token"] for r in rows}) == 1},
            "args": {k: v for k, v in vars(args).items() if k != "func"}}
    out = args.out or f"bench/results/sm_split_{name}_cuda.json"
    save(info, out, _draw)
    print_tables(summary_tables(info))
    return 0


def summary_tables(info: dict) -> list:
    on = f"{info['shape']} on {info['gpu']}, read {info['read_tokens']}"
    rows = [{**r, "stream": r["stream_gbs"]["best"]} for r in info["rows"]]
    held = [("SMs", "sms", "d"), ("reached", "probe_sms", "d"), ("stream GB/s", "stream", ".0f"),
            ("itl p50 ms", "itl_p50_ms", ".2f"), ("itl p99 ms", "itl_p99_ms", ".2f"),
            ("read tok/s", "read_tok_s", ".0f")]
    return [summary_table(f"SMs held: {on}", held, rows),
            summary_table(f"splits (goals: decode <= {GOAL_ITL}x idle, read >= {GOAL_READ}x alone)",
                          [("decode SMs", "decode_sms", "d"), ("read SMs", "read_sms", "d"),
                           ("read / alone", "read_over_alone", ".3f"), ("decode / idle", "decode_over_idle", ".3f"),
                           ("planned / idle", "planned_over_idle", ".3f"), ("bound / idle", "bound_over_idle", ".3f"),
                           ("meets both", "meets_goals", "")],
                          [{**p, "meets_goals": "yes" if p["meets_goals"] else "no"} for p in info["frontier"]])]


def _draw(plt, info: dict) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = sorted(info["rows"], key=lambda r: r["sms"])
    ref = next(r for r in rows if r["sms"] == info["num_sms"])
    x = [r["sms"] for r in rows]
    a.plot(x, [ref["itl_p50_ms"] / r["itl_p50_ms"] for r in rows], "o-", label="decode speed (1 / latency)")
    a.plot(x, [r["read_tok_s"] / ref["read_tok_s"] for r in rows], "s-", label=f"read {info['read_tokens']} speed")
    a.plot(x, [r["stream_gbs"]["best"] / ref["stream_gbs"]["best"] for r in rows], "^--", label="HBM stream")
    a.plot(x, [r / info["num_sms"] for r in x], ":", color="grey", label="SMs / all")
    a.set_xlabel("SMs free (the rest held)")
    a.set_ylabel("fraction of all SMs' figure")
    a.set_title(f"{info['shape']} on {info['gpu']}", fontsize=9)
    a.legend(fontsize=8)
    pts = info["frontier"]
    b.fill_between([GOAL_READ, 1.05], 0.9, GOAL_ITL, color="tab:green", alpha=0.15, label="both goals")
    b.plot([p["read_over_alone"] for p in pts], [p["decode_over_idle"] for p in pts], "o-", label="measured split")
    b.plot([p["read_over_alone"] for p in pts], [max(1.0, p["bound_over_idle"]) for p in pts], "x--",
           label="bound: weights / stream bandwidth")
    for p in pts:
        b.annotate(str(p["decode_sms"]), (p["read_over_alone"], p["decode_over_idle"]), fontsize=7)
    b.set_xlabel("read with the other SMs / alone")
    b.set_ylabel("decode latency with d SMs / idle (p50)")
    b.set_yscale("log")
    b.set_title("a split: d SMs decode (labels), the rest read", fontsize=9)
    b.legend(fontsize=8)


def add_parser(sub) -> None:
    p = sub.add_parser("sm-split", help="issue 11's two goals under every split of the SMs: decode latency and "
                                        "read speed on the SMs a hold leaves (CUDA)")
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES), help="random weights at this shape")
    p.add_argument("--quant", default=None, help="random weights kept quantized in this GGUF format (Q8_0, ...)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--read", type=int, default=32768, help="prompt tokens of the read")
    p.add_argument("--tokens", type=int, default=128, help="decode tokens timed at each SM count")
    p.add_argument("--chunk", type=int, default=2048, help="read chunk")
    p.add_argument("--held", type=_int_list, default=list(range(8, 128, 8)),
                   help="SM counts to hold, one measurement each (0, all SMs free, is always measured)")
    p.add_argument("--carveout", action="store_true",
                   help="tell the read's cuBLAS products the SMs held (torch's SM carveout), so their tiles fit "
                        "the rest")
    p.add_argument("--plan-sms", action="store_true",
                   help="also time, at each count held, a decode whose CUDA graphs were captured with its GEMV "
                        "tiles planned for the SMs left (strata.kernels.plan), a fresh engine each")
    p.add_argument("--kernels", action="store_true",
                   help="also time each batch-1 decode product (one layer's qkv, o_proj, gate_up, down and the "
                        "LM head) alone on the SMs free: microseconds and GB/s of weights")
    p.add_argument("--profile", action="store_true",
                   help="with all SMs, read the prompt once more under torch.profiler: device seconds by kind "
                        "of kernel (not under a hold: the profiler synchronizes the device)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)
