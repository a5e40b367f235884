"""A streaming `/v1/completions` client that records when each SSE chunk arrives.

Run as its own process by the decode benchmark's HTTP arm (`python -m strata.bench.http_client URL
...`), so its parsing and clock share no interpreter (no GIL) with the server it measures. Standard
library and, when importable, httpx; nothing from torch. Prints one JSON object on stdout:
`{"client": "httpx"|"urllib", "runs": [{"times": [...], "completion_tokens": n}, ...]}` where `times`
are the arrival times (seconds after the request was sent) of the chunks that carry completion text.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Iterator


def _lines_httpx(url: str, body: dict) -> Iterator[str]:
    import httpx

    with httpx.stream("POST", url, json=body, timeout=None) as resp:
        resp.raise_for_status()
        yield from resp.iter_lines()


def lines_urllib(url: str, body: dict) -> Iterator[str]:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        for raw in resp:
            yield raw.decode().rstrip("\r\n")


def sse_chunks(lines: Iterator[str]) -> Iterator[dict]:
    """The JSON chunks of an OpenAI-style SSE stream, up to `[DONE]`; a streamed error raises."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"the server streamed an error: {chunk['error']}")
        yield chunk


def client_name() -> str:
    try:
        import httpx  # noqa: F401
    except ImportError:
        return "urllib"
    return "httpx"


def stream_once(url: str, body: dict, client: str) -> dict:
    """One streamed completion: arrival times of text chunks and the usage's completion tokens."""
    lines = _lines_httpx if client == "httpx" else lines_urllib
    times: list[float] = []
    completion_tokens = None
    t0 = time.perf_counter()
    for chunk in sse_chunks(lines(url, body)):
        now = time.perf_counter() - t0
        if chunk.get("usage"):
            completion_tokens = chunk["usage"]["completion_tokens"]
        if any(c.get("text") for c in chunk.get("choices", ())):
            times.append(now)
    return {"times": times, "completion_tokens": completion_tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.bench.http_client")
    p.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-tokens", type=int, required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True, help="prompt ids are drawn from [0, vocab)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    client = client_name()
    runs = []
    for _ in range(a.runs):
        body = {"model": a.model, "prompt": [rng.randrange(a.vocab) for _ in range(a.prompt_tokens)],
                "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        runs.append(stream_once(a.url.rstrip("/") + "/v1/completions", body, client))
    json.dump({"client": client, "runs": runs}, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
