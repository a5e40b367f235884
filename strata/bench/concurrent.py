"""`strata bench concurrent`: the concurrent prompt read (STRATA_PIPED_CONCURRENT=1) measured.

Two arms, each a fresh engine on the same model, run in `--pairs` interleaved pairs: `concurrent`
(STRATA_PIPED_CONCURRENT=1) and `concurrent_smb` (also STRATA_SPLIT_MTP_BATCH=1 and
STRATA_PIPED_CONCURRENT_SMB=1: the read stage writes the draft K/V itself; the same as the first arm
without `--spec`). Per arm, at each of `--lengths`:
- alone: the long prompt read with nothing else, timed from submission to its first token;
- beside a decoding slot: one request decodes greedily, `--idle-tokens` of it are timed alone, then
  the long prompt arrives; the decode's inter-token latency (gaps between its events) idle and during
  the read, stalls (gaps over `STALL_S`), decode tok/s, and the read's tok/s beside it.
Then a give-way: a `--giveway-tokens` read (64K on CUDA) that a short request joins after its first
chunk; the short one's TTFT (and alone, for scale) and the give-ways counted. With a model that has a
tokenizer (`--model default`, the embedded model) a needle across the yield point per arm: a pass key
read in chunks such that the long read gives way in the middle of the key, answered or not.

Allocation: the allocation guard's snapshots (`AllocationGuard.snapshot`) are taken around every read
step, as `EngineConfig.alloc_guard` would, but growth is summed instead of raised (`alloc_growth_bytes`).
Token outputs of the reads must be the same in every arm and pair (`outputs_identical`).
JSON under bench/results/ (`summary` holds the headline ratios) and a PNG timeline of the longest read:
decode tokens and prompt tokens read over time, one panel per arm.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time
from contextlib import ExitStack, contextmanager

import torch

from strata.bench.http_arm import percentile
from strata.bench.random_model import SHAPES, random_model
from strata.bench.results import print_tables, save, summary_table
from strata.bench.throughput import check_context, room_for_reads, build_engine, default_out, engine_config
from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineRequest
from strata.env import ENV, overridden
from strata.loaders import default_model_path, load_model
from strata.params import SamplingParams
from strata.runner.read_stage import AllocationGuard

STALL_S = 1.0  # a decode gap longer than this is a stall
IDLE_SKIP = 4  # decode events before the idle timing starts (the slot's own read and first steps)
SHORT_TOKENS = 32  # the give-way scenario's short prompt
DEC_PROMPT_TOKENS = 16
GPU_GIVEWAY_TOKENS = 65536
DEFAULT_LENGTHS = (4096, 32768, 131072)

ARMS = {
    "concurrent": ((ENV.PIPED_CONCURRENT, "1"), (ENV.SPLIT_MTP_BATCH, "0"), (ENV.PIPED_CONCURRENT_SMB, "0")),
    "concurrent_smb": ((ENV.PIPED_CONCURRENT, "1"), (ENV.SPLIT_MTP_BATCH, "1"), (ENV.PIPED_CONCURRENT_SMB, "1")),
}


@contextmanager
def arm_env(arm: str):
    """The arm's switches set for the block (engine construction and run), restored after."""
    with ExitStack() as stack:
        for switch, value in ARMS[arm]:
            stack.enter_context(overridden(switch, value))
        yield


class GrowthMeter(AllocationGuard):
    """The allocation guard's snapshots around each read step (the engine calls `start` before it
    submits one and `check` when it is back), growth summed per snapshot key instead of raised."""

    def __init__(self, stage, pool):
        super().__init__(stage, pool)
        self.growth: dict[str, int] = {}
        self.reads = 0

    def check(self) -> None:
        if self.before is None:
            return
        for key, value in self.snapshot().items():
            if value > self.before.get(key, value):
                self.growth[key] = self.growth.get(key, 0) + value - self.before[key]
        self.before = None
        self.reads += 1

    def take(self) -> dict:
        """What was measured since the last take: reads, growth in bytes and in grow events, per key."""
        out = {"reads": self.reads, "growth_bytes": sum(v for k, v in self.growth.items() if k.endswith("_bytes")),
               "grows": sum(v for k, v in self.growth.items() if k.endswith("_grows")), "by_key": dict(self.growth)}
        self.growth, self.reads = {}, 0
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _req(rid: str, ids, max_tokens: int, ignore_eos: bool = True) -> EngineRequest:
    return EngineRequest(rid, tuple(ids), SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                         time.monotonic())


