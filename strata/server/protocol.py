"""The OpenAI wire format: request bodies as pydantic models, responses as the shapes clients parse.

Requests ignore fields they do not know (clients and SDKs send many optional ones), but a known field
asking for something Strata cannot do (suffix, best_of > 1, llama.cpp's typical-p, mirostat, DRY, XTC
and top-n-sigma samplers) is a 400 naming it rather than being silently dropped. `model` is optional:
the server serves one model whatever name is sent. llama-server's spellings act on the OpenAI routes
too: `n_predict` (max_tokens), `n_probs` (logprobs with that many alternatives), `cache_prompt`
(the prefix cache keeps exact K/V, so a hit gives the same result as a fresh read). Every numeric field is bounded by what the engine holds (the
vocabulary-dependent ones, `top_k` and `logit_bias` ids, by `strata.server.service`), and stop strings
in number and length. Chat takes `tools`, `tool_choice`
and `chat_template_kwargs` (see `strata.server.tools`); messages carry `tool_calls` / `tool_call_id`. Extensions beyond OpenAI's schema, in vLLM's spelling:
`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`; `/tokenize` and `/detokenize`
take vLLM's bodies.

Structured output (chat and completions): `response_format` of type `json_object`, `json_schema`
(`{"name", "schema", "strict"}`) and the extensions `{"type": "regex", "regex": ...}` and
`{"type": "grammar", "grammar": GBNF or Lark}`; also llama-server's top-level `json_schema` and
`grammar` and vLLM's `structured_outputs` (`json`, `regex`, `choice` or `grammar`). At most one of
these per request; `grammar_spec()` gives it as a `GrammarSpec` and `grammar_param` names its field.
Shapes are checked here; whether a schema, regex or grammar compiles is the engine's tokenizer's
business (`strata.grammar.GrammarCompiler.compile` raises GrammarError, a 400 naming the problem).

Defaults follow OpenAI: temperature 1.0; `max_tokens` 16 for completions and the rest of the context
for chat. Logprobs are those of the sampled tokens (chat `logprobs: true`, completions `logprobs: 0`),
with up to 20 alternatives per token (chat `top_logprobs`, completions `logprobs` > 0). `n` up to
MAX_N choices per request.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer,
                      model_validator)

from strata.engine.types import MAX_TOP_LOGPROBS
from strata.grammar.spec import GrammarError, GrammarSpec
from strata.params import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MAX_TOP_K, REPETITION_PENALTY_RANGE
from strata.tokenizer import TEMPLATE_RESERVED_NAMES
from strata.version import __version__

# Names the server build, as llama-server's `b<build>` does.
SYSTEM_FINGERPRINT = f"b{__version__}-strata"
MAX_N = 16  # choices per request: each is an engine request of its own
# Stop strings are searched in the output after every token: their number and length bound that work.
MAX_STOPS, MAX_STOP_CHARS = 16, 1000
MAX_STOP_TOKEN_IDS = 256
MAX_OUTPUT_TOKENS = 2**31 - 1  # beyond any context; a larger max_tokens is a 400 before any lookup


# llama.cpp's samplers Strata does not implement, each with the value that turns it off: a request that
# turns one on is a 400 naming it.
LLAMA_SAMPLERS: dict[str, Any] = {
    "typical_p": 1.0, "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "top_n_sigma": -1.0,
}
LLAMA_SAMPLER_NAMES = {"typical": "locally typical sampling", "mirostat": "mirostat", "dry": "DRY",
                       "xtc": "XTC", "top": "top-n-sigma"}


class RequestModel(BaseModel):
    """A request body or a part of one: unknown fields are ignored, NaN and infinities refused."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    def check_supported(self) -> None:
        """Raises `Unsupported` for a well-formed request asking for what Strata does not do."""


