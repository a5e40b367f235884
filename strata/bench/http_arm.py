"""The decode benchmark's HTTP arm: batch-1 decode through the real serving path.

The engine runs as `strata serve` runs it (`AsyncEngine`'s loop thread, the app from `build_app`,
uvicorn's event loop), here in a background thread of this process on a free loopback port; the
client (`strata.bench.http_client`) is a separate process that streams `/v1/completions` with a
token-id prompt and records when each chunk arrives. Tokens after the first over the time from the
first chunk to the last gives tok/s; the gaps between chunks give the inter-token latencies. Where the
server writes a stream at most every `stream_interval_ms` (its default on the CPU), the chunks between
come in bursts: gaps of ~0 within one, the interval between them.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Iterator

import strata
from strata.env import child_environment


@contextlib.contextmanager
def running_server(engine, model_name: str, log_level: str = "warning", start_timeout_s: float = 60.0,
                   stream_interval_ms: float | None = None) -> Iterator[str]:
    """Serves `engine` (an `LLMEngine`, which this takes over and shuts down) over HTTP on 127.0.0.1;
    yields the base URL. The socket is bound before uvicorn starts, so no other process can take the
    port in between. `stream_interval_ms`: the server's option (None: its default)."""
    import uvicorn

    from strata.engine.async_engine import AsyncEngine
    from strata.server.app import build_app
    from strata.server.config import ServerConfig
    from strata.server.serve import uvicorn_config

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server_cfg = ServerConfig(host="127.0.0.1", port=port, model_name=model_name, log_level=log_level,
                              stream_interval_ms=stream_interval_ms)
    async_engine = AsyncEngine(engine)
    try:
        app = build_app(async_engine, server_cfg, own_engine=True)
        # The uvicorn settings `strata serve` uses; run() would also own the signals, and a server in a
        # side thread must leave those to the main one (uvicorn does so off the main thread).
        config = uvicorn_config(app, server_cfg)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="strata-bench-http",
                                  daemon=True)
        thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                raise RuntimeError("the benchmark's HTTP server did not start")
            time.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(timeout=server_cfg.shutdown_timeout + 30)
    finally:
        async_engine.shutdown()  # the app's lifespan has done it when the server started; then a no-op
        sock.close()


def run_client(url: str, model_name: str, prompt_tokens: int, max_tokens: int, vocab: int, runs: int,
               seed: int = 0, timeout_s: float = 600.0) -> dict:
    """Runs `python -m strata.bench.http_client` against `url`; returns its JSON."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(strata.__file__)))
    env = child_environment(root)
    cmd = [sys.executable, "-m", "strata.bench.http_client", url, "--model", model_name,
           "--prompt-tokens", str(prompt_tokens), "--max-tokens", str(max_tokens), "--vocab", str(vocab),
           "--runs", str(runs), "--seed", str(seed)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"the HTTP client failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(client_out: dict, warmup: int = 1) -> dict:
    """The HTTP fields of the decode JSON from the client's runs, the first `warmup` ones dropped.
    tok/s is the best run's; the latency percentiles pool the gaps of all measured runs."""
    runs = client_out["runs"][warmup:] or client_out["runs"]
    best_tok_s, best = 0.0, runs[0]
    gaps_ms: list[float] = []
    for r in runs:
        t = r["times"]
        tokens = r["completion_tokens"] or len(t)
        if len(t) >= 2 and t[-1] > t[0]:
            tok_s = (tokens - 1) / (t[-1] - t[0])
            if tok_s > best_tok_s:
                best_tok_s, best = tok_s, r
        gaps_ms += [(b - a) * 1e3 for a, b in zip(t, t[1:])]
    chunks = len(best["times"])
    tokens = best["completion_tokens"] or chunks
    return {
        "http_b1_tok_s": best_tok_s or None,
        "http_itl_p50_ms": percentile(gaps_ms, 50),
        "http_itl_p99_ms": percentile(gaps_ms, 99),
        "http_ttft_ms": percentile([r["times"][0] * 1e3 for r in runs if r["times"]], 50),
        "http_tokens": tokens,
        # 1.0 when every chunk carries one token, which makes the gaps per-token latencies.
        "http_tokens_per_chunk": tokens / chunks if chunks else None,
        "http_runs": len(runs),
        "http_client": client_out.get("client"),
    }


def measure_http(engine, model_name: str, prompt_tokens: int, max_tokens: int, vocab: int, repeats: int,
                 seed: int = 0, stream_interval_ms: float | None = None) -> dict:
    """Serves `engine`, streams `repeats` + 1 completions from a client process (the first warms up)
    and returns `summarize`'s fields, the server's stream interval and the raw arrival times."""
    from strata.engine.async_engine import default_stream_interval

    interval = default_stream_interval(engine) * 1e3 if stream_interval_ms is None else stream_interval_ms
    with running_server(engine, model_name, stream_interval_ms=stream_interval_ms) as url:
        out = run_client(url, model_name, prompt_tokens, max_tokens, vocab, repeats + 1, seed)
    return {**summarize(out), "http_stream_interval_ms": interval, "http_raw": out["runs"]}
