"""The OpenAI-compatible HTTP API over an `AsyncEngine`: `build_app(engine, server_cfg)`.

Every failure a client can cause is answered with OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` and a 4xx status; nothing a request carries can stop
the server. A request whose client goes away (mid-stream or while waiting for a whole completion) is
aborted in the engine so its slot frees at the next step.

A request for `n` choices is n engine requests for the same prompt (each reads it: there is no
prefix cache to share its blocks yet), merged into one response as their events arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import secrets
import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata import __version__
from strata.engine.types import EngineEvent, EngineRequest
from strata.params import SamplingParams
from strata.server import protocol as P
from strata.server.config import ServerConfig
from strata.server.metrics import CONTENT_TYPE, Metrics, RequestCounter, slots_json
from strata.web import mount_webui

OPENAI_DEFAULT_TEMPERATURE = 1.0
# Below this, dividing fp32 logits by the temperature can overflow to inf/NaN; the distribution is
# already a point mass there, so such requests run greedy.
GREEDY_BELOW_TEMPERATURE = 1e-5


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> Response:
        body = P.ErrorResponse(error=P.ErrorDetail(message=self.message, type=self.type, param=self.param,
                                                   code=self.code))
        return Response(body.model_dump_json(), status_code=self.status, media_type="application/json",
                        headers=self.headers)


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _validation_error(e: ValidationError | RequestValidationError) -> APIError:
    errors = e.errors()
    parts, param = [], None
    for err in errors[:3]:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
        if param is None and loc:
            param = loc[0]
    return APIError(400, "; ".join(parts) or "invalid request", param=param)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        parts.append(part)
    return b"".join(parts)


async def _read_json(request: Request, limit: int) -> dict:
    raw = await _read_body(request, limit)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return data


async def _parse(request: Request, model: type[P._Request], limit: int) -> Any:
    return _validate(model, await _read_json(request, limit))


def _validate(model: type[P._Request], data: dict) -> Any:
    try:
        body = model.model_validate(data)
        body.check_supported()
    except ValidationError as e:
        raise _validation_error(e) from None
    except P.Unsupported as e:
        raise APIError(400, str(e), param=e.param, code="unsupported_parameter") from None
    return body


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next message the server sends is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


_Tops = tuple[tuple[tuple[int, float], ...], ...]


def _visible(ev: EngineEvent, sent: int) -> tuple[tuple[int, ...], tuple[float, ...] | None, _Tops | None]:
    """The event's tokens that belong to the completion (the engine does not count a final EOS), with
    their logprobs and alternatives where the event has them."""
    keep = max(0, min(len(ev.token_ids), ev.completion_tokens - sent))
    return (ev.token_ids[:keep], tuple(ev.logprobs[:keep]) if ev.logprobs is not None else None,
            tuple(ev.top_logprobs[:keep]) if ev.top_logprobs is not None else None)


class _Result:
    """A whole completion gathered from engine events."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] | None = None
        self.tops: list[tuple[tuple[int, float], ...]] | None = None
        self.finish_reason: str | None = None
        self.prompt_tokens = self.completion_tokens = 0
        self.error: str | None = None
        self.spec: dict | None = None

    def add(self, ev: EngineEvent) -> None:
        self.text.append(ev.text)
        ids, lps, tops = _visible(ev, len(self.token_ids))
        self.token_ids.extend(ids)
        if lps is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs.extend(lps)
        if tops is not None:
            self.tops = self.tops if self.tops is not None else []
            self.tops.extend(tops)
        self.finish_reason = ev.finish_reason or self.finish_reason
        self.prompt_tokens, self.completion_tokens = ev.prompt_tokens, ev.completion_tokens
        self.error = ev.error or self.error
        self.spec = ev.spec or self.spec


def _usage(parts: list[_Result] | list[EngineEvent]) -> P.Usage:
    """The usage of a response whose choices are `parts` (results, or their last events): the prompt
    counted once, completions summed."""
    prompt = parts[0].prompt_tokens
    completion = sum(p.completion_tokens for p in parts)
    return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   speculation=_pooled_spec([p.spec for p in parts if p.spec]))


