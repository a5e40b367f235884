"""Prometheus text exposition (format 0.0.4) for /metrics, written by hand: the format is a few lines
of text and a client library would be one more dependency for the GPU machine.

Engine figures come from `EngineStats` snapshots; tokens/s is derived here from the token counters
between scrapes, and HTTP request counts are kept by a small ASGI middleware.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any, Callable, Iterable

from strata.engine.types import TTFT_BUCKETS, EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# Label values for request counting: known routes only, so a scanner probing paths cannot grow the set.
TRACKED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
})


def _num(v: float | int) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = {k: v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in labels.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str, samples: Iterable[tuple[str, dict[str, str], float]]) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")
        for suffix, labels, value in samples:
            self.lines.append(f"{name}{suffix}{_labels(labels)} {_num(value)}")

    def one(self, name: str, kind: str, help_: str, value: float) -> None:
        self.family(name, kind, help_, [("", {}, value)])

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


class RateWindow:
    """Per-second rate of a counter over roughly the last `window_s` seconds of scrapes."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.clock = window_s, clock
        self.samples: deque[tuple[float, float]] = deque()

    def update(self, total: float, uptime_s: float) -> float:
        now = self.clock()
        self.samples.append((now, total))
        # Keep the newest sample older than the window so the rate always spans at least the window.
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        t0, v0 = self.samples[0]
        if now - t0 > 0:
            return max(total - v0, 0.0) / (now - t0)
        return total / uptime_s if uptime_s > 0 else 0.0


class Metrics:
    def __init__(self, model_name: str, clock: Callable[[], float] = time.monotonic):
        self.model_name = model_name
        self._lock = threading.Lock()
        self._http: dict[tuple[str, str, str], int] = {}
        self._prompt_rate = RateWindow(clock=clock)
        self._gen_rate = RateWindow(clock=clock)

    def count_http(self, method: str, path: str, status: int) -> None:
        key = (method, path if path in TRACKED_PATHS else "other", str(status))
        with self._lock:
            self._http[key] = self._http.get(key, 0) + 1

    def render(self, s: EngineStats) -> str:
        w = _Writer()
        with self._lock:
            prompt_tps = self._prompt_rate.update(s.prompt_tokens_total, s.uptime_seconds)
            gen_tps = self._gen_rate.update(s.generation_tokens_total, s.uptime_seconds)
            http = sorted(self._http.items())
        w.family("strata_model_info", "gauge", "The served model.", [("", {"model": self.model_name}, 1)])
        w.one("strata_uptime_seconds", "gauge", "Seconds since the engine started.", s.uptime_seconds)
        w.one("strata_queue_length", "gauge", "Requests waiting for a slot.", s.queue_len)
        w.one("strata_slots_busy", "gauge", "Slots running a request.", s.slots_busy)
        w.one("strata_slots_total", "gauge", "Slots (requests run at once).", s.parallel)
        w.one("strata_kv_blocks_used", "gauge", "KV cache blocks in use.", s.kv_blocks_used)
        w.one("strata_kv_blocks_total", "gauge", "KV cache blocks in all.", s.kv_blocks_total)
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        w.one("strata_kv_cache_usage_ratio", "gauge", "Fraction of KV cache blocks in use.", usage)
        w.one("strata_prompt_tokens_total", "counter", "Prompt tokens read.", s.prompt_tokens_total)
        w.one("strata_generation_tokens_total", "counter", "Tokens generated.", s.generation_tokens_total)
        w.one("strata_requests_finished_total", "counter", "Requests finished (any reason).", s.requests_finished_total)
        w.one("strata_give_ways_total", "counter", "Times a prompt read gave way to decoding.", s.give_ways_total)
        w.one("strata_preemptions_total", "counter", "Requests preempted for KV cache space.", s.preemptions_total)
        w.one("strata_prompt_tokens_per_second", "gauge", "Prompt tokens read per second, recent.", prompt_tps)
        w.one("strata_generation_tokens_per_second", "gauge", "Tokens generated per second, recent.", gen_tps)
        cumulative = list(s.ttft_counts) or [0] * (len(TTFT_BUCKETS) + 1)
        total, n = s.ttft_sum, cumulative[-1]
        bounds = [_num(b) for b in TTFT_BUCKETS] + ["+Inf"]
        samples: list[tuple[str, dict[str, str], float]] = [
            ("_bucket", {"le": b}, c) for b, c in zip(bounds, cumulative)
        ]
        samples += [("_sum", {}, total), ("_count", {}, n)]
        w.family("strata_time_to_first_token_seconds", "histogram", "Seconds from arrival to first token.", samples)
        if s.spec is not None:
            w.one("strata_spec_drafts_proposed_total", "counter", "MTP drafts proposed.", s.spec["drafts_proposed"])
            w.one("strata_spec_drafts_accepted_total", "counter", "MTP drafts accepted.", s.spec["drafts_accepted"])
            w.one("strata_spec_acceptance_ratio", "gauge", "Accepted / proposed drafts.", s.spec["acceptance"])
            w.one("strata_spec_mean_accepted_length", "gauge", "Tokens emitted per verification step.",
                  s.spec["mean_accepted_length"])
            w.family("strata_spec_accepted_per_position", "gauge", "Acceptance of the draft at each position.",
                     [("", {"position": str(i + 1)}, a) for i, a in enumerate(s.spec["accepted_per_position"])])
        w.family("strata_http_requests_total", "counter", "HTTP requests answered, by route and status.",
                 [("", {"method": m, "path": p, "status": c}, v) for (m, p, c), v in http])
        return w.text()


class RequestCounter:
    """ASGI middleware: counts every HTTP response by method, path and status."""

    def __init__(self, app: Any, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.count_http(scope.get("method", ""), scope.get("path", ""), status["code"])