class Trace:
    """Steps an engine and records when each request's tokens arrive and how far one read has got."""

    def __init__(self, eng: LLMEngine):
        self.eng = eng
        self.events: dict[str, list[tuple[float, int]]] = {}  # request id -> (time, tokens) per event
        self.tokens: dict[str, list[int]] = {}
        self.first: dict[str, float] = {}
        self.read_id, self.read_len, self.read_points = None, 0, []  # (time, prompt tokens read)

    def watch(self, rid: str, prompt_len: int, t: float) -> None:
        self.read_id, self.read_len, self.read_points = rid, prompt_len, [(t, 0)]

    def step(self) -> None:
        events = self.eng.step()
        t = time.perf_counter()
        for ev in events:
            if ev.token_ids:
                self.events.setdefault(ev.request_id, []).append((t, len(ev.token_ids)))
                self.tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
                self.first.setdefault(ev.request_id, t)
        if self.read_id is not None:
            r = self.eng.requests.get(self.read_id)
            read = min(r.num_computed_tokens, self.read_len) if r is not None else self.read_len
            if read != self.read_points[-1][1]:
                self.read_points.append((t, read))

    def run_until(self, done) -> None:
        while not done():
            if not self.eng.has_work():
                raise RuntimeError("the engine ran out of work before the scenario's condition was met")
            self.step()

    def drain(self) -> None:
        self.run_until(lambda: not self.eng.has_work())


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---- scenarios --------------------------------------------------------------------------------------

def read_alone(eng: LLMEngine, ids: list[int], tag: str, read_tokens: int) -> dict:
    """The prompt read with nothing else: seconds from submission to its first token, and its tokens."""
    tr = Trace(eng)
    _sync(eng.device)
    t0 = time.perf_counter()
    eng.add_request(_req(tag, ids, read_tokens))
    tr.watch(tag, len(ids), t0)
    tr.run_until(lambda: tag in tr.first)
    seconds = tr.first[tag] - t0
    tr.drain()
    return {"read_alone_s": seconds, "read_alone_tok_s": len(ids) / seconds, "alone_tokens": tr.tokens[tag],
            "read_steps": len(tr.read_points) - 1}


def read_beside_decode(eng: LLMEngine, ids: list[int], dec_ids: list[int], tag: str, idle_tokens: int) -> dict:
    """A decoding slot timed alone for `idle_tokens` events, then the prompt read beside it; the decode
    is aborted once the read's first token is out."""
    tr = Trace(eng)
    dec, long = f"{tag}-dec", f"{tag}-long"
    eng.add_request(_req(dec, dec_ids, eng.max_model_len - len(dec_ids) - 1))
    tr.run_until(lambda: len(tr.events.get(dec, ())) >= IDLE_SKIP + idle_tokens)
    t_add = time.perf_counter()
    eng.add_request(_req(long, ids, 1))
    tr.watch(long, len(ids), t_add)
    tr.run_until(lambda: long in tr.first)
    t_end = tr.first[long]
    stopped = eng.abort(dec)
    tr.drain()
    dec_events = tr.events[dec]
    idle = [(t, n) for t, n in dec_events[IDLE_SKIP:] if t < t_add]
    during = [(t, n) for t, n in dec_events if t_add < t <= t_end]
    before = [t for t, _ in dec_events if t <= t_add][-1:]
    itl_idle = _gaps([t for t, _ in idle])
    itl_during = _gaps(before + [t for t, _ in during])
    # The gap still open when the read ended counts for stalls, though no token closes it.
    open_gaps = _gaps(before + [t for t, _ in during] + [t_end])
    p = {f"itl_{name}_{q}_ms": _ms(percentile(gaps, q)) for name, gaps in (("idle", itl_idle), ("during", itl_during))
         for q in (50, 99)}
    read_s = t_end - t_add
    idle_s = idle[-1][0] - idle[0][0] if len(idle) > 1 else None
    spec = stopped.spec if stopped is not None else None
    return {
        "read_beside_s": read_s, "read_beside_tok_s": len(ids) / read_s, "beside_tokens": tr.tokens[long],
        **p,
        "itl_during_over_idle_p50": _ratio(p["itl_during_50_ms"], p["itl_idle_50_ms"]),
        "itl_during_over_idle_p99": _ratio(p["itl_during_99_ms"], p["itl_idle_99_ms"]),
        "decode_idle_tok_s": _ratio(sum(n for _, n in idle[1:]), idle_s),
        "decode_during_tok_s": sum(n for _, n in during) / read_s, "decode_tokens_during": sum(n for _, n in during),
        "stalls": sum(g > STALL_S for g in open_gaps), "max_gap_s": max(open_gaps, default=None),
        "decode_drafts": {k: spec[k] for k in ("drafts_proposed", "drafts_accepted", "acceptance")} if spec else None,
        "timeline": {"decode_t": [round(t - t_add, 5) for t, _ in dec_events],
                     "decode_tokens": [sum(n for _, n in dec_events[: i + 1]) for i in range(len(dec_events))],
                     "read_t": [round(t - t_add, 5) for t, _ in tr.read_points],
                     "read_tokens": [n for _, n in tr.read_points]},
    }


