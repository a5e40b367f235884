"""`strata bench concurrent --http`: the give-way through the real serving path.

What a short request sees is its first token during a long read *through `strata serve`*:
the engine here runs as the server runs it (`AsyncEngine`'s loop thread, the app, uvicorn; in a side
thread of this process, `http_arm.running_server`). A client thread streams the long prompt
(token ids); once the server's `strata_prompt_tokens_total` shows the read under way, a second client
streams the short prompt, whose first chunk's arrival is the TTFT. Both clients live in this process,
so the TTFT includes their share of the interpreter: an upper bound of what an outside client sees.
"""

from __future__ import annotations

import threading
import time

from strata.bench.http_arm import running_server
from strata.bench.http_client import client_name, stream_once


def _metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def give_way_through_serve(engine, model_name: str, long_ids: list[int], short_ids: list[int],
                           started_after: int, timeout_s: float = 600.0) -> dict:
    """Serves `engine` (taken over and shut down); returns the short request's TTFT during the long
    read, the long read's own TTFT and the give-ways counted meanwhile. `started_after`: prompt tokens
    the server must have read before the short request is sent (the long read is under way)."""
    client = client_name()
    out: dict = {}
    with running_server(engine, model_name) as url:
        completions = url + "/v1/completions"

        def body(ids, n):
            return {"model": model_name, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}

        before = _metric(url, "strata_give_ways_total")
        read_before = _metric(url, "strata_prompt_tokens_total")
        t_long = threading.Thread(target=lambda: out.setdefault("long", stream_once(completions, body(long_ids, 2),
                                                                                     client)))
        t0 = time.perf_counter()
        t_long.start()
        deadline = time.monotonic() + timeout_s
        while (_metric(url, "strata_prompt_tokens_total") - read_before < started_after
               and time.monotonic() < deadline and t_long.is_alive()):
            time.sleep(0.005)
        sent_at = time.perf_counter() - t0
        short = stream_once(completions, body(short_ids, 4), client)
        t_long.join(timeout_s)
        give_ways = _metric(url, "strata_give_ways_total") - before
    long = out.get("long", {"times": []})
    return {
        "serve_short_ttft_s": short["times"][0] if short["times"] else None,
        "serve_short_sent_at_s": sent_at,
        "serve_long_ttft_s": long["times"][0] if long["times"] else None,
        "serve_give_ways": give_ways,
        "serve_short_finished_first": bool(short["times"] and long["times"]
                                           and sent_at + short["times"][-1] < long["times"][0]),
        "serve_client": client,
    }
