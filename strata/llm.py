"""The offline Python API, in the shape vLLM users know:

    from strata import LLM, SamplingParams
    llm = LLM()                       # the embedded default model
    outs = llm.generate(["Once upon a time", "In the beginning"], SamplingParams(max_tokens=32))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].outputs[0].finish_reason

It runs on the serving engine, so a list of prompts is batched across `parallel` slots (default: as
many as prompts fit in, up to 8) with chunked reads, and any `EngineConfig` option can be passed
(`LLM(spec=3, kv="int8")`).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from strata.config import EngineConfig
from strata.engine.engine import LLMEngine
from strata.engine.types import EngineEvent, EngineRequest
from strata.params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    speculation: dict | None = None


class LLM:
    def __init__(self, model: str | None = None, *, device: str | None = None, dtype: str | None = None,
                 ctx: int = EngineConfig.ctx, parallel: int = 8, progress: bool = False, **engine_options: Any):
        self.engine_config = EngineConfig(model=model, device=device, dtype=dtype, ctx=ctx, parallel=parallel,
                                          **engine_options)
        self.engine = LLMEngine(self.engine_config, progress=progress)
        self.model, self.config, self.tokenizer = self.engine.model, self.engine.model_config, self.engine.tokenizer
        if self.tokenizer is None:
            raise ValueError(f"{model}: the model has no tokenizer; pass token ids instead of text")
        self._ids = itertools.count()

    def _prompt_ids(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def _submit(self, ids: list[int], params: SamplingParams) -> str:
        rid = f"llm-{next(self._ids)}"
        self.engine.add_request(EngineRequest(rid, tuple(ids), params, time.monotonic()))
        return rid

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        per = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        order = []
        for prompt, p in zip(prompts, per):
            text, ids = self._prompt_ids(prompt)  # type: ignore[arg-type]
            order.append((self._submit(ids, p), text, ids))
        events = self.engine.run_to_completion()
        return [self._output(text, ids, events[rid]) for rid, text, ids in order]

    @staticmethod
    def _output(text: str | None, ids: list[int], evs: list[EngineEvent]) -> RequestOutput:
        last = evs[-1]
        tokens = [t for ev in evs for t in ev.token_ids][: last.completion_tokens]  # no trailing EOS
        out = CompletionOutput(0, "".join(ev.text for ev in evs), tokens, last.finish_reason)
        return RequestOutput(text, ids, [out], last.spec)

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[EngineEvent]:
        """Events of one request as the engine produces them (the CLI streams these)."""
        rid = self._submit(list(prompt_ids), params)
        while self.engine.has_work():
            for ev in self.engine.step():
                if ev.request_id == rid:
                    yield ev

    def chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt, add_special=False)
        return self.generate([ids], sampling_params)[0]