def give_way(eng: LLMEngine, long_ids: list[int], short_ids: list[int], tag: str) -> dict:
    """The short request alone (for scale), then arriving once the long read's first chunk is in: its
    TTFT and the long read's give-ways."""
    tr = Trace(eng)
    _sync(eng.device)
    t0 = time.perf_counter()
    eng.add_request(_req(f"{tag}-short0", short_ids, 4))
    tr.run_until(lambda: f"{tag}-short0" in tr.first)
    idle_ttft = tr.first[f"{tag}-short0"] - t0
    tr.drain()
    long, short = f"{tag}-long", f"{tag}-short"
    give_ways0 = eng.scheduler.give_ways_total
    t_long = time.perf_counter()
    eng.add_request(_req(long, long_ids, 1))
    tr.watch(long, len(long_ids), t_long)
    chunk = eng.cfg.chunk_size
    # Arrives with the long read's second chunk in flight on the read stage: it gives way after it.
    tr.run_until(lambda: tr.read_points[-1][1] >= min(chunk, len(long_ids)))
    arrived_at = tr.read_points[-1][1]
    t_short = time.perf_counter()
    eng.add_request(_req(short, short_ids, 4))
    tr.run_until(lambda: short in tr.first and long in tr.first)
    tr.drain()
    return {"long_tokens": len(long_ids), "short_tokens": len(short_ids), "short_arrived_at_read": arrived_at,
            "short_ttft_s": tr.first[short] - t_short, "short_ttft_idle_s": idle_ttft,
            "long_read_s": tr.first[long] - t_long, "give_ways": eng.scheduler.give_ways_total - give_ways0,
            "short_finished_first": tr.first[short] < tr.first[long]}