class Unsupported(ValueError):
    """A well-formed request for a feature Strata does not implement; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class StreamOptions(RequestModel):
    include_usage: bool = False


class JsonSchemaFormat(RequestModel):
    name: str | None = None  # OpenAI requires one; it names the schema and nothing is derived from it
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`, with Strata's `regex` and `grammar` types, and llama-server's
    `schema` on `json_object`."""

    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    regex: str | None = None
    grammar: str | None = None

    def spec(self) -> GrammarSpec | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return GrammarSpec.json_schema(self.schema_, strict=False) if self.schema_ is not None \
                else GrammarSpec.json_object()
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise ValueError("type 'json_schema' needs json_schema.schema")
            return GrammarSpec.json_schema(self.json_schema.schema_, strict=bool(self.json_schema.strict))
        text = self.regex if self.type == "regex" else self.grammar
        if not text:
            raise ValueError(f"type {self.type!r} needs a non-empty {self.type!r} field")
        return GrammarSpec.regex(text) if self.type == "regex" else GrammarSpec.grammar(text)


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs`: exactly one of `json` (a schema, or its JSON text), `regex`,
    `choice` and `grammar`."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def spec(self) -> GrammarSpec:
        given = [k for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                ("grammar", self.grammar)) if v is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice and grammar")
        if self.json_ is not None:
            schema = self.json_
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"json is not a JSON schema: {e}") from None
            return GrammarSpec.json_schema(schema, strict=False)
        if self.choice is not None:
            return GrammarSpec.choice(self.choice)
        return GrammarSpec.regex(self.regex) if self.regex is not None else GrammarSpec.grammar(self.grammar or "")


class SamplingRequest(RequestModel):
    """What chat and completion requests share: the model, sampling, stops and output constraints."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    n_predict: int | None = Field(None, ge=-1, le=MAX_OUTPUT_TOKENS)  # llama-server's max_tokens; -1: no limit
    n_probs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # llama-server's: alternatives per token
    cache_prompt: bool | None = None
    typical_p: float | None = None  # llama.cpp's samplers: accepted only when off (LLAMA_SAMPLERS)
    mirostat: int | None = None
    dry_multiplier: float | None = None
    xtc_probability: float | None = None
    top_n_sigma: float | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)  # -1 and 0 both mean off; at most the vocabulary
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    # OpenAI's: {"token id": bias in [-100, 100]} added to the logits; -100 bans a token.
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    grammar: str | None = None  # llama-server's: GBNF (or Lark)
    json_schema: dict[str, Any] | None = None  # llama-server's
    verbose: bool | None = None  # llama-server's: the response carries `__verbose` (None: the server's --verbose)
    # llama-server's, when streamed: `timings` on every event, and a `prompt_progress` event per chunk read.
    timings_per_token: bool = False
    return_progress: bool = False

    default_max_tokens: ClassVar[int | None] = None  # None: whatever room the context leaves

    @field_validator("response_format", "structured_outputs")
    @classmethod
    def _format_shape(cls, v: ResponseFormat | StructuredOutputs | None) -> Any:
        if v is not None:
            try:
                v.spec()
            except GrammarError as e:
                raise ValueError(str(e)) from None
        return v

    @field_validator("grammar")
    @classmethod
    def _grammar_not_empty(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("the grammar is empty")
        return v

    @model_validator(mode="after")
    def _one_output_constraint(self) -> "SamplingRequest":
        given = [name for name in ("response_format", "structured_outputs", "grammar", "json_schema")
                 if getattr(self, name) is not None and not (name == "response_format"
                                                             and getattr(self, name).type == "text")]
        if len(given) > 1:
            raise ValueError(f"give at most one of {', '.join(given)}: each constrains the whole output")
        return self

    @property
    def grammar_param(self) -> str | None:
        """The field the output constraint came from (the `param` of a 400 about it), or None."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        return next((n for n in ("structured_outputs", "grammar", "json_schema") if getattr(self, n) is not None),
                    None)

    def grammar_spec(self) -> GrammarSpec | None:
        """What the output must match, or None. Its shape is checked; whether it compiles is not (that
        needs the engine's tokenizer and may take milliseconds: the server compiles it off the event
        loop, and a GrammarError is a 400 with `grammar_param`)."""
        param = self.grammar_param
        if param == "response_format":
            return self.response_format.spec()  # type: ignore[union-attr]
        if param == "structured_outputs":
            return self.structured_outputs.spec()  # type: ignore[union-attr]
        if param == "grammar":
            return GrammarSpec.grammar(self.grammar or "")
        if param == "json_schema":
            return GrammarSpec.json_schema(self.json_schema or {}, strict=False)
        return None

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if not v:
            return v
        if len(v) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_TOKENS} tokens")
        for key, bias in v.items():
            if not key.isascii() or not key.isdigit() or len(key) > 10:
                raise ValueError(f"keys are token ids (non-negative integers as strings), got {key[:20]!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"the bias of token {key} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        return v

    @property
    def token_bias(self) -> dict[int, float]:
        return {int(k): float(b) for k, b in (self.logit_bias or {}).items()}

    def check_supported(self) -> None:
        for name, off in LLAMA_SAMPLERS.items():
            value = getattr(self, name)
            if value is not None and value != off:
                raise Unsupported(name, f"{name} ({LLAMA_SAMPLER_NAMES[name.split('_')[0]]}) is not supported; "
                                        f"use temperature, top_k, top_p, min_p and the penalties")
        if self.stream_options is not None and not self.stream:
            raise Unsupported("stream_options", "stream_options is only allowed when stream is true")

    @property
    def wants_progress(self) -> bool:
        return self.return_progress and self.stream

    @property
    def wants_filtered_logprobs(self) -> bool:
        """Logprobs under the distribution after temperature, top-k, top-p and min-p (the one the
        token was drawn from) rather than the plain softmax."""
        return False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def predict_limit(self) -> int | None:
        """llama-server's `n_predict` as a max_tokens (None when absent or -1: no limit)."""
        return self.n_predict if self.n_predict is not None and self.n_predict > 0 else None


class ContentPart(RequestModel):
    type: str
    text: str | None = None


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning, for templates that render it

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise Unsupported("messages", f"content parts of type {part.type!r} are not supported (text only)")
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: tool_choice "required" makes exactly one call
    chat_template_kwargs: dict[str, Any] | None = None
    # A final assistant message is continued, not closed (assistant prefill), as in llama-server; vLLM's
    # `continue_final_message` asks for it, `add_generation_prompt: true` with one is a 400.
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs_not_reserved(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        clash = TEMPLATE_RESERVED_NAMES & (v or {}).keys()
        if clash:
            raise ValueError(f"may not set {', '.join(sorted(clash))}: the server sets them")
        return v

    @model_validator(mode="after")
    def _prefill(self) -> "ChatCompletionRequest":
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs a final assistant message")
        if self.continue_final_message is None and self.prefill and len(self.messages) > 1 \
                and self.messages[-2].role == "assistant":
            # As llama-server: which of them would be continued is a guess; continue_final_message says.
            raise ValueError("the conversation ends with two assistant messages; send continue_final_message: true "
                             "to continue the last one")
        return self

    @property
    def prefill(self) -> bool:
        """Whether the final message is an assistant's to continue."""
        return self.messages[-1].role == "assistant" and not self.add_generation_prompt \
            and self.continue_final_message is not False

    def check_supported(self) -> None:
        super().check_supported()
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, dict)
        if forced and self.grammar_spec() is not None:
            raise Unsupported("response_format", "response_format (or another output grammar) cannot be combined "
                                                 "with tool_choice 'required' or a named function")

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return v

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.n_probs is not None

    @property
    def num_top_logprobs(self) -> int:
        if self.n_probs is not None:
            return self.n_probs
        return (self.top_logprobs or 0) if self.logprobs else 0

    @property
    def output_limit(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else self.predict_limit

    def chat(self) -> list[dict[str, Any]]:
        # Model chat templates predate OpenAI's "developer" role; it means what "system" means to them.
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                | ({"name": m.name} if m.name else {})
                | ({"tool_calls": m.tool_calls} if m.tool_calls else {})
                | ({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})
                | ({"reasoning_content": m.reasoning_content} if m.reasoning_content and m.role == "assistant" else {})
                for m in self.messages]


MAX_PROMPTS = 64  # prompts in one completions request (each with `n` choices)

PromptPart = str | int
Prompt = str | list[PromptPart]


class CompletionRequest(SamplingRequest):
    # A string, token ids, ids mixed with strings (one prompt), or a list of these (one prompt each).
    prompt: str | list[int | str | list[int | str]] = Field(min_length=1)
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token (OpenAI: up to 5)
    best_of: int | None = Field(None, ge=1)

    @property
    def prompts(self) -> list[Prompt]:
        """The request's prompts (OpenAI's batch: choice `i * n + j` is prompt i's choice j)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p) or any(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _prompts(self) -> "CompletionRequest":
        prompts = self.prompts
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        if len(prompts) * self.n > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} choices per request (prompts × n)")
        if any(isinstance(p, list) and not p for p in prompts):
            raise ValueError("a prompt must not be empty")
        return self

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise Unsupported("suffix", "suffix is not supported")
        if self.best_of not in (None, 1):
            raise Unsupported("best_of", "only best_of=1 is supported")
        if self.echo and self.logprobs is not None:
            raise Unsupported("echo", "echo together with logprobs is not supported")

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None or self.n_probs is not None

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or self.n_probs or 0

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.predict_limit

    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's default here; chat's is the rest of the context


class TokenizeRequest(RequestModel):
    """vLLM's: a prompt, or chat messages (templated as chat completions template them, other chat
    fields included); `add_special_tokens` defaults to true for a prompt and false for messages, whose
    template writes its own. llama-server's: `content`, with `add_special` (default false) and
    `with_pieces` (each token as `{"id", "piece"}`)."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_special: bool | None = None
    with_pieces: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if sum(x is not None for x in (self.prompt, self.content, self.messages)) != 1:
            raise ValueError("give exactly one of prompt, content and messages")
        if self.add_special is not None and self.add_special_tokens is not None:
            raise ValueError("give add_special_tokens or add_special, not both")
        return self

    @property
    def text(self) -> str | None:
        return self.prompt if self.prompt is not None else self.content

    @property
    def special(self) -> bool | None:
        """Whether to add the tokenizer's special tokens (None: the default of the body's kind)."""
        if self.add_special is not None:
            return self.add_special
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return False if self.content is not None else None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# Responses. Plain models: the server fills them, clients validate them.


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Strata extension, present with --spec: drafts proposed/accepted, acceptance, mean accepted
    # length and acceptance per draft position for this request.
    speculation: dict | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _optional_fields(self, handler: Any) -> dict[str, Any]:
        # `reasoning_content` and `tool_calls` appear only when there are some.
        out = handler(self)
        for k in ("reasoning_content", "tool_calls"):
            if out.get(k) is None:
                out.pop(k, None)
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = SYSTEM_FINGERPRINT


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler: Any) -> dict[str, Any]:
        # OpenAI sends `"delta": {}` on the finishing chunk, not a delta full of nulls; the first chunk
        # is `{"role": "assistant", "content": null}`.
        out = handler(self)
        return {k: v for k, v in out.items() if v is not None or k == "content" and out.get("role")}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = SYSTEM_FINGERPRINT


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = SYSTEM_FINGERPRINT


class TokenPiece(BaseModel):
    id: int
    piece: str | list[int]  # the token's text, or its bytes when they are not whole UTF-8 characters


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int] | list[TokenPiece]


class DetokenizeResponse(BaseModel):
    prompt: str  # vLLM's name
    content: str  # llama-server's


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "strata"
    max_model_len: int
    aliases: list[str] | None = Field(None, exclude_if=lambda v: v is None)  # llama-server's --alias names
    tags: list[str] | None = Field(None, exclude_if=lambda v: v is None)  # llama-server's --tags


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
