"""What the monitoring routes say: /metrics (Prometheus, through prometheus-client) and /slots (JSON).

Both read the engine's latest `EngineStats` snapshot and nothing else, so a scrape never waits for
the engine thread. Each app has its own `CollectorRegistry`, never the library's global one: several
servers may run in one process (tests). HTTP request counts are kept by a small ASGI middleware.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from strata.engine.types import TTFT_BUCKETS, EngineStats, RateWindow

__all__ = ["CONTENT_TYPE", "Metrics", "RateWindow", "RequestCounter", "llama_metrics", "slots_json"]

CONTENT_TYPE = CONTENT_TYPE_LATEST


# Label values for request counting: known routes only, so a scanner probing paths cannot grow the set.
TRACKED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/responses", "/v1/messages", "/health", "/metrics",
    "/slots", "/strata/slots", "/completion", "/completions", "/chat/completions", "/models", "/props",
    "/apply-template", "/tokenize", "/detokenize",
})


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class EngineCollector(Collector):
    """Metric families built at each scrape from the latest engine snapshot and the HTTP counts."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats],
                 http_counts: Callable[[], list[tuple[tuple[str, str, str], int]]],
                 rejected: Callable[[], int] = lambda: 0):
        self.model_name, self.stats, self.http_counts, self.rejected = model_name, stats, http_counts, rejected

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        info = GaugeMetricFamily("strata_model_info", "The served model.", labels=["model"])
        info.add_metric([self.model_name], 1)
        yield info
        yield _gauge("strata_uptime_seconds", "Seconds since the engine started.", s.uptime_seconds)
        yield _gauge("strata_queue_length", "Requests waiting for a slot.", s.queue_len)
        yield _counter("strata_requests_rejected_total", "Requests refused with 429: the queue was full (--max-queue).",
                       self.rejected())
        yield _gauge("strata_slots_busy", "Slots running a request.", s.slots_busy)
        yield _gauge("strata_slots_total", "Slots (requests run at once).", s.parallel)
        yield _gauge("strata_kv_blocks_used", "KV cache blocks in use.", s.kv_blocks_used)
        yield _gauge("strata_kv_blocks_total", "KV cache blocks in all.", s.kv_blocks_total)
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        yield _gauge("strata_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", usage)
        yield _counter("strata_prompt_tokens_total", "Prompt tokens read.", s.prompt_tokens_total)
        yield _counter("strata_generation_tokens_total", "Tokens generated.", s.generation_tokens_total)
        yield _counter("strata_requests_finished_total", "Requests finished (any reason).", s.requests_finished_total)
        yield _counter("strata_give_ways_total", "Times a prompt read gave way to decoding.", s.give_ways_total)
        yield _counter("strata_preemptions_total", "Requests preempted for KV cache space.", s.preemptions_total)
        yield _counter("strata_read_stage_steps_total", "Prompt read steps run beside decoding on the read stage.",
                       s.read_stage_steps_total)
        yield _counter("strata_solo_reads_total", "Short prompt reads given a step of their own (a CUDA graph) "
                       "while other slots waited to decode.", s.solo_reads_total)
        yield _counter("strata_prefix_cache_queries_total", "Requests that looked up the prefix cache.",
                       s.prefix_cache_queries_total)
        yield _counter("strata_prefix_cache_hits_total", "Requests that reused at least one cached KV block.",
                       s.prefix_cache_hits_total)
        yield _counter("strata_prefix_cache_misses_total", "Requests that found no cached KV block.",
                       s.prefix_cache_queries_total - s.prefix_cache_hits_total)
        yield _counter("strata_prefix_cache_cached_tokens_total", "Prompt tokens whose K/V came from the prefix cache.",
                       s.prefix_cache_cached_tokens_total)
        if s.kv_host_blocks_total:
            yield _counter("strata_prefix_cache_host_hits_total", "Requests whose cached prefix came from the "
                           "host KV tier (also counted in strata_prefix_cache_hits_total).", s.prefix_cache_host_hits_total)
            yield _counter("strata_prefix_cache_host_cached_tokens_total", "Prompt tokens whose K/V came from the "
                           "host KV tier.", s.prefix_cache_host_cached_tokens_total)
            yield _gauge("strata_kv_host_blocks_used", "Host KV tier blocks in use.", s.kv_host_blocks_used)
            yield _gauge("strata_kv_host_blocks_total", "Host KV tier blocks in all.", s.kv_host_blocks_total)
            yield _counter("strata_kv_blocks_moved_total", "KV blocks moved from the device to the host tier.",
                           s.kv_blocks_moved_total)
        yield _gauge("strata_prompt_tokens_per_second", "Prompt tokens read per second, recent.",
                     s.prompt_tokens_per_second)
        yield _gauge("strata_generation_tokens_per_second", "Tokens generated per second, recent.",
                     s.generation_tokens_per_second)
        cumulative = list(s.ttft_counts) or [0] * (len(TTFT_BUCKETS) + 1)
        bounds = [floatToGoString(b) for b in TTFT_BUCKETS] + ["+Inf"]
        yield HistogramMetricFamily("strata_time_to_first_token_seconds", "Seconds from arrival to first token.",
                                    buckets=list(zip(bounds, cumulative)), sum_value=s.ttft_sum)
        if s.spec is not None:
            yield _counter("strata_spec_drafts_proposed_total", "MTP drafts proposed.", s.spec["drafts_proposed"])
            yield _counter("strata_spec_drafts_accepted_total", "MTP drafts accepted.", s.spec["drafts_accepted"])
            yield _gauge("strata_spec_acceptance_ratio", "Accepted / proposed drafts.", s.spec["acceptance"])
            yield _gauge("strata_spec_mean_accepted_length", "Tokens emitted per verification step.",
                         s.spec["mean_accepted_length"])
            per_position = GaugeMetricFamily("strata_spec_accepted_per_position",
                                             "Acceptance of the draft at each position.", labels=["position"])
            for i, a in enumerate(s.spec["accepted_per_position"]):
                per_position.add_metric([str(i + 1)], a)
            yield per_position
        http = CounterMetricFamily("strata_http_requests_total", "HTTP requests answered, by route and status.",
                                   labels=["method", "path", "status"])
        for labels, count in self.http_counts():
            http.add_metric(list(labels), count)
        yield http


