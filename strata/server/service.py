"""The served model behind the HTTP APIs: `ModelService` admits a request (a bounded queue: 429 with
Retry-After beyond `max_queue` waiting engine requests; 503 while the server drains), checks it against
the model (its name, context length, vocabulary, tools and output constraints), templates the prompt,
and submits one engine request per choice.

A request for `n` choices is n engine requests for the same prompt, merged into one response as their
events arrive (`strata.server.jobs`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import functools
import inspect
import logging
import os
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from fastapi import Request

from strata.engine.types import EngineRequest
from strata.grammar import GrammarError, GrammarSpec
from strata.grammar.spec import has_finite_value
from strata.params import SamplingParams
from strata.server import protocol as P
from strata.server.chat_templates import resolve_chat_template
from strata.server.config import ServerConfig
from strata.server.errors import APIError
from strata.server.jobs import Job
from strata.server.logprobs import LogprobFormatter
from strata.server.metrics import Metrics
from strata.server.reasoning import reasoning_parser_for, thinking_opened_in_prompt
from strata.server.templates import TemplateLimitError, TemplateRenderer, TemplateUnavailable
from strata.server.tool_grammar import tool_call_grammar
from strata.server.tools import (ChatOutputParser, ToolChoice, ToolRequestError, resolve_tool_choice,
                                 template_tools, tool_parser_for, tools_for_template)

log = logging.getLogger("strata")

OPENAI_DEFAULT_TEMPERATURE = 1.0
CPU_WORKERS = 2  # threads tokenizing prompts and compiling grammars
TEMPLATE_WORKERS = 2  # chat-template worker processes (`strata.server.templates`)
TEMPLATE_TIMEOUT_S = 5.0  # longest a chat template may take to render
# Below this, dividing fp32 logits by the temperature can overflow to inf/NaN; the distribution is
# already a point mass there, so such requests run greedy.
GREEDY_BELOW_TEMPERATURE = 1e-5


def model_id(name: str) -> str:
    """The id clients see for a model loaded from `name`: a path's last part (a GGUF file's name without
    `.gguf`), not the server's local path."""
    base = os.path.basename(os.path.normpath(name))
    return (base[: -len(".gguf")] if base.lower().endswith(".gguf") else base) or name


def text_chars(value: Any) -> int:
    """Characters in every string of a JSON-like value."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(k) + text_chars(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(text_chars(v) for v in value)
    return 0


def _engine_attr(engine: Any, name: str, inner: str | None = None) -> Any:
    """`engine.name`, else the wrapped LLMEngine's (`engine.engine`, its `inner` part if given), or None."""
    found = getattr(engine, name, None)
    if found is None:
        core = getattr(engine, "engine", None)
        found = getattr(getattr(core, inner, None) if inner else core, name, None)
    return found


class Ticket:
    """`n` engine requests counted as in service from admission until their job closes (or the
    request fails before it has one); `release` is idempotent."""

    def __init__(self, service: "ModelService", n: int):
        self.service, self.n = service, n

    def release(self) -> None:
        if self.n:
            self.service.in_service -= self.n
            self.n = 0


SHUTTING_DOWN = "the server is shutting down"
CONTEXT_EXCEEDED = "exceed_context_size_error"  # llama-server's error type for a request the context cannot hold


