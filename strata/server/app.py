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
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata import __version__
from strata.engine.types import EngineRequest
from strata.grammar import GrammarError, GrammarSpec
from strata.params import SamplingParams
from strata.server import protocol as P
from strata.server.config import ServerConfig
from strata.server.metrics import CONTENT_TYPE, Metrics, RequestCounter, slots_json
from strata.server.reasoning import reasoning_parser_for, thinking_opened_in_prompt
from strata.server.responses import (_ChatChunks, _chat_message, _CompletionChunks, _EngineStreamResponse, _Job,
                                     _json, _Merged, _Result, _sse, _usage)
from strata.server.tool_grammar import tool_call_grammar
from strata.server.tools import (ChatOutputParser, ToolChoice, ToolRequestError, resolve_tool_choice,
                                 template_tools, tool_parser_for, tools_for_template)
from strata.web import mount_webui

OPENAI_DEFAULT_TEMPERATURE = 1.0
# Below this, dividing fp32 logits by the temperature can overflow to inf/NaN; the distribution is
# already a point mass there, so such requests run greedy.
GREEDY_BELOW_TEMPERATURE = 1e-5
MIN_LOGPROB = -9999.0  # what an alternative the grammar disallows (-inf) is reported as


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


def _engine_attr(engine: Any, name: str, inner: str | None = None) -> Any:
    """`engine.name`, else the wrapped LLMEngine's (`engine.engine`, its `inner` part if given), or None."""
    found = getattr(engine, name, None)
    if found is None:
        core = getattr(engine, "engine", None)
        found = getattr(getattr(core, inner, None) if inner else core, name, None)
    return found


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
        model_type = _engine_attr(engine, "model_type", "model_config")  # picks the tool-call and reasoning formats
        self.model_type = model_type if isinstance(model_type, str) else None
        self.grammar_compiler = _engine_attr(engine, "grammar_compiler")  # None: structured output is unavailable

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

    async def constrain(self, params: SamplingParams, spec: GrammarSpec | None, param: str | None,
                        ) -> SamplingParams:
        """`params` with `spec` as its grammar, compiled here in the thread pool (a schema can take
        milliseconds; the engine's own compile is then a cache hit). A GrammarError is a 400 naming the
        problem and `param`."""
        if spec is None:
            return params
        if self.grammar_compiler is None:
            if param == "tool_choice":  # as before grammars: the call is asked for and parsed, not enforced
                return params
            raise APIError(400, "structured output is not available: the model has no tokenizer the grammar "
                                "engine can use", param=param, code="unsupported_parameter")
        try:
            await run_in_threadpool(self.grammar_compiler.compile, spec)
        except GrammarError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None
        return dataclasses.replace(params, grammar=spec)

    def chat_grammar(self, body: P.ChatCompletionRequest, prompt: str, choice: ToolChoice,
                     ) -> tuple[GrammarSpec | None, str | None]:
        """(what the output must match, the field it comes from): a tool call for tool_choice
        "required" or a named function, in the model's format; else the request's response_format (or
        another output constraint), unless tools are offered under "auto" (the model may call one)."""
        if choice.mode in ("required", "function"):
            template = self.tokenizer.chat_template
            tp = tool_parser_for(self.model_type, template)
            if tp is None:
                raise APIError(400, f"tool_choice {choice.mode!r} needs a model with a known tool-call format",
                               param="tool_choice", code="unsupported_parameter")
            kw = body.chat_template_kwargs or {}
            rp = reasoning_parser_for(self.model_type, template, kw.get("enable_thinking", True))
            reasoning = "none" if rp is None else "open" if thinking_opened_in_prompt(prompt) else "optional"
            try:
                spec = tool_call_grammar(body.tools, choice, tp.format, self.tokenizer,
                                         parallel=body.parallel_tool_calls is not False, reasoning=reasoning)
            except ToolRequestError as e:
                raise APIError(400, str(e), param=e.param) from None
            return spec, "tool_choice"
        if choice.mode == "auto" and body.tools:
            return None, None
        return self.grammar_spec(body)

    @staticmethod
    def grammar_spec(body: P._SamplingRequest) -> tuple[GrammarSpec | None, str | None]:
        param = body.grammar_param
        try:
            return body.grammar_spec(), param
        except GrammarError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None

    # -- prompts ----------------------------------------------------------------------------------

    def chat_prompt(self, body: P.ChatCompletionRequest) -> tuple[list[int], str, ToolChoice]:
        """(prompt ids, prompt text, what `tool_choice` asks for)."""
        try:
            tools_for_template(body.tools)  # checked before tool_choice looks names up in them
            choice = resolve_tool_choice(body.tool_choice, body.tools)
            tpl_tools = template_tools(body.tools, choice)
        except ToolRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        kw = body.chat_template_kwargs or {}
        try:
            text = self.tokenizer.apply_chat_template(body.chat(), tools=tpl_tools, add_generation_prompt=True,
                                                      **kw)
        except P.Unsupported as e:
            raise APIError(400, str(e), param=e.param, code="unsupported_parameter") from None
        except Exception as e:  # the template is the model's code: any failure is about these messages
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        return self.tokenizer.encode(text, add_special=False), text, choice

    def chat_parsers(self, body: P.ChatCompletionRequest, prompt: str, choice: ToolChoice,
                     ) -> list[ChatOutputParser] | None:
        """One output parser per choice, or None when the model's output is neither reasoning nor calls."""
        kw = body.chat_template_kwargs or {}
        template = self.tokenizer.chat_template
        rp = reasoning_parser_for(self.model_type, template, kw.get("enable_thinking", True))
        tp = tool_parser_for(self.model_type, template) if choice.uses_tools else None
        if rp is None and tp is None:
            return None
        opened = thinking_opened_in_prompt(prompt)
        return [ChatOutputParser(rp, tp, opened_in_prompt=opened, request_tools=body.tools) for _ in range(body.n)]

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
        # A grammar's mask leaves disallowed alternatives at -inf; OpenAI reports such as -9999.
        return P.TopLogprob(token=tok, logprob=max(logprob, MIN_LOGPROB), bytes=list(tok.encode("utf-8")))

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
                    alt.setdefault(self._token_text(a), max(v, MIN_LOGPROB))
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

    async def _sse(self, request: Request, job: _Job, streams: list[Any], chunks: Any, end: str | None,
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
            for piece in chunks.end() if end is None else [end]:
                yield piece
        finally:
            watcher.cancel()
            merged.close()
            job.close()

    def streaming(self, request: Request, job: _Job, streams: list[Any], chunks: Any,
                  end: str | None = "data: [DONE]\n\n") -> StreamingResponse:
        """SSE of `chunks` (`start()`, `event(i, ev)`), closed by `end`, or by `chunks.end()` when None."""
        return _EngineStreamResponse(job, self._sse(request, job, streams, chunks, end))

    async def start_chat(self, rid: str, body: P.ChatCompletionRequest,
                         ) -> tuple[_Job, list[Any], list[ChatOutputParser] | None, int]:
        """A chat request templated, checked and submitted: its job, streams, output parsers and
        prompt length."""
        self.check_model(body.model)
        ids, prompt, tool_choice = await run_in_threadpool(self.chat_prompt, body)
        parsers = self.chat_parsers(body, prompt, tool_choice)
        params = self.sampling(body, len(ids), "messages")
        params = await self.constrain(params, *self.chat_grammar(body, prompt, tool_choice))
        job, streams = self.submit(rid, body.n, ids, params, body.logprobs, body.num_top_logprobs)
        return job, streams, parsers, len(ids)

    # -- endpoints --------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        body: P.ChatCompletionRequest = await _parse(request, P.ChatCompletionRequest, self.cfg.max_body_bytes)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        job, streams, parsers, _ = await self.start_chat(rid, body)
        if body.stream:
            chunks = _ChatChunks(self, rid, body.model, body.include_usage, body.logprobs, body.n, parsers)
            return self.streaming(request, job, streams, chunks)
        results = await self.collect(request, job, streams)
        choices = []
        for i, r in enumerate(results):
            message, finish = _chat_message(r, parsers[i] if parsers else None)
            choices.append(P.ChatChoice(index=i, message=message, finish_reason=finish,
                                        logprobs=self.chat_logprobs(r.token_ids, r.logprobs, r.tops)
                                        if body.logprobs else None))
        return _json(P.ChatCompletion(id=rid, created=int(time.time()), model=body.model, choices=choices,
                                      usage=_usage(results)))

    async def completions(self, request: Request) -> Response:
        body: P.CompletionRequest = await _parse(request, P.CompletionRequest, self.cfg.max_body_bytes)
        self.check_model(body.model)
        ids, prompt_text = await run_in_threadpool(self.completion_prompt, body)
        params = await self.constrain(self.sampling(body, len(ids), "prompt"), *self.grammar_spec(body))
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
            ids = (await run_in_threadpool(self.chat_prompt, chat))[0]
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
    # Anthropic's Messages API: its own key header and error shape, so not behind `authorize`.
    from strata.server.anthropic import anthropic_messages  # it builds on this module

    async def messages(request: Request) -> Response:
        return await anthropic_messages(s, request)

    app.add_api_route("/v1/messages", messages, methods=["POST"])
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
