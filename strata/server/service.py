"""The served model behind the HTTP APIs: `ModelService` checks a request against the model (its
name, context length, vocabulary, tools and output constraints), templates the prompt, and submits
one engine request per choice.

A request for `n` choices is n engine requests for the same prompt, merged into one response as their
events arrive (`strata.server.jobs`).
"""

from __future__ import annotations

import dataclasses
import inspect
import secrets
import time
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from strata.engine.types import EngineRequest
from strata.grammar import GrammarError, GrammarSpec
from strata.params import SamplingParams
from strata.server import protocol as P
from strata.server.config import ServerConfig
from strata.server.errors import APIError
from strata.server.jobs import Job
from strata.server.logprobs import LogprobFormatter
from strata.server.metrics import Metrics
from strata.server.reasoning import reasoning_parser_for, thinking_opened_in_prompt
from strata.server.tool_grammar import tool_call_grammar
from strata.server.tools import (ChatOutputParser, ToolChoice, ToolRequestError, resolve_tool_choice,
                                 template_tools, tool_parser_for, tools_for_template)

OPENAI_DEFAULT_TEMPERATURE = 1.0
# Below this, dividing fp32 logits by the temperature can overflow to inf/NaN; the distribution is
# already a point mass there, so such requests run greedy.
GREEDY_BELOW_TEMPERATURE = 1e-5


def _engine_attr(engine: Any, name: str, inner: str | None = None) -> Any:
    """`engine.name`, else the wrapped LLMEngine's (`engine.engine`, its `inner` part if given), or None."""
    found = getattr(engine, name, None)
    if found is None:
        core = getattr(engine, "engine", None)
        found = getattr(getattr(core, inner, None) if inner else core, name, None)
    return found


class ModelService:
    """The served model behind every API: its engine, tokenizer and names, the checks that turn a
    request into engine requests, and their submission."""

    def __init__(self, engine: Any, cfg: ServerConfig):
        self.engine, self.cfg = engine, cfg
        self.tokenizer = engine.tokenizer
        self.max_model_len = int(engine.max_model_len)
        self.model_name = cfg.model_name or engine.model_name
        self.known_names = {self.model_name, engine.model_name}
        self.created = int(time.time())
        self.metrics = Metrics(self.model_name, engine.stats)
        self.logprobs = LogprobFormatter(self.tokenizer)
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

    def sampling(self, body: P.SamplingRequest, n_prompt: int, param: str) -> SamplingParams:
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
            if param == "tool_choice":  # the call is asked for in the prompt and parsed, not enforced
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
    def grammar_spec(body: P.SamplingRequest) -> tuple[GrammarSpec | None, str | None]:
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
               top: int = 0) -> tuple[Job, list[Any]]:
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
        return Job(self.engine, rids), streams

    async def start_chat(self, rid: str, body: P.ChatCompletionRequest,
                         ) -> tuple[Job, list[Any], list[ChatOutputParser] | None, int]:
        """A chat request templated, checked and submitted: its job, streams, output parsers and
        prompt length."""
        self.check_model(body.model)
        ids, prompt, tool_choice = await run_in_threadpool(self.chat_prompt, body)
        parsers = self.chat_parsers(body, prompt, tool_choice)
        params = self.sampling(body, len(ids), "messages")
        params = await self.constrain(params, *self.chat_grammar(body, prompt, tool_choice))
        job, streams = self.submit(rid, body.n, ids, params, body.logprobs, body.num_top_logprobs)
        return job, streams, parsers, len(ids)

    def model_card(self) -> P.ModelCard:
        return P.ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)