def _pooled_spec(specs: list[dict]) -> dict | None:
    """One speculation summary for several choices: counts summed, rates weighted by drafts proposed."""
    if len(specs) <= 1:
        return specs[0] if specs else None
    weights = [s["drafts_proposed"] for s in specs]
    proposed, accepted = sum(weights), sum(s["drafts_accepted"] for s in specs)

    def mean(values: list[float]) -> float:
        return sum(w * v for w, v in zip(weights, values)) / proposed if proposed else 0.0

    positions = len(specs[0]["accepted_per_position"])
    return {"drafts_proposed": proposed, "drafts_accepted": accepted,
            "acceptance": accepted / proposed if proposed else 0.0,
            "mean_accepted_length": mean([s["mean_accepted_length"] for s in specs]),
            "accepted_per_position": [mean([s["accepted_per_position"][j] for s in specs]) for j in range(positions)]}


class _Chunks:
    """What both SSE formats share: `n` choices, each with its own count of tokens sent; an error
    ends the stream; token ids are paired with logprobs; usage follows the last choice's finish."""

    def __init__(self, server: "_Server", rid: str, model: str, include_usage: bool, logprobs: bool, n: int):
        self.s, self.rid, self.model = server, rid, model
        self.include_usage, self.logprobs = include_usage, logprobs
        self.created = int(time.time())
        self.sent = [0] * n
        self.last: list[EngineEvent] = []  # the finished choices' final events

    def _error_or_tokens(self, i: int, ev: EngineEvent) -> tuple[str | None, tuple[int, ...], Any, Any]:
        if ev.error:
            return self.s.stream_error(ev.error), (), None, None
        ids, lps, tops = _visible(ev, self.sent[i])
        self.sent[i] += len(ids)
        return None, ids, lps, tops

    def _usage_when_done(self, ev: EngineEvent) -> P.Usage | None:
        if ev.finish_reason is None:
            return None
        self.last.append(ev)
        return _usage(self.last) if self.include_usage and len(self.last) == len(self.sent) else None


class _ChatChunks(_Chunks):
    """Engine events to `chat.completion.chunk` SSE lines."""

    def _chunk(self, i: int, delta: P.ChatDelta, finish: str | None = None,
               logprobs: P.ChoiceLogprobs | None = None) -> str:
        choice = P.ChatChunkChoice(index=i, delta=delta, finish_reason=finish, logprobs=logprobs)
        return _sse(P.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[choice]))

    def start(self) -> Iterator[str]:
        for i in range(len(self.sent)):
            yield self._chunk(i, P.ChatDelta(role="assistant", content=""))

    def event(self, i: int, ev: EngineEvent) -> Iterator[str]:
        error, ids, lps, tops = self._error_or_tokens(i, ev)
        if error:
            yield error
            return
        lp = self.s.chat_logprobs(ids, lps, tops) if self.logprobs else None
        if ev.text or lp is not None and lp.content:
            yield self._chunk(i, P.ChatDelta(content=ev.text), logprobs=lp)
        if ev.finish_reason is not None:
            yield self._chunk(i, P.ChatDelta(), finish=ev.finish_reason)
        usage = self._usage_when_done(ev)
        if usage is not None:
            yield _sse(P.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[],
                                             usage=usage))


class _CompletionChunks(_Chunks):
    """Engine events to `text_completion` SSE lines."""

    def __init__(self, server: "_Server", rid: str, model: str, include_usage: bool, logprobs: bool, n: int,
                 echo: str):
        super().__init__(server, rid, model, include_usage, logprobs, n)
        self.echo = echo
        self.offset = [0] * n

    def _chunk(self, i: int, text: str, finish: str | None = None, logprobs: P.CompletionLogprobs | None = None,
               usage: P.Usage | None = None) -> str:
        choices = [] if usage else [P.CompletionChoice(index=i, text=text, finish_reason=finish, logprobs=logprobs)]
        return _sse(P.Completion(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage))

    def start(self) -> Iterator[str]:
        if self.echo:
            for i in range(len(self.sent)):
                yield self._chunk(i, self.echo)

    def event(self, i: int, ev: EngineEvent) -> Iterator[str]:
        error, ids, lps, tops = self._error_or_tokens(i, ev)
        if error:
            yield error
            return
        lp = self.s.completion_logprobs(ids, lps, self.offset[i], tops) if self.logprobs else None
        self.offset[i] += len(ev.text)
        if ev.text or ev.finish_reason is not None or lp is not None and lp.tokens:
            yield self._chunk(i, ev.text, ev.finish_reason, lp)
        usage = self._usage_when_done(ev)
        if usage is not None:
            yield self._chunk(i, "", usage=usage)


