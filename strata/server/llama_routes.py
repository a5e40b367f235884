"""llama-server's native endpoints, in its shapes: `POST /completion` (and `/completions`), `GET /props`,
`POST /apply-template`, and the token counts of a chat request (`/chat/completions/input_tokens`,
`/v1/chat/completions/input_tokens`, Anthropic's `/v1/messages/count_tokens`). All behind the key.

`/completion` takes llama-server's request: a prompt as text, token ids, ids and text mixed, a
`{"prompt_string"}` object or a list of these (a list of results then); `n_predict`, llama.cpp's
sampling defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05) and names (`repeat_penalty`),
`logit_bias` as `[[token id or text, bias or false], ...]` or an object, `n_probs` (the sampled
token's logprob with that many alternatives, as `completion_probabilities`), `return_tokens`,
`response_fields`; `post_sampling_probs` gives, in place of logprobs, the probabilities after
temperature, top-k, top-p and min-p (`prob`, `top_probs`: the tokens they keep, at most `n_probs`). It
answers `content`, `tokens`, `stop`, `stop_type`, `timings`, ... and streams one such object per event,
with no `[DONE]`. Fields whose meaning Strata cannot give are a 400 naming them: `id_slot` other than -1
(requests are not pinned to slots), multimodal prompts, `repeat_last_n` with a repetition penalty (Strata's reads the whole context).
`cache_prompt` is accepted either way: the prefix cache keeps exact K/V, so it never changes a result.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any, AsyncIterator, ClassVar, Iterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import Field, ValidationError

from strata.engine.types import EngineEvent
from strata.server import protocol as P
from strata.server.errors import APIError, validation_error
from strata.server.jobs import EngineStreamResponse, Job, MergedEvents, Result, collect, visible_tokens, wait_disconnect
from strata.server.logprobs import MIN_LOGPROB
from strata.server.request_body import read_json, validate_body
from strata.server.responses import ChatChunks
from strata.server.service import ModelService

# llama.cpp's sampling defaults (common/common.h), used where a native request names none.
LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
PROMPT_STRING_KEY, MULTIMODAL_KEY = "prompt_string", "multimodal_data"


class NativeCompletionRequest(P.SamplingRequest):
    prompt: Any = None
    n_predict: int | None = Field(None, ge=-1, le=P.MAX_OUTPUT_TOKENS)
    repeat_penalty: float | None = Field(None, ge=0.01, le=100.0)
    repeat_last_n: int | None = None
    return_tokens: bool = False
    response_fields: list[str] | None = None
    post_sampling_probs: bool = False
    id_slot: int | None = None
    n_cmpl: int | None = Field(None, ge=1, le=P.MAX_N)

    default_max_tokens: ClassVar[int | None] = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.id_slot not in (None, -1):
            raise P.Unsupported("id_slot", "id_slot: requests are not pinned to slots here; send -1 or leave it out")
        if self.repeat_penalty not in (None, 1.0) and self.repeat_last_n not in (None, -1):
            raise P.Unsupported("repeat_last_n", "repeat_last_n: the repetition penalty reads the whole context "
                                                 "here (-1)")

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.predict_limit

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.n_probs)

    @property
    def num_top_logprobs(self) -> int:
        return self.n_probs or 0

    @property
    def wants_filtered_logprobs(self) -> bool:
        return self.post_sampling_probs


def _logit_bias(s: ModelService, raw: Any) -> dict[str, float] | None:
    """llama-server's `logit_bias` (pairs `[token id or text, bias or false]`, or an object keyed by ids
    or texts) as OpenAI's `{"token id": bias}`: a text biases each of its tokens, false bans."""
    if raw is None:
        return None
    pairs = list(raw.items()) if isinstance(raw, dict) else raw
    if not isinstance(pairs, list):
        raise APIError(400, "logit_bias: expected a list of [token, bias] pairs or an object", param="logit_bias")
    out: dict[str, float] = {}
    for pair in pairs:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise APIError(400, "logit_bias: each entry is [token id or text, bias or false]", param="logit_bias")
        key, bias = pair
        if bias is False:
            bias = -P.MAX_LOGIT_BIAS
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise APIError(400, f"logit_bias: the bias of {key!r} must be a number or false", param="logit_bias")
        bias = max(-P.MAX_LOGIT_BIAS, min(P.MAX_LOGIT_BIAS, float(bias)))
        if isinstance(key, str) and not key.isdigit():
            ids = s.tokenizer.encode(key, add_special=False)
        elif isinstance(key, (int, str)) and not isinstance(key, bool):
            ids = [int(key)]
        else:
            raise APIError(400, f"logit_bias: {key!r} is neither a token id nor a text", param="logit_bias")
        for t in ids:
            out[str(t)] = bias
    return out