def needle(args, loaded, device: torch.device, arm: str) -> dict:
    """tests/engine/test_engine.py's needle across the yield point, on the arm's concurrent read: a pass key
    whose prompt is read in chunks of half of (key position + 2), so the read gives way to a short
    request at the chunk boundary after the second chunk, inside the key (the stage already holds the
    second chunk when the short one arrives). Each trial: the answer alone and with the give-way."""
    from strata.data.retrieval import make_retrieval_example

    tok = loaded.tokenizer
    filler = open(os.path.join(default_model_path(), "README.md")).read() * 4
    short_ids = tok.encode("To be, or not to be:")
    trials = []
    for seed in range(args.needle_trials):
        ex = make_retrieval_example(tok, filler, 1000, 0.3, kind="passkey", seed=f"yield/{seed}")
        ids, key = tok.encode(ex.prompt), tok.encode(ex.answer.strip())
        first = next((i for i in range(len(ids)) if ids[i: i + len(key)] == key), None)
        if first is None:
            trials.append({"seed": seed, "skipped": "the key's tokens are not in the prompt's"})
            continue
        chunk = max(1, (first + 2) // 2)
        cfg = dataclasses.replace(engine_config(args, device, 2048, 2, chunk), max_num_batched_tokens=chunk + 64,
                                  spec=args.spec, batch_mtp=bool(args.spec))
        with arm_env(arm):
            eng = LLMEngine(cfg, progress=False, loaded=loaded)
            try:
                tr = Trace(eng)
                eng.add_request(_req("alone", ids, ex.answer_tokens, ignore_eos=False))
                tr.drain()
                eng.add_request(_req("long", ids, ex.answer_tokens, ignore_eos=False))
                tr.step()
                eng.add_request(_req("short", short_ids, 8, ignore_eos=False))
                tr.drain()
                give_ways = eng.scheduler.give_ways_total
            finally:
                eng.close()
        alone, yielded = tok.decode(tr.tokens.get("alone", [])), tok.decode(tr.tokens.get("long", []))
        trials.append({"seed": seed, "prompt_tokens": len(ids), "key_at": first, "key_tokens": len(key),
                       "yield_at": 2 * chunk, "answer": ex.answer.strip(), "alone": alone.strip(),
                       "yielded": yielded.strip(), "alone_correct": alone.strip() == ex.answer.strip(),
                       "correct": yielded.strip() == ex.answer.strip(), "same_as_alone": alone == yielded,
                       "give_ways": give_ways})
    run = [t for t in trials if "skipped" not in t]
    return {"trials": trials, "correct": sum(t["correct"] for t in run), "total": len(run),
            "alone_correct": sum(t["alone_correct"] for t in run), "same_as_alone": sum(t["same_as_alone"] for t in run)}


# ---- one arm ----------------------------------------------------------------------------------------

def run_arm(args, arm: str, pair: int, loaded, device: torch.device, prompts: dict[int, list[int]],
            dec_ids: list[int], short_ids: list[int], giveway_ids: list[int], ctx: int) -> dict:
    cfg = dataclasses.replace(engine_config(args, device, ctx, 2, args.chunk), spec=args.spec, batch_mtp=bool(args.spec))
    with arm_env(arm):
        eng, startup = build_engine(cfg, loaded)
        try:
            if eng.read_stage is None:
                raise ValueError(f"arm {arm}: no read stage ({eng.concurrent.concurrent_read_off()})")
            meter = eng.alloc_guard = GrowthMeter(eng.read_stage, eng.pool)
            warm = prompts[min(prompts)][: 2 * args.chunk + 1]
            read_alone(eng, warm, f"p{pair}-warm-alone", 1)
            read_beside_decode(eng, warm, dec_ids, f"p{pair}-warm", 8)
            warmup_alloc = meter.take()
            rows = []
            for n, ids in prompts.items():
                row = {"prompt_tokens": n, **read_alone(eng, ids, f"p{pair}-{n}-alone", args.read_tokens),
                       **read_beside_decode(eng, ids, dec_ids, f"p{pair}-{n}", args.idle_tokens)}
                row["read_beside_over_alone"] = row["read_beside_tok_s"] / row["read_alone_tok_s"]
                rows.append(row)
                print(f"pair {pair} {arm:15s} read {n:7d}: alone {row['read_alone_tok_s']:10.1f} tok/s, beside "
                      f"{row['read_beside_tok_s']:10.1f} tok/s; decode itl p50 {row['itl_idle_50_ms'] or 0:.2f} -> "
                      f"{row['itl_during_50_ms'] or 0:.2f} ms, p99 {row['itl_idle_99_ms'] or 0:.2f} -> "
                      f"{row['itl_during_99_ms'] or 0:.2f} ms, stalls {row['stalls']}", flush=True)
            gw = give_way(eng, giveway_ids, short_ids, f"p{pair}-gw")
            print(f"pair {pair} {arm:15s} give-way: short ttft {gw['short_ttft_s'] * 1e3:.1f} ms (alone "
                  f"{gw['short_ttft_idle_s'] * 1e3:.1f} ms), give-ways {gw['give_ways']}", flush=True)
            alloc = meter.take()
            spec = eng.stats().spec
            draft_kv_on_stage = eng.read_stage.prefill is not None
        finally:
            eng.close()
    info = {"pair": pair, "arm": arm, "env": {sw.name: v for sw, v in ARMS[arm]}, "startup_s": startup,
            "async_scheduling": eng.cfg.async_scheduling, "cuda_graph": eng.cfg.cuda_graph,
            "draft_kv_on_read_stage": draft_kv_on_stage, "lengths": rows,
            "giveway": gw, "alloc": alloc, "alloc_warmup": warmup_alloc,
            "spec": {k: spec[k] for k in ("drafts_proposed", "drafts_accepted", "acceptance")} if spec else None}
    del eng
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return info


# ---- summary ----------------------------------------------------------------------------------------

def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _by_length(runs: list[dict], lengths: list[int]) -> list[dict]:
    out = []
    for n in lengths:
        rows = [row for r in runs for row in r["lengths"] if row["prompt_tokens"] == n]
        med = {k: _median(row[k] for row in rows) for k in (
            "read_alone_tok_s", "read_beside_tok_s", "read_beside_over_alone", "itl_idle_50_ms", "itl_idle_99_ms",
            "itl_during_50_ms", "itl_during_99_ms", "decode_idle_tok_s", "decode_during_tok_s")}
        out.append({"prompt_tokens": n, **med,
                    "itl_during_over_idle": {"p50": _median(row["itl_during_over_idle_p50"] for row in rows),
                                             "p99": _median(row["itl_during_over_idle_p99"] for row in rows)},
                    "stalls": sum(row["stalls"] for row in rows),
                    "max_gap_s": max((row["max_gap_s"] for row in rows if row["max_gap_s"] is not None), default=None)})
    return out


def _headline(runs: list[dict], lengths: list[int], needle_out: dict | None) -> dict:
    """The longest read's medians over `runs`, the give-way's, allocation growth, the needle's counts."""
    by_length = _by_length(runs, lengths)
    top = by_length[-1]
    gws = [r["giveway"] for r in runs]
    specs = [r["spec"] for r in runs if r["spec"]]
    return {
        "at_prompt_tokens": top["prompt_tokens"],
        "itl_during_over_idle": top["itl_during_over_idle"],
        "read_beside_over_alone": top["read_beside_over_alone"],
        "read_alone_tok_s": top["read_alone_tok_s"], "read_beside_tok_s": top["read_beside_tok_s"],
        "decode_idle_tok_s": top["decode_idle_tok_s"], "decode_during_tok_s": top["decode_during_tok_s"],
        "stalls": sum(r["stalls"] for r in by_length),
        "short_ttft_s": _median(g["short_ttft_s"] for g in gws),
        "short_ttft_idle_s": _median(g["short_ttft_idle_s"] for g in gws),
        "give_ways": min(g["give_ways"] for g in gws),
        "alloc_growth_bytes": sum(r["alloc"]["growth_bytes"] for r in runs),
        "alloc_growth_warmup_bytes": sum(r["alloc_warmup"]["growth_bytes"] for r in runs),
        "reads_measured": sum(r["alloc"]["reads"] for r in runs),
        "drafts_accepted": sum(s["drafts_accepted"] for s in specs) if specs else None,
        "drafts_proposed": sum(s["drafts_proposed"] for s in specs) if specs else None,
        "acceptance": _ratio(sum(s["drafts_accepted"] for s in specs), sum(s["drafts_proposed"] for s in specs))
        if specs else None,
        "needle_correct": needle_out["correct"] if needle_out else 0,
        "needle_total": needle_out["total"] if needle_out else 0,
        "needle_alone_correct": needle_out["alone_correct"] if needle_out else 0,
        "by_length": by_length,
    }


def outputs_identical(runs: list[dict]) -> bool:
    """Every run's reads gave the tokens of the first run's, length by length (alone and beside)."""
    ref = {row["prompt_tokens"]: (row["alone_tokens"], row["beside_tokens"]) for row in runs[0]["lengths"]}
    return all((row["alone_tokens"], row["beside_tokens"]) == ref[row["prompt_tokens"]]
               for r in runs for row in r["lengths"])


def summarize(runs: list[dict], lengths: list[int], needle_by_arm: dict | None) -> dict:
    needle_all = ({k: sum(v[k] for v in needle_by_arm.values()) for k in ("correct", "total", "alone_correct")}
                  if needle_by_arm else None)
    by_arm = {arm: _headline([r for r in runs if r["arm"] == arm], lengths, (needle_by_arm or {}).get(arm))
              for arm in ARMS}
    return {**_headline(runs, lengths, needle_all), "outputs_identical": outputs_identical(runs),
            "beside_first_token_matches_alone": all(row["beside_tokens"][:1] == row["alone_tokens"][:1]
                                                    for r in runs for row in r["lengths"]),
            "needle_run": needle_by_arm is not None, "by_arm": by_arm}


# ---- entry ------------------------------------------------------------------------------------------

def _load(args, device: torch.device, dtype: torch.dtype):
    if args.model and args.quant:
        raise SystemExit("--quant makes random --shape weights kept quantized, not a checkpoint's")
    if args.model:
        loaded = load_model(None if args.model == "default" else args.model, device=device, dtype=dtype,
                            progress=False)
        return loaded, "default" if args.model == "default" else os.path.basename(os.path.normpath(args.model))
    name = args.shape + (f"_{args.quant}" if args.quant else "")
    return random_model(args.shape, device, dtype, seed=args.seed, quant=args.quant), name


def _prompt_ids(loaded, n: int, seed: int) -> list[int]:
    """Text of the embedded model's card for a model with a tokenizer, else random ids."""
    if loaded.tokenizer is not None:
        text = open(os.path.join(default_model_path(), "README.md")).read()
        ids = loaded.tokenizer.encode(text)
        return (ids * (n // max(len(ids), 1) + 1))[:n]
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist()


def _through_serve(args, loaded, name: str, device: torch.device, giveway_ids: list[int], short_ids: list[int],
                   ctx: int) -> dict:
    """The give-way once more through `strata serve`'s path (the `concurrent` arm's switches)."""
    from strata.bench.concurrent_http import give_way_through_serve
    from strata.bench.random_model import synthetic_tokenizer, with_tokenizer

    if loaded.tokenizer is None:  # the server checks token-id prompts against a tokenizer's vocabulary
        loaded = with_tokenizer(loaded, synthetic_tokenizer(loaded.config.vocab_size))
    cfg = dataclasses.replace(engine_config(args, device, ctx, 2, args.chunk), spec=args.spec, batch_mtp=bool(args.spec))
    with arm_env("concurrent"):
        eng, _ = build_engine(cfg, loaded)
        res = give_way_through_serve(eng, name, giveway_ids, short_ids, started_after=args.chunk)
    print(f"through strata serve: short ttft {res['serve_short_ttft_s'] * 1e3:.1f} ms during the "
          f"{len(giveway_ids)}-token read, give-ways {res['serve_give_ways']:.0f}", flush=True)
    gc.collect()
    return res


def run(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    args.chunk = args.chunk or EngineConfig(device=str(device)).resolved().chunk_size
    loaded, name = _load(args, device, getattr(torch, args.dtype))
    if args.spec and not loaded.has_mtp:
        raise ValueError(f"--spec needs a model with an MTP head; {name} has none (try --model default)")
    mc = loaded.config
    lengths = sorted(set(args.lengths or [n for n in DEFAULT_LENGTHS if n <= mc.max_position_embeddings]
                         or [mc.max_position_embeddings // 2]))
    if not args.lengths and max(DEFAULT_LENGTHS) > max(lengths):
        print(f"reads of {lengths} tokens: {name} has {mc.max_position_embeddings} positions", flush=True)
    check_context(mc, max(lengths), name)
    giveway = min(args.giveway_tokens or (GPU_GIVEWAY_TOKENS if device.type == "cuda" else max(lengths)),
                  mc.max_position_embeddings - 1)
    ctx = max(max(lengths), giveway) + 8
    loaded = room_for_reads(loaded, ctx)
    prompts = {n: _prompt_ids(loaded, n, args.seed + n) for n in lengths}
    dec_ids = _prompt_ids(loaded, DEC_PROMPT_TOKENS, args.seed + 1)[::-1]
    short_ids = _prompt_ids(loaded, SHORT_TOKENS, args.seed + 2)[::-1]
    giveway_ids = _prompt_ids(loaded, giveway, args.seed + 3)
    runs = [run_arm(args, arm, pair, loaded, device, prompts, dec_ids, short_ids, giveway_ids, ctx)
            for pair in range(args.pairs) for arm in ARMS]
    serve = _through_serve(args, loaded, name, device, giveway_ids, short_ids, ctx) if args.http else None
    needle_by_arm, needle_reason = None, "the model has no tokenizer (random weights): run with --model default"
    if loaded.tokenizer is not None and args.needle_trials:
        needle_by_arm, needle_reason = {arm: needle(args, loaded, device, arm) for arm in ARMS}, None
        for arm, nd in needle_by_arm.items():
            print(f"{arm:15s} needle across the yield point: {nd['correct']}/{nd['total']} correct "
                  f"({nd['alone_correct']} alone)", flush=True)
    for r in runs:  # one timeline per arm and length, the last pair's: the JSON stays small
        if r["pair"] != args.pairs - 1:
            for row in r["lengths"]:
                row.pop("timeline", None)
    info = {"bench": "concurrent", "shape": name, "model": loaded.path, "device": str(device), "dtype": args.dtype,
            "kv": args.kv, "quant": args.quant, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__, "chunk": args.chunk, "lengths": lengths, "pairs": args.pairs,
            "spec": args.spec, "giveway_tokens": giveway, "stall_s": STALL_S,
            "arms": {arm: {sw.name: v for sw, v in env} for arm, env in ARMS.items()},
            "runs": runs, "needle": {"run": needle_by_arm is not None, "reason": needle_reason, "by_arm": needle_by_arm},
            "summary": {**summarize(runs, lengths, needle_by_arm), **(serve or {})},
            "args": {k: v for k, v in vars(args).items() if k != "func"}}
    out = args.out or default_out("concurrent", name, args.kv, device)
    save(info, out, None if args.no_plot else _draw)
    print_tables(summary_tables(info))
    return 0


def summary_tables(info: dict) -> list:
    on = f"{info['shape']} on {info.get('gpu') or info['device']} ({info['dtype']}), chunk {info['chunk']}"
    s = info["summary"]
    rows = [{"arm": arm, **row, "p50x": row["itl_during_over_idle"]["p50"], "p99x": row["itl_during_over_idle"]["p99"]}
            for arm, h in s["by_arm"].items() for row in h["by_length"]]
    reads = summary_table(
        f"concurrent read beside one decoding slot: {on} (medians of {info['pairs']} pairs)",
        [("arm", "arm", ""), ("prompt", "prompt_tokens", "d"), ("alone tok/s", "read_alone_tok_s", ".1f"),
         ("beside tok/s", "read_beside_tok_s", ".1f"), ("beside/alone", "read_beside_over_alone", ".3f"),
         ("itl idle p50 ms", "itl_idle_50_ms", ".2f"), ("itl during p50 ms", "itl_during_50_ms", ".2f"),
         ("p50 x", "p50x", ".2f"), ("itl idle p99 ms", "itl_idle_99_ms", ".2f"),
         ("itl during p99 ms", "itl_during_99_ms", ".2f"), ("p99 x", "p99x", ".2f"),
         ("decode tok/s during", "decode_during_tok_s", ".1f"), ("stalls", "stalls", "d")], rows)
    arms = [{"arm": arm, **{k: h[k] for k in ("short_ttft_idle_s", "short_ttft_s", "give_ways", "alloc_growth_bytes",
                                              "needle_correct", "needle_total", "drafts_accepted")}}
            for arm, h in s["by_arm"].items()]
    for a in arms:
        a["ttft_idle_ms"], a["ttft_ms"] = _ms(a["short_ttft_idle_s"]), _ms(a["short_ttft_s"])
        if not info["needle"]["run"]:
            a["needle_correct"] = a["needle_total"] = None
    other = summary_table(
        f"give-way ({info['giveway_tokens']}-token read), allocation, needle; outputs identical: {s['outputs_identical']}",
        [("arm", "arm", ""), ("short ttft alone ms", "ttft_idle_ms", ".1f"), ("short ttft beside ms", "ttft_ms", ".1f"),
         ("give-ways", "give_ways", "d"), ("alloc growth B", "alloc_growth_bytes", "d"),
         ("needle correct", "needle_correct", "d"), ("needle trials", "needle_total", "d"),
         ("drafts accepted", "drafts_accepted", "d")], arms)
    return [reads, other]


def _draw(plt, info: dict) -> None:
    last = [r for r in info["runs"] if r["pair"] == info["pairs"] - 1]
    _, axes = plt.subplots(1, len(last), figsize=(6 * len(last), 3.8), squeeze=False)
    for ax, r in zip(axes[0], last):
        row = r["lengths"][-1]
        tl = row["timeline"]
        ax.step(tl["decode_t"], tl["decode_tokens"], where="post", color="tab:blue", label="decode tokens")
        ax.set_xlabel("seconds since the read was submitted")
        ax.set_ylabel("decode tokens", color="tab:blue")
        ax.axvline(0, color="grey", lw=0.8)
        ax.axvline(row["read_beside_s"], color="grey", lw=0.8, ls="--")
        ax2 = ax.twinx()
        ax2.step(tl["read_t"], tl["read_tokens"], where="post", color="tab:orange", marker=".", ms=3,
                 label="prompt tokens read")
        ax2.set_ylabel("prompt tokens read", color="tab:orange")
        x = row["itl_during_over_idle_p50"], row["itl_during_over_idle_p99"]
        ax.set_title(f"{r['arm']}: {row['prompt_tokens']}-token read beside decode\nITL during/idle "
                     f"p50 {x[0] or 0:.2f}x, p99 {x[1] or 0:.2f}x; read {row['read_beside_over_alone']:.2f}x of alone",
                     fontsize=9)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_parser(sub) -> None:
    p = sub.add_parser("concurrent", help="the concurrent prompt read (STRATA_PIPED_CONCURRENT): read tok/s, decode "
                                          "latency beside it, give-way TTFT, allocation growth")
    p.add_argument("--shape", default="qwen3-8b-128k", choices=sorted(SHAPES), help="random weights at this shape")
    p.add_argument("--model", default=None,
                   help="a checkpoint instead of --shape; 'default': the embedded model (MTP head, tokenizer: "
                        "--spec and the needle run)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--kv", default="auto", choices=["auto", "bf16", "int8"], help="KV cache storage")
    p.add_argument("--quant", default=None,
                   help="random --shape weights kept quantized in this GGUF format (Q8_0, Q4_K, IQ3_S, ...), as "
                        "`strata bench quant` makes them; the default out name gains it")
    p.add_argument("--lengths", type=_int_list, default=None,
                   help=f"prompt tokens of the reads (default: those of {DEFAULT_LENGTHS} within the model's context)")
    p.add_argument("--pairs", type=int, default=3, help="interleaved pairs of arms, a fresh engine per arm")
    p.add_argument("--chunk", type=int, default=None, help="read chunk (default: the engine's, 2048 on CUDA)")
    p.add_argument("--spec", type=int, default=0, help="MTP drafts per step (a model with an MTP head)")
    p.add_argument("--idle-tokens", type=int, default=128, help="decode events timed before each read")
    p.add_argument("--read-tokens", type=int, default=4, help="tokens the read alone generates (compared across arms)")
    p.add_argument("--giveway-tokens", type=int, default=None,
                   help=f"the give-way scenario's long read (default {GPU_GIVEWAY_TOKENS} on CUDA, else the "
                        "longest --lengths; at most the model's context)")
    p.add_argument("--needle-trials", type=int, default=6, help="needle across the yield point (models with a tokenizer)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--no-cuda-graph", action="store_true", help="EngineConfig(cuda_graph=False)")
    p.add_argument("--out", default=None, help="default: bench/results/concurrent_{shape}[_int8]_{device}.json")
    p.add_argument("--no-plot", action="store_true", help="JSON only, no PNG timeline")
    p.add_argument("--http", action="store_true",
                   help="also the give-way through strata serve's path (summary: serve_short_ttft_s, ...)")
    p.set_defaults(func=run)