class _Job:
    """The engine requests behind one response, one per choice; `close()` aborts those not finished."""

    def __init__(self, engine: Any, rids: list[str]):
        self.engine, self.rids = engine, rids
        self.running = set(range(len(rids)))

    @property
    def finished(self) -> bool:
        return not self.running

    def done(self, i: int) -> None:
        self.running.discard(i)

    def close(self) -> None:
        for i in sorted(self.running):
            self.engine.abort(self.rids[i])
        self.running.clear()


class _Merged:
    """The events of a job's streams as (choice index, event), in the order they arrive, until every
    stream has finished; `close()` stops listening."""

    def __init__(self, streams: list[Any]):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.left = len(streams)
        self.tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, i: int, stream: Any) -> None:
        try:
            async for ev in stream:
                self.queue.put_nowait((i, ev))
        except Exception as e:  # handed to the consumer, which would otherwise wait forever
            self.queue.put_nowait((i, e))

    def __aiter__(self) -> "_Merged":
        return self

    async def __anext__(self) -> tuple[int, EngineEvent]:
        if not self.left:
            raise StopAsyncIteration
        i, ev = await self.queue.get()
        if isinstance(ev, Exception):
            raise ev
        self.left -= ev.finish_reason is not None
        return i, ev

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()


class _EngineStreamResponse(StreamingResponse):
    """SSE over an engine request that is aborted however the response ends: a client gone before the
    body iterator ever started leaves no generator frame whose `finally` could do it."""

    def __init__(self, job: _Job, body: AsyncIterator[str]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close()


class _Server:
    def __init__(self, engine: Any, cfg: ServerConfig):
        self.engine, self.cfg = engine, cfg
        self.tokenizer = engine.tokenizer
        self.max_model_len = int(engine.max_model_len)
        self.model_name = cfg.model_name or engine.model_name
        self.known_names = {self.model_name, engine.model_name}
        self.created = int(time.time())
        self.metrics = Metrics(self.model_name, engine.stats)
        self.token_texts: dict[int, str] = {}  # decoded single tokens, for logprobs
        # Engines that can report sampled-token logprobs take `submit(req, logprobs=True)`.
        self.engine_logprobs = "logprobs" in inspect.signature(engine.submit).parameters

    # -- request checks ---------------------------------------------------------------------------

    async def authorize(self, request: Request) -> None:
        if self.cfg.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.cfg.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_model(self, name: str) -> None:
        if name not in self.known_names:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    def sampling(self, body: P._SamplingRequest, n_prompt: int, param: str) -> SamplingParams:
        if n_prompt == 0:
            raise APIError(400, "the prompt is empty", param=param)
        room = self.max_model_len - n_prompt
        requested = body.output_limit
        if room < 1 or requested is not None and requested > room:
            asked = f"{n_prompt + requested} tokens ({n_prompt} in the prompt, {requested} for the completion)" \
                if requested is not None else f"{n_prompt} tokens in the prompt and at least 1 for the completion"
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; "
                                f"this request needs {asked}.", param=param, code="context_length_exceeded")
        max_tokens = requested if requested is not None else min(body.default_max_tokens or room, room)
        if body.stop_token_ids:
            self.check_ids(body.stop_token_ids, "stop_token_ids")
        kw: dict[str, Any] = dict(
            max_tokens=max_tokens, stop=list(body.stop or []), stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos, seed=body.seed,
            temperature=OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        )
        if kw["temperature"] < GREEDY_BELOW_TEMPERATURE:
            kw["temperature"] = 0.0
        for name in ("top_p", "min_p", "repetition_penalty"):
            if getattr(body, name) is not None:
                kw[name] = getattr(body, name)
        if body.top_k is not None:
            kw["top_k"] = max(body.top_k, 0)
        if body.wants_logprobs and not self.engine_logprobs:
            raise APIError(400, "logprobs are not supported by this engine", param="logprobs",
                           code="unsupported_parameter")
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    # -- prompts ----------------------------------------------------------------------------------

    def chat_prompt(self, body: P.ChatCompletionRequest) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(body.chat(), add_generation_prompt=True)
        except P.Unsupported as e:
            raise APIError(400, str(e), param=e.param, code="unsupported_parameter") from None
        except Exception as e:  # the template is the model's code: any failure is about these messages
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        return self.tokenizer.encode(text, add_special=False)

    def completion_prompt(self, body: P.CompletionRequest) -> tuple[list[int], str]:
        """(prompt ids, prompt text for echo)."""
        if isinstance(body.prompt, str):
            return self.tokenizer.encode(body.prompt), body.prompt
        ids = list(body.prompt)
        self.check_ids(ids, "prompt")
        return ids, (self.tokenizer.decode(ids) if body.echo else "")

    def _token_text(self, token_id: int) -> str:
        text = self.token_texts.get(token_id)
        if text is None:
            text = self.token_texts[token_id] = self.tokenizer.decode([token_id], skip_special=False)
        return text

    def _top_entry(self, token_id: int, logprob: float) -> P.TopLogprob:
        tok = self._token_text(token_id)
        return P.TopLogprob(token=tok, logprob=logprob, bytes=list(tok.encode("utf-8")))

    def chat_logprobs(self, ids: tuple[int, ...] | list[int], lps: Any, tops: Any = None) -> P.ChoiceLogprobs | None:
        if lps is None:
            return None
        content = []
        for j, (t, lp) in enumerate(zip(ids, lps)):
            tok = self._token_text(t)
            top = [self._top_entry(a, v) for a, v in tops[j]] if tops is not None else []
            content.append(P.TokenLogprob(token=tok, logprob=float(lp), bytes=list(tok.encode("utf-8")),
                                          top_logprobs=top))
        return P.ChoiceLogprobs(content=content)

    def completion_logprobs(self, ids: tuple[int, ...] | list[int], lps: Any, offset: int,
                            tops: Any = None) -> P.CompletionLogprobs | None:
        """OpenAI's legacy shape. Alternatives map token text to logprob, so tokens whose texts match
        share the most likely one's entry; the sampled token is always in its map, as OpenAI's."""
        if lps is None:
            return None
        tokens, values, offsets, alternatives = [], [], [], []
        for j, (t, lp) in enumerate(zip(ids, lps)):
            tokens.append(self._token_text(t))
            values.append(float(lp))
            offsets.append(offset)
            offset += len(tokens[-1])
            if tops is not None:
                alt: dict[str, float] = {}
                for a, v in tops[j]:
                    alt.setdefault(self._token_text(a), v)
                alt.setdefault(tokens[-1], values[-1])
                alternatives.append(alt)
        return P.CompletionLogprobs(tokens=tokens, token_logprobs=values, text_offset=offsets,
                                    top_logprobs=alternatives if tops is not None else None)

    # -- running ----------------------------------------------------------------------------------

    def _submit_one(self, rid: str, ids: list[int], params: SamplingParams, logprobs: bool, top: int) -> Any:
        req = EngineRequest(request_id=rid, prompt_ids=tuple(ids), params=params, arrival_time=time.monotonic(),
                            top_logprobs=top)
        try:
            return self.engine.submit(req, logprobs=True) if logprobs else self.engine.submit(req)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            raise APIError(503, f"the engine is not accepting requests: {e}", type_="server_error") from None

    def submit(self, rid: str, n: int, ids: list[int], params: SamplingParams, logprobs: bool,
               top: int = 0) -> tuple[_Job, list[Any]]:
        """One engine request per choice (ids `{rid}-{i}` when n > 1); choice i of a seeded request
        draws from seed + i (mod 2^64), so the choices differ and the whole response is reproducible."""
        rids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
        streams: list[Any] = []
        try:
            for i, r in enumerate(rids):
                p = params
                if i and params.seed is not None:
                    p = dataclasses.replace(params, seed=(params.seed + i) % 2**64)
                streams.append(self._submit_one(r, ids, p, logprobs, top))
        except APIError:
            for r in rids[: len(streams)]:
                self.engine.abort(r)
            raise
        return _Job(self.engine, rids), streams

    def stream_error(self, message: str) -> str:
        return _sse(P.ErrorResponse(error=P.ErrorDetail(message=message, type="server_error")))

    async def collect(self, request: Request, job: _Job, streams: list[Any]) -> list[_Result]:
        results = [_Result() for _ in streams]
        merged = _Merged(streams)

        async def pump() -> None:
            async for i, ev in merged:
                results[i].add(ev)
                if ev.finish_reason is not None:
                    job.done(i)
                if ev.error:
                    return  # the response fails: the other choices are aborted

        pumping = asyncio.ensure_future(pump())
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({pumping, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            complete = pumping.done()
            if not complete:
                pumping.cancel()
            merged.close()
            job.close()
        if not complete:
            raise APIError(499, "the client closed the request", code="client_closed_request")
        pumping.result()
        error = next((r.error for r in results if r.error), None)
        if error:
            raise APIError(500, f"the engine failed the request: {error}", type_="server_error")
        return results

    async def _sse(self, request: Request, job: _Job, streams: list[Any], chunks: _ChatChunks | _CompletionChunks,
                   ) -> AsyncIterator[str]:
        async def abort_when_gone() -> None:
            await _wait_disconnect(request)
            job.close()

        watcher = asyncio.ensure_future(abort_when_gone())
        merged = _Merged(streams)
        try:
            for piece in chunks.start():
                yield piece
            async for i, ev in merged:
                if ev.finish_reason is not None:
                    job.done(i)
                for piece in chunks.event(i, ev):
                    yield piece
                if ev.error or job.finished:
                    break
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            merged.close()
            job.close()

    def streaming(self, request: Request, job: _Job, streams: list[Any], chunks: _ChatChunks | _CompletionChunks,
                  ) -> StreamingResponse:
        return _EngineStreamResponse(job, self._sse(request, job, streams, chunks))

    # -- endpoints --------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        body: P.ChatCompletionRequest = await _parse(request, P.ChatCompletionRequest, self.cfg.max_body_bytes)
        self.check_model(body.model)
        ids = await run_in_threadpool(self.chat_prompt, body)
        params = self.sampling(body, len(ids), "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        job, streams = self.submit(rid, body.n, ids, params, body.logprobs, body.num_top_logprobs)
        if body.stream:
            chunks = _ChatChunks(self, rid, body.model, body.include_usage, body.logprobs, body.n)
            return self.streaming(request, job, streams, chunks)
        results = await self.collect(request, job, streams)
        choices = [P.ChatChoice(index=i, message=P.AssistantMessage(content="".join(r.text)),
                                finish_reason=r.finish_reason,
                                logprobs=self.chat_logprobs(r.token_ids, r.logprobs, r.tops) if body.logprobs else None)
                   for i, r in enumerate(results)]
        return _json(P.ChatCompletion(id=rid, created=int(time.time()), model=body.model, choices=choices,
                                      usage=_usage(results)))

    async def completions(self, request: Request) -> Response:
        body: P.CompletionRequest = await _parse(request, P.CompletionRequest, self.cfg.max_body_bytes)
        self.check_model(body.model)
        ids, prompt_text = await run_in_threadpool(self.completion_prompt, body)
        params = self.sampling(body, len(ids), "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        job, streams = self.submit(rid, body.n, ids, params, body.wants_logprobs, body.num_top_logprobs)
        echo = prompt_text if body.echo else ""
        if body.stream:
            chunks = _CompletionChunks(self, rid, body.model, body.include_usage, body.wants_logprobs, body.n, echo)
            return self.streaming(request, job, streams, chunks)
        results = await self.collect(request, job, streams)
        choices = [P.CompletionChoice(index=i, text=echo + "".join(r.text), finish_reason=r.finish_reason,
                                      logprobs=self.completion_logprobs(r.token_ids, r.logprobs, 0, r.tops)
                                      if body.wants_logprobs else None)
                   for i, r in enumerate(results)]
        return _json(P.Completion(id=rid, created=int(time.time()), model=body.model, choices=choices,
                                  usage=_usage(results)))

    async def tokenize(self, request: Request) -> Response:
        data = await _read_json(request, self.cfg.max_body_bytes)
        body: P.TokenizeRequest = _validate(P.TokenizeRequest, data)
        if body.model is not None:
            self.check_model(body.model)
        if body.prompt is not None:
            ids = await run_in_threadpool(self.tokenizer.encode, body.prompt, body.add_special_tokens is not False)
        else:
            # The chat fields (the template's inputs) as a chat completion reads them.
            chat: P.ChatCompletionRequest = _validate(P.ChatCompletionRequest, {**data, "model": self.model_name})
            ids = await run_in_threadpool(self.chat_prompt, chat)
            if body.add_special_tokens:
                ids = self.tokenizer.encode("", add_special=True) + ids
        return _json(P.TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids))

    async def detokenize(self, request: Request) -> Response:
        body: P.DetokenizeRequest = await _parse(request, P.DetokenizeRequest, self.cfg.max_body_bytes)
        if body.model is not None:
            self.check_model(body.model)
        self.check_ids(body.tokens, "tokens")
        text = await run_in_threadpool(self.tokenizer.decode, body.tokens, False)
        return _json(P.DetokenizeResponse(prompt=text))

    def model_card(self) -> P.ModelCard:
        return P.ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)

    async def list_models(self) -> Response:
        return _json(P.ModelList(data=[self.model_card()]))

    async def get_model(self, model: str) -> Response:
        self.check_model(model)
        return _json(self.model_card())

    async def health(self) -> Response:
        try:
            self.engine.stats()
        except Exception as e:
            return APIError(503, f"the engine is not healthy: {e}", type_="server_error").response()
        return Response('{"status":"ok"}', media_type="application/json")

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def slots(self) -> Response:
        return Response(json.dumps(slots_json(self.engine.stats(), self.model_name)), media_type="application/json")


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, e: Exception) -> Response:
        assert isinstance(e, APIError)
        return e.response()

    async def http_error(_: Request, e: Exception) -> Response:
        assert isinstance(e, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return APIError(e.status_code, str(e.detail), code=code, headers=getattr(e, "headers", None)).response()

    async def validation_error(_: Request, e: Exception) -> Response:
        assert isinstance(e, RequestValidationError)
        return _validation_error(e).response()

    async def server_error(_: Request, e: Exception) -> Response:
        return APIError(500, f"internal server error: {type(e).__name__}: {e}", type_="server_error").response()

    handlers: dict[Any, Callable[..., Any]] = {
        APIError: api_error, StarletteHTTPException: http_error, RequestValidationError: validation_error,
        Exception: server_error,
    }
    for exc, fn in handlers.items():
        app.add_exception_handler(exc, fn)


def build_app(engine: Any, server_cfg: ServerConfig | None = None, *, own_engine: bool = False) -> FastAPI:
    """The FastAPI app for `engine` (an `AsyncEngine`, or anything with its attributes and methods).

    With `own_engine`, the app shuts the engine down when the server stops: uvicorn re-raises the
    stopping signal on its way out, so code after `uvicorn.Server.run()` may never get to.
    """
    s = _Server(engine, server_cfg or ServerConfig())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if own_engine:
            await run_in_threadpool(engine.shutdown)

    app = FastAPI(title="Strata", version=__version__, openapi_url=None, docs_url=None, redoc_url=None,
                  lifespan=lifespan)
    app.state.strata = s
    _add_error_handlers(app)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(s.authorize)])
    v1.add_api_route("/chat/completions", s.chat_completions, methods=["POST"])
    v1.add_api_route("/completions", s.completions, methods=["POST"])
    v1.add_api_route("/models", s.list_models, methods=["GET"])
    v1.add_api_route("/models/{model:path}", s.get_model, methods=["GET"])
    app.include_router(v1)
    # vLLM's paths, outside /v1, behind the same key.
    tokens = APIRouter(dependencies=[Depends(s.authorize)])
    tokens.add_api_route("/tokenize", s.tokenize, methods=["POST"])
    tokens.add_api_route("/detokenize", s.detokenize, methods=["POST"])
    app.include_router(tokens)
    app.add_api_route("/health", s.health, methods=["GET"])
    # /slots answers exactly whoever may read /metrics: one router, one rule.
    monitoring = APIRouter()
    monitoring.add_api_route("/metrics", s.metrics_text, methods=["GET"])
    monitoring.add_api_route("/slots", s.slots, methods=["GET"])
    app.include_router(monitoring)
    if s.cfg.webui:
        mount_webui(app)
    app.add_middleware(RequestCounter, metrics=s.metrics)
    return app
