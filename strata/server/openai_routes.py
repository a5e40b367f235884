"""OpenAI's endpoints (`/v1/chat/completions`, `/v1/completions`, `/v1/models`, and without the `/v1`
prefix `/chat/completions` and `/models` as llama-server serves them) and the tokenizer ones
(`/tokenize`, `/detokenize`: vLLM's bodies and llama-server's), all behind the server's key."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from strata.server import protocol as P
from strata.server.errors import APIError
from strata.server.jobs import collect, stream_response
from strata.server.llama_routes import LlamaChatChunks
from strata.server.request_body import parse_body, read_json, validate_body
from strata.server.responses import ChatChunks, CompletionChunks, chat_message, json_response, response_usage
from strata.server.service import ModelService


class OpenAIRoutes:
    def __init__(self, service: ModelService):
        self.s = service

    def routers(self) -> list[APIRouter]:
        """`/v1/...`, then vLLM's paths outside /v1, behind the same key."""
        v1 = APIRouter(prefix="/v1", dependencies=[Depends(self.s.authorize)])
        v1.add_api_route("/chat/completions", self.chat_completions, methods=["POST"])
        v1.add_api_route("/completions", self.completions, methods=["POST"])
        v1.add_api_route("/models", self.list_models, methods=["GET"])
        v1.add_api_route("/models/{model:path}", self.get_model, methods=["GET"])
        plain = APIRouter(dependencies=[Depends(self.s.authorize)])
        plain.add_api_route("/chat/completions", self.chat_completions, methods=["POST"])
        plain.add_api_route("/models", self.list_models, methods=["GET"])
        plain.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        plain.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        return [v1, plain]

    async def _parse(self, request: Request, model: type[P.RequestModel]):
        return await parse_body(request, model, self.s.cfg.max_body_bytes, self.s.cfg.body_timeout)

    async def chat_completions(self, request: Request) -> Response:
        s = self.s
        body: P.ChatCompletionRequest = await self._parse(request, P.ChatCompletionRequest)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        job, streams, parsers, prompt_ids = await s.start_chat(rid, body)
        logprobs = s.logprobs if body.wants_logprobs else None
        model = body.model or s.model_name
        if body.stream:
            if body.return_progress or body.timings_per_token:
                chunks = LlamaChatChunks(rid, model, body.n, body.include_usage, logprobs, parsers,
                                         per_token=body.timings_per_token)
            else:
                chunks = ChatChunks(rid, model, body.n, body.include_usage, logprobs, parsers)
            return stream_response(request, job, streams, chunks)
        results = await collect(request, job, streams)
        choices = []
        for i, r in enumerate(results):
            message, finish = chat_message(r, parsers[i] if parsers else None)
            choices.append(P.ChatChoice(index=i, message=message, finish_reason=finish,
                                        logprobs=logprobs.chat_logprobs(r.token_ids, r.logprobs, r.tops)
                                        if logprobs is not None else None))
        verbose = s.verbose(body, prompt_ids, "".join(results[0].text))
        return json_response(P.ChatCompletion(id=rid, created=int(time.time()), model=model, choices=choices,
                                              usage=response_usage(results)),
                             {"__verbose": verbose} if verbose is not None else None)

    async def completions(self, request: Request) -> Response:
        s = self.s
        body: P.CompletionRequest = await self._parse(request, P.CompletionRequest)
        s.check_model(body.model)
        n = body.n
        rid, encoded, _, job, streams = await s.submit_completion(body, body.prompts, n, body.echo)
        echoes = [text if body.echo else "" for _, text in encoded for _ in range(n)]
        logprobs = s.logprobs if body.wants_logprobs else None
        model = body.model or s.model_name
        if body.stream:
            chunks = CompletionChunks(rid, model, len(streams), body.include_usage, logprobs, echoes)
            chunks.per_prompt = n
            return stream_response(request, job, streams, chunks)
        results = await collect(request, job, streams)
        choices = [P.CompletionChoice(index=i, text=echoes[i] + "".join(r.text), finish_reason=r.finish_reason,
                                      logprobs=logprobs.completion_logprobs(r.token_ids, r.logprobs, 0, r.tops)
                                      if logprobs is not None else None)
                   for i, r in enumerate(results)]
        return json_response(P.Completion(id=rid, created=int(time.time()), model=model, choices=choices,
                                          usage=response_usage(results, n)))

    async def tokenize(self, request: Request) -> Response:
        s = self.s
        data = await read_json(request, s.cfg.max_body_bytes, s.cfg.body_timeout)
        body: P.TokenizeRequest = validate_body(P.TokenizeRequest, data)
        if body.model is not None:
            s.check_model(body.model)
        text = body.text
        if text is not None:
            s.check_chars(len(text), "prompt" if body.prompt is not None else "content")
            ids = await s.run_cpu(s.tokenizer.encode, text, body.special is not False)
        else:
            # The chat fields (the template's inputs) as a chat completion reads them.
            chat: P.ChatCompletionRequest = validate_body(P.ChatCompletionRequest, {**data, "model": s.model_name})
            ids = (await s.chat_prompt(chat))[0]
            if body.special:
                ids = s.tokenizer.encode("", add_special=True) + ids
        tokens: list[int] | list[P.TokenPiece] = ids
        if body.with_pieces:
            tokens = [P.TokenPiece(id=t, piece=self._piece(t)) for t in ids]
        return json_response(P.TokenizeResponse(count=len(ids), max_model_len=s.max_model_len, tokens=tokens))

    def _piece(self, token: int) -> str | list[int]:
        text = self.s.logprobs.token_text(token)
        if "\ufffd" not in text:
            return text
        raw = self.s.tokenizer.tk.id_to_token(token) or ""
        # Byte-level vocabularies spell a lone byte as <0xNN>; otherwise the text's own bytes.
        if raw.startswith("<0x") and raw.endswith(">") and len(raw) == 6:
            return [int(raw[3:5], 16)]
        return list(text.encode("utf-8"))

    async def detokenize(self, request: Request) -> Response:
        s = self.s
        body: P.DetokenizeRequest = await self._parse(request, P.DetokenizeRequest)
        if body.model is not None:
            s.check_model(body.model)
        s.check_ids(body.tokens, "tokens")
        text = await s.run_cpu(s.tokenizer.decode, body.tokens, False)
        return json_response(P.DetokenizeResponse(prompt=text, content=text))

    async def list_models(self) -> Response:
        return json_response(P.ModelList(data=[self.s.model_card()]))

    async def get_model(self, model: str) -> Response:
        if model not in self.s.known_names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.s.model_name}`.",
                           param="model", code="model_not_found")
        return json_response(self.s.model_card())


def openai_routers(service: ModelService) -> list[APIRouter]:
    return OpenAIRoutes(service).routers()