def llama_metrics(s: EngineStats) -> bytes:
    """llama-server's `llamacpp:*` families, for dashboards built on them. Rendered by hand: its counters
    are named as they are (`n_tokens_max`, no `_total` split off), which prometheus-client would rename."""
    spec = s.spec or {}
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", s.prompt_tokens_total),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache",
         s.prefix_cache_cached_tokens_total),
        ("prompt_seconds_total", "Seconds from each request's arrival to its first token, summed", s.ttft_sum),
        ("tokens_predicted_total", "Number of generation tokens processed", s.generation_tokens_total),
        ("tokens_predicted_seconds_total", "Seconds from each request's first token to its end, summed",
         s.decode_seconds_total),
        ("n_decode_total", "Model steps run", s.steps_total),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)", s.longest_sequence),
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated",
         spec.get("drafts_proposed", 0)),
        ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
         spec.get("drafts_accepted", 0)),
        ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps",
         spec.get("verification_steps", 0)),
    ]
    gauges = [
        ("prompt_tokens_seconds", "Prompt throughput in tokens/s, recent", s.prompt_tokens_per_second),
        ("predicted_tokens_seconds", "Generation throughput in tokens/s, recent", s.generation_tokens_per_second),
        ("requests_processing", "Number of requests processing", s.slots_busy),
        ("requests_deferred", "Number of requests deferred", s.queue_len),
        ("n_busy_slots_per_decode", "Average number of busy slots per model step",
         s.step_rows_total / max(s.steps_total, 1)),
    ]
    lines = [f"# HELP llamacpp:{name} {doc}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {floatToGoString(value)}\n"
             for kind, items in (("counter", counters), ("gauge", gauges)) for name, doc, value in items]
    return "".join(lines).encode()


class Metrics:
    """The app's metrics: HTTP counts (from the middleware) and a registry that renders /metrics."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats], rejected: Callable[[], int] = lambda: 0):
        self.model_name, self.stats = model_name, stats
        self.start_time = int(time.time())  # llama-server's Process-Start-Time-Unix header
        self._lock = threading.Lock()
        self._http: dict[tuple[str, str, str], int] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(model_name, stats, self._http_counts, rejected))

    def count_http(self, method: str, path: str, status: int) -> None:
        key = (method, path if path in TRACKED_PATHS else "other", str(status))
        with self._lock:
            self._http[key] = self._http.get(key, 0) + 1

    def _http_counts(self) -> list[tuple[tuple[str, str, str], int]]:
        with self._lock:
            return sorted(self._http.items())

    def render(self) -> bytes:
        return generate_latest(self.registry) + llama_metrics(self.stats())


def slots_json(s: EngineStats, model_name: str, now: float | None = None, rejected: int = 0) -> dict[str, Any]:
    """The body of GET /strata/slots (docs: the slots schema); `now` is the wall clock, seconds; `rejected`
    the requests refused with 429 (queue full)."""
    slots = [{
        "id": x.id, "state": x.state, "request_id": x.request_id, "prompt_tokens": x.prompt_tokens,
        "prompt_read": x.prompt_read, "generated": x.generated, "max_tokens": x.max_tokens,
        "tokens_per_s": x.tokens_per_s, "give_ways": x.give_ways, "drafts_proposed": x.drafts_proposed,
        "drafts_accepted": x.drafts_accepted, "acceptance": x.acceptance,
    } for x in s.slots]
    totals = {
        "parallel": s.parallel, "queue": s.queue_len, "rejected": rejected,
        "kv_blocks_used": s.kv_blocks_used, "kv_blocks_total": s.kv_blocks_total,
        "give_ways": s.give_ways_total, "preemptions": s.preemptions_total,
        "prompt_tokens": s.prompt_tokens_total, "generation_tokens": s.generation_tokens_total,
        "requests_finished": s.requests_finished_total, "uptime_s": s.uptime_seconds,
        "ttft_last_s": s.ttft_last_seconds, "generation_tok_s": s.generation_tokens_per_second,
    }
    return {"model": model_name, "time": time.time() if now is None else now, "slots": slots, "totals": totals}


def llama_slots_json(s: EngineStats, n_ctx: int, speculative: bool) -> list[dict[str, Any]]:
    """The body of GET /slots in llama-server's shape: one object per slot."""
    return [{
        "id": x.id, "id_task": x.request_id or -1, "n_ctx": n_ctx, "speculative": speculative,
        "is_processing": x.state != "idle",
        "next_token": [{"has_next_token": x.state != "idle", "n_decoded": x.generated if x.state != "idle" else 0,
                        "n_remain": max(x.max_tokens - x.generated, 0) if x.state != "idle" else -1}],
    } for x in s.slots]


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
