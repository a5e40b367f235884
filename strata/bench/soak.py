"""`strata bench soak`: many streaming clients for a long time against one `--batch-invariant` server.

One `strata serve` (engine, app and uvicorn as `strata serve` runs them, in a thread of this process on
a loopback port: `http_arm.running_server`, as the determinism bench does) takes `--clients` streaming
`/v1/completions` clients for `--seconds`; each client loops requests with prompts (token ids) and
output lengths drawn from `--prompts` and `--max-tokens`, half greedy, half sampled. Every request ends
one of three ways:
- completed: status 200, a finish reason and `[DONE]`;
- rejected: 429 or 503, the server's backpressure (the client waits `Retry-After`, at most 5 s);
- lost: anything else: a connection error or timeout, a stream cut without `[DONE]`, an SSE error
  event, a chunk not of the API's shape, another status (`lost_reasons` says which).
The clients run in a child process (`python -m strata.bench.soak`: standard library only, a JSON job on
stdin, the records on stdout), so the server process's memory is the server's. A thread here samples
it every `--sample-every` seconds: the host RSS and, on CUDA, torch's reserved memory (the server's
allocator, read in its own process) and nvidia-smi's figure for this process when it lists it. The
headline memory is the reserved memory on CUDA, the RSS on the CPU: its peak after `--warmup` seconds
and that peak minus the value at the end of the warm-up (the growth).

Greedy answers: a fixed set of probe prompts, each sent alone before the soak (one at a time, the
server otherwise idle), then again, one at a time, in rounds from the end of the warm-up to the end of
the soak under the full load (the clients keep going until one round is done). Their texts must be
identical (`greedy_identical`); the logprobs are compared bitwise too (`probe_logprobs_identical`).
JSON under bench/results/ and a PNG of memory and completed requests over time.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error

from strata.bench.http_client import lines_urllib, sse_chunks  # standard library only, like this client

RETRY_CAP_S = 5.0
LOST_SHOWN = 50  # lost requests whose details the JSON keeps


# -- the client (its own process) ------------------------------------------------------------------

def one_request(url: str, body: dict) -> dict:
    """One streamed completion: `outcome` (completed, lost, rejected), `reason` when not completed,
    `status`, the text, the token logprobs, the finish reason and the completion tokens."""
    done = False

    def lines():
        nonlocal done
        for line in lines_urllib(url + "/v1/completions", body):
            if line == "data: [DONE]":
                done = True
            yield line

    out: dict = {"outcome": "lost", "reason": None, "status": 200, "text": "", "logprobs": [], "finish_reason": None,
                 "tokens": 0}
    parts: list[str] = []
    try:
        for chunk in sse_chunks(lines()):
            for choice in chunk.get("choices", ()):
                parts.append(choice.get("text") or "")
                if choice.get("logprobs"):
                    out["logprobs"] += choice["logprobs"]["token_logprobs"]
                out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
            if chunk.get("usage"):
                out["tokens"] = chunk["usage"]["completion_tokens"]
    except urllib.error.HTTPError as e:  # before OSError: HTTPError is one
        out["status"] = e.code
        if e.code in (429, 503):
            out["outcome"], out["reason"] = "rejected", str(e.code)
            out["retry_after"] = e.headers.get("Retry-After")
        else:
            out["reason"] = f"http_{e.code}"
        e.close()
        return out
    except RuntimeError as e:  # sse_chunks: the server streamed an error event
        out["reason"] = "stream_error"
        out["detail"] = str(e)[:300]
        return out
    except (OSError, http.client.HTTPException, ValueError) as e:  # refused, reset, timed out, cut mid-chunk
        out["reason"] = "connection"
        out["detail"] = f"{type(e).__name__}: {e}"[:300]
        return out
    except Exception as e:  # a chunk not of the API's shape: counted, so no client thread dies unseen
        out["reason"] = "malformed"
        out["detail"] = f"{type(e).__name__}: {e}"[:300]
        return out
    out["text"] = "".join(parts)
    if not done:
        out["reason"] = "cut"
    elif out["finish_reason"] is None:
        out["reason"] = "no_finish_reason"
    else:
        out["outcome"] = "completed"
    return out


def request_body(rng: random.Random, job: dict) -> dict:
    """A request of the mix: a prompt length and an output length from the job's lists, the prompt cut
    from the job's token ids at a random offset, greedy or sampled at even odds."""
    n = rng.choice(job["prompts"])
    source = job["source"]
    offset = rng.randrange(len(source))
    ids = (source * (2 + n // len(source)))[offset:offset + n]
    body = {"model": job["model"], "prompt": ids, "max_tokens": rng.choice(job["max_tokens"]), "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, seed=rng.randrange(2**31))
    return body


def probe_body(job: dict, ids: list[int]) -> dict:
    return {"model": job["model"], "prompt": ids, "max_tokens": job["probe_tokens"], "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": True}


def soak(job: dict) -> dict:
    """The soak as the client sees it: the alone probes, then the clients and the probe rounds under
    load; every request's record and the probes' answers, with wall-clock times."""
    url = job["url"]
    socket.setdefaulttimeout(job["request_timeout"])  # urllib's sockets: a silent server is a lost request
    alone = [one_request(url, probe_body(job, ids)) for ids in job["probe_prompts"]]
    records: list[dict] = []
    lock = threading.Lock()
    stop = threading.Event()
    start = time.time()
    deadline = start + job["seconds"]
    rounds: list[list[dict]] = []

    def client(i: int) -> None:
        rng = random.Random(job["seed"] * 1_000_003 + i)
        while not stop.is_set():
            body = request_body(rng, job)
            t0 = time.time()
            r = one_request(url, body)
            row = {"client": i, "start": t0, "end": time.time(), "prompt_tokens": len(body["prompt"]),
                   "max_tokens": body["max_tokens"], **{k: r.get(k) for k in ("outcome", "reason", "status", "tokens")}}
            if "detail" in r:
                row["detail"] = r["detail"]
            with lock:
                records.append(row)
            if r["outcome"] == "rejected":
                try:
                    wait = float(r.get("retry_after") or 1)
                except ValueError:
                    wait = 1.0
                stop.wait(min(wait, RETRY_CAP_S))

    def probes() -> None:
        time.sleep(max(0.0, start + job["warmup"] - time.time()))
        while True:
            one = []
            for ids in job["probe_prompts"]:
                t0 = time.time()
                one.append({**one_request(url, probe_body(job, ids)), "start": t0, "end": time.time()})
            rounds.append(one)
            if time.time() >= deadline:
                return

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(job["clients"])]
    prober = threading.Thread(target=probes, daemon=True)
    for t in threads:
        t.start()
    prober.start()
    next_report = start + job["progress_every"]
    while time.time() < deadline or prober.is_alive():
        time.sleep(0.2)
        if time.time() >= next_report:
            next_report += job["progress_every"]
            with lock:
                counts = {o: sum(r["outcome"] == o for r in records) for o in ("completed", "lost", "rejected")}
            print(f"soak {time.time() - start:.0f}/{job['seconds']:.0f} s: {counts}, probe rounds {len(rounds)}",
                  file=sys.stderr, flush=True)
    ended = time.time()
    stop.set()
    for t in threads:
        t.join()
    return {"start": start, "ended": ended, "drained": time.time(), "records": records, "alone": alone,
            "under_load": rounds}


def client_main() -> int:
    job = json.load(sys.stdin)
    json.dump(soak(job), sys.stdout)
    sys.stdout.write("\n")
    return 0


# -- what the records say --------------------------------------------------------------------------

def tally(records: list[dict]) -> dict:
    """Counts per outcome, lost requests per reason, and the first `LOST_SHOWN` lost ones."""
    lost = [r for r in records if r["outcome"] == "lost"]
    reasons: dict[str, int] = {}
    for r in lost:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    return {"requests_completed": sum(r["outcome"] == "completed" for r in records),
            "requests_lost": len(lost), "requests_rejected": sum(r["outcome"] == "rejected" for r in records),
            "lost_reasons": reasons, "lost_shown": lost[:LOST_SHOWN],
            "tokens_generated": sum(r.get("tokens") or 0 for r in records if r["outcome"] == "completed")}


def compare_probes(alone: list[dict], rounds: list[list[dict]]) -> dict:
    """Each under-load answer against the same probe's alone answer: `greedy_identical` when every
    probe completed alone and in at least one round, and every text equals its alone text."""
    mismatches = []
    logprobs_identical = True
    for k, one in enumerate(rounds):
        for i, (a, b) in enumerate(zip(alone, one)):
            same = a["outcome"] == b["outcome"] == "completed" and a["text"] == b["text"]
            if not same:
                mismatches.append({"round": k, "probe": i, "alone": a["text"], "under_load": b["text"],
                                   "alone_outcome": a["outcome"], "under_load_outcome": b["outcome"],
                                   "under_load_reason": b.get("reason")})
            elif [float(x).hex() for x in a["logprobs"]] != [float(x).hex() for x in b["logprobs"]]:
                logprobs_identical = False
    ok = bool(rounds) and all(a["outcome"] == "completed" for a in alone) and not mismatches
    return {"greedy_identical": ok, "probe_logprobs_identical": ok and logprobs_identical,
            "probe_rounds_under_load": len(rounds), "probe_mismatches": mismatches[:LOST_SHOWN],
            "probe_answers": [{"tokens": len(a["logprobs"]), "text": a["text"], "finish_reason": a["finish_reason"]}
                              for a in alone]}


def memory_summary(samples: list[dict], key: str, warmup_s: float) -> dict:
    """Of `samples[*][key]` (bytes; `t`: seconds since the soak started): the value at the end of the
    warm-up (the last sample at or before it, the first sample if none), the peak from there on, the
    peak's growth over that value, and the growth at the last sample."""
    rows = [s for s in samples if s.get(key) is not None]
    if not rows:
        return {"at_warmup_end": None, "peak_after_warmup": None, "growth_after_warmup": None, "end_growth": None}
    before = [s for s in rows if s["t"] <= warmup_s]
    base = before[-1] if before else rows[0]
    after = [s[key] for s in rows if s["t"] >= base["t"]]
    return {"at_warmup_end": base[key], "peak_after_warmup": max(after), "growth_after_warmup": max(after) - base[key],
            "end_growth": rows[-1][key] - base[key]}


def timeline(records: list[dict], start: float, bucket_s: float) -> list[dict]:
    """Per `bucket_s` seconds since `start` (by end time): requests completed, lost, rejected."""
    n = 1 + int(max((r["end"] - start for r in records), default=0.0) // bucket_s)
    rows = [{"t": i * bucket_s, "completed": 0, "lost": 0, "rejected": 0} for i in range(n)]
    for r in records:
        rows[max(0, int((r["end"] - start) // bucket_s))][r["outcome"]] += 1
    return rows


# -- memory of this (the server's) process ---------------------------------------------------------

def host_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def nvidia_smi_bytes(pid: int) -> int | None:
    """This process's GPU memory as nvidia-smi lists it (None when it does not, e.g. in another PID
    namespace)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    total = [int(mib) * 2**20 for p, _, mib in (line.partition(",") for line in out.splitlines())
             if p.strip() == str(pid) and mib.strip().isdigit()]
    return sum(total) if total else None


class MemorySampler(threading.Thread):
    """Samples every `every` seconds until stopped: `wall` (time.time()), `host_rss` and, on CUDA,
    `gpu_reserved` (torch) and `gpu_process` (nvidia-smi; given up after its first miss)."""

    def __init__(self, every: float, device: str):
        super().__init__(name="strata-soak-memory", daemon=True)
        self.every, self.cuda = every, device.startswith("cuda")
        self.device = device
        self.samples: list[dict] = []
        self.halt = threading.Event()
        self.smi = self.cuda

    def sample(self) -> None:
        s: dict = {"wall": time.time(), "host_rss": host_rss_bytes()}
        if self.cuda:
            import torch

            s["gpu_reserved"] = torch.cuda.memory_reserved(self.device)
            s["gpu_process"] = nvidia_smi_bytes(os.getpid()) if self.smi else None
            self.smi = s["gpu_process"] is not None
        self.samples.append(s)

    def run(self) -> None:
        while True:
            self.sample()
            if self.halt.wait(self.every):
                self.sample()
                return


# -- the bench (the server's side) -----------------------------------------------------------------

def _child_client(job: dict, timeout_s: float) -> dict:
    import strata
    from strata.env import child_environment

    root = os.path.dirname(os.path.dirname(os.path.abspath(strata.__file__)))
    # stderr passes through: the client's progress lines show while the soak runs.
    res = subprocess.run([sys.executable, "-m", "strata.bench.soak"], input=json.dumps(job), stdout=subprocess.PIPE,
                         text=True, env=child_environment(root), timeout=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"the soak client failed ({res.returncode}); its stderr is above")
    return json.loads(res.stdout.strip().splitlines()[-1])


def probe_prompts(source: list[int], lengths: list[int], limit: int) -> list[list[int]]:
    """One probe per length (at most `limit` tokens), cut from `source` at offsets 131 apart."""
    out = []
    for i, n in enumerate(lengths):
        n = min(n, limit)
        ids = source * (2 + (131 * i + n) // len(source))
        out.append(ids[131 * i:131 * i + n])
    return out


def run(args) -> int:
    import torch

    from strata.bench.http_arm import running_server
    from strata.bench.results import print_tables, save, summary_table
    from strata.config import EngineConfig
    from strata.engine.engine import LLMEngine
    from strata.loaders import default_model_path

    if args.warmup >= args.seconds:
        raise SystemExit("--warmup must be shorter than --seconds")
    if args.shape and args.model:
        raise SystemExit("give --shape (random weights) or --model, not both")
    model = None if args.model in (None, "default") else args.model
    cfg = EngineConfig(model=model, device=args.device, dtype=args.dtype, parallel=args.parallel, ctx=args.ctx,
                       batch_invariant=True, gpu_memory=args.gpu_memory)
    device, dtype = cfg.resolved_device, cfg.resolved_dtype
    if args.shape:  # random weights; prompts are random token ids, texts from a tokenizer naming every id
        from strata.bench.random_model import random_model, shape_config, synthetic_tokenizer

        vocab = shape_config(args.shape).vocab_size
        loaded = random_model(args.shape, device, getattr(torch, dtype), tokenizer=synthetic_tokenizer(vocab))
        eng = LLMEngine(cfg, progress=False, loaded=loaded)
        source = torch.randint(0, vocab, (65536,), generator=torch.Generator().manual_seed(0)).tolist()
        model_name = args.shape
    else:
        eng = LLMEngine(cfg, progress=False)
        card = os.path.join(model, "README.md") if model and os.path.isdir(model) else None
        if not card or not os.path.exists(card):  # any English text will do for prompts
            card = os.path.join(default_model_path(), "README.md")
        with open(card) as f:
            source = eng.tokenizer.encode(f.read())
        model_name = os.path.basename(os.path.normpath(model)) if model else "default"
    limit = eng.max_model_len
    if max(args.prompts) + max(args.max_tokens) > limit or args.probe_tokens >= limit:
        raise SystemExit(f"the longest prompt plus the longest output must fit the context ({limit} tokens)")
    job = {"model": model_name, "clients": args.clients, "seconds": args.seconds, "warmup": args.warmup,
           "prompts": args.prompts, "max_tokens": args.max_tokens, "source": source, "seed": args.seed,
           "probe_prompts": probe_prompts(source, args.probe_prompts, limit - args.probe_tokens),
           "probe_tokens": args.probe_tokens, "request_timeout": args.request_timeout,
           "progress_every": min(30.0, max(1.0, args.seconds / 10))}
    sampler = MemorySampler(args.sample_every, device)
    with running_server(eng, model_name) as url:
        sampler.start()
        try:
            res = _child_client({**job, "url": url}, args.seconds + args.request_timeout + 600)
        finally:
            sampler.halt.set()
            sampler.join()
    eng.close()
    start = res["start"]
    samples = [{"t": s["wall"] - start, **{k: v for k, v in s.items() if k != "wall"}} for s in sampler.samples]
    primary = "gpu_reserved" if device.startswith("cuda") else "host_rss"
    mem = {k: memory_summary(samples, k, args.warmup) for k in ("gpu_reserved", "gpu_process", "host_rss")
           if any(s.get(k) is not None for s in samples)}
    counts = tally(res["records"])
    probes = compare_probes(res["alone"], res["under_load"])
    summary = {
        "clients": args.clients, "seconds": res["ended"] - start, "drain_seconds": res["drained"] - res["ended"],
        "requests_completed": counts["requests_completed"], "requests_lost": counts["requests_lost"],
        "requests_rejected": counts["requests_rejected"], "tokens_generated": counts["tokens_generated"],
        "memory_measure": primary,
        "memory_at_warmup_end_bytes": mem[primary]["at_warmup_end"],
        "peak_memory_after_warmup_bytes": mem[primary]["peak_after_warmup"],
        "memory_growth_after_warmup_bytes": mem[primary]["growth_after_warmup"],
        "host_rss_peak_after_warmup_bytes": mem["host_rss"]["peak_after_warmup"] if "host_rss" in mem else None,
        "host_rss_growth_after_warmup_bytes": mem["host_rss"]["growth_after_warmup"] if "host_rss" in mem else None,
        "greedy_identical": probes["greedy_identical"],
        "probe_logprobs_identical": probes["probe_logprobs_identical"],
        "probe_rounds_under_load": probes["probe_rounds_under_load"],
    }
    resolved = cfg.resolved()
    info = {
        "bench": "soak", "model": args.model or args.shape or "default", "device": device, "dtype": dtype,
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "config": {"clients": args.clients, "seconds": args.seconds, "warmup_s": args.warmup,
                   "parallel": args.parallel, "ctx": limit, "batch_invariant": True,
                   "gpu_memory_gib": args.gpu_memory,
                   "chunk_size": resolved.chunk_size, "prompt_lengths": args.prompts, "max_tokens": args.max_tokens,
                   "probe_prompt_lengths": [len(p) for p in job["probe_prompts"]], "probe_tokens": args.probe_tokens,
                   "sample_every_s": args.sample_every, "request_timeout_s": args.request_timeout, "seed": args.seed,
                   "endpoint": "/v1/completions (token-id prompts, streamed, ignore_eos; half greedy, half "
                               "temperature 0.8 with a seed)"},
        "summary": summary, "memory": mem, "lost_reasons": counts["lost_reasons"], "lost": counts["lost_shown"],
        **{k: v for k, v in probes.items() if k not in summary},
        "timeline": timeline(res["records"], start, max(1.0, args.sample_every)) if res["records"] else [],
        "memory_samples": samples,
    }
    out = args.out or f"bench/results/soak_{model_name}_{device.split(':')[0]}.json"
    save(info, out, _draw)
    gib = 2**30
    row = {**summary, **{k: (v / gib if v is not None else None) for k, v in summary.items() if k.endswith("_bytes")}}
    title = (f"soak: {args.clients} clients for {summary['seconds']:.0f} s on {args.parallel} slots "
             f"({info['gpu'] or device}, {dtype}, --batch-invariant)")
    print_tables([summary_table(title, [("completed", "requests_completed", "d"), ("lost", "requests_lost", "d"),
                                        ("rejected", "requests_rejected", "d"), ("tokens", "tokens_generated", "d"),
                                        (f"peak {primary} GiB", "peak_memory_after_warmup_bytes", ".3f"),
                                        ("growth GiB", "memory_growth_after_warmup_bytes", ".4f"),
                                        ("greedy identical", "greedy_identical", ""),
                                        ("probe rounds", "probe_rounds_under_load", "d")], [row])])
    return 0


def _draw(plt, info: dict) -> None:
    samples, summary = info["memory_samples"], info["summary"]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for key, label in (("gpu_reserved", "GPU reserved (torch)"), ("gpu_process", "GPU (nvidia-smi)"),
                       ("host_rss", "host RSS")):
        pts = [(s["t"], s[key] / 2**30) for s in samples if s.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), label=label)
    ax.axvline(info["config"]["warmup_s"], color="gray", linestyle="--", linewidth=1)
    ax.set_ylabel("GiB")
    ax.legend(fontsize=8)
    ax.set_title(f"{info['model']} {info['device']}: {summary['clients']} clients, {summary['requests_completed']} "
                 f"completed, {summary['requests_lost']} lost, {summary['requests_rejected']} rejected; growth after "
                 f"warm-up {(summary['memory_growth_after_warmup_bytes'] or 0) / 2**20:.1f} MiB", fontsize=9)
    rows = info["timeline"]
    if rows:
        width = rows[1]["t"] - rows[0]["t"] if len(rows) > 1 else 1.0
        bx.bar([r["t"] for r in rows], [r["completed"] for r in rows], width=width, align="edge", color="tab:green",
               label="completed")
        bx.bar([r["t"] for r in rows], [r["lost"] + r["rejected"] for r in rows], width=width, align="edge",
               bottom=[r["completed"] for r in rows], color="tab:red", label="lost or rejected")
        bx.legend(fontsize=8)
    bx.set_ylabel("requests ended")
    bx.set_xlabel("seconds since the soak started (dashed: end of warm-up)")


def _ints(s: str) -> list[int]:
    values = [int(x) for x in s.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive integers")
    return values


def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="streaming clients for a long time against a --batch-invariant server: lost "
                                    "requests, memory growth, greedy answers under load")
    p.add_argument("--model", default=None, help="`default` (the embedded model) or an HF directory / .gguf file")
    p.add_argument("--shape", default=None, help="random weights at this shape instead (e.g. qwen3-8b)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--clients", type=int, default=64, help="streaming clients, each looping requests")
    p.add_argument("--seconds", type=float, default=600.0, help="how long the clients keep starting requests")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before memory growth is counted")
    p.add_argument("--parallel", type=int, default=16, help="the server's slots")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                   help="the server's VRAM cap (strata serve --gpu-memory), so other work can share the card")
    p.add_argument("--prompts", type=_ints, default=[16, 128, 512, 2048],
                   help="prompt lengths in tokens, drawn at random")
    p.add_argument("--max-tokens", type=_ints, default=[16, 64, 256], help="output lengths, drawn at random")
    p.add_argument("--probe-prompts", type=_ints, default=[8, 100, 700], help="the greedy probes' prompt lengths")
    p.add_argument("--probe-tokens", type=int, default=64, help="tokens each greedy probe generates")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between memory samples")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds a client waits on a silent socket before it counts the request lost")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)


if __name__ == "__main__":
    sys.exit(client_main())