class ModelService:
    """The served model behind every API: its engine, tokenizer and names, the checks that turn a
    request into engine requests, and their submission."""

    def __init__(self, engine: Any, cfg: ServerConfig):
        self.engine, self.cfg = engine, cfg
        if cfg.stream_interval_ms is not None and hasattr(engine, "stream_interval_s"):
            engine.stream_interval_s = cfg.stream_interval_ms / 1e3
        self.tokenizer = engine.tokenizer
        template = resolve_chat_template(cfg.chat_template, cfg.chat_template_file)
        if template is not None:  # the server's own copy: the engine's tokenizer keeps the model's
            self.tokenizer = dataclasses.replace(engine.tokenizer, chat_template=template)
        self.max_model_len = int(engine.max_model_len)
        self.model_name = cfg.model_name or (cfg.aliases or [model_id(engine.model_name)])[0]
        # The path too: what clients sent before.
        self.known_names = {self.model_name, engine.model_name, *cfg.aliases}
        self.other_names: set[str] = set()  # other names clients sent (logged once each)
        self.created = int(time.time())
        self.metrics = Metrics(self.model_name, engine.stats, rejected=lambda: self.rejected_total)
        self.logprobs = LogprobFormatter(self.tokenizer)
        # Engines that can report sampled-token logprobs take `submit(req, logprobs=True)`.
        self.engine_logprobs = "logprobs" in inspect.signature(engine.submit).parameters
        model_type = _engine_attr(engine, "model_type", "model_config")  # picks the tool-call and reasoning formats
        self.model_type = model_type if isinstance(model_type, str) else None
        self.grammar_compiler = _engine_attr(engine, "grammar_compiler")  # None: structured output is unavailable
        # The logits' width: what top_k and logit_bias ids are checked against.
        vocab = getattr(_engine_attr(engine, "model_config"), "vocab_size", None)
        self.vocab_size = vocab if isinstance(vocab, int) else self.tokenizer.vocab_size
        self.parallel = max(int(engine.stats().parallel), 1)
        self.speculative = bool(getattr(getattr(engine, "engine_config", None), "spec", 0))
        self.default_seed = getattr(getattr(engine, "engine_config", None), "seed", None)
        self.default_temperature = OPENAI_DEFAULT_TEMPERATURE if cfg.temp is None else cfg.temp
        kv, ctx = _engine_attr(engine, "kv_capacity"), getattr(getattr(engine, "engine_config", None), "ctx", None)
        sizes = _engine_attr(engine, "context_sizes")  # with the host KV tier: the device's and the host's
        self.context_note = ((sizes if isinstance(sizes, str) and sizes else
                              f" (what its KV cache of {kv} tokens holds, below --ctx {ctx})")
                             if isinstance(kv, int) and isinstance(ctx, int) and kv < ctx else "")
        # Text longer than this cannot fit the context (`check_chars`).
        vocab_chars = max((len(t) for t in self.tokenizer.tk.get_vocab(with_added_tokens=True)), default=1)
        self.max_prompt_chars = self.max_model_len * max(vocab_chars, 1) * 2
        self.cpu_pool = ThreadPoolExecutor(max_workers=CPU_WORKERS, thread_name_prefix="strata-text")
        # One thread per template worker process: each waits for its render, at most `timeout_s`.
        self.template_pool = ThreadPoolExecutor(max_workers=TEMPLATE_WORKERS, thread_name_prefix="strata-template")
        self.waiting = {self.cpu_pool: 0, self.template_pool: 0}
        self.pool_queue = max(cfg.max_queue, 64)
        self.renderer = TemplateRenderer(self.tokenizer, self.max_prompt_chars, workers=TEMPLATE_WORKERS,
                                         timeout_s=TEMPLATE_TIMEOUT_S)
        self.renderer.check()
        self.in_service = 0  # engine requests admitted and not finished: running, queued or being prepared
        self.jobs: set[Job] = set()
        self.rejected_total = 0  # requests refused with 429 (queue full)
        self.draining = False  # no new requests (shutdown); those in service finish
        self.closing = False  # shutdown's deadline passed: nothing more is submitted

    # -- admission --------------------------------------------------------------------------------

    def shutting_down(self) -> APIError:
        return APIError(503, SHUTTING_DOWN, type_="server_error", code="server_shutting_down",
                        headers={"Retry-After": "5", "Connection": "close"})

    def admit(self, n: int) -> Ticket:
        """Counts `n` engine requests in service, or refuses them: 503 while draining, 429 when the
        queue behind the busy slots would grow past `max_queue`."""
        if self.draining:
            raise self.shutting_down()
        waiting = self.in_service + n - self.parallel
        if waiting > self.cfg.max_queue:
            self.rejected_total += 1
            # A rough wait: the queue ahead, a slot's worth at a time, a second each.
            retry = max(1, min(60, (self.in_service - self.parallel) // self.parallel))
            raise APIError(429, f"the server is at capacity: {self.in_service} requests in service on "
                                f"{self.parallel} slots and a queue of at most {self.cfg.max_queue}; retry later",
                           type_="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry)})
        self.in_service += n
        return Ticket(self, n)

    def _closed(self, job: Job, ticket: Ticket) -> None:
        self.jobs.discard(job)
        ticket.release()

    def interrupt_all(self, message: str = SHUTTING_DOWN) -> None:
        """Ends every response in service now with `message` (shutdown's deadline)."""
        self.closing = True
        for job in list(self.jobs):
            job.interrupt(message)

    # -- request checks ---------------------------------------------------------------------------

    def key_matches(self, request: Request) -> bool:
        """Whether the request carries the server's key, as `Authorization: Bearer` or `X-Api-Key`
        (Anthropic's header, which llama-server takes on every route)."""
        assert self.cfg.api_key is not None
        key = self.cfg.api_key.encode()
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key):
            return True
        x_key = request.headers.get("x-api-key")
        return x_key is not None and secrets.compare_digest(x_key.strip().encode(), key)

    async def authorize(self, request: Request) -> None:
        if self.cfg.api_key is not None and not self.key_matches(request):
            raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>` or "
                                "`X-Api-Key: <key>`.", type_="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def check_model(self, name: str | None) -> None:
        """Any name (or none) is this server's one model, as llama-server takes it; a name that is not
        one of its own is logged once, so an operator can see what clients ask for."""
        if name is None or name in self.known_names:
            return
        if name not in self.other_names and len(self.other_names) < 64:
            self.other_names.add(name)
            log.info("requests for model %r are served by %r", name[:200], self.model_name)

    def check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    def sampling(self, body: P.SamplingRequest, n_prompt: int, param: str) -> SamplingParams:
        if n_prompt == 0:
            raise APIError(400, "the prompt is empty", param=param)
        room = self.max_model_len - n_prompt
        requested = body.output_limit
        if room < 1 or requested is not None and requested > room:
            asked = f"{n_prompt + requested} tokens ({n_prompt} in the prompt, {requested} for the completion)" \
                if requested is not None else f"{n_prompt} tokens in the prompt and at least 1 for the completion"
            raise self.context_exceeded(f"This model's maximum context length is {self.max_model_len} tokens"
                                        f"{self.context_note}; this request needs {asked}.", param, n_prompt)
        # --n-predict is the limit of requests that set none, as llama-server's; a request's own limit wins.
        default = self.cfg.n_predict if self.cfg.n_predict > 0 else body.default_max_tokens
        max_tokens = requested if requested is not None else min(default or room, room)
        if body.stop_token_ids:
            self.check_ids(body.stop_token_ids, "stop_token_ids")
        kw: dict[str, Any] = dict(
            max_tokens=max_tokens, stop=list(body.stop or []), stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos, seed=body.seed,
            temperature=self.default_temperature if body.temperature is None else body.temperature,
        )
        if kw["temperature"] < GREEDY_BELOW_TEMPERATURE:
            kw["temperature"] = 0.0
        for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if getattr(body, name) is not None:
                kw[name] = getattr(body, name)
        if body.top_k is not None:
            if body.top_k > self.vocab_size:
                raise APIError(400, f"top_k must be at most the vocabulary size, {self.vocab_size}", param="top_k")
            kw["top_k"] = max(body.top_k, 0)
        if body.logit_bias:
            bias = body.token_bias
            bad = next((t for t in bias if t >= self.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"logit_bias: token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                               param="logit_bias")
            kw["logit_bias"] = bias
        if body.wants_logprobs and not self.engine_logprobs:
            raise APIError(400, "logprobs are not supported by this engine", param="logprobs",
                           code="unsupported_parameter")
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def constrain(self, params: SamplingParams, spec: GrammarSpec | None, param: str | None,
                        ) -> SamplingParams:
        """`params` with `spec` as its grammar, compiled here in the server's pool (a schema can take
        milliseconds; the engine's own compile is then a cache hit). A GrammarError is a 400 naming the
        problem and `param`."""
        if spec is None:
            return params
        if self.grammar_compiler is None:
            if param == "tool_choice":  # the call is asked for in the prompt and parsed, not enforced
                return params
            raise APIError(400, "structured output is not available: the model has no tokenizer the grammar "
                                "engine can use", param=param, code="unsupported_parameter")
        try:
            await self.run_cpu(self.compile_checked, spec)
        except GrammarError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None
        return dataclasses.replace(params, grammar=spec)

    def compile_checked(self, spec: GrammarSpec) -> None:
        """Compiles `spec`; a GrammarError too when it admits no output at all (its first step allows only
        stop tokens, as a schema that only refers to itself compiles), which would end every answer
        empty; or when no finite value satisfies a schema (it requires itself), under which output
        could only end at max_tokens."""
        if spec.kind == "json_schema" and not has_finite_value(spec.schema()):
            raise GrammarError("the schema has no finite value: every value it admits must contain a value "
                               "of its own type (e.g. {\"$ref\": \"#\"})")
        matcher = self.grammar_compiler.compile(spec).matcher()
        row = np.zeros(matcher.words, dtype=np.int32)
        matcher.fill_mask(row)
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        if not matcher.can_stop() and set(allowed.tolist()) <= set(matcher.stop_ids):
            raise GrammarError("it admits no output (a schema that refers only to itself?)")

    async def check_tool_schemas(self, tools: list[dict[str, Any]] | None) -> None:
        """Each tool's `parameters` checked as a `response_format` schema is (400 naming the tool), whatever
        `tool_choice` is: a schema is valid or not whether or not it is enforced."""
        if not tools or self.grammar_compiler is None:
            return
        for i, tool in enumerate(tools):
            schema = (tool.get("function") or {}).get("parameters")
            if not isinstance(schema, dict):
                continue
            param = f"tools[{i}].function.parameters"
            try:
                await self.run_cpu(self.compile_checked, GrammarSpec.json_schema(schema, strict=False))
            except GrammarError as e:
                raise APIError(400, f"{param}: {e}", param=param) from None

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
            rp = reasoning_parser_for(self.model_type, template, self.template_kwargs(body)["enable_thinking"])
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
    def grammar_spec(body: P.SamplingRequest) -> tuple[GrammarSpec | None, str | None]:
        param = body.grammar_param
        try:
            return body.grammar_spec(), param
        except GrammarError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None

    # -- prompts ----------------------------------------------------------------------------------

    async def chat_prompt(self, body: P.ChatCompletionRequest) -> tuple[list[int], str, ToolChoice]:
        """(prompt ids, prompt text, what `tool_choice` asks for): rendered in the template pool, encoded
        in the text pool, so that a slow template never holds up other requests' tokenization."""
        try:
            tools_for_template(body.tools)  # checked before tool_choice looks names up in them
            choice = resolve_tool_choice(body.tool_choice, body.tools)
            tpl_tools = template_tools(body.tools, choice)
        except ToolRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        try:
            messages = body.chat()
        except P.Unsupported as e:
            raise APIError(400, str(e), param=e.param, code="unsupported_parameter") from None
        kw = self.template_kwargs(body)
        parts = [messages, tpl_tools, kw]
        self.check_chars(sum(text_chars(x) for x in parts), "messages")
        table: dict[str, str] = {}
        r = self.renderer
        try:
            messages, tpl_tools, kw = (r.protect(x, table) for x in parts)
            text = await self.render_chat(messages, tpl_tools, kw, body.prefill, body.add_generation_prompt)
        except TemplateUnavailable as e:
            raise APIError(503, str(e), type_="server_error", code="template_unavailable",
                           headers={"Retry-After": "1"}) from None
        except TemplateLimitError as e:  # the template is the model's code: any failure is about these messages
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        ids = await self.run_cpu(r.encode, text, table)
        for placeholder, original in table.items():
            text = text.replace(placeholder, original)
        return ids, text, choice

    def template_kwargs(self, body: P.ChatCompletionRequest) -> dict[str, Any]:
        """The chat template's extra variables: the request's `chat_template_kwargs` over what llama-server
        gives every template: `enable_thinking` (--reasoning; templates that test `not enable_thinking`
        would read an unset one as thinking turned off) and today's date as `date_string` ("06 Dec 2026",
        Llama 3's) and `datetime` ("Dec 06 2026", FireFunction's)."""
        today = datetime.date.today()
        return {"enable_thinking": self.cfg.reasoning != "off", "date_string": today.strftime("%d %b %Y"),
                "datetime": today.strftime("%b %d %Y"), **(body.chat_template_kwargs or {})}

    async def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          kw: dict[str, Any], prefill: bool, add_generation_prompt: bool | None = None) -> str:
        """The template's text for `messages`. With `prefill`, the final (assistant) message is left open
        for the model to continue: the conversation rendered without a generation prompt and cut right
        after that message's content (an empty one: the earlier messages with the generation prompt)."""
        render = self.renderer.render
        if not prefill:
            gen = True if add_generation_prompt is None else add_generation_prompt
            return await self._run(self.template_pool, render, messages, tools, gen, kw)
        content = messages[-1].get("content") or ""
        if content:
            text = await self._run(self.template_pool, render, messages, tools, False, kw)
            end = text.rfind(content)
            if end >= 0:
                return text[: end + len(content)]
        text = await self._run(self.template_pool, render, messages[:-1], tools, True, kw)
        return text + content

    def chat_parsers(self, body: P.ChatCompletionRequest, prompt: str, choice: ToolChoice,
                     ) -> list[ChatOutputParser] | None:
        """One output parser per choice, or None when the model's output is neither reasoning nor calls."""
        template = self.tokenizer.chat_template
        rp = reasoning_parser_for(self.model_type, template, self.template_kwargs(body)["enable_thinking"])
        tp = tool_parser_for(self.model_type, template) if choice.uses_tools else None
        if rp is None and tp is None:
            return None
        opened = thinking_opened_in_prompt(prompt)
        return [ChatOutputParser(rp, tp, opened_in_prompt=opened, request_tools=body.tools) for _ in range(body.n)]

    def completion_prompt(self, prompt: P.Prompt, echo: bool = False) -> tuple[list[int], str]:
        """(prompt ids, prompt text for echo) of one prompt: text, token ids, or ids and text mixed (each
        piece in order, special tokens added before the first only). A completion's prompt is the
        caller's own template, so its special strings are control tokens (as vLLM and llama-server read
        it); chat content is not."""
        if isinstance(prompt, str):
            self.check_chars(len(prompt), "prompt")
            return self.tokenizer.encode(prompt), prompt
        self.check_chars(sum(len(p) for p in prompt if isinstance(p, str)), "prompt")
        ids: list[int] = []
        for k, piece in enumerate(prompt):
            ids += [piece] if isinstance(piece, int) else self.tokenizer.encode(piece, add_special=k == 0)
        if len(ids) >= self.max_model_len:
            raise self.context_exceeded(f"This model's maximum context length is {self.max_model_len} tokens"
                                        f"{self.context_note}; the prompt has {len(ids)}.", "prompt", len(ids))
        self.check_ids(ids, "prompt")
        return ids, (self.tokenizer.decode(ids) if echo else "")

    def check_chars(self, n: int, param: str) -> None:
        """A 400 for text that cannot fit the context whatever it tokenizes to: more characters than the
        context's tokens times the longest token's characters (twice over, for normalizers that join
        characters). Checked before tokenizing, which costs time and memory by the character."""
        if n > self.max_prompt_chars:
            raise self.context_exceeded(f"This model's maximum context length is {self.max_model_len} tokens; the "
                                        f"{param} has {n} characters, more than the {self.max_prompt_chars} that "
                                        f"could fit it.", param)

    def context_exceeded(self, message: str, param: str, n_prompt: int | None = None) -> APIError:
        """The 400 of a request the context cannot hold: OpenAI's code, llama-server's type and its `n_ctx`
        and `n_prompt_tokens` (when the prompt was tokenized)."""
        extra: dict[str, Any] = {"n_ctx": self.max_model_len}
        if n_prompt is not None:
            extra["n_prompt_tokens"] = n_prompt
        return APIError(400, message, type_=CONTEXT_EXCEEDED, param=param, code="context_length_exceeded",
                        extra=extra)

    async def run_cpu(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` in the server's text pool (tokenization, grammar compiles): bounded, so such work
        waits there rather than crowd the event loop or anyio's shared threads."""
        return await self._run(self.cpu_pool, fn, *args)

    async def _run(self, pool: ThreadPoolExecutor, fn: Any, *args: Any) -> Any:
        """`fn(*args)` in `pool`; 429 when too much already waits for it."""
        if self.waiting[pool] >= self.pool_queue:
            raise APIError(429, "the server is busy preparing prompts; retry later", type_="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"})
        self.waiting[pool] += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))
        finally:
            self.waiting[pool] -= 1

    def close(self) -> None:
        self.renderer.close()
        for pool in self.waiting:
            pool.shutdown(wait=False, cancel_futures=True)

    # -- running ----------------------------------------------------------------------------------

    def _submit_one(self, rid: str, ids: list[int], params: SamplingParams, logprobs: bool, top: int,
                    progress: bool = False, filtered: bool = False) -> Any:
        req = EngineRequest(request_id=rid, prompt_ids=tuple(ids), params=params, arrival_time=time.monotonic(),
                            top_logprobs=top, report_progress=progress, filtered_logprobs=filtered and top > 0)
        try:
            return self.engine.submit(req, logprobs=True) if logprobs else self.engine.submit(req)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            raise APIError(503, f"the engine is not accepting requests: {e}", type_="server_error") from None

    def submit(self, rid: str, n: int, ids: list[int], params: SamplingParams, logprobs: bool, ticket: Ticket,
               top: int = 0, progress: bool = False) -> tuple[Job, list[Any]]:
        """One engine request per choice (ids `{rid}-{i}` when n > 1); choice i of a seeded request
        draws from seed + i (mod 2^64), so the choices differ and the whole response is reproducible.
        The job holds `ticket` until it closes."""
        return self.submit_prompts(rid, n, [(ids, params)], logprobs, ticket, top, progress)

    async def submit_completion(self, body: Any, prompts: list[Any], n: int, echo: bool
                                ) -> tuple[str, list[tuple[list[int], str]], list[SamplingParams], Job, list[Any]]:
        """A completions request (OpenAI's or llama-server's native one) admitted, its prompts encoded
        and constrained, and submitted: (request id, (ids, echoed text) per prompt, sampling parameters per
        prompt, the job, its streams)."""
        ticket = self.admit(n * len(prompts))
        try:
            encoded = [await self.run_cpu(self.completion_prompt, p, echo) for p in prompts]
            spec, param = self.grammar_spec(body)
            params = [await self.constrain(self.sampling(body, len(ids), "prompt"), spec, param) for ids, _ in encoded]
            rid = f"cmpl-{uuid.uuid4().hex}"
            job, streams = self.submit_prompts(rid, n, [(ids, p) for (ids, _), p in zip(encoded, params)],
                                               body.wants_logprobs, ticket, body.num_top_logprobs,
                                               body.wants_progress, body.wants_filtered_logprobs)
        except BaseException:
            ticket.release()
            raise
        return rid, encoded, params, job, streams

    def submit_prompts(self, rid: str, n: int, prompts: list[tuple[list[int], SamplingParams]], logprobs: bool,
                       ticket: Ticket, top: int = 0, progress: bool = False, filtered: bool = False
                       ) -> tuple[Job, list[Any]]:
        """`submit` for several prompts: `n` choices each, choice `i * n + j` being prompt i's choice j.
        `filtered`: logprobs under the distribution after the sampler's filters."""
        if self.closing:
            raise self.shutting_down()
        total = n * len(prompts)
        rids = [rid] if total == 1 else [f"{rid}-{k}" for k in range(total)]
        streams: list[Any] = []
        try:
            for k, r in enumerate(rids):
                ids, params = prompts[k // n]
                p, i = params, k % n
                if i and params.seed is not None:
                    p = dataclasses.replace(params, seed=(params.seed + i) % 2**64)
                streams.append(self._submit_one(r, ids, p, logprobs, top, progress, filtered))
        except APIError:
            for r in rids[: len(streams)]:
                self.engine.abort(r)
            raise
        job = Job(self.engine, rids, on_close=lambda j: self._closed(j, ticket))
        self.jobs.add(job)
        return job, streams

    async def start_chat(self, rid: str, body: P.ChatCompletionRequest,
                         ) -> tuple[Job, list[Any], list[ChatOutputParser] | None, list[int]]:
        """A chat request admitted, templated, checked and submitted: its job, streams, output parsers
        and prompt ids."""
        self.check_model(body.model)
        ticket = self.admit(body.n)
        try:
            ids, prompt, tool_choice = await self.chat_prompt(body)
            await self.check_tool_schemas(body.tools)
            parsers = self.chat_parsers(body, prompt, tool_choice)
            params = self.sampling(body, len(ids), "messages")
            params = await self.constrain(params, *self.chat_grammar(body, prompt, tool_choice))
            job, streams = self.submit(rid, body.n, ids, params, body.wants_logprobs, ticket, body.num_top_logprobs,
                                       body.wants_progress)
        except BaseException:
            ticket.release()
            raise
        return job, streams, parsers, ids

    def verbose(self, body: P.SamplingRequest, prompt_ids: list[int], text: str) -> dict[str, Any] | None:
        """llama-server's `__verbose` of a response, when the request (or else --verbose) asks for it."""
        if not (self.cfg.verbose if body.verbose is None else body.verbose):
            return None
        return {"prompt": self.tokenizer.decode(prompt_ids, skip_special=False), "content": text,
                "tokens_evaluated": len(prompt_ids)}

    def model_card(self) -> P.ModelCard:
        return P.ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len,
                           aliases=self.cfg.aliases or None, tags=self.cfg.tag_list or None)
