"""`strata bench offload`: a model whose routed experts live in host RAM (`--cpu-moe`, `--n-cpu-moe N`,
or the memory plan under `--gpu-memory`), timed as a user runs it: batch-1 decode and a 4K-token prompt
read, for each CPU format of the experts asked for (`F+graphs`: decode steps replaying CUDA graph pieces,
`--host-expert-graphs`; `F+cpu`, `F+pcie`, `F+both`: `--host-expert-decode`, else its auto, each row
saying which way decode ran and how many of a row's experts the CPU took; consecutive arms of one format
share one load, the later ones' engines built on the first's model; the same engine's decode is also
timed with its graphs off), beside llama.cpp's figures on the same file (`--llamacpp`: llama-bench's
JSON). It also reports the host's read bandwidth, what fraction of it the CPU expert computation
reached during decode, and the peak GPU memory against the cap.

    strata bench offload --model qwen3-30b-a3b-Q8_0.gguf --cpu-moe --formats int8,w8a8,int4 \\
        --llamacpp llama_bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import traceback

import torch

from strata.bench.results import print_tables, save, summary_table
from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.kernels.device import release_unused_memory
from strata.loaders import LoadedModel
from strata.models.host_experts import host_step_seconds
from strata.models.moe import MoE
from strata.params import SamplingParams
from strata.runner.host_offload import fastest_pcie_config, pcie_stacks_of, split_counts, split_step_seconds


def host_read_bandwidth(gib: float = 2.0, repeats: int = 5) -> float:
    """Bytes per second the host reads with every thread torch uses (a sum over a buffer far larger
    than the caches; best of `repeats`)."""
    x = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def _host_moes(engine: LLMEngine) -> list[MoE]:
    return [m for m in engine.model.modules() if isinstance(m, MoE) and m.host is not None]


def _ids(n: int, vocab: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, vocab, (n,), generator=g).tolist())


def _generate(engine: LLMEngine, prompt: tuple[int, ...], tokens: int) -> list[float]:
    """Greedy generation of `tokens`; the wall time at each token event."""
    engine.add_request(EngineRequest(f"r{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=tokens, ignore_eos=True),
                                     time.monotonic()))
    stamps = []
    while engine.has_work():
        for ev in engine.step():
            if ev.error is not None:  # a failed step (out of memory, say) is the arm's failure, not a fast read
                raise RuntimeError(f"the engine failed a request: {ev.error}")
            stamps += [time.perf_counter()] * len(ev.token_ids)
    return stamps


def crossover(engine: LLMEngine, moes: list[MoE], sizes: list[int], seed: int) -> list[dict]:
    """A step of T prompt tokens with the experts in RAM computed on the CPU and streamed to the GPU,
    for each T: where streaming starts to pay (`--expert-stream-tokens`)."""
    if engine.expert_streamer is None:
        return []
    measured = [m.stream_min_tokens for m in moes]
    rows = []
    for t in sizes:
        row = {"tokens": t}
        for where, threshold in (("cpu", 0), ("streamed", 1)):
            for m in moes:
                m.stream_min_tokens = threshold
            best = float("inf")
            for attempt in range(3):
                t0 = time.perf_counter()
                _generate(engine, _ids(t, engine.model_config.vocab_size, seed + 100 * t + attempt), 1)
                best = min(best, time.perf_counter() - t0)
            row[f"{where}_s"] = best
        rows.append(row)
        print(json.dumps(row), flush=True)
    for m, t in zip(moes, measured):
        m.stream_min_tokens = t
    return rows


def measure(cfg: EngineConfig, read_tokens: int, decode_tokens: int, seed: int, sweep: list[int] = (),
            loaded: LoadedModel | None = None) -> tuple[dict, LoadedModel]:
    """One arm's row, and the model as it loaded, for a next arm of the same format (`loaded`: this arm's
    engine starts from it instead of the file, with no memory plan of its own)."""
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = LLMEngine(cfg, progress=False, loaded=loaded)
    load_s = time.perf_counter() - t0
    vocab = engine.model_config.vocab_size
    moes = _host_moes(engine)
    row: dict = {"host_experts": cfg.host_experts, "load_s": load_s, "host_layers": len(moes),
                 "host_format": ",".join(sorted({m.host.fmt for m in moes})) or None,
                 "host_bytes": sum(m.host.nbytes for m in moes),
                 "host_decode": ("cpu" if not any(m.pcie_stacks is not None for m in moes)
                                 else "both" if any(m.cpu_slots for m in moes) else "pcie"),
                 "cpu_slots": max((m.cpu_slots for m in moes), default=0),
                 "stream_min_tokens": moes[0].stream_min_tokens if moes and engine.expert_streamer else None,
                 "memory_plan": engine.memory_plan.table() if engine.memory_plan is not None else None}
    # The prompt read: once to compile, then timed.
    for attempt in range(2):
        prompt = _ids(read_tokens, vocab, seed + attempt)
        t0 = time.perf_counter()
        _generate(engine, prompt, 1)
        row["read_s"] = time.perf_counter() - t0
    row["read_tok_s"] = read_tokens / row["read_s"]
    row.update(decode_figures(engine, moes, decode_tokens, seed))
    if engine.expert_streamer is not None:
        row["streamed_bytes"] = engine.expert_streamer.bytes_copied
    if sweep:
        row["crossover"] = crossover(engine, moes, sweep, seed)
    row["eager"] = decode_eager(engine, moes, decode_tokens, seed)
    if moes:
        row.update(layer_step_figures(moes, engine.model_config.num_experts_per_tok, cfg.torch_dtype, engine.device))
    row["peak_gpu_bytes"] = torch.cuda.max_memory_reserved()
    free, total = torch.cuda.mem_get_info()
    row["driver_used_bytes"] = total - free
    kept = loaded or LoadedModel(engine.model, engine.model_config, engine.tokenizer, cfg.model, bool(cfg.spec))
    for m in moes:  # this engine's buffers go with it; the next engine sets the layers up again
        m.host_staging = m.streamer = m.pcie_stacks = m.graph_cut = None
        m.cpu_slots = 0
    del engine, moes
    release_unused_memory()
    return row, kept


def decode_figures(engine: LLMEngine, moes: list[MoE], decode_tokens: int, seed: int) -> dict:
    """Batch-1 decode of `decode_tokens` tokens after a warm-up: its rate, and the CPU experts' share."""
    _generate(engine, _ids(32, engine.model_config.vocab_size, seed + 7), 8)
    for m in moes:
        m.host.seconds, m.host.bytes_read = 0.0, 0
    stamps = _generate(engine, _ids(32, engine.model_config.vocab_size, seed + 8), decode_tokens + 1)
    out = {"decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}
    cpu_s = sum(m.host.seconds for m in moes)
    if moes and cpu_s:
        out["cpu_expert_s_per_token"] = cpu_s / (decode_tokens + 1)
        out["cpu_expert_bytes_per_token"] = sum(m.host.bytes_read for m in moes) / (decode_tokens + 1)
        out["cpu_expert_read_gb_s"] = sum(m.host.bytes_read for m in moes) / cpu_s / 1e9
        out["cpu_expert_share_of_step"] = out["cpu_expert_s_per_token"] * out["decode_tok_s"]
    return out


def layer_step_figures(moes: list[MoE], k: int, dtype: torch.dtype, device: torch.device) -> dict:
    """One decode row through the largest layer's experts in RAM, each way `--host-expert-decode` can take
    (as its start-up probe times them): on the CPU, and read over PCIe by the GPU's kernels where they
    take the layer's pinned copy, with the rate of that read (the chosen experts' bytes in the GPU's
    format over its time) and the row's time at each share of its experts the CPU may take (the CPU ones
    only where it holds a copy)."""
    m = max(moes, key=lambda m: m.host.nbytes)
    act = dtype if m.host.fmt == "float" else torch.float32
    out = {"layer_step_cpu_ms": host_step_seconds(m.host, 1, k, act, repeats=4) * 1e3} if m.host.on_cpu else {}
    stacks = pcie_stacks_of(m, k, dtype, device)
    if stacks is not None:
        config, seconds = fastest_pcie_config(m.host, stacks, k, dtype, device)
        out["layer_step_pcie_ms"] = seconds * 1e3
        out["pcie_block_k"] = config.gate_up_block_k if config is not None else None  # None: the default tiles
        out["pcie_read_gb_s"] = k * m.host.stream.nbytes / m.host.num_experts / seconds / 1e9
        # By how many of the row's experts the CPU computes while the GPU reads the others (0: none, k: all;
        # the shares the start-up probe times).
        out["layer_step_split_ms"] = {c: split_step_seconds(m.host, stacks, k, c, dtype, device, config) * 1e3
                                      for c in (split_counts(k, "auto") if m.host.on_cpu else [0])}
    return out


def decode_eager(engine: LLMEngine, moes: list[MoE], decode_tokens: int, seed: int) -> dict | None:
    """The decode again on the same engine (no second load) with every step launched eagerly, where
    the engine replays decode graphs (in pieces around the CPU's experts): what the graphs buy."""
    graphs = engine.runner.graphs
    if not graphs:
        return None
    engine.runner.graphs = {}
    try:
        return decode_figures(engine, moes, decode_tokens, seed)
    finally:
        engine.runner.graphs = graphs


def llamacpp_figures(paths: list[str], read_tokens: int) -> dict:
    """llama-bench's JSON (-o json), one file or several (other batch sizes): its best prompt rate at
    `read_tokens` and its best generation rate, with the micro-batch each came from."""
    rows = [r for path in paths for r in json.load(open(path))]
    out: dict = {"runs": [{k: r.get(k) for k in ("n_prompt", "n_gen", "n_batch", "n_ubatch", "avg_ts", "stddev_ts")}
                          for r in rows]}
    for r in rows:
        if r.get("n_prompt") == read_tokens and not r.get("n_gen") and r["avg_ts"] > out.get("read_tok_s", 0):
            out["read_tok_s"], out["read_n_ubatch"] = r["avg_ts"], r.get("n_ubatch")
        elif r.get("n_gen") and not r.get("n_prompt") and r["avg_ts"] > out.get("decode_tok_s", 0):
            out["decode_tok_s"] = r["avg_ts"]
    out.update({k: rows[0].get(k) for k in ("n_cpu_moe", "model_type", "cpu_info", "gpu_info", "build_commit")
                if rows and k in rows[0]})
    return out


def write(args, rows: list[dict], failures: list[dict], peer: dict, bandwidth: float, quiet: bool) -> None:
    """The results file of the arms timed so far (and, unless `quiet`, their table)."""
    if not rows:
        return
    best = max(rows, key=lambda r: r["decode_tok_s"])
    cap = int(args.gpu_memory * 2**30) if args.gpu_memory else None
    summary = {
        "decode_tok_s": best["decode_tok_s"], "read_4096_tok_s": best["read_tok_s"], "host_experts": best["host_experts"],
        "decode_over_llamacpp": best["decode_tok_s"] / peer["decode_tok_s"] if peer.get("decode_tok_s") else None,
        "read_4096_over_llamacpp": best["read_tok_s"] / peer["read_tok_s"] if peer.get("read_tok_s") else None,
        "peak_gpu_bytes": max(r["peak_gpu_bytes"] for r in rows), "gpu_memory_cap_bytes": cap,
        "cap_held": None if cap is None else all(r["peak_gpu_bytes"] <= cap for r in rows),
        "cpu_expert_bandwidth_fraction": max((r for r in rows if r.get("cpu_expert_bandwidth_fraction")),
                                             key=lambda r: r["decode_tok_s"], default={}).get("cpu_expert_bandwidth_fraction"),
        "host_decode": best.get("host_decode"),
        "pcie_read_gb_s": max((r["pcie_read_gb_s"] for r in rows if "pcie_read_gb_s" in r), default=None),
        "stream_min_tokens": best.get("stream_min_tokens"),
        "host_read_bandwidth_gb_s": bandwidth / 1e9,
    }
    info = {"bench": "offload", "model": args.model, "placement": "cpu-moe" if args.cpu_moe else
            f"n-cpu-moe {args.n_cpu_moe}" if args.n_cpu_moe is not None else "memory plan",
            "gpu": torch.cuda.get_device_name(), "read_tokens": args.read, "decode_tokens": args.tokens,
            "spec": args.spec, "rows": rows, "failed": failures, "llamacpp": peer, "summary": summary}
    save(info, args.out or f"bench/results/offload_{args.name}_cuda.json", draw)
    if quiet:
        return
    print_tables([summary_table(f"experts in host RAM: {args.name} ({info['placement']})",
                                [("CPU format", "host_experts", ""), ("decode on", "host_decode", ""),
                                 ("decode tok/s", "decode_tok_s", ".1f"),
                                 ("read tok/s", "read_tok_s", ".0f"),
                                 ("CPU expert GB/s", "cpu_expert_read_gb_s", ".1f"),
                                 ("of host BW", "cpu_expert_bandwidth_fraction", ".2f"),
                                 ("layer CPU ms", "layer_step_cpu_ms", ".3f"), ("layer PCIe ms", "layer_step_pcie_ms", ".3f"),
                                 ("peak GPU GiB", "peak_gpu_gib", ".2f")],
                                [{**r, "peak_gpu_gib": r["peak_gpu_bytes"] / 2**30} for r in rows]
                                + ([{"host_experts": "llama.cpp", **{k: v for k, v in peer.items() if k != "runs"}}]
                                   if peer else []))])


def draw(plt, info):
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    labels = [r["host_experts"] for r in info["rows"]] + (["llama.cpp"] if info["llamacpp"] else [])
    for ax, key, title in ((axes[0], "decode_tok_s", "decode, batch 1 (tok/s)"),
                           (axes[1], "read_tok_s", f"read {info['read_tokens']} tokens (tok/s)")):
        vals = [r[key] for r in info["rows"]] + ([info["llamacpp"].get(key, 0)] if info["llamacpp"] else [])
        ax.bar(labels, vals, color=["C0"] * len(info["rows"]) + ["C3"] * bool(info["llamacpp"]))
        ax.set_title(title)


def run(args) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("strata bench offload times a GPU with experts in host RAM: it needs CUDA")
    bandwidth = host_read_bandwidth()
    print(f"host read bandwidth: {bandwidth / 1e9:.1f} GB/s ({torch.get_num_threads()} threads)", flush=True)
    base = EngineConfig(model=args.model, device="cuda", parallel=1, ctx=args.read + 256, cpu_moe=args.cpu_moe,
                        n_cpu_moe=args.n_cpu_moe, gpu_memory=args.gpu_memory, spec=args.spec,
                        max_num_batched_tokens=args.read, chunk_size=args.read,
                        expert_stream_tokens=args.expert_stream_tokens)
    rows, failures = [], []
    peer = llamacpp_figures([args.llamacpp, *args.llamacpp_more], args.read) if args.llamacpp else {}
    kept: tuple[str, LoadedModel] | None = None  # the last arm's format and model: arms of one format load once
    for label in args.formats:
        fmt, *adds = label.split("+")
        ways = set(adds) & {"cpu", "pcie", "both"}
        if not set(adds) <= {"graphs", "cpu", "pcie", "both"} or len(ways) > 1:
            raise SystemExit(f"--formats {label}: a format's additions are +graphs and one of +cpu, +pcie, +both")
        way = ways.pop() if ways else "auto"
        cfg = dataclasses.replace(base, host_experts=fmt, host_expert_graphs="graphs" in adds, host_expert_decode=way)
        loaded = kept[1] if kept is not None and kept[0] == fmt else None
        kept = None  # a model of another format leaves memory before the next loads
        try:
            row, model = measure(cfg, args.read, args.tokens, args.seed, args.crossover, loaded)
            row["host_experts"], row["reused_load"] = label, loaded is not None
            kept = (fmt, model)
        except Exception as e:  # noqa: BLE001 - one arm's failure is its row; the other arms still run
            failures.append({"host_experts": label, "error": f"{type(e).__name__}: {e}"[:2000]})
            traceback.print_exc()
            if isinstance(e, torch.OutOfMemoryError):
                print(torch.cuda.memory_summary(abbreviated=True), flush=True)
            print(json.dumps(failures[-1]), flush=True)
            release_unused_memory()
            continue
        print(json.dumps(row), flush=True)
        rows.append(row)
        eager = row.pop("eager")
        if eager is not None:  # the same engine's decode without its graphs: a row of its own
            same = {k: v for k, v in row.items() if k != "crossover" and not k.startswith(("decode", "cpu_expert"))}
            rows.append({**same, **eager, "host_experts": fmt, "same_engine_as": label})
        for r in rows:
            if "cpu_expert_read_gb_s" in r:
                r["cpu_expert_bandwidth_fraction"] = r["cpu_expert_read_gb_s"] * 1e9 / bandwidth
        # After every arm: a run cut short (a device call's limit) keeps the arms it finished.
        write(args, rows, failures, peer, bandwidth, quiet=True)
    if not rows:
        raise SystemExit(f"every arm failed: {json.dumps(failures)}")
    write(args, rows, failures, peer, bandwidth, quiet=False)
    return 0


def _add_args(p) -> None:
    p.add_argument("--model", required=True, help="the GGUF (or HF directory) both engines load")
    p.add_argument("--name", default="model", help="the results file's shape name (offload_NAME_cuda.json)")
    p.add_argument("--formats", type=lambda s: [f for f in s.split(",") if f], default=["auto"],
                   help="CPU formats of the experts in RAM to time (auto, float, int8, w8a8, fbgemm, compiled, compiled-int4, int4, "
                        "file: none, the GPU reads or streams the file's blocks; "
                        "F+graphs: with --host-expert-graphs; F+cpu, F+pcie, F+both: --host-expert-decode cpu, pcie or "
                        "both, else auto)")
    p.add_argument("--cpu-moe", action="store_true")
    p.add_argument("--n-cpu-moe", type=int, default=None)
    p.add_argument("--gpu-memory", type=float, default=None, help="GiB cap (the memory plan places the experts)")
    p.add_argument("--expert-stream-tokens", type=int, default=EngineConfig.expert_stream_tokens,
                   help="steps of this many tokens or more stream the experts (0: never; default: measured)")
    p.add_argument("--spec", type=int, default=0)
    p.add_argument("--read", type=int, default=4096, help="prompt tokens of the read")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens timed")
    p.add_argument("--llamacpp", default=None, help="llama-bench -o json output on the same file and placement")
    p.add_argument("--llamacpp-more", nargs="*", default=[], help="more llama-bench JSON (other batch sizes): the best counts")
    p.add_argument("--crossover", type=lambda s: [int(t) for t in s.split(",") if t], default=[],
                   help="prompt steps of these token counts timed with the experts on the CPU and streamed (e.g. 4,8,16,32,64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)


def add_parser(sub) -> None:
    _add_args(sub.add_parser("offload", help="experts in host RAM: decode and prompt read against llama.cpp (CUDA)"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="strata bench offload")
    _add_args(parser)
    ns = parser.parse_args()
    raise SystemExit(ns.func(ns))