def _prompts(raw: Any) -> list[P.Prompt]:
    """The request's prompts (a list of results when more than one)."""
    def one(p: Any) -> P.Prompt:
        if isinstance(p, dict):
            if p.get(MULTIMODAL_KEY):
                raise APIError(400, "multimodal prompts are not supported: the model reads text only", param="prompt")
            p = p.get(PROMPT_STRING_KEY)
        if isinstance(p, str) or isinstance(p, list) and p and all(
                isinstance(x, str) or isinstance(x, int) and not isinstance(x, bool) for x in p):
            return p
        raise APIError(400, "prompt: expected text, token ids, or a list of prompts", param="prompt")

    if raw is None or raw == "" or raw == []:
        raise APIError(400, "the prompt is empty", param="prompt")
    if isinstance(raw, list) and any(isinstance(x, (list, dict)) for x in raw):
        return [one(p) for p in raw]
    if isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw) and len(raw) > 1:
        return list(raw)
    return [one(raw)]


class Timer:
    """When a request's first token and its end came, for llama-server's `timings`."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.end: float | None = None

    async def timed(self, stream: Any) -> AsyncIterator[EngineEvent]:
        async for ev in stream:
            self.seen(ev)
            yield ev

    def seen(self, ev: EngineEvent) -> None:
        now = time.perf_counter()
        if self.first is None and ev.token_ids:
            self.first = now
        if ev.finish_reason is not None:
            self.end = now

    def timings(self, prompt_n: int, cached: int, predicted_n: int) -> dict[str, Any]:
        """llama-server's `timings`. The first token comes with the prompt's last step, so the generation
        rates count the steps after it (predicted_n - 1), as llama-server counts them."""
        now = time.perf_counter()
        first = self.first or self.end or now
        end = self.end or now
        read_ms, gen_ms = (first - self.start) * 1e3, (end - first) * 1e3
        evaluated = max(prompt_n - cached, 0)
        steps = max(predicted_n - 1, 0)
        return {"cache_n": cached, "prompt_n": evaluated, "prompt_ms": read_ms,
                "prompt_per_token_ms": read_ms / evaluated if evaluated else 0.0,
                "prompt_per_second": evaluated / read_ms * 1e3 if read_ms > 0 else 0.0,
                "predicted_n": predicted_n, "predicted_ms": gen_ms,
                "predicted_per_token_ms": gen_ms / steps if steps else 0.0,
                "predicted_per_second": steps / gen_ms * 1e3 if gen_ms > 0 else 0.0}

    def read_timings(self, read: int, cached: int, started: bool = True) -> dict[str, Any]:
        """`timings` while the prompt is read: `read` tokens of it so far, `cached` of them from the cache
        (`started`: False for the report sent before any is read, whose times are 0)."""
        ms = (time.perf_counter() - self.start) * 1e3 if started else 0.0
        n = max(read - cached, 0)
        return {"cache_n": cached, "prompt_n": n, "prompt_ms": ms, "prompt_per_token_ms": ms / n if n else 0.0,
                "prompt_per_second": n / ms * 1e3 if ms > 0 else 0.0, "predicted_n": 0, "predicted_ms": 0.0,
                "predicted_per_token_ms": 0.0, "predicted_per_second": 0.0}

    def progress(self, ev: EngineEvent, first: bool) -> dict[str, Any]:
        """llama-server's `prompt_progress` of a progress event (`first`: the report of what the prefix cache
        gave, before any token is read)."""
        processed = ev.cached_tokens if first else ev.prompt_read
        ms = (time.perf_counter() - self.start) * 1e3
        return {"total": ev.prompt_tokens, "cache": ev.cached_tokens, "processed": processed,
                "time_ms": 0 if first else int(ms)}


class NativeRoutes:
    def __init__(self, service: ModelService):
        self.s = service

    def routers(self) -> list[APIRouter]:
        r = APIRouter(dependencies=[Depends(self.s.authorize)])
        r.add_api_route("/completion", self.completion, methods=["POST"])
        r.add_api_route("/completions", self.completion, methods=["POST"])
        r.add_api_route("/props", self.props, methods=["GET"])
        r.add_api_route("/props", self.set_props, methods=["POST"])
        r.add_api_route("/apply-template", self.apply_template, methods=["POST"])
        r.add_api_route("/chat/completions/input_tokens", self.chat_tokens, methods=["POST"])
        r.add_api_route("/v1/chat/completions/input_tokens", self.chat_tokens, methods=["POST"])
        r.add_api_route("/v1/messages/count_tokens", self.messages_tokens, methods=["POST"])
        return [r]

    # -- /completion ------------------------------------------------------------------------------

    async def completion(self, request: Request) -> Response:
        s = self.s
        data = await read_json(request, s.cfg.max_body_bytes, s.cfg.body_timeout)
        prompts = _prompts(data.get("prompt"))
        fields = {**self.defaults(), **{k: v for k, v in data.items() if v is not None}}
        fields["logit_bias"] = _logit_bias(s, data.get("logit_bias"))
        # llama-server's --seed is every request's default seed (-1: a random one), not a seed per arrival.
        if fields.get("seed") == -1:
            fields.pop("seed")
        elif "seed" not in fields and s.default_seed is not None:
            fields["seed"] = s.default_seed
        if "repeat_penalty" in fields and "repetition_penalty" not in fields:
            fields["repetition_penalty"] = fields["repeat_penalty"]
        if data.get("input_suffix") or data.get("input_extra"):
            raise APIError(400, "input_suffix: fill-in-the-middle is not supported", param="input_suffix",
                           code="unsupported_parameter")
        fields["prompt"] = None
        body: NativeCompletionRequest = validate_body(NativeCompletionRequest, fields)
        s.check_model(body.model)
        n = body.n_cmpl or 1
        _, encoded, params, job, streams = await s.submit_completion(body, prompts, n, False)
        view = _Native(s, body, [ids for ids, _ in encoded for _ in range(n)], [p for p in params for _ in range(n)])
        streams = [view.timer.timed(stream) for stream in streams]
        if body.stream:
            return EngineStreamResponse(job, view.stream(request, job, streams))
        results = await collect(request, job, streams)
        out = [view.whole(i, r) for i, r in enumerate(results)]
        return Response(json.dumps(out[0] if len(out) == 1 else out), media_type="application/json")

    # -- /props, /apply-template, token counts ----------------------------------------------------

    async def props(self) -> Response:
        s = self.s
        tok = s.tokenizer
        settings = {"n_ctx": s.max_model_len, "id": 0, "params": {**self.default_params(), "seed": s.default_seed
                                                                   if s.default_seed is not None else -1}}
        body = {
            "default_generation_settings": settings, "total_slots": s.parallel, "model_alias": s.model_name,
            "model_path": s.engine.model_name, "chat_template": tok.chat_template or "",
            "bos_token": tok.bos_token, "eos_token": tok.eos_token, "modalities": {"vision": False, "audio": False},
            "endpoint_slots": s.cfg.slots, "endpoint_props": False, "endpoint_metrics": s.cfg.metrics,
            "build_info": P.SYSTEM_FINGERPRINT, "is_sleeping": False,
        }
        return Response(json.dumps(body), media_type="application/json")

    def defaults(self) -> dict[str, Any]:
        """llama.cpp's sampling defaults, with the server's --temp."""
        temp = self.s.cfg.temp
        return LLAMA_DEFAULTS if temp is None else {**LLAMA_DEFAULTS, "temperature": temp}

    def default_params(self) -> dict[str, Any]:
        return {**self.defaults(), "n_predict": -1, "repeat_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "stop": [], "n_probs": 0, "ignore_eos": False}

    async def set_props(self) -> Response:
        raise APIError(403, "the server's properties cannot be changed over HTTP", type_="permission_error")

    async def _chat_body(self, request: Request) -> P.ChatCompletionRequest:
        data = await read_json(request, self.s.cfg.max_body_bytes, self.s.cfg.body_timeout)
        return validate_body(P.ChatCompletionRequest, data)

    async def apply_template(self, request: Request) -> Response:
        body = await self._chat_body(request)
        _, text, _ = await self.s.chat_prompt(body)
        return Response(json.dumps({"prompt": text}), media_type="application/json")

    async def chat_tokens(self, request: Request) -> Response:
        ids, _, _ = await self.s.chat_prompt(await self._chat_body(request))
        return Response(json.dumps({"input_tokens": len(ids)}), media_type="application/json")

    async def messages_tokens(self, request: Request) -> Response:
        from strata.server.anthropic import MessagesRequest, to_chat_request

        data = await read_json(request, self.s.cfg.max_body_bytes, self.s.cfg.body_timeout)
        data.setdefault("max_tokens", 1)
        try:
            body = MessagesRequest.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        ids, _, _ = await self.s.chat_prompt(to_chat_request(body))
        return Response(json.dumps({"input_tokens": len(ids)}), media_type="application/json")


class _Native:
    """One native request's results in llama-server's shape, whole or streamed."""

    def __init__(self, s: ModelService, body: NativeCompletionRequest, prompt_ids: list[list[int]], params: list[Any]):
        self.s, self.body, self.prompt_ids, self.params = s, body, prompt_ids, params
        self.timer = Timer()

    def settings(self, i: int) -> dict[str, Any]:
        p = self.params[i]
        seed = p.seed if p.seed is not None else self.s.default_seed
        return {"n_predict": p.max_tokens, "seed": seed if seed is not None else -1,
                "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
                "repeat_penalty": p.repetition_penalty, "presence_penalty": p.presence_penalty,
                "frequency_penalty": p.frequency_penalty, "stop": list(p.stop), "max_tokens": p.max_tokens,
                "n_probs": self.body.n_probs or 0, "ignore_eos": p.ignore_eos, "stream": self.body.stream,
                "logit_bias": [[t, b] for t, b in p.logit_bias.items()], "grammar": self.body.grammar or ""}

    def probabilities(self, ids: Any, lps: Any, tops: Any) -> list[dict[str, Any]]:
        fmt = self.s.logprobs
        post = self.body.post_sampling_probs

        def entry(t: int, lp: float) -> dict[str, Any]:
            text = fmt.token_text(t)
            value = {"prob": min(1.0, math.exp(lp))} if post else {"logprob": max(float(lp), MIN_LOGPROB)}
            return {"id": t, "token": text, **value, "bytes": list(text.encode())}

        # After the filters, a token they drop has probability 0: it is no alternative.
        alternatives = "top_probs" if post else "top_logprobs"
        return [{**entry(t, lp), alternatives: [entry(a, v) for a, v in (tops[j] if tops is not None else ())
                                                 if not post or v > -math.inf]}
                for j, (t, lp) in enumerate(zip(ids, lps or ()))]

    def _stop_type(self, i: int, finish: str | None, eos: bool) -> str:
        if finish == "length":
            return "limit"
        if finish != "stop":
            return "none"
        return "eos" if eos or not self.params[i].stop else "word"

    def final(self, i: int, text: str, ids: list[int], finish: str | None, prompt_n: int, cached: int,
              eos: bool) -> dict[str, Any]:
        return {
            "index": i, "content": text, "tokens": ids if self.body.return_tokens else [], "id_slot": -1,
            "stop": True, "model": self.body.model or self.s.model_name, "tokens_predicted": len(ids),
            "tokens_evaluated": prompt_n, "generation_settings": self.settings(i),
            "prompt": self.s.tokenizer.decode(self.prompt_ids[i], skip_special=False),
            "has_new_line": "\n" in text, "truncated": False,
            "stop_type": self._stop_type(i, finish, eos), "stopping_word": "",
            "tokens_cached": cached, "timings": self.timer.timings(prompt_n, cached, len(ids)),
        }

    def whole(self, i: int, r: Result) -> dict[str, Any]:
        text = "".join(r.text)
        out = self.final(i, text, r.token_ids, r.finish_reason, r.prompt_tokens, r.cached_tokens,
                         r.emitted > len(r.token_ids))
        if self.body.n_probs:
            out["completion_probabilities"] = self.probabilities(r.token_ids, r.logprobs, r.tops)
        fields = self.body.response_fields
        if fields:
            out = {f: _path(out, f) for f in fields}
        return out

    async def stream(self, request: Request, job: Job, streams: list[Any]) -> AsyncIterator[str]:
        merged = MergedEvents(streams, job)
        sent = [0] * len(streams)
        ids: list[list[int]] = [[] for _ in streams]
        texts: list[list[str]] = [[] for _ in streams]
        totals = [0] * len(streams)
        reported = [False] * len(streams)  # progress reported (the cache's share first)
        cached = [0] * len(streams)  # prompt tokens from the prefix cache, as far as events told yet
        timed = self.body.timings_per_token

        async def abort_when_gone() -> None:
            await wait_disconnect(request)
            job.close()

        watcher = asyncio.ensure_future(abort_when_gone())
        try:
            async for i, ev in merged:
                if ev.error:
                    error = {"error": {"code": 500, "message": ev.error, "type": "server_error"}}
                    yield f"data: {json.dumps(error)}\n\n"
                    break
                if ev.prompt_read is not None:
                    cached[i] = ev.cached_tokens
                    for first in [True, False] if not reported[i] else [False]:
                        chunk = {"index": i, "content": "", "tokens": [], "stop": False, "id_slot": -1,
                                 "tokens_predicted": 0, "tokens_evaluated": ev.prompt_tokens,
                                 "prompt_progress": self.timer.progress(ev, first)}
                        if timed:
                            chunk["timings"] = self.timer.read_timings(
                                ev.cached_tokens if first else ev.prompt_read, ev.cached_tokens, not first)
                        yield f"data: {json.dumps(chunk)}\n\n"
                    reported[i] = True
                    continue
                new, lps, tops = visible_tokens(ev, sent[i])
                sent[i] += len(new)
                totals[i] += len(ev.token_ids)
                ids[i] += new
                texts[i].append(ev.text)
                if ev.text or new:
                    chunk = {"index": i, "content": ev.text, "tokens": list(new), "stop": False, "id_slot": -1,
                             "tokens_predicted": sent[i], "tokens_evaluated": ev.prompt_tokens}
                    if self.body.n_probs:
                        chunk["completion_probabilities"] = self.probabilities(new, lps, tops)
                    if timed:
                        chunk["timings"] = self.timer.timings(ev.prompt_tokens, cached[i], sent[i])
                    yield f"data: {json.dumps(chunk)}\n\n"
                if ev.finish_reason is not None:
                    job.done(i)
                    out = self.final(i, "", ids[i], ev.finish_reason, ev.prompt_tokens, ev.cached_tokens,
                                     totals[i] > sent[i])
                    out["tokens"] = []
                    yield f"data: {json.dumps(out)}\n\n"
                if job.finished:
                    break
        except Exception as e:  # an interrupted job (shutdown): its error, as llama-server sends one
            yield f"data: {json.dumps({'error': {'code': 503, 'message': str(e), 'type': 'unavailable_error'}})}\n\n"
        finally:
            watcher.cancel()
            merged.close()
            job.close()


class LlamaChatChunks(ChatChunks):
    """Chat SSE chunks with the extras of llama-server's streams that a request asked for: a chunk with
    `prompt_progress` per chunk of the prompt read (`return_progress`), and `timings` on every chunk
    (`timings_per_token`) or else on the last one."""

    def __init__(self, *args: Any, per_token: bool, **kw: Any):
        super().__init__(*args, **kw)
        self.timer, self.per_token = Timer(), per_token
        self.reported = [False] * len(self.sent)
        self.cached = [0] * len(self.sent)

    def event(self, i: int, ev: EngineEvent) -> Iterator[str]:
        self.timer.seen(ev)
        if ev.prompt_read is not None:
            self.cached[i] = ev.cached_tokens
            for first in [True, False] if not self.reported[i] else [False]:
                extra: dict[str, Any] = {"prompt_progress": self.timer.progress(ev, first)}
                if self.per_token:
                    extra["timings"] = self.timer.read_timings(ev.cached_tokens if first else ev.prompt_read,
                                                               ev.cached_tokens, not first)
                yield _with(self._chunk(i, P.ChatDelta(role="assistant")), extra)
            self.reported[i] = True
            return
        pieces = list(super().event(i, ev))
        for k, piece in enumerate(pieces):
            if self.per_token or ev.finish_reason is not None and k == len(pieces) - 1:
                cached = max(self.cached[i], ev.cached_tokens)
                pieces[k] = _with(piece, {"timings": self.timer.timings(ev.prompt_tokens, cached, self.sent[i])})
        yield from pieces


def _with(piece: str, extra: dict[str, Any]) -> str:
    """An SSE `data:` line with `extra`'s keys added to its object."""
    doc = json.loads(piece.removeprefix("data: "))
    return f"data: {json.dumps({**doc, **extra}, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _path(doc: dict[str, Any], path: str) -> Any:
    """`a/b` of `doc` (llama-server's `response_fields`), None when absent."""
    cur: Any = doc
    for part in path.split("/"):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return cur


def native_routers(service: ModelService) -> list[APIRouter]:
    return NativeRoutes(service).routers()
